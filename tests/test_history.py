"""The history drafter (rollout.drafters.history): drafts from the GRPO group's in-flight siblings and from
earlier answers to the same prompt, alone and hybrid with the EAGLE-3 chain. Lossless: greedy
and coupled sampling give plain decoding's tokens and log-probs exactly; rejection sampling
keeps the target's law at every depth of a verify step (chi-square, with a power companion)."""
from __future__ import annotations

import pytest
import torch

import rollout.spec_sampling as spec_sampling
from rollout.drafters import DrafterSpec, SpecConfig
from rollout.drafters.history import HistoryConfig, HistoryStore
from rollout.drafters.hybrid import HybridProposer
from rollout.engine import EmbeddedEngine, EngineConfig
from rollout.protocol import SamplingParams, Trajectory, summarize_spec_stats
from test_speculative_law import ALPHA, CHAIN, N, law_check, pair, residual_check, _generate  # noqa: F401 (pair: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def _history_drafter(store: HistoryStore, gamma: int = 3) -> DrafterSpec:
    return DrafterSpec("history", spec=SpecConfig("chain", gamma), history=store)


def _hybrid_drafter(draft, store: HistoryStore, gamma: int = 3) -> DrafterSpec:
    """The hybrid as the co-training plug-in installs it."""
    return DrafterSpec("hybrid", draft=draft, spec=SpecConfig("chain", gamma), history=store)


def _groups(prompts, n=4):
    return [p for p in prompts[:4] for _ in range(n)]  # 4 prompts, each n times: GRPO groups


def _generate_with(model, prompts, params, drafter=None, sampling_mode="coupled", batch=6, ids=None):
    engine = EmbeddedEngine(model, EngineConfig(max_batch=batch, sampling_mode=sampling_mode), drafter=drafter)
    return engine.generate(prompts, params, request_ids=ids), engine


def _sft_groups(sft_policy, n_prompts: int, seed: int, max_new_tokens: int, **sampling):
    """(policy, GRPO-style groups of 6 of n arith prompts, their sampling params) on the SFT policy."""
    tokenizer, task, policy, _ = sft_policy
    group = [[tokenizer.bos_id] + tokenizer.encode(e.prompt) for e in task.examples("train", n_prompts, seed)
             for _ in range(6)]
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=(tokenizer.eos_id,), seed=2, **sampling)
    return policy, group, params


def _assert_plain(out, plain):
    """Plain decoding's tokens, and its log-probs within float noise."""
    assert [t.token_ids for t in out] == [t.token_ids for t in plain]
    for a, b in zip(out, plain):
        assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_history_drafts_decode_what_plain_decoding_does(tiny_model, prompts, temperature):
    """Greedy and coupled sampling: the same tokens and log-probs as plain decoding, with drafts
    from siblings accepted. Siblings decoding in lockstep have nothing ahead of each other; those
    admitted later draft from the earlier ones, which greedy decoding repeats exactly: there the
    drafts' own estimate of their acceptance comes true."""
    params = SamplingParams(temperature=temperature, max_new_tokens=16, seed=5)
    group = _groups(prompts)
    plain, _ = _generate_with(tiny_model, group, params)
    store = HistoryStore()
    out, engine = _generate_with(tiny_model, group, params, _history_drafter(store))
    assert engine.draft_faults == []
    _assert_plain(out, plain)
    s = store.stats["history"]
    assert s["rows"] > 0 and s["accepted"] > 0
    if temperature == 0.0:
        assert s["expected"] > 20 and s["accepted"] >= 0.8 * s["expected"], s


