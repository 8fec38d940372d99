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
`draft_logp[b, i]` is the q from which node i's children were drafted. `first_step (B,)` is the
index (within the completion) of the token that chain position 0 / the root's children predict.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rollout.sampling import gumbel_noise, sample
from rollout.tree import node_depths

Long = torch.Tensor


# ----------------------------------------------------------------------------- primitives
def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalise(max(0, p - q)) over the last dim; falls back to p where the residual has no
    mass (p <= q everywhere, e.g. p == q: then a rejection has probability 0 anyway)."""
    r = (p - q).clamp_min(0.0)  # (..., V)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp_min(1e-30), p)


def reject_step(p: torch.Tensor, q: torch.Tensor, x: torch.Tensor, u: torch.Tensor):
    """One step of recursive rejection, rows independent. p, q (B, V); x, u (B,).

    Returns (accept (B,) bool, p_next (B, V), q_next (B, V)): accept x with prob min(1, p(x)/q(x))
    (written u*q(x) < p(x): no division, q(x)=0 < p(x) accepts, p(x)=0 never does); the
    distributions to use for the next sibling if x was rejected: p <- residual(p, q) and
    q <- q with x removed, renormalised (the next sibling was drawn without replacement).
    """
    px = p.gather(1, x[:, None])[:, 0]  # (B,)
    qx = q.gather(1, x[:, None])[:, 0]  # (B,)
    accept = u * qx < px
    q_next = q.scatter(1, x[:, None], 0.0)  # (B, V)
    q_mass = q_next.sum(1, keepdim=True)
    pass
    return accept, residual(p, q), q_next


def _accepted_prefix(match: torch.Tensor) -> Long:
    """Length of the leading run of True per row. (B, g) -> (B,)."""
    return match.long().cumprod(1).sum(1)


def _coupled_samples(logp: torch.Tensor, seed: int, request_ids: Long, steps: Long) -> Long:
    """The target's coupled samples: argmax(logp + noise(request, step)). (B, T, V) -> (B, T)."""
    return sample(logp, mode="coupled", seed=seed, request_ids=request_ids[:, None], steps=steps)


# ----------------------------------------------------------------------------- chains
def verify_chain_greedy(draft_tokens: Long, target_logits: torch.Tensor) -> tuple[Long, Long]:
    """Longest prefix equal to the target's argmax, then the argmax at the first mismatch
    (or the bonus argmax at position g). draft_tokens (B, g), target_logits (B, g+1, V)."""
    best = target_logits.argmax(-1)  # (B, g+1)
    n = _accepted_prefix(draft_tokens == best[:, :-1])  # (B,)
    return n, best.gather(1, n[:, None])[:, 0]


def verify_chain_rejection(draft_tokens: Long, draft_logp: torch.Tensor, target_logp: torch.Tensor,
                           generator: torch.Generator | None = None) -> tuple[Long, Long]:
    """Standard speculative sampling. draft_tokens (B, g) drawn from draft_logp (B, g, V);
    target_logp (B, g+1, V). Randomness: one uniform per draft token, then one multinomial."""
    B, g = draft_tokens.shape
    p = target_logp.exp()  # (B, g+1, V)
    q = F.pad(draft_logp.exp(), (0, 0, 0, 1))  # (B, g+1, V), q = 0 at the bonus position
    px = p[:, :g].gather(2, draft_tokens[..., None])[..., 0]  # (B, g)
    qx = q[:, :g].gather(2, draft_tokens[..., None])[..., 0]  # (B, g)
    u = torch.rand(B, g, generator=generator, device=p.device)  # (B, g)
    n = _accepted_prefix(u * qx < px)  # (B,)
    rows = torch.arange(B, device=p.device)
    # at a rejection: residual(p, q); after a full accept: residual(p, 0) = p (bonus)
    final = residual(p[rows, n], q[rows, n])  # (B, V)
    return n, torch.multinomial(final, 1, generator=generator)[:, 0]


