"""Lossless acceptance rules for speculative decoding (chains and trees), batched over B.

Every rule returns what the target emits in one verify step: the accepted draft prefix plus
one token of the target's own (the correction at the first rejection, or the bonus token after
a fully accepted chain/branch). Three sampling modes, matching `rollout.sampling`:

- greedy:   accept while the draft equals the target's argmax. Output = plain greedy decoding.
- rejection (rng mode): accept draft x ~ q with prob min(1, p(x)/q(x)); on rejection draw from
  normalise(max(0, p - q)). Output is distributed exactly as sampling from p (Leviathan et al.,
  Chen et al. 2023). Trees use recursive rejection over siblings drawn without replacement.
- coupled:  the target's sample at step t is argmax(logp + gumbel_noise(seed, request, t)), a
  pure function of the request and the step. The draft proposes with the same noise, and a
  draft token is accepted iff it equals the target's coupled sample, so the output equals plain
  coupled decoding token for token (and each token is an exact sample from p).

Conventions. Distributions are float32 log-probs already processed identically for draft and
target (`process_logits`: temperature, top-k, top-p). Chains: `draft_tokens (B, g)`,
`draft_logp (B, g, V)` (row i is the q that drafted token i), `target_logp (B, g+1, V)` (row i
is the target's p for the token after i accepted drafts; row g gives the bonus token). Trees:
see `rollout.tree`; `target_logp[b, i]` is the target's p for the token FOLLOWING node i and
`draft_logp[b, i]` is the q from which node i's children were drafted. Coupled noise is
`rollout.sampling.coupled_noise(seed, request_ids, first_step, n, V)` (B, n, V), where
`first_step (B,)` is the index (within the completion) of the token that chain position 0 /
the root's children predict: one call per verify step covers every position it can reach.
"""
from __future__ import annotations

import torch

from rollout.sampling import gumbel_argmax
from rollout.tree import node_depths

Long = torch.Tensor


# ----------------------------------------------------------------------------- primitives
def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalise(max(0, p - q)) over the last dim; falls back to p where the residual has no
    mass (p <= q everywhere, e.g. p == q: then a rejection has probability 0 anyway)."""
    r = (p - q).clamp_min(0.0)  # (..., V)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp_min(1e-30), p)


def accept_test(px: torch.Tensor, qx: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Accept with prob min(1, p(x)/q(x)), written u*q(x) < p(x) with u ~ U[0, 1): no division,
    q(x)=0 < p(x) accepts, p(x)=0 never accepts, p(x) >= q(x) > 0 always accepts."""
    return u * qx < px


def rejection_update(p: torch.Tensor, q: torch.Tensor, x: Long) -> tuple[torch.Tensor, torch.Tensor]:
    """After sibling x (drawn from q) was rejected: p <- residual(p, q) (the law the rest of the
    procedure must still produce) and q <- q without x, renormalised (the law of the next
    sibling, drawn without replacement). p, q (A, V); x (A,)."""
    q_next = q.scatter(1, x[:, None], 0.0)  # (A, V)
    q_mass = q_next.sum(1, keepdim=True)
    q_next = torch.where(q_mass > 0, q_next / q_mass.clamp_min(1e-30), q_next)
    return residual(p, q), q_next


