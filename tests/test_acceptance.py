"""Acceptance rules: exact checks for greedy/coupled, chi-square checks for rejection sampling.

Statistical tests run a small Markov chain (V = 6, the distributions depend on the previous
token) batched over B = 20000 independent trials, collect the first two emitted tokens and
compare their joint histogram (36 cells) to the exact target law p(a | s0) p(b | a) with a
chi-square test: cells with expected count < 5 are pooled, and the test passes when the
p-value (regularised upper incomplete gamma, torch.special.gammaincc) exceeds ALPHA = 1e-3.
Any emitted pair with target probability 0 fails outright. Seeds are fixed, so every test is
deterministic. Each correctness check has a companion "power" check: a deliberately broken
rule must fail the same test (p-value < ALPHA), which shows the check can see a wrong rule.
"""
from __future__ import annotations

import pytest
import torch
from helpers import chi2_pvalue

from rollout import acceptance as acc
from rollout.sampling import coupled_noise, process_logits, sample
from rollout.tree import gather_path, select_nodes

V = 6
TRIALS = 20000
ALPHA = 1e-3
START = 0
NEG = float("-inf")


# ----------------------------------------------------------------------------- helpers
def make_case(name: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft log-prob tables (V, V): row = previous token."""
    g = torch.Generator().manual_seed(seed)
    rand_dist = lambda scale: (torch.randn(V, V, generator=g) * scale).softmax(-1)  # noqa: E731
    p = rand_dist(1.5)
    if name == "far":
        q = rand_dist(2.0)
    elif name == "equal":
        q = p.clone()
    elif name == "q_zero":  # q puts no mass on two tokens where p > 0
        q = rand_dist(1.0)
        q[:, [1, 4]] = 0.0
    elif name == "q_narrow":  # q's support (2 tokens) is smaller than a node's 3 children
        q = torch.zeros(V, V)
        q[:, [0, 3]] = torch.rand(V, 2, generator=g) + 0.1
    elif name == "topk_p":  # both processed identically: temperature + top-k / top-p
        logits_p, logits_q = torch.randn(V, V, generator=g) * 2, torch.randn(V, V, generator=g) * 2
        return process_logits(logits_p, 0.8, top_k=3), process_logits(logits_q, 0.8, top_k=3, top_p=0.9)
    elif name == "disjoint":
        p[:, 3:] = 0.0
        q = torch.zeros(V, V)
        q[:, 3:] = 1.0
    else:
        raise ValueError(name)
    p, q = p / p.sum(1, keepdim=True), q / q.sum(1, keepdim=True)
    return p.log(), q.log()


def exact_pairs(p_logp: torch.Tensor) -> torch.Tensor:
    p = p_logp.double().exp()
    return p[START][:, None] * p  # (V, V): P(first = a, second = b)


def append_round(out, count, seq, n):
    """Append seq[b, :n[b]+1] (accepted drafts + the target's token) to out (B, 2)."""
    for i in range(seq.shape[1]):
        m = (i <= n) & (count < out.shape[1])
        out[m, count[m]] = seq[m, i]
        count += m.long()


def pair_counts(out: torch.Tensor) -> torch.Tensor:
    return torch.bincount(out[:, 0] * V + out[:, 1], minlength=V * V).view(V, V)


def run_chain(verify, p_logp, q_logp, gamma, seed=1, B=TRIALS):
    gen = torch.Generator().manual_seed(seed)
    out = torch.full((B, 2), -1, dtype=torch.long)
    count = torch.zeros(B, dtype=torch.long)
    prev = torch.full((B,), START, dtype=torch.long)
    for _ in range(2):
        x, toks, dl = prev, [], []
        for _ in range(gamma):  # draft chain from q
            dl.append(q_logp[x])
            x = torch.multinomial(q_logp[x].exp(), 1, generator=gen)[:, 0]
            toks.append(x)
        draft, draft_logp = torch.stack(toks, 1), torch.stack(dl, 1)  # (B, g), (B, g, V)
        target_logp = p_logp[torch.cat([prev[:, None], draft], 1)]  # (B, g+1, V)
        n, nxt = verify(draft, draft_logp, target_logp, gen)
        seq = torch.cat([draft, nxt[:, None]], 1).scatter(1, n[:, None], nxt[:, None])
        append_round(out, count, seq, n)
        prev = nxt
    assert bool((count == 2).all())
    return pair_counts(out)


TREE_PARENTS = torch.tensor([-1, 0, 0, 0, 1, 1, 2, 2, 3, 3])  # root, 3 children, 2 grandchildren each


def build_tree(prev, q_logp, gen):
    """Depth-2 tree drafted from q: 3 root children, 2 children each, without replacement."""
    B = prev.shape[0]
    c1, v1 = acc.sample_children_without_replacement(q_logp[prev], 3, gen)  # (B, 3)
    c2, v2 = acc.sample_children_without_replacement(q_logp[c1].view(B * 3, V), 2, gen)
    tokens = torch.cat([prev[:, None], c1, c2.view(B, 6)], 1)  # (B, 10)
    valid = torch.cat([torch.ones(B, 1, dtype=torch.bool), v1, v2.view(B, 6) & v1.repeat_interleave(2, 1)], 1)
    return TREE_PARENTS.expand(B, -1), tokens, valid


def run_tree(p_logp, q_logp, seed=2, B=TRIALS, prune_budget=None, drop_pruned=False):
    gen = torch.Generator().manual_seed(seed)
    out = torch.full((B, 2), -1, dtype=torch.long)
    count = torch.zeros(B, dtype=torch.long)
    prev = torch.full((B,), START, dtype=torch.long)
    for _ in range(2):
        parents, tokens, valid = build_tree(prev, q_logp, gen)
        verified = None
        if prune_budget is not None:  # EAGLE-2 re-rank by cumulative draft log-prob
            step = q_logp[tokens.gather(1, parents.clamp(min=0)), tokens]  # (B, N) log q(node | parent)
            scores = torch.zeros_like(step)
            for i in range(1, parents.shape[1]):
                scores[:, i] = scores[:, parents[0, i]] + step[:, i]
            keep, _, keep_valid = select_nodes(scores, parents, prune_budget, valid)
            verified = torch.zeros_like(valid).scatter(1, keep, keep_valid)
            if drop_pruned:  # the lossy way: pruned siblings vanish from the recursion
                valid, verified = verified, None
        path, n, nxt = acc.verify_tree_rejection(parents, tokens, valid, q_logp[tokens], p_logp[tokens],
                                                 gen, verified=verified)
        seq = gather_path(path, tokens)[:, 1:]  # accepted tokens, padded with -1
        seq = torch.cat([seq, nxt[:, None]], 1).scatter(1, n[:, None], nxt[:, None])
        append_round(out, count, seq, n)
        prev = nxt
    assert bool((count == 2).all())
    return pair_counts(out)


# ----------------------------------------------------------------------------- greedy
def test_chain_greedy_exact():
    best = torch.tensor([2, 3, 1, 4])
    logits = torch.nn.functional.one_hot(best, 5).float().expand(3, 4, 5) + 0.1 * torch.rand(3, 4, 5)
    draft = torch.tensor([[2, 3, 0], [2, 3, 1], [0, 3, 1]])
    n, nxt = acc.verify_chain_greedy(draft, logits)
    assert n.tolist() == [2, 3, 0]
    assert nxt.tolist() == [1, 4, 2]


def test_tree_greedy_exact():
    #        0
    #      /   \
    #   1(2)   2(3)
    #   /  \      \
    # 3(1) 4(4)   5(0)
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2]] * 3)
    tokens = torch.tensor([[9, 2, 3, 1, 4, 0]] * 3)
    valid = torch.ones(3, 6, dtype=torch.bool)
    valid[2, 5] = False
    best = torch.tensor([[3, 0, 0, 0, 0, 4],   # root->2, 2->5, 5 emits 4
                         [2, 4, 1, 0, 1, 0],   # root->1, 1->4, 4 emits 1
                         [3, 0, 0, 0, 0, 4]])  # node 5 invalid: stop at 2, emit 0
    logits = torch.nn.functional.one_hot(best, 10).float()
    path, n, nxt = acc.verify_tree_greedy(parents, tokens, valid, logits)
    assert path.tolist() == [[0, 2, 5], [0, 1, 4], [0, 2, -1]]
    assert n.tolist() == [2, 2, 1] and nxt.tolist() == [4, 1, 0]
    # a depth bound from the caller (the drafted depth) only pads the path
    path, n, nxt = acc.verify_tree_greedy(parents, tokens, valid, logits, max_depth=4)
    assert path.tolist() == [[0, 2, 5, -1, -1], [0, 1, 4, -1, -1], [0, 2, -1, -1, -1]]
    assert n.tolist() == [2, 2, 1] and nxt.tolist() == [4, 1, 0]


