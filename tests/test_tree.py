"""Tree helpers: depths, attention mask, EAGLE-2 node selection, path compaction."""
from __future__ import annotations

import torch

from rollout.tree import (accepted_kv_positions, gather_path, node_depths, node_positions, select_nodes,
                          tree_attention_mask)
from target_training.model import KVCache

#        0
#      /   \
#     1     2
#    / \     \
#   3   4     5
PARENTS = torch.tensor([[-1, 0, 0, 1, 1, 2]])


def random_trees(B: int, M: int, gen: torch.Generator) -> torch.Tensor:
    """parents (B, M) with parents[:, i] uniform in [0, i)."""
    par = (torch.rand(B, M, generator=gen) * torch.arange(M)).long()
    par[:, 0] = -1
    return par


def ancestors_naive(parents_row: list[int], i: int) -> set[int]:
    out = {i}
    while parents_row[i] >= 0:
        i = parents_row[i]
        out.add(i)
    return out


def test_node_depths_and_positions():
    assert node_depths(PARENTS).tolist() == [[0, 1, 1, 2, 2, 2]]
    assert node_positions(PARENTS, torch.tensor([10])).tolist() == [[10, 11, 11, 12, 12, 12]]


def test_attention_mask_hand_made():
    valid = torch.tensor([[True, True, True, True, True, False]])
    m = tree_attention_mask(PARENTS, valid)[0].int().tolist()
    assert m == [[1, 0, 0, 0, 0, 0],
                 [1, 1, 0, 0, 0, 0],
                 [1, 0, 1, 0, 0, 0],
                 [1, 1, 0, 1, 0, 0],
                 [1, 1, 0, 0, 1, 0],
                 [0, 0, 0, 0, 0, 1]]  # invalid node 5: itself only


def test_attention_mask_is_ancestor_relation():
    gen = torch.Generator().manual_seed(0)
    parents = random_trees(6, 24, gen)
    valid = torch.ones(6, 24, dtype=torch.bool)
    mask = tree_attention_mask(parents, valid)
    for b in range(6):
        row = parents[b].tolist()
        for i in range(24):
            assert set(torch.nonzero(mask[b, i])[:, 0].tolist()) == ancestors_naive(row, i)
    assert bool(mask.any(-1).all())  # every query has a key: no NaN in softmax


def _cumulative_scores(parents: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    scores = torch.zeros_like(step)
    for i in range(1, parents.shape[1]):
        scores[:, i] = scores.gather(1, parents[:, i:i + 1])[:, 0] + step[:, i]
    return scores


def _check_selection(scores, parents, budget, keep, new_parents, keep_valid):
    B = parents.shape[0]
    assert keep.shape == (B, budget) and new_parents.shape == (B, budget)
    for b in range(B):
        k = keep[b].tolist()
        assert k == sorted(set(k)) and k[0] == 0  # distinct, ascending, root kept
        kept = set(k)
        for pos, node in enumerate(k):
            if not keep_valid[b, pos]:
                continue
            par = int(parents[b, node])
            if node == 0:
                assert int(new_parents[b, pos]) == -1
                continue
            assert par in kept  # ancestor-closed
            assert 0 <= int(new_parents[b, pos]) < pos  # parents before children
            assert k[int(new_parents[b, pos])] == par  # remap consistent


def test_select_nodes_topk_by_cumulative_score():
    gen = torch.Generator().manual_seed(1)
    B, M, budget = 8, 40, 12
    parents = random_trees(B, M, gen)
    step = torch.log(torch.rand(B, M, generator=gen))  # log q < 0: scores decrease down the tree
    scores = _cumulative_scores(parents, step)
    keep, new_parents, keep_valid = select_nodes(scores, parents, budget)
    assert bool(keep_valid.all())
    _check_selection(scores, parents, budget, keep, new_parents, keep_valid)
    for b in range(B):  # exactly the top `budget` nodes (root counts as best)
        s = scores[b].clone()
        s[0] = float("inf")
        assert set(keep[b].tolist()) == set(s.topk(budget).indices.tolist())


def test_select_nodes_ties_and_non_monotone_scores_stay_closed():
    gen = torch.Generator().manual_seed(2)
    B, M, budget = 8, 30, 10
    parents = random_trees(B, M, gen)
    tied = _cumulative_scores(parents, torch.zeros(B, M))  # every score equal: ties everywhere
    keep, new_parents, keep_valid = select_nodes(tied, parents, budget)
    _check_selection(tied, parents, budget, keep, new_parents, keep_valid)
    assert bool(keep_valid.all())
    noisy = torch.randn(B, M, generator=gen)  # children may outscore parents: still closed
    _check_selection(noisy, parents, budget, *select_nodes(noisy, parents, budget))


def test_select_nodes_with_fewer_valid_candidates_than_budget():
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2]])
    scores = torch.tensor([[0.0, -1.0, -2.0, -1.5, -3.0, -2.5]])
    valid = torch.tensor([[True, True, False, True, True, True]])  # node 2 invalid -> 5 orphaned
    keep, new_parents, keep_valid = select_nodes(scores, parents, 5, valid)
    assert keep_valid.sum().item() == 4
    assert set(keep[0][keep_valid[0]].tolist()) == {0, 1, 3, 4}
    _check_selection(scores, parents, 5, keep, new_parents, keep_valid)


def test_gather_path_and_kv_compaction():
    path = torch.tensor([[0, 2, 5], [0, 1, -1], [0, -1, -1]])
    tokens = torch.tensor([[9, 1, 2, 3, 4, 5]] * 3)
    assert gather_path(path, tokens).tolist() == [[9, 2, 5], [9, 1, -1], [9, -1, -1]]
    block_start = torch.tensor([4, 7, 0])
    src, n_keep = accepted_kv_positions(path, block_start)
    assert src.tolist() == [[4, 6, 9], [7, 8, 8], [0, 0, 0]] and n_keep.tolist() == [3, 2, 1]

    cache = KVCache(num_layers=2, batch_size=3, max_len=16, num_kv_heads=1, head_dim=1)
    pos = torch.arange(16, dtype=torch.float32).view(1, 1, 16, 1, 1)
    cache.k[:] = pos + 100 * torch.arange(3).view(1, 3, 1, 1, 1)  # value = 100 * slot + position
    cache.v[:] = cache.k
    cache.lengths[:] = block_start + 6
    slots = torch.arange(3)
    cache.compact(slots, src, block_start)
    cache.rollback(slots, block_start + n_keep)
    assert cache.lengths.tolist() == [7, 9, 1]
    for b in range(3):
        kept = cache.k[0, b, : int(cache.lengths[b]), 0, 0].tolist()
        prefix = list(range(int(block_start[b])))
        accepted = [int(block_start[b]) + i for i in path[b].tolist() if i >= 0]
        assert kept == [100 * b + x for x in prefix + accepted]