# ----------------------------------------------------------------------------- acceptance probabilities
def rejection_accept_prob(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The probability that rejection sampling accepts a token drafted from q, sum_x min(p(x), q(x)).
    p, q (..., V) probabilities (p may hold less than 1 where the draft's vocabulary is a subset
    of the target's: the rest is on tokens never drafted) -> (...)."""
    return torch.minimum(p, q).sum(-1)


def coupled_accept_prob(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The probability that coupled sampling accepts the drafted token: that the target's and the
    draft's Gumbel-max draws with the same noise pick the same token. p (..., V): the target's
    probabilities over the tokens the draft can propose (summing to P <= 1; the rest, 1 - P, is on
    tokens it never proposes); q (..., V): the draft's, summing to 1 -> (...).

    Both draws pick token i with probability 1 / sum_j max(p_j / p_i, q_j / q_i), the sum over
    the whole vocabulary (a token the draft never proposes adds p_j / p_i), so the answer is
    sum_i p_i / (sum_j max(p_j, c_i q_j) + 1 - P) with c_i = p_i / q_i over tokens with p_i, q_i > 0.
    For a given i, max(p_j, c_i q_j) is p_j where p_j / q_j >= c_i and c_i q_j elsewhere, so one
    sort of the tokens by p_j / q_j and two cumulative sums give every i's sum: O(V log V), not
    O(V^2). It is at most rejection_accept_prob(p, q) (a coupling can agree no more often than
    the maximal one), equal to it where q is p renormalised over the draft's tokens or the
    vocabulary has two tokens, and below it for most other pairs."""
    valid = (p > 0) & (q > 0)  # tokens both can pick
    ratio = torch.where(valid, p / q.clamp_min(1e-38), torch.where(q > 0, 0.0, float("inf")))  # (..., V)
    order = ratio.argsort(dim=-1, descending=True)
    r_sorted = ratio.gather(-1, order)
    cum_p, cum_q = p.gather(-1, order).cumsum(-1), q.gather(-1, order).cumsum(-1)  # (..., V)
    above = torch.searchsorted(-r_sorted.contiguous(), -ratio.contiguous(), right=True)  # j with ratio_j >= ratio_i
    at = (above - 1).clamp_min(0)
    c = torch.where(valid, ratio, 0.0)
    total = cum_p.gather(-1, at) + c * (cum_q[..., -1:] - cum_q.gather(-1, at)) + (1.0 - cum_p[..., -1:]).clamp_min(0.0)
    return torch.where(valid, p / total.clamp_min(1e-38), 0.0).sum(-1)


# ----------------------------------------------------------------------------- chains
def verify_chain_greedy(draft_tokens: Long, target_logits: torch.Tensor) -> tuple[Long, Long]:
    """Longest prefix equal to the target's argmax, then the argmax at the first mismatch
    (or the bonus argmax at position g). draft_tokens (B, g), target_logits (B, g+1, V)."""
    best = target_logits.argmax(-1)  # (B, g+1)
    n = (draft_tokens == best[:, :-1]).long().cumprod(1).sum(1)  # (B,) leading matches
    return n, best.gather(1, n[:, None])[:, 0]


def verify_chain_rejection(draft_tokens: Long, draft_logp: torch.Tensor, target_logp: torch.Tensor,
                           generator: torch.Generator | None = None) -> tuple[Long, Long]:
    """Standard speculative sampling. draft_tokens (B, g) drawn from draft_logp (B, g, V);
    target_logp (B, g+1, V). Randomness: one uniform per draft token, then one multinomial."""
    B, g = draft_tokens.shape
    px = target_logp[:, :g].gather(2, draft_tokens[..., None])[..., 0].exp()  # (B, g)
    qx = draft_logp.gather(2, draft_tokens[..., None])[..., 0].exp()  # (B, g)
    u = torch.rand(B, g, generator=generator, device=target_logp.device)  # (B, g)
    n = accept_test(px, qx, u).long().cumprod(1).sum(1)  # (B,) accepted prefix
    rows = torch.arange(B, device=target_logp.device)
    p = target_logp[rows, n].exp()  # (B, V) at the first rejection, or the bonus position
    # q at the first rejection; 0 at the bonus position (n == g), where residual(p, 0) = p
    q = torch.where((n < g)[:, None], draft_logp[rows, n.clamp(max=g - 1)].exp(), 0.0)  # (B, V)
    return n, torch.multinomial(residual(p, q), 1, generator=generator)[:, 0]


def propose_coupled(draft_logp: torch.Tensor, noise: torch.Tensor) -> Long:
    """The draft's coupled proposal: argmax(draft_logp + the target's noise for that token).
    draft_logp (B, V), noise (B, V) (from `coupled_noise`) -> (B,). When q = p this IS the
    target's sample, so acceptance is 1; the closer q is to p the more often the argmaxes agree."""
    return gumbel_argmax(draft_logp, noise)


def propose_coupled_topk(draft_logp: torch.Tensor, k: int, noise: torch.Tensor) -> tuple[Long, torch.Tensor]:
    """Tree children under coupling: the k best tokens of draft_logp + noise (B, V) -> (B, k)
    tokens (column 0 = propose_coupled) and a (B, k) validity mask (False for tokens outside
    the draft's support). Extra children raise the chance that one of them equals the
    target's coupled sample; the target's output is unchanged whatever the tree."""
    top = (draft_logp + noise).topk(min(k, draft_logp.shape[-1]), dim=-1)
    return top.indices, torch.isfinite(top.values)


def verify_chain_coupled(draft_tokens: Long, target_logp: torch.Tensor, noise: torch.Tensor) -> tuple[Long, Long]:
    """Coupled verification: the target's sample at chain position i is argmax(target_logp[:, i]
    + noise[:, i]) (noise (B, g+1, V) from `coupled_noise` at the step of position 0); accept
    while the draft equals it; emit the target's sample at the first mismatch, or the bonus."""
    target_tokens = gumbel_argmax(target_logp, noise)  # (B, g+1)
    n = (draft_tokens == target_tokens[:, :-1]).long().cumprod(1).sum(1)  # (B,) leading matches
    return n, target_tokens.gather(1, n[:, None])[:, 0]


# ----------------------------------------------------------------------------- trees
def _max_depth(parents: Long, valid: torch.Tensor) -> int:
    """Deepest valid node over the batch: the accepted path has at most D + 1 nodes."""
    return int(node_depths(parents).masked_fill(~valid, 0).max())


def _walk_deterministic(parents: Long, tokens: Long, valid: torch.Tensor, target_next: Long,
                        max_depth: int | None = None):
    """Follow, from the root, the child whose token equals the target's own token after the
    current node, target_next[b, node] (first such child in index order); stop when there is
    none and emit it. The target's token is computed for every node up front (a few batched
    ops), so the walk itself is table lookups. `max_depth`: a bound on the valid nodes' depth
    known to the caller (the drafted depth), which spares reading it from the device.
    Returns (path (B, D+1) padded with -1, n_accepted (B,), next_token (B,))."""
    B, N = parents.shape
    dev = parents.device
    D = _max_depth(parents, valid) if max_depth is None else max_depth
    idx = torch.arange(N, device=dev)
    rows = torch.arange(B, device=dev)
    cur = torch.zeros(B, dtype=torch.long, device=dev)  # (B,)
    path = torch.full((B, D + 1), -1, dtype=torch.long, device=dev)
    path[:, 0] = 0
    active = torch.ones(B, dtype=torch.bool, device=dev)
    for d in range(D):
        want = target_next[rows, cur]  # (B,)
        hit = valid & (parents == cur[:, None]) & (tokens == want[:, None]) & active[:, None]  # (B, N)
        active = hit.any(1)
        child = torch.where(hit, idx, N).min(1).values  # (B,)
        cur = torch.where(active, child, cur)
        path[:, d + 1] = torch.where(active, child, -1)
    return path, (path >= 0).sum(1) - 1, target_next[rows, cur]


def verify_tree_greedy(parents: Long, tokens: Long, valid: torch.Tensor, target_logits: torch.Tensor,
                       max_depth: int | None = None):
    """Greedy tree walk: at node n descend to the child whose token is argmax target_logits[n].
    Returns (path (B, D+1) padded with -1, n_accepted (B,), next_token (B,)); D = max_depth
    where given, else the deepest valid node."""
    return _walk_deterministic(parents, tokens, valid, target_logits.argmax(-1), max_depth)


def verify_tree_coupled(parents: Long, tokens: Long, valid: torch.Tensor, target_logp: torch.Tensor,
                        noise: torch.Tensor, max_depth: int | None = None):
    """Coupled tree walk: at a node of depth d the target's sample is argmax(target_logp + noise[:, d])
    (noise (B, D+1, V) from `coupled_noise` at the step of the root's children); descend to the
    child carrying that token, else emit it. Same returns as the greedy walk."""
    depth = node_depths(parents).clamp(max=noise.shape[1] - 1)  # (B, N); padding nodes are never reached
    node_noise = noise.gather(1, depth[..., None].expand(-1, -1, noise.shape[-1]))  # (B, N, V)
    return _walk_deterministic(parents, tokens, valid, gumbel_argmax(target_logp, node_noise), max_depth)


def sample_children_without_replacement(draft_logp: torch.Tensor, k: int,
                                        generator: torch.Generator | None = None):
    """Gumbel-top-k: k distinct tokens drawn sequentially without replacement from q.
    draft_logp (B, V) -> (tokens (B, k), valid (B, k)). The descending order of the perturbed
    scores IS the sequential draw order, so place the children in the tree in this order
    (node index order) for `verify_tree_rejection`. valid is False past q's support."""
    u = torch.rand(draft_logp.shape, generator=generator, device=draft_logp.device)
    top = (draft_logp - torch.log(-torch.log(u))).topk(min(k, draft_logp.shape[-1]), dim=-1)
    return top.indices, torch.isfinite(top.values)


def verify_tree_rejection(parents: Long, tokens: Long, valid: torch.Tensor, draft_logp: torch.Tensor,
                          target_logp: torch.Tensor, generator: torch.Generator | None = None,
                          verified: torch.Tensor | None = None, max_depth: int | None = None,
                          max_children: int | None = None):
    """Recursive rejection sampling over a tree whose siblings were drafted without replacement.

    At the current node (p = target, q = draft distribution there) try the valid children in
    index order: accept x_j with prob min(1, p(x_j)/q(x_j)); on rejection p <- residual(p, q)
    and q <- q without x_j, renormalised. The first accepted child is descended into; if all
    are rejected (or there are none) the next token is drawn from the current p. Given the
    earlier siblings, x_j ~ q_j and the residual never puts mass on a rejected token, so by
    induction over siblings each node outputs exactly its p: the walk samples from the target.

    `verified` (B, N) bool, default = valid: nodes the target actually scored. A child that is
    valid but not verified still takes part in the sibling recursion (which needs only the
    parent's p and q); if it is accepted its token becomes next_token and the walk stops there.
    This keeps EAGLE-2 pruning lossless: prune for compute, not out of the sibling sequence.

    Every row walks in lockstep under masks, so nothing is read back from the device when the
    caller knows `max_depth` (a bound on the valid nodes' depth: the drafted depth) and
    `max_children` (a bound on any node's valid children: the tree's top-k); without them the
    bounds are read from the tree. Randomness: one uniform per node (B, N), then one
    multinomial over all rows (rows whose token is an accepted unverified child ignore theirs).
    Returns (path (B, D+1) verified nodes root-first padded with -1, n_accepted, next_token).
    """
    B, N, V = target_logp.shape
    dev = target_logp.device
    verified = valid if verified is None else verified & valid
    D = _max_depth(parents, valid) if max_depth is None else max_depth
    is_child = valid & (parents >= 0)  # (B, N)
    K = int(_child_counts(parents, is_child).max()) if max_children is None else min(max_children, N)
    u = torch.rand(B, N, generator=generator, device=dev)  # (B, N): node c's accept test
    idx = torch.arange(N, device=dev)
    rows = torch.arange(B, device=dev)
    path = torch.full((B, D + 1), -1, dtype=torch.long, device=dev)
    path[:, 0] = 0
    final_p = torch.ones(B, V, device=dev)  # law of next_token where it is drawn (any law elsewhere)
    forced = torch.full((B,), -1, dtype=torch.long, device=dev)  # accepted unverified child
    walking = torch.ones(B, dtype=torch.bool, device=dev)  # (B,) rows still descending
    cur = torch.zeros(B, dtype=torch.long, device=dev)  # (B,) their current node
    for d in range(1, D + 2):  # a node of depth D has no children: every row stops by D + 1
        p, q = target_logp[rows, cur].exp(), draft_logp[rows, cur].exp()  # (B, V)
        kid_mask = is_child & (parents == cur[:, None])  # (B, N)
        kids = torch.where(kid_mask, idx, N + idx).argsort(1)  # (B, N) children first, index order
        chosen = torch.full_like(cur, -1)  # (B,)
        for j in range(K):
            c = kids[:, j]  # (B,)
            x = tokens[rows, c]  # (B,)
            live = walking & (chosen < 0) & kid_mask[rows, c]
            acc = live & accept_test(p.gather(1, x[:, None])[:, 0], q.gather(1, x[:, None])[:, 0], u[rows, c])
            chosen = torch.where(acc, c, chosen)
            rej = (live & ~acc)[:, None]
            p_rej, q_rej = rejection_update(p, q, x)
            p, q = torch.where(rej, p_rej, p), torch.where(rej, q_rej, q)
        stop = walking & (chosen < 0)
        final_p = torch.where(stop[:, None], p, final_p)
        ok = verified[rows, chosen.clamp(min=0)]
        forced = torch.where(walking & (chosen >= 0) & ~ok, tokens[rows, chosen.clamp(min=0)], forced)
        walking = walking & (chosen >= 0) & ok
        cur = torch.where(walking, chosen, cur)
        if d <= D:
            path[:, d] = torch.where(walking, chosen, -1)
    drawn = torch.multinomial(final_p, 1, generator=generator)[:, 0]
    next_token = torch.where(forced >= 0, forced, drawn)
    return path, (path >= 0).sum(1) - 1, next_token


def _child_counts(parents: Long, is_child: torch.Tensor) -> Long:
    """(B, N) number of valid children of every node."""
    counts = torch.zeros(parents.shape, dtype=torch.long, device=parents.device)
    return counts.scatter_add_(1, parents.clamp(min=0), is_child.long())
