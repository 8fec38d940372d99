"""Rejection sampling ("rng" mode) through the engine, past the first verify decision: the law of
tokens decided after an accepted draft prefix (later chain positions, the residual at the first
rejection, the bonus token), of tokens decided below the root's children of a tree, and of
trees whose score-pruned siblings are kept in the sibling recursion (unverified).

Setup. The target is the tiny random model with its lm_head scaled by 4 (context-dependent
logits, std about 0.6) and biased towards token A = 7 (p(A) about 0.55, varying with the
context); the draft is a random EAGLE-3 head biased more sharply towards A (q(A) about 0.8)
and towards tokens the target does not favour. So A is drafted and accepted often (the
accepted prefixes are frequent), while q differs clearly from p (a wrong rule shows). One
prompt, 3000 requests, temperature 1, 5 new tokens: t0 comes from the prefill, every later
token from a verify step. A spy on the verify step records, per row, where its emitted run
starts and how many drafts it accepted, so each token's depth within its verify step is known.

Statistic. A token decided at depth d of a verify step, given the tokens before it, is an exact
sample from the target's law at that context: the events that led there (which step, how many
drafts accepted before it) depend only on earlier draws. Tokens are grouped by prefix; every
prefix with at least MIN_COUNT tokens is compared to the exact law p(. | prompt + prefix) from a
full forward of the target (cells pooled as `chi2_pvalue` does), and the groups' chi-square
statistics and degrees of freedom are summed into one p-value. Correct: p > ALPHA; every check
has a power companion in which a broken rule must give p < ALPHA. Seeds are fixed: deterministic.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

import pytest
import torch

import rollout.acceptance as acc
import rollout.drafters.eagle3 as eagle3
import rollout.verify as verify
from draft_models.vocab import target_ids
from helpers import chi2_pvalue
from rollout.engine import EmbeddedEngine, EngineConfig
from rollout.protocol import SamplingParams
from rollout.drafters import DrafterSpec, SpecConfig
from rollout.tree import node_depths
from specrl.config import DraftTrainConfig
from specrl.drafts import new_draft
from target_training.config import model_config_for

pytestmark = pytest.mark.usefixtures("one_thread")

ALPHA = 1e-3
V = 64
A = 7
PROMPT = [5, 17, 33, 9, 41]
N = 3000
MAX_NEW = 5
MIN_COUNT = 20
CHAIN = SpecConfig(mode="chain", gamma=3)
TREE = SpecConfig(mode="tree", gamma=3, tree_topk=3, tree_budget=21)  # 21 = every drafted node: no pruning
PRUNED = SpecConfig(mode="tree", gamma=3, tree_topk=3, tree_budget=4)  # 4 of 21 nodes verified
_TREE_RULE, _UPDATE = acc.verify_tree_rejection, acc.rejection_update  # the correct rules, kept before patching


def _bias(linear: torch.nn.Linear, scale: float, bias: torch.Tensor) -> None:
    with torch.no_grad():
        linear.weight.mul_(scale)
    linear.bias = torch.nn.Parameter(bias.clone())


@pytest.fixture(scope="module")
def pair():
    """(target, draft) as described in the module docstring."""
    torch.manual_seed(0)
    target = model_config_for("tiny", V).build().eval()
    bias = torch.zeros(V)
    bias[[A, 11, 23]] = torch.tensor([4.5, 2.0, 2.0])
    _bias(target.lm_head, 4.0, bias)
    draft = new_draft(target, [PROMPT], DraftTrainConfig(draft_vocab_size=48))  # q = 0 on 16 tokens
    ids = target_ids(draft.d2t)
    assert {A, 11, 40} <= set(ids.tolist())
    bias = torch.zeros(V)
    bias[[A, 11, 40]] = torch.tensor([6.0, 1.0, 3.0])
    _bias(draft.lm_head, 4.0, bias[ids])
    return target, draft


# ----------------------------------------------------------------------------- running and recording
@dataclass
class Step:
    """One row of one verify step."""

    request_id: int
    start: int  # index (in the completion) of the first token the step emits
    n: int  # drafts accepted
    depth: int  # drafted depth (a chain's gamma)
    q: torch.Tensor | None = None  # chain: (g, V) the laws the drafts were drawn from
    unverified: int = 0  # tree: pruned siblings kept in the block as unverified nodes
    forced: bool = False  # tree: the last token is an accepted unverified sibling


def _spy_steps(monkeypatch) -> list[Step]:
    """Record every verify step's rows; the rule in force (correct or broken) runs unchanged."""
    steps: list[Step] = []
    chain, tree = verify._verify_chain, verify._verify_tree

    def on_chain(step, prop, target, layers):
        v = chain(step, prop, target, layers)
        g = prop.tokens.shape[1]
        q = (prop.draft_logp.exp() if prop.draft_logp is not None  # None: a point mass on each drafted token
             else torch.nn.functional.one_hot(prop.tokens, V).float())
        for r, (st, n) in enumerate(zip(step.states, (v.counts - 1).tolist())):
            steps.append(Step(st.request_id, len(st.tokens), n, g, q=q[r]))
        return v

    def on_tree(step, prop, target, layers):
        v = tree(step, prop, target, layers)
        B = prop.tokens.shape[0]
        rows = torch.arange(B)
        tokens = torch.cat([step.roots[:, None], prop.tokens], 1)  # block positions, root first
        parents = torch.cat([torch.full((B, 1), -1), prop.parents], 1)
        unver = torch.cat([torch.zeros(B, 1, dtype=torch.bool), prop.valid & ~prop.verified], 1)
        n = v.counts - 1
        last = v.kv_positions[rows, n] - step.lengths  # block position of the last accepted node
        nxt = v.emitted[rows, n]
        # a rejected sibling never comes back in a residual, so the emitted token equals an
        # unverified child of the last node exactly when that child was accepted
        forced = (unver & (parents == last[:, None]) & (tokens == nxt[:, None])).any(1)
        for st, k, u, f in zip(step.states, n.tolist(), unver.sum(1).tolist(), forced.tolist()):
            steps.append(Step(st.request_id, len(st.tokens), k, step.depth, unverified=u, forced=f))
        return v

    monkeypatch.setattr(verify, "_verify_chain", on_chain)
    monkeypatch.setattr(verify, "_verify_tree", on_tree)
    return steps