# ----------------------------------------------------------------------------- chain rejection
def test_chain_rejection_edge_cases():
    """q(x)=0 < p(x) accepts, p(x)=0 never accepts, p=q accepts everything, no NaN anywhere."""
    gen = torch.Generator().manual_seed(0)
    B = 2000
    p = torch.tensor([0.5, 0.5, 0.0, 0.0]).log()
    q = torch.tensor([0.0, 0.5, 0.5, 0.0]).log()
    draft_logp = q.expand(B, 1, 4)
    target_logp = p.expand(B, 2, 4)
    n, nxt = acc.verify_chain_rejection(torch.zeros(B, 1, dtype=torch.long), draft_logp, target_logp, gen)
    assert bool((n == 1).all())  # q(0) = 0 < p(0): accepted
    n, nxt = acc.verify_chain_rejection(torch.full((B, 1), 2), draft_logp, target_logp, gen)
    assert bool((n == 0).all()) and bool((nxt == 0).all())  # residual = [1, 0, 0, 0]
    n, nxt = acc.verify_chain_rejection(torch.full((B, 1), 1), p.expand(B, 1, 4), target_logp, gen)
    assert bool((n == 1).all()) and set(nxt.tolist()) == {0, 1}  # p == q: accept, bonus from p
    # residual with zero mass (only reachable through float noise): falls back to p, no NaN
    r = acc.residual(torch.tensor([[0.5, 0.5]]), torch.tensor([[0.5, 0.5]]))
    assert torch.equal(r, torch.tensor([[0.5, 0.5]]))