def test_finished_answers_of_earlier_steps_draft_the_next_epoch(tiny_model, prompts):
    """With siblings switched off, a first call drafts from each answer's own past only (rarely
    right); after its answers are added, the same prompts (the next epoch) are drafted from them:
    greedy, so nearly every draft is accepted."""
    params = SamplingParams(temperature=0.0, max_new_tokens=16, seed=5)
    store = HistoryStore(HistoryConfig(siblings=False))
    first, _ = _generate_with(tiny_model, prompts, params, _history_drafter(store))
    s = store.stats["history"]
    assert s["accepted"] < 0.1 * s["drafted"], s
    store.add_rollout(first)
    second, _ = _generate_with(tiny_model, prompts, params, _history_drafter(store))
    assert [t.token_ids for t in second] == [t.token_ids for t in first]
    s = store.stats["history"]
    assert s["accepted"] > 0.9 * s["drafted"], s


def test_store_keeps_bounded_memory_and_proposes_the_majority():
    store = HistoryStore(HistoryConfig(max_answers_per_prompt=3, max_prompts=2))
    p = (1, 2)
    answers = [[5, 6, 7, 8], [5, 6, 7, 9], [5, 6, 7, 9], [5, 6, 4, 4]]
    store.add_rollout([Trajectory(list(p), a, torch.zeros(len(a)), "stop") for a in answers])
    assert len(store.prompts[p].done) == 3  # the oldest answer left
    assert all(aid != ("done", 0) for ids in store.prompts[p].pairs.values() for aid, _ in ids)

    class St:
        request_id, prompt, tokens = 99, list(p), [5, 6]

    store.observe([St])
    d = store.draft(99, 2)
    assert d.tokens == [7, 9]  # two of the three kept answers continue 7, 9; the third goes 4
    assert d.expected == pytest.approx(2 / 3 + 2 / 3)
    for k in ((3,), (4,)):
        store.add_rollout([Trajectory(list(k), [1], torch.zeros(1), "stop")])
    assert p not in store.prompts and len(store.prompts) == 2  # the least recently fed prompt left


def test_history_config_refuses_nonsense():
    for bad in (dict(max_match=1), dict(siblings=False, history=False), dict(max_candidates=0),
                dict(hybrid_margin=float("nan")), dict(hybrid="both")):
        with pytest.raises(ValueError, match="HistoryConfig"):
            HistoryConfig(**bad)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_hybrid_of_two_branches_decodes_what_plain_decoding_does(offline_draft, sft_policy, temperature):
    """The tree hybrid (HistoryConfig.hybrid="tree"): each row's history chain and EAGLE-3 chain
    verified as two branches of one tree. Plain decoding's tokens and log-probs, and at least the EAGLE-3 chain's
    acceptance alone (the tree holds that chain, so the longer accepted branch can only add)."""
    policy, group, params = _sft_groups(sft_policy, 4, 3, 48, temperature=temperature)
    plain, _ = _generate_with(policy, group, params, batch=8)
    store = HistoryStore(HistoryConfig(hybrid="tree"))
    out, engine = _generate_with(policy, group, params, _hybrid_drafter(offline_draft, store), batch=8)
    assert engine.draft_faults == []
    _assert_plain(out, plain)
    alone, _ = _generate_with(policy, group, params, DrafterSpec(draft=offline_draft, spec=SpecConfig("chain", 3)), batch=8)
    tree, eagle = (summarize_spec_stats(t.spec for t in x)["accept_length"] for x in (out, alone))
    assert set(store.stats) == {"tree"} and tree >= 0.95 * eagle, (tree, eagle)
    if temperature == 0.0:  # greedy siblings agree: the history branch adds accepted tokens
        assert tree > 1.05 * eagle, (tree, eagle)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_hybrid_by_rows_decodes_what_plain_decoding_does(offline_draft, sft_policy, temperature):
    """Hybrid of the EAGLE-3 chain and history drafts on the SFT policy: plain decoding's tokens and
    log-probs; both sources draft rows; the EAGLE-3 head drafts all rows, some (the others'
    pending features grow) or, in greedy steps where every row takes the history draft, none."""
    policy, group, params = _sft_groups(sft_policy, 4, 3, 48, temperature=temperature)
    plain, _ = _generate_with(policy, group, params, batch=8)
    store = HistoryStore(HistoryConfig(hybrid="rows"))
    fed = []  # per step: rows the EAGLE-3 head drafted, of all rows
    orig = HybridProposer.propose

    def spy(self, step):
        # the head's invariant: each row's pending features run from its draft cache's end to the
        # target cache's, whichever rows it skipped before
        pend = [sum(x.shape[0] for x in self.eagle.pending[s]) for s in step.active]
        ends = self.eagle.cache.lengths[step.slots].tolist()
        assert [st.n_cached - n for st, n in zip(step.states, pend)] == ends
        out = orig(self, step)
        fed.append((sum(self._fed), len(self._fed)))
        return out

    HybridProposer.propose = spy
    try:
        out, engine = _generate_with(policy, group, params, _hybrid_drafter(offline_draft, store), batch=8)
    finally:
        HybridProposer.propose = orig
    assert engine.draft_faults == []
    _assert_plain(out, plain)
    assert set(store.stats) == {"history", "eagle3"}, store.stats
    assert any(n == b for n, b in fed)  # steps the head drafted for every row,
    assert any(0 < n < b for n, b in fed)  # for some rows only (the others' features wait),
    if temperature == 0.0:  # and, where greedy siblings agree, steps it did not run at all
        assert any(n == 0 for n, b in fed)
    m = store.metrics()
    assert 0 < m["rollout/history_rows_share"] < 1
    # the head's rows are accepted as often as with the head alone: skipped rows' features reached it
    alone, _ = _generate_with(policy, group, params, DrafterSpec(draft=offline_draft, spec=SpecConfig("chain", 3)), batch=8)
    alpha_alone = sum(t.spec.accepted for t in alone) / sum(t.spec.drafted for t in alone)
    assert m["rollout/eagle3_alpha"] > 0.8 * alpha_alone, (m, alpha_alone)