def _generate(pair, cfg: SpecConfig, monkeypatch, seed: int = 3, drafter: DrafterSpec | None = None):
    """N copies of the prompt through the engine in rng mode -> (decisions, steps). A decision is
    (trajectory, token index, depth within its verify step, step) for every token a step emitted.
    `drafter`: another drafter than the pair's EAGLE-3 draft (rollout.drafters.history)."""
    target, draft = pair
    steps = _spy_steps(monkeypatch)
    engine = EmbeddedEngine(target, EngineConfig(max_batch=256, sampling_mode="rng"),
                            drafter=drafter or DrafterSpec(draft=draft, spec=cfg))
    trajs = engine.generate([PROMPT] * N, SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, seed=seed))
    assert engine.draft_faults == [] and all(len(t.token_ids) == MAX_NEW for t in trajs)
    by_id = {t.request_id: t for t in trajs}
    decisions = [(by_id[s.request_id], s.start + d, d, s) for s in steps for d in range(s.n + 1)
                 if s.start + d < MAX_NEW]
    assert len(decisions) == N * (MAX_NEW - 1)  # every token after t0 came from a verify step
    return decisions, steps


# ----------------------------------------------------------------------------- exact laws and tests
def _target_laws(target, prefixes: list[tuple[int, ...]]) -> dict[tuple[int, ...], torch.Tensor]:
    """Exact p(. | prompt + prefix) at temperature 1, one full forward per prefix length."""
    by_len = defaultdict(list)
    for pre in prefixes:
        by_len[len(pre)].append(pre)
    laws = {}
    with torch.no_grad():
        for group in by_len.values():
            probs = target(torch.tensor([PROMPT + list(pre) for pre in group])).logits[:, -1].double().softmax(-1)
            laws.update(zip(group, probs))
    return laws


def _counts(tokens) -> torch.Tensor:
    return torch.bincount(torch.tensor(list(tokens)), minlength=V)