@pytest.mark.parametrize("gamma", [3, 1])
@pytest.mark.parametrize("case", ["far", "equal", "q_zero", "topk_p", "disjoint"])
def test_chain_rejection_matches_target(case, gamma):
    p_logp, q_logp = make_case(case)
    stat, df, pval = chi2_pvalue(run_chain(acc.verify_chain_rejection, p_logp, q_logp, gamma), exact_pairs(p_logp))
    assert pval > ALPHA, f"{case} gamma={gamma}: chi2={stat:.1f} df={df} p={pval:.2e}"


def _accept_always(draft, draft_logp, target_logp, gen):
    """Broken: q = 0 makes every draft token with p(x) > 0 accepted."""
    return acc.verify_chain_rejection(draft, torch.full_like(draft_logp, NEG), target_logp, gen)


def _no_residual(draft, draft_logp, target_logp, gen):
    """Broken: after a rejection draw from p instead of normalise(max(0, p - q))."""
    n, _ = acc.verify_chain_rejection(draft, draft_logp, target_logp, gen)
    p = target_logp[torch.arange(draft.shape[0]), n].exp()
    return n, torch.multinomial(p, 1, generator=gen)[:, 0]


@pytest.mark.parametrize("wrong", [_accept_always, _no_residual])
def test_chain_check_has_power(wrong):
    p_logp, q_logp = make_case("far")
    stat, df, pval = chi2_pvalue(run_chain(wrong, p_logp, q_logp, 3), exact_pairs(p_logp))
    assert pval < ALPHA, f"{wrong.__name__} passed: chi2={stat:.1f} df={df} p={pval:.2e}"