def test_hybrid_in_rng_mode_keeps_the_law_of_plain_sampling(offline_draft, sft_policy):
    """Rejection sampling with rows of both sources in one chain: a point mass for history rows
    beside EAGLE-3's q. top_k=1 puts all the target's mass on one token: the rollout is plain
    decoding's whatever the draft (a law check with power is the next test)."""
    policy, group, params = _sft_groups(sft_policy, 3, 4, 40, temperature=1.0, top_k=1)
    plain, _ = _generate_with(policy, group, params, sampling_mode="rng", batch=8)
    store = HistoryStore()
    out, _ = _generate_with(policy, group, params, _hybrid_drafter(offline_draft, store), sampling_mode="rng",
                            batch=8)
    assert [t.token_ids for t in out] == [t.token_ids for t in plain]
    assert store.stats["history"]["accepted"] > 0 and store.stats["eagle3"]["accepted"] > 0


def _point_mass_accepted_always(monkeypatch):
    """A broken rule: a point-mass draft accepted without testing p(x) (as if q were p)."""
    orig = spec_sampling.SpecSampling.verify_chain

    def broken(self, draft_tokens, draft_logp, target_logits):
        if self.mode == "rejection" and draft_logp is None:
            target_logp = self.process(target_logits)
            return spec_sampling.acc.verify_chain_rejection(draft_tokens, target_logp[:, :-1], target_logp, self.generator)
        return orig(self, draft_tokens, draft_logp, target_logits)

    monkeypatch.setattr(spec_sampling.SpecSampling, "verify_chain", broken)