def propose_coupled(draft_logp: torch.Tensor, seed: int, request_ids: Long, steps: Long) -> Long:
    """The draft's coupled proposal: argmax(draft_logp + the target's noise at `steps`).
    draft_logp (B, V), request_ids (B,), steps (B,) -> (B,). When q = p this IS the target's
    sample, so acceptance is 1; the closer q is to p the more often the argmaxes agree."""
    return sample(draft_logp, mode="coupled", seed=seed, request_ids=request_ids, steps=steps)


def propose_coupled_topk(draft_logp: torch.Tensor, k: int, seed: int, request_ids: Long,
                         steps: Long) -> tuple[Long, torch.Tensor]:
    """Tree children under coupling: the k best tokens of draft_logp + noise (B, V) -> (B, k)
    tokens (column 0 = propose_coupled) and a (B, k) validity mask (False for tokens outside
    the draft's support). Extra children raise the chance that one of them equals the
    target's coupled sample; the target's output is unchanged whatever the tree."""
    noise = gumbel_noise(seed, request_ids, steps, draft_logp.shape[-1])  # (B, V)
    top = (draft_logp + noise).topk(min(k, draft_logp.shape[-1]), dim=-1)
    return top.indices, torch.isfinite(top.values)


def verify_chain_coupled(draft_tokens: Long, target_logp: torch.Tensor, seed: int, request_ids: Long,
                         first_step: Long) -> tuple[Long, Long]:
    """Coupled verification: target sample at chain position i uses step first_step + i;
    accept while the draft equals it; emit the target's sample at the first mismatch/bonus."""
    g1 = target_logp.shape[1]
    steps = first_step[:, None] + torch.arange(g1, device=target_logp.device)  # (B, g+1)
    best = _coupled_samples(target_logp, seed, request_ids, steps)  # (B, g+1)
    n = _accepted_prefix(draft_tokens == best[:, :-1])
    return n, best.gather(1, n[:, None])[:, 0]


# ----------------------------------------------------------------------------- trees
def _max_depth(parents: Long, valid: torch.Tensor) -> tuple[Long, int]:
    depth = node_depths(parents)
    return depth, int(depth.masked_fill(~valid, 0).max())


def _walk_deterministic(parents: Long, tokens: Long, valid: torch.Tensor, choice: Long):
    """Follow, from the root, the child whose token equals choice[node] (the target's own
    token after that node); first such child in index order. Returns (path, n, next_token)."""
    B, N = parents.shape
    _, D = _max_depth(parents, valid)
    idx = torch.arange(N, device=parents.device)
    cur = torch.zeros(B, dtype=torch.long, device=parents.device)  # (B,)
    path = torch.full((B, D + 1), -1, dtype=torch.long, device=parents.device)
    path[:, 0] = 0
    active = torch.ones(B, dtype=torch.bool, device=parents.device)
    for d in range(1, D + 1):
        want = choice.gather(1, cur[:, None])  # (B, 1)
        hit = valid & (parents == cur[:, None]) & (tokens == want) & active[:, None]  # (B, N)
        active = hit.any(1)
        child = torch.where(hit, idx, N).min(1).values  # (B,)
        cur = torch.where(active, child, cur)
        path[:, d] = torch.where(active, child, -1)
    n = (path >= 0).sum(1) - 1
    return path, n, choice.gather(1, cur[:, None])[:, 0]


def verify_tree_greedy(parents: Long, tokens: Long, valid: torch.Tensor, target_logits: torch.Tensor):
    """Greedy tree walk: at node n descend to the child whose token is argmax target_logits[n].
    Returns (path (B, D+1) padded with -1, n_accepted (B,), next_token (B,))."""
    return _walk_deterministic(parents, tokens, valid, target_logits.argmax(-1))