# ----------------------------------------------------------------------------- tree rejection
def test_tree_rejection_special_cases():
    """q = p accepts the first child at every level; an accepted unverified child is emitted."""
    gen = torch.Generator().manual_seed(0)
    B = 500
    parents = torch.tensor([[-1, 0, 0, 1, 1]]).expand(B, -1)
    tokens = torch.tensor([[0, 1, 2, 3, 1]]).expand(B, -1)
    valid = torch.ones(B, 5, dtype=torch.bool)
    logp = torch.randn(B, 5, 4, generator=gen).log_softmax(-1)
    path, n, _ = acc.verify_tree_rejection(parents, tokens, valid, logp, logp, gen)
    assert path.tolist() == [[0, 1, 3]] * B and n.tolist() == [2] * B
    # child 2 unverified, q(2) = 0 < p(2): child 1 (p = 0) is rejected, child 2 accepted and emitted
    p = torch.tensor([0.0, 0.0, 0.5, 0.5]).log().expand(B, 5, 4)
    q = torch.tensor([0.0, 1.0, 0.0, 0.0]).log().expand(B, 5, 4)
    verified = torch.tensor([[True, True, False, True, True]]).expand(B, -1)
    path, n, nxt = acc.verify_tree_rejection(parents, tokens, valid, q, p, gen, verified=verified)
    assert path.tolist() == [[0, -1, -1]] * B and n.tolist() == [0] * B and nxt.tolist() == [2] * B


def test_children_without_replacement():
    gen = torch.Generator().manual_seed(0)
    logp = torch.tensor([[0.0, 0.0, NEG, 0.0]]).log_softmax(-1).expand(5000, 4)
    toks, ok = acc.sample_children_without_replacement(logp, 3, gen)
    assert bool(ok.all()) and bool((toks != 2).all())
    assert bool((toks.sort(1).values == torch.tensor([0, 1, 3])).all())  # distinct
    toks, ok = acc.sample_children_without_replacement(logp, 4, gen)
    assert ok.sum(1).tolist() == [3] * 5000  # the 4th "child" lies outside q's support
    first = torch.bincount(toks[:, 0], minlength=4).float() / 5000  # first child ~ q
    assert torch.allclose(first, torch.tensor([1 / 3, 1 / 3, 0, 1 / 3]), atol=0.03)


@pytest.mark.parametrize("case", ["far", "equal", "q_zero", "q_narrow", "topk_p", "disjoint"])
def test_tree_rejection_matches_target(case):
    p_logp, q_logp = make_case(case)
    stat, df, pval = chi2_pvalue(run_tree(p_logp, q_logp), exact_pairs(p_logp))
    assert pval > ALPHA, f"{case}: chi2={stat:.1f} df={df} p={pval:.2e}"


@pytest.mark.parametrize("case", ["far", "q_zero"])
def test_tree_rejection_with_pruned_siblings_matches_target(case):
    """EAGLE-2 pruning by score (keep 4 of 10 nodes), pruned siblings kept as
    valid-but-unverified: lossless."""
    p_logp, q_logp = make_case(case)
    stat, df, pval = chi2_pvalue(run_tree(p_logp, q_logp, prune_budget=4), exact_pairs(p_logp))
    assert pval > ALPHA, f"{case}: chi2={stat:.1f} df={df} p={pval:.2e}"


