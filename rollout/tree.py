"""Token-tree helpers for EAGLE-2 style dynamic draft trees.

A batch of trees is stored as flat node tables, one row per sequence:

    parents (B, N) int64   parents[b, 0] = -1 (node 0 is the root = the last committed token),
                           parents[b, i] < i for every other valid node, so listing nodes in
                           index order always lists a parent before its children;
    tokens  (B, N) int64   node 0's token is the root token;
    valid   (B, N) bool    rows may hold different numbers of nodes; invalid nodes are padding.

The verify pass feeds the N nodes to the target as one block. Node i sits at KV-cache
position `block_start + i` but at RoPE position `start + depth(i)`, and may attend only to
itself and its ancestors (`tree_attention_mask`). After acceptance, the accepted path is moved
to the front of the block (`accepted_kv_positions` + `KVCache.compact`) and the rest dropped.

Everything is vectorised over B; the only Python loops run over node indices (N <= ~64).
"""
from __future__ import annotations

import torch


def node_depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of every node, root = 0. (B, N) -> (B, N) int64.

    Relies on parents[b, i] < i (parents listed first). A node with a negative parent (the
    root, or padding) gets depth 0.
    """
    B, N = parents.shape
    depth = torch.zeros(B, N, dtype=torch.long, device=parents.device)
    for i in range(1, N):
        par = parents[:, i]  # (B,)
        up = depth.gather(1, par.clamp(min=0)[:, None])[:, 0] + 1  # (B,)
        depth[:, i] = torch.where(par >= 0, up, 0)
    return depth


def tree_attention_mask(parents: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B, N, N) bool: mask[b, i, j] is True iff node j is node i or one of its ancestors.

    Built row by row in index order: a node's ancestor set is its parent's set plus itself.
    Invalid nodes see only themselves, so every softmax row has at least one key (no NaN).
    """
    B, N = parents.shape
    eye = torch.eye(N, dtype=torch.bool, device=parents.device).expand(B, N, N)
    mask = eye.clone()  # (B, N, N)
    rows = torch.arange(B, device=parents.device)
    for i in range(1, N):
        par = parents[:, i]  # (B,)
        inherit = valid[:, i] & (par >= 0)  # (B,)
        up = mask[rows, par.clamp(min=0)]  # (B, N) the parent's ancestor set
        mask[:, i] = eye[:, i] | (up & inherit[:, None])
    return mask


def node_positions(parents: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """RoPE positions of the verify block: start[b] + depth. (B, N).

    `start` is the position of the root token (the number of tokens before it)."""
    return start[:, None] + node_depths(parents)


def select_nodes(scores: torch.Tensor, parents: torch.Tensor, budget: int,
                 valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EAGLE-2 re-rank: keep the `budget` best candidate nodes as an ancestor-closed tree.

    scores  (B, M): cumulative draft log-prob of the path root -> node (root's score unused).
    parents (B, M): candidate tree, parents[b, i] < i, node 0 = root.
    budget        : number of nodes kept INCLUDING the root (the verify block size).

    A child's cumulative log-prob never exceeds its parent's, so plain top-k is already closed
    under ancestors provided ties go to the earlier (shallower) node. We still enforce it: each
    node's effective score is the min of its own and its parent's effective score (computed in
    index order), the root gets +inf, and ranking is by (effective score desc, index asc); any
    prefix of that ranking contains every kept node's parent.

    Returns
      keep        (B, budget) int64 candidate indices, ascending (so parents precede children);
      new_parents (B, budget) int64 parents as positions inside `keep` (-1 for the root);
      keep_valid  (B, budget) bool  False where the row had fewer than `budget` valid candidates.

    Note (rng mode): dropping sampled siblings by score biases which children are verified;
    to stay lossless keep the dropped siblings in the tree passed to `verify_tree_rejection`
    with `verified=False` (see there). Greedy and coupled verification are unaffected.
    """
    B, M = scores.shape
    budget = min(budget, M)
    dev = scores.device
    valid = torch.ones(B, M, dtype=torch.bool, device=dev) if valid is None else valid
    eff = scores.float().masked_fill(~valid, float("-inf")).clone()  # (B, M)
    eff[:, 0] = float("inf")
    for i in range(1, M):
        par = parents[:, i]
        up = eff.gather(1, par.clamp(min=0)[:, None])[:, 0]  # (B,)
        eff[:, i] = torch.where(par >= 0, torch.minimum(eff[:, i], up), float("-inf"))
    # stable descending sort: equal scores keep index order, i.e. the parent ranks first
    order = torch.sort(eff, dim=1, descending=True, stable=True).indices[:, :budget]  # (B, budget)
    keep = order.sort(dim=1).values  # (B, budget)
    keep_valid = torch.isfinite(eff.gather(1, keep)) | (keep == 0)
    keep_valid &= valid.gather(1, keep)
    # remap parents: candidate index -> position in keep
    pos = torch.full((B, M), -1, dtype=torch.long, device=dev)
    pos.scatter_(1, keep, torch.arange(budget, device=dev).expand(B, budget))
    old_par = parents.gather(1, keep)  # (B, budget)
    new_parents = torch.where(old_par >= 0, pos.gather(1, old_par.clamp(min=0)), -1)
    new_parents = torch.where(keep_valid, new_parents, -1)
    return keep, new_parents, keep_valid


def gather_path(path: torch.Tensor, values: torch.Tensor, fill=-1) -> torch.Tensor:
    """values (B, N, ...) gathered along an accepted path (B, W) padded with -1 -> (B, W, ...),
    with `fill` at padding. E.g. gather_path(path, tokens)[:, 1:] are the accepted tokens."""
    idx = path.clamp(min=0)
    view = idx.view(*idx.shape, *([1] * (values.dim() - 2))).expand(*idx.shape, *values.shape[2:])
    out = values.gather(1, view)
    pad = (path < 0).view(*path.shape, *([1] * (values.dim() - 2)))
    return out.masked_fill(pad, fill)


def accepted_kv_positions(path: torch.Tensor, block_start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the accepted path's KV entries sit, for `KVCache.compact`.

    path (B, W): node indices root-first, padded with -1 (from a verify_tree_* function);
    block_start (B,): cache position of node 0 (the root) in the verify block.

    Returns (src_positions (B, W), n_keep (B,)). Padding repeats the row's last accepted
    position, so `cache.compact(slots, src_positions, block_start)` then
    `cache.rollback(slots, block_start + n_keep)` leaves exactly root + accepted nodes; the
    extra copies land past the kept length and are discarded. Path indices increase, so each
    entry moves towards the front (compact reads everything before writing anyway).
    """
    n_keep = (path >= 0).sum(1)  # (B,) root + accepted nodes
    last = path.gather(1, (n_keep - 1).clamp(min=0)[:, None])  # (B, 1)
    filled = torch.where(path >= 0, path, last)  # (B, W)
    return block_start[:, None] + filled, n_keep