def law_check(target, decisions, min_depth: int) -> tuple[float, int, float, Counter]:
    """Chi-square of the tokens decided at depth >= min_depth of their verify step against the exact
    target law at their prefix (groups of >= MIN_COUNT tokens, summed). Returns (statistic, df,
    p-value, tested tokens per depth)."""
    groups = defaultdict(list)  # prefix -> (token, depth) of every decision after it
    for t, i, d, _ in decisions:
        if d >= min_depth:
            groups[tuple(t.token_ids[:i])].append((t.token_ids[i], d))
    groups = {pre: found for pre, found in groups.items() if len(found) >= MIN_COUNT}
    laws = _target_laws(target, list(groups))
    stat, df = 0.0, 0
    for pre, found in groups.items():
        s, k, _ = chi2_pvalue(_counts(tok for tok, _ in found), laws[pre])
        stat, df = stat + s, df + k
    pval = float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64))) if df else 0.0
    return stat, df, pval, Counter(d for found in groups.values() for _, d in found)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalise(max(0, p - q)), written here rather than taken from the code under test."""
    r = (p - q).clamp_min(0.0)
    return r / r.sum() if r.sum() > 0 else p


def residual_check(target, decisions) -> tuple[float, int, float, int]:
    """Chain tokens emitted at the first rejection after >= 1 accepted draft of their step: each is
    drawn from normalise(max(0, p - q)), p the target's law at its context and q the law that
    drafted the rejected token. Counts are compared to the sum of each token's own residual law
    (conservative where the laws differ: the counts then vary less than a multinomial's).
    Returns (statistic, df, p-value, tokens)."""
    events = [(tuple(t.token_ids[:i]), t.token_ids[i], s.q[d]) for t, i, d, s in decisions if 1 <= d == s.n < s.depth]
    laws = _target_laws(target, list({pre for pre, _, _ in events}))
    expected = sum(_residual(laws[pre], q.double()) for pre, _, q in events)
    stat, df, pval = chi2_pvalue(_counts(tok for _, tok, _ in events), expected / len(events))
    return stat, df, pval, len(events)


def test_chain_later_positions_and_residual_match_target(pair, monkeypatch):
    """Chain, gamma 3: every token decided after >= 1 accepted draft of its verify step (positions
    2 and 3 of the chain and the bonus after 3 accepted drafts) follows the target's law given its
    prefix, and the tokens drawn at the first rejection after an accepted prefix follow the
    residual normalise(max(0, p - q)). Both kinds are frequent here."""
    decisions, _ = _generate(pair, CHAIN, monkeypatch)
    stat, df, pval, tested = law_check(pair[0], decisions, min_depth=1)
    assert pval > ALPHA, f"chi2={stat:.1f} df={df} p={pval:.2e}"
    assert tested[1] >= 800 and tested[2] >= 300 and tested[3] >= 100, tested  # depth 3: the bonus token
    stat, df, pval, n = residual_check(pair[0], decisions)
    assert pval > ALPHA, f"residual: chi2={stat:.1f} df={df} p={pval:.2e} over {n} tokens"
    assert n >= 1000, n


def _chain_rule(late_accept=False, late_residual=False):
    """rollout.acceptance's chain rule, broken only after an accepted draft: `late_accept` accepts
    every draft after the first, `late_residual` draws a rejection at position >= 1 from p
    instead of the residual. A check of the first verify decision alone cannot see either."""
    def rule(draft_tokens, draft_logp, target_logp, generator=None):
        B, g = draft_tokens.shape
        px = target_logp[:, :g].gather(2, draft_tokens[..., None])[..., 0].exp()
        qx = draft_logp.gather(2, draft_tokens[..., None])[..., 0].exp()
        u = torch.rand(B, g, generator=generator)
        if late_accept:
            u[:, 1:] = 0.0
        n = acc.accept_test(px, qx, u).long().cumprod(1).sum(1)
        rows = torch.arange(B)
        p = target_logp[rows, n].exp()
        q = torch.where((n < g)[:, None], draft_logp[rows, n.clamp(max=g - 1)].exp(), 0.0)
        if late_residual:
            q = torch.where((n >= 1)[:, None], 0.0, q)  # residual(p, 0) = p
        return n, torch.multinomial(acc.residual(p, q), 1, generator=generator)[:, 0]
    return rule


@pytest.mark.parametrize("bug", ["late_accept", "late_residual"])
def test_chain_later_positions_check_has_power(pair, monkeypatch, bug):
    """The same checks fail under a chain rule broken only past the first draft (`_chain_rule`):
    the law check for both bugs, the residual check for the wrong residual."""
    monkeypatch.setattr(acc, "verify_chain_rejection", _chain_rule(**{bug: True}))
    decisions, _ = _generate(pair, CHAIN, monkeypatch)
    stat, df, pval, tested = law_check(pair[0], decisions, min_depth=1)
    assert sum(tested.values()) >= 1000, tested
    assert pval < ALPHA, f"{bug} passed: chi2={stat:.1f} df={df} p={pval:.2e}"
    if bug == "late_residual":
        stat, df, pval, n = residual_check(pair[0], decisions)
        assert n >= 500 and pval < ALPHA, f"{bug} passed the residual check: chi2={stat:.1f} df={df} p={pval:.2e}"


def test_tree_below_the_root_children_matches_target(pair, monkeypatch):
    """Tree of depth 3, top-3, every drafted node verified: the tokens decided at a node of depth
    >= 1 (among depth-2 and depth-3 children, at a residual there, or the bonus after a depth-3
    node) follow the target's law given their prefix."""
    decisions, steps = _generate(pair, TREE, monkeypatch)
    stat, df, pval, tested = law_check(pair[0], decisions, min_depth=1)
    assert pval > ALPHA, f"chi2={stat:.1f} df={df} p={pval:.2e}"
    assert tested[1] >= 800 and tested[2] >= 300 and tested[3] >= 100, tested
    assert all(s.unverified == 0 for s in steps)  # nothing pruned: this is the plain tree


def _accept_below_root_children(parents, tokens, valid, draft_logp, target_logp, generator=None, **kw):
    """Broken below the root's children: q = 0 there, so every child with p > 0 is accepted."""
    deep = (node_depths(parents) >= 1)[..., None]
    return _TREE_RULE(parents, tokens, valid, draft_logp.masked_fill(deep, float("-inf")), target_logp, generator,
                      **kw)


def _p_not_updated(p, q, x):
    """Broken: after a rejected sibling keep p instead of the residual."""
    return p, _UPDATE(p, q, x)[1]


@pytest.mark.parametrize("bug", ["accept_below_root_children", "p_not_updated"])
def test_tree_check_has_power(pair, monkeypatch, bug):
    """The tree check fails under a broken recursion: acceptance forced below the root's children
    only (a check of the root's decision alone cannot see it), or siblings' residual not taken."""
    if bug == "accept_below_root_children":
        monkeypatch.setattr(acc, "verify_tree_rejection", _accept_below_root_children)
    else:
        monkeypatch.setattr(acc, "rejection_update", _p_not_updated)
    decisions, _ = _generate(pair, TREE, monkeypatch)
    stat, df, pval, tested = law_check(pair[0], decisions, min_depth=1)
    assert sum(tested.values()) >= 1000, tested
    assert pval < ALPHA, f"{bug} passed: chi2={stat:.1f} df={df} p={pval:.2e}"


def test_tree_with_pruned_siblings_matches_target(pair, monkeypatch):
    """Tree of depth 3, top-3, budget 4 (EAGLE-2 re-rank keeps 4 of 21 drafted nodes): the pruned
    siblings of kept nodes stay in the sibling recursion unverified, and an accepted one is
    emitted. Every token a verify step decides follows the target's law given its prefix; pruned
    siblings are present in most steps and accepted often, also below the root."""
    decisions, steps = _generate(pair, PRUNED, monkeypatch)
    stat, df, pval, _ = law_check(pair[0], decisions, min_depth=0)
    assert pval > ALPHA, f"chi2={stat:.1f} df={df} p={pval:.2e}"
    assert sum(s.unverified > 0 for s in steps) > 0.9 * len(steps)
    forced = Counter(s.n for s in steps if s.forced)  # by the depth of the node deciding it
    assert forced[0] >= 1000 and sum(forced.values()) - forced[0] >= 1000, forced


def test_tree_pruned_siblings_check_has_power(pair, monkeypatch):
    """The same check fails when the pruned siblings are dropped from the recursion instead of
    kept unverified (marked invalid, as if they had never been drafted)."""
    keep = eagle3._with_pruned_siblings

    def dropped(*args):
        nodes, parents, valid, verified = keep(*args)
        return nodes, parents, verified, verified

    monkeypatch.setattr(eagle3, "_with_pruned_siblings", dropped)
    decisions, steps = _generate(pair, PRUNED, monkeypatch)
    assert all(s.unverified == 0 for s in steps)
    stat, df, pval, tested = law_check(pair[0], decisions, min_depth=0)
    assert sum(tested.values()) >= 1000, tested
    assert pval < ALPHA, f"dropped siblings passed: chi2={stat:.1f} df={df} p={pval:.2e}"