def test_tree_rejection_with_host_bounds_walks_the_same():
    """Bounds from the caller (the drafted depth, the tree's top-k; here looser than the tree)
    spare reading them from the device and change nothing but the path's padding: the same
    random draws give the same walk."""
    p_logp, q_logp = make_case("far")
    prev = torch.full((500,), START, dtype=torch.long)
    parents, tokens, valid = build_tree(prev, q_logp, torch.Generator().manual_seed(5))
    args = (parents, tokens, valid, q_logp[tokens], p_logp[tokens])
    path, n, nxt = acc.verify_tree_rejection(*args, torch.Generator().manual_seed(6))
    path_b, n_b, nxt_b = acc.verify_tree_rejection(*args, torch.Generator().manual_seed(6), max_depth=4,
                                                   max_children=5)
    assert path.shape[1] == 3 and torch.equal(path_b[:, :3], path) and bool((path_b[:, 3:] == -1).all())
    assert torch.equal(n_b, n) and torch.equal(nxt_b, nxt) and 0 < float(n.float().mean()) < 2


def test_tree_rejection_dropping_pruned_siblings_is_lossy():
    """Why `verified` exists: removing score-pruned siblings from the recursion biases the
    output towards high-q tokens, and the chi-square check sees it."""
    p_logp, q_logp = make_case("far")
    stat, df, pval = chi2_pvalue(run_tree(p_logp, q_logp, prune_budget=4, drop_pruned=True), exact_pairs(p_logp))
    assert pval < ALPHA, f"chi2={stat:.1f} df={df} p={pval:.2e}"


_UPDATE = acc.rejection_update  # the correct rule, kept before any monkeypatching


def _p_not_updated(p, q, x):  # draws the correction from p instead of the residual
    return p, _UPDATE(p, q, x)[1]


def _q_not_updated(p, q, x):  # with-replacement rule applied to without-replacement drafts
    return _UPDATE(p, q, x)[0], q


@pytest.mark.parametrize("wrong", [_p_not_updated, _q_not_updated])
def test_tree_check_has_power(wrong, monkeypatch):
    p_logp, q_logp = make_case("far")
    monkeypatch.setattr(acc, "rejection_update", wrong)
    stat, df, pval = chi2_pvalue(run_tree(p_logp, q_logp), exact_pairs(p_logp))
    assert pval < ALPHA, f"{wrong.__name__} passed: chi2={stat:.1f} df={df} p={pval:.2e}"


# ----------------------------------------------------------------------------- coupled
SEED = 1234


def plain_coupled(p_logp, request_ids, T):
    """Plain coupled decoding: token t = argmax(p(. | prev) + noise(seed, request, t))."""
    prev = torch.full_like(request_ids, START)
    out = []
    for t in range(T):
        prev = sample(p_logp[prev], mode="coupled", seed=SEED, request_ids=request_ids,
                      steps=torch.full_like(request_ids, t))
        out.append(prev)
    return torch.stack(out, 1)  # (B, T)