@pytest.mark.parametrize("broken", [False, True])
def test_history_drafts_keep_the_target_law_in_rng_mode(pair, monkeypatch, broken):
    """rng mode, history drafts of 3000 siblings of one prompt (chain of 3): every token decided
    after >= 1 accepted draft follows p(. | prefix), and the tokens drawn at the first rejection
    after an accepted prefix follow p with the drafted token removed, renormalised. Power: a
    point mass accepted without its test fails the same check."""
    if broken:
        _point_mass_accepted_always(monkeypatch)
    store = HistoryStore()
    decisions, steps = _generate(pair, CHAIN, monkeypatch, drafter=_history_drafter(store))
    stat, df, pval, tested = law_check(pair[0], decisions, min_depth=0)
    if broken:
        assert pval < ALPHA, f"the broken rule passed: chi2={stat:.1f} df={df} p={pval:.2e}"
        return
    assert pval > ALPHA, f"chi2={stat:.1f} df={df} p={pval:.2e}"
    stat1, df1, pval1, tested1 = law_check(pair[0], decisions, min_depth=1)
    assert pval1 > ALPHA, f"depth >= 1: chi2={stat1:.1f} df={df1} p={pval1:.2e}"
    assert tested1[1] >= 500 and tested1[2] >= 100, tested1
    rstat, rdf, rp, n = residual_check(pair[0], decisions)
    assert rp > ALPHA and n >= 300, f"residual: chi2={rstat:.1f} df={rdf} p={rp:.2e} over {n} tokens"
    assert sum(s.n for s in steps) > N  # drafts were accepted: the check saw verify decisions past depth 0


def test_the_two_branch_tree_shares_the_chains_common_prefix():
    """Rows whose history and EAGLE-3 chains agree on a prefix hold it once: the EAGLE-3 branch
    hangs from the history node where they part (its duplicate nodes are padding). Two sibling
    nodes with one token would let the first branch take the path whatever the second holds."""
    from types import SimpleNamespace

    from rollout.drafters.history import HistoryDraft
    from rollout.proposer import ChainProposal

    eagle_tokens = torch.tensor([[5, 6, 9], [1, 2, 3], [7, 7, 7]])
    eagle = SimpleNamespace(propose=lambda step: ChainProposal(eagle_tokens, None))
    hybrid = HybridProposer(eagle, HistoryStore())
    drafts = [HistoryDraft([5, 6, 7], 1.0), HistoryDraft([4, 2, 3], 1.0), HistoryDraft([7, 7, 7], 1.0)]
    tree = hybrid._tree(SimpleNamespace(depth=3, slots=torch.zeros(3, dtype=torch.long)), drafts)
    assert tree.tokens.tolist() == [[5, 6, 7, 5, 6, 9], [4, 2, 3, 1, 2, 3], [7, 7, 7, 7, 7, 7]]
    # block positions: the history chain at 1..3 (parents 0, 1, 2), the EAGLE-3 chain at 4..6
    assert tree.parents[0].tolist()[3:] == [0, 0, 2] and tree.valid[0].tolist() == [True] * 3 + [False, False, True]
    assert tree.parents[1].tolist() == [0, 1, 2, 0, 4, 5] and tree.valid[1].all()
    assert tree.valid[2].tolist() == [True] * 3 + [False] * 3  # the same chain twice: one branch


def test_hybrid_rows_keep_the_target_law_in_rng_mode(pair, monkeypatch):
    """rng mode, the hybrid choosing per row (point masses from history beside EAGLE-3's q in one
    chain): the tokens decided at every depth follow the target's law (power: the point-mass
    rule broken as above fails the history-only check; EAGLE-3's rows are
    test_speculative_law's)."""
    target, draft = pair
    store = HistoryStore(HistoryConfig(hybrid="rows"))
    decisions, steps = _generate(pair, CHAIN, monkeypatch, drafter=_hybrid_drafter(draft, store))
    stat, df, pval, tested = law_check(target, decisions, min_depth=0)
    assert pval > ALPHA, f"chi2={stat:.1f} df={df} p={pval:.2e}"
    stat1, df1, pval1, tested1 = law_check(target, decisions, min_depth=1)
    assert pval1 > ALPHA and tested1[1] >= 300, (stat1, df1, pval1, tested1)
    assert store.stats["history"]["rows"] > 0 and store.stats["eagle3"]["rows"] > 0, store.stats