def verify_tree_coupled(parents: Long, tokens: Long, valid: torch.Tensor, target_logp: torch.Tensor,
                        seed: int, request_ids: Long, first_step: Long):
    """Coupled tree walk: at a node of depth d the target's sample uses step first_step + d;
    descend to the child carrying that token, else emit it. Same returns as the greedy walk."""
    B, N, V = target_logp.shape
    depth, D = _max_depth(parents, valid)
    steps = first_step[:, None] + torch.arange(D + 1, device=target_logp.device)  # (B, D+1)
    noise = gumbel_noise(seed, request_ids[:, None], steps, V)  # (B, D+1, V): one row per depth
    rows = torch.arange(B, device=target_logp.device)
    choice = torch.stack([(target_logp[:, i] + noise[rows, depth[:, i].clamp(max=D)]).argmax(-1)
                          for i in range(N)], dim=1)  # (B, N), one (B, V) temporary at a time
    return _walk_deterministic(parents, tokens, valid, choice)


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
                          verified: torch.Tensor | None = None):
    """Recursive rejection sampling over a tree whose siblings were drafted without replacement.

    At the current node (p = target, q = draft distribution there) try the valid children in
    index order: accept x_j with prob min(1, p(x_j)/q(x_j)); on rejection p <- residual(p, q)
    and q <- q without x_j, renormalised. The first accepted child is descended into; if all
    are rejected (or there are none) the next token is drawn from the current p. By induction
    over siblings each step outputs exactly the current p, so the walk samples from the target.

    `verified` (B, N) bool, default = valid: nodes the target actually scored. A child that is
    valid but not verified still takes part in the sibling recursion (which needs only the
    parent's p and q); if it is accepted its token becomes next_token and the walk stops there.
    This keeps EAGLE-2 pruning lossless: prune for compute, not out of the sibling sequence.

    Randomness: one uniform per node (B, N), then one multinomial over (B, V).
    Returns (path (B, D+1) verified nodes root-first padded with -1, n_accepted, next_token).
    """
    B, N, V = target_logp.shape
    dev = target_logp.device
    verified = valid if verified is None else verified & valid
    _, D = _max_depth(parents, valid)
    is_child = valid & (parents >= 0)  # (B, N)
    n_kids = torch.zeros(B, N + 1, dtype=torch.long, device=dev)
    n_kids.scatter_add_(1, torch.where(is_child, parents, N), torch.ones_like(parents))
    K = int(n_kids[:, :N].max()) if N > 1 else 0
    u = torch.rand(B, N, generator=generator, device=dev)  # (B, N) node c's accept test
    idx = torch.arange(N, device=dev)
    rows = torch.arange(B, device=dev)
    cur = torch.zeros(B, dtype=torch.long, device=dev)
    path = torch.full((B, D + 1), -1, dtype=torch.long, device=dev)
    path[:, 0] = 0
    active = torch.ones(B, dtype=torch.bool, device=dev)  # still walking
    final_p = target_logp[:, 0].exp()  # (B, V) distribution of next_token where sampled
    forced = torch.full((B,), -1, dtype=torch.long, device=dev)  # accepted unverified child
    for d in range(1, D + 2):
        p, q = target_logp[rows, cur].exp(), draft_logp[rows, cur].exp()  # (B, V)
        kid_mask = is_child & (parents == cur[:, None])  # (B, N)
        kids = torch.where(kid_mask, idx, N + idx).argsort(1)[:, :K]  # (B, K) index order
        kid_ok = kid_mask.gather(1, kids)  # (B, K)
        chosen = torch.full((B,), -1, dtype=torch.long, device=dev)
        trying = active.clone()
        for j in range(K):
            c = kids[:, j]
            live = trying & kid_ok[:, j]
            acc, p_next, q_next = reject_step(p, q, tokens.gather(1, c[:, None])[:, 0], u[rows, c])
            acc &= live
            rej = (live & ~acc)[:, None]
            chosen = torch.where(acc, c, chosen)
            p, q = torch.where(rej, p_next, p), torch.where(rej, q_next, q)
            trying &= ~acc
        stop_here = active & (chosen < 0)
        final_p = torch.where(stop_here[:, None], p, final_p)
        unverified = active & (chosen >= 0) & ~verified.gather(1, chosen.clamp(min=0)[:, None])[:, 0]
        forced = torch.where(unverified, tokens.gather(1, chosen.clamp(min=0)[:, None])[:, 0], forced)
        descend = active & (chosen >= 0) & ~unverified
        if d <= D:
            path[:, d] = torch.where(descend, chosen, -1)
        cur = torch.where(descend, chosen, cur)
        active = descend
    drawn = torch.multinomial(final_p, 1, generator=generator)[:, 0]  # (B,)
    n = (path >= 0).sum(1) - 1
    return path, n, torch.where(forced >= 0, forced, drawn)