def spec_coupled(p_logp, q_logp, request_ids, T, gamma=None, tree=None, gen=None):
    """Speculative coupled decoding with a chain (gamma) or a depth-2 tree (tree='coupled'
    drafts with the shared noise, tree='random' drafts unrelated tokens). Returns (tokens, verifies)."""
    B = request_ids.shape[0]
    seqs = [[] for _ in range(B)]
    prev = torch.full((B,), START, dtype=torch.long)
    step = torch.zeros(B, dtype=torch.long)
    verifies = 0
    while min(len(s) for s in seqs) < T:
        verifies += 1
        if gamma is not None:
            noise = coupled_noise(SEED, request_ids, step, gamma + 1, V)  # (B, g+1, V)
            x, toks = prev, []
            for i in range(gamma):
                x = acc.propose_coupled(q_logp[x], noise[:, i])
                toks.append(x)
            draft = torch.stack(toks, 1)  # (B, g)
            n, nxt = acc.verify_chain_coupled(draft, p_logp[torch.cat([prev[:, None], draft], 1)], noise)
        else:
            noise = coupled_noise(SEED, request_ids, step, 3, V)  # depths 0..2 of the tree
            if tree == "coupled":
                c1, v1 = acc.propose_coupled_topk(q_logp[prev], 3, noise[:, 0])
                c2, v2 = acc.propose_coupled_topk(q_logp[c1].view(B * 3, V), 2, noise[:, 1].repeat_interleave(3, 0))
                tokens = torch.cat([prev[:, None], c1, c2.view(B, 6)], 1)
                valid = torch.cat([torch.ones(B, 1, dtype=torch.bool), v1, v2.view(B, 6) & v1.repeat_interleave(2, 1)], 1)
            else:
                tokens = torch.cat([prev[:, None], torch.randint(0, V, (B, 9), generator=gen)], 1)
                valid = torch.rand(B, 10, generator=gen) < 0.8
                valid[:, 0] = True
            path, n, nxt = acc.verify_tree_coupled(TREE_PARENTS.expand(B, -1), tokens, valid, p_logp[tokens], noise)
            draft = gather_path(path, tokens)[:, 1:]
        for b in range(B):
            seqs[b] += draft[b, : n[b]].tolist() + [int(nxt[b])]
        step += n + 1
        prev = nxt
    return torch.tensor([s[:T] for s in seqs]), verifies


@pytest.mark.parametrize("case", ["far", "q_zero", "topk_p"])
@pytest.mark.parametrize("mode", ["chain", "tree_coupled", "tree_random"])
def test_coupled_reproduces_plain_decoding(case, mode):
    p_logp, q_logp = make_case(case)
    rid = torch.arange(64) * 7919 + 3
    plain = plain_coupled(p_logp, rid, 12)
    kw = {"chain": dict(gamma=3), "tree_coupled": dict(tree="coupled"),
          "tree_random": dict(tree="random", gen=torch.Generator().manual_seed(5))}[mode]
    spec, _ = spec_coupled(p_logp, q_logp, rid, 12, **kw)
    assert torch.equal(spec, plain)


def test_coupled_equal_draft_accepts_everything():
    p_logp, _ = make_case("far")
    rid = torch.arange(32)
    spec, verifies = spec_coupled(p_logp, p_logp, rid, 12, gamma=3)
    assert torch.equal(spec, plain_coupled(p_logp, rid, 12))
    assert verifies == 3  # 4 tokens per verify: every draft accepted + the bonus


def test_plain_coupled_sampling_matches_target():
    p_logp, _ = make_case("far")
    pairs = plain_coupled(p_logp, torch.arange(TRIALS) * 31 + 11, 2)
    stat, df, pval = chi2_pvalue(pair_counts(pairs), exact_pairs(p_logp))
    assert pval > ALPHA, f"chi2={stat:.1f} df={df} p={pval:.2e}"
    # power: reusing one request id for every trial makes the "samples" identical
    stat, df, pval = chi2_pvalue(pair_counts(plain_coupled(p_logp, torch.zeros(TRIALS, dtype=torch.long), 2)),
                                 exact_pairs(p_logp))
    assert pval < ALPHA


def _coupled_accept_brute(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The coupled acceptance by its definition, O(V^2): sum_i 1 / sum_j max(p_j / p_i, q_j / q_i)
    over the whole vocabulary, the mass 1 - sum(p) on one extra token the draft never proposes."""
    rest = (1.0 - p.sum(-1, keepdim=True)).clamp_min(0.0)
    p_full, q_full = torch.cat([p, rest], -1).double(), torch.cat([q, torch.zeros_like(rest)], -1).double()
    out = torch.zeros(p.shape[:-1], dtype=torch.float64)
    for i in range(p.shape[-1]):
        pi, qi = p_full[..., i:i + 1], q_full[..., i:i + 1]
        ok = (pi[..., 0] > 0) & (qi[..., 0] > 0)
        s = torch.maximum(p_full / pi.clamp_min(1e-300), q_full / qi.clamp_min(1e-300)).sum(-1)
        out += torch.where(ok, 1.0 / s, 0.0)
    return out


def test_coupled_acceptance_is_the_definitions_sum_and_at_most_rejections():
    """coupled_accept_prob's sort-and-cumulate form equals the definition's double sum, on peaked,
    flat and disjoint pairs, with zeros on either side and target mass outside the draft's
    vocabulary; it equals min(p, q)'s sum where q is p renormalised, and never exceeds it."""
    gen = torch.Generator().manual_seed(0)
    V = 12
    p = torch.softmax(1.5 * torch.randn(64, V + 3, generator=gen), -1)[:, :V]  # 3 tokens outside the draft's
    q = torch.softmax(1.5 * torch.randn(64, V, generator=gen), -1)
    q[:8, :4] = 0.0  # tokens the draft never proposes ...
    p[8:16, 4:8] = 0.0  # ... or the target never samples
    q = q / q.sum(-1, keepdim=True)
    q[16:20] = torch.nn.functional.one_hot(torch.arange(4) % V, V).float()  # a point mass
    q[20:24] = (p[20:24] / p[20:24].sum(-1, keepdim=True))  # the target renormalised
    got = acc.coupled_accept_prob(p, q)
    assert torch.allclose(got.double(), _coupled_accept_brute(p, q), atol=1e-5)
    assert (got <= acc.rejection_accept_prob(p, q) + 1e-6).all()
    assert torch.allclose(got[20:24], acc.rejection_accept_prob(p[20:24], q[20:24]), atol=1e-5)
    assert (got < acc.rejection_accept_prob(p, q) - 1e-3).sum() > 32  # a real gap elsewhere
    disjoint = torch.zeros(2, V)
    disjoint[:, :6] = 1 / 6
    assert acc.coupled_accept_prob(disjoint, disjoint.flip(-1)).abs().max() == 0.0


def test_coupled_acceptance_is_how_often_the_engines_coupled_draws_agree():
    """The probability is that of the engine's own coupled draws: the draft proposing with
    propose_coupled over its vocabulary, the target sampling with the same noise over the whole
    vocabulary (rollout.sampling.sample, mode "coupled"). 20,000 independent request ids per
    pair: a difference of 0.01 is about 3 standard errors, and the rejection rule's probability,
    larger by more than that on these pairs, is rejected (the check has power)."""
    gen = torch.Generator().manual_seed(1)
    V, extra, N = 10, 4, 20_000
    p_full = torch.softmax(torch.randn(3, V + extra, generator=gen), -1)  # the last `extra` never drafted
    q = torch.softmax(torch.randn(3, V, generator=gen), -1)
    want = acc.coupled_accept_prob(p_full[:, :V], q)
    rid = torch.arange(N) * 7919 + 5
    noise = coupled_noise(SEED, rid, torch.zeros(N, dtype=torch.long), 1, V + extra)[:, 0]  # (N, V + extra)
    for k in range(3):
        q_full = torch.cat([q[k].log(), torch.full((extra,), float("-inf"))])
        drafted = acc.propose_coupled(q_full.expand(N, -1), noise)
        sampled = sample(p_full[k].log().expand(N, -1), mode="coupled", seed=SEED, request_ids=rid,
                         steps=torch.zeros(N, dtype=torch.long))
        agree = (drafted == sampled).double().mean()
        se = (agree * (1 - agree) / N).sqrt()
        assert abs(agree - want[k]) < 4 * se + 1e-3, (k, float(agree), float(want[k]))
        rejection = acc.rejection_accept_prob(p_full[k, :V], q[k])
        assert rejection - agree > 6 * se, "the check cannot tell the two rules apart on this pair"
