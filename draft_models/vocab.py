"""Draft vocabulary: the most frequent target tokens, and maps between the two vocabularies.

Conventions (EAGLE-3 / SpecForge / SGLang):
- `d2t` int64 (Vd,): target id = draft id + d2t[draft id]; the draft ids enumerate the chosen
  target ids in increasing order, so d2t is non-decreasing and non-negative.
- `t2d` bool (V,): True for target ids in the draft vocabulary.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch


def count_tokens(sequences: Iterable, vocab_size: int) -> torch.Tensor:
    """Token counts (V,) int64 over an iterable of id sequences (lists or tensors)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for seq in sequences:
        ids = torch.as_tensor(seq, dtype=torch.long).reshape(-1)
        if ids.numel() == 0:
            continue
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise ValueError(f"token id out of range [0, {vocab_size}) in a sequence")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def _as_counts(token_counts, vocab_size: int) -> torch.Tensor:
    if isinstance(token_counts, Mapping):
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for tok, c in token_counts.items():
            if not 0 <= int(tok) < vocab_size:
                raise ValueError(f"token id {tok} out of range [0, {vocab_size})")
            counts[int(tok)] += int(c)
        return counts
    if isinstance(token_counts, torch.Tensor) and token_counts.dim() == 1:  # counts, not one sequence
        if token_counts.numel() != vocab_size:
            raise ValueError(f"token_counts has {token_counts.numel()} entries, vocab_size is {vocab_size}")
        return token_counts.detach().cpu()
    return count_tokens(token_counts, vocab_size)


def build_draft_vocab(token_counts, vocab_size: int, draft_vocab_size: int,
                      always_include: Iterable[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the draft vocabulary and return (d2t, t2d).

    token_counts: a 1-D tensor of counts (V,), a mapping id -> count, or an iterable of id
    sequences. `always_include` ids (special tokens) are taken first; the rest are the most
    frequent tokens (ties: lower id first); if fewer tokens were seen than needed, the lowest
    unseen ids fill the vocabulary. The chosen ids are sorted.
    """
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size must lie in [1, {vocab_size}], got {draft_vocab_size}")
    counts = _as_counts(token_counts, vocab_size).to(torch.float64)
    forced = sorted({int(i) for i in always_include})
    for i in forced:
        if not 0 <= i < vocab_size:
            raise ValueError(f"always_include id {i} out of range [0, {vocab_size})")
    if len(forced) > draft_vocab_size:
        raise ValueError(f"always_include has {len(forced)} ids, more than draft_vocab_size {draft_vocab_size}")
    score = counts.clone()
    score[forced] = float("inf")
    # Stable sort by descending count keeps lower ids first among ties (unseen ids included).
    order = torch.sort(-score, stable=True).indices
    chosen = torch.sort(order[:draft_vocab_size]).values
    d2t = chosen - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    return d2t.to(torch.long), t2d


def identity_vocab(vocab_size: int, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `draft_vocab_size` target ids (the placeholder before data is seen)."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[:draft_vocab_size] = True
    return torch.zeros(draft_vocab_size, dtype=torch.long), t2d


def check_vocab(d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int, draft_vocab_size: int) -> str | None:
    """None when consistent, else a one-line description of the problem."""
    if d2t.dtype != torch.long or tuple(d2t.shape) != (draft_vocab_size,):
        return f"d2t must be int64 of shape ({draft_vocab_size},), got {d2t.dtype} {tuple(d2t.shape)}"
    if t2d.dtype != torch.bool or tuple(t2d.shape) != (vocab_size,):
        return f"t2d must be bool of shape ({vocab_size},), got {t2d.dtype} {tuple(t2d.shape)}"
    ids = draft_to_target_ids(torch.arange(draft_vocab_size, device=d2t.device), d2t)
    if draft_vocab_size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        return f"d2t maps draft ids outside the target vocabulary [0, {vocab_size})"
    if draft_vocab_size > 1 and not bool((ids[1:] > ids[:-1]).all()):
        return "d2t must map draft ids to strictly increasing target ids"
    if int(t2d.sum()) != draft_vocab_size or not bool(t2d[ids].all()):
        return "t2d does not mark exactly the target ids of d2t"
    return None


def target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """(Vd,) the target id of every draft id."""
    return torch.arange(d2t.shape[0], device=d2t.device) + d2t


def draft_to_target_ids(draft_ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    return draft_ids + d2t[draft_ids]


def target_to_draft_ids(tgt_ids: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """Draft id of each target id, -1 where the token is outside the draft vocabulary."""
    index = torch.cumsum(t2d.to(torch.long), 0) - 1
    return torch.where(t2d[tgt_ids], index[tgt_ids], torch.full_like(tgt_ids, -1))


def draft_logits_to_target(draft_logits: torch.Tensor, d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(..., Vd) -> (..., V): the same logits at the target ids, -inf outside the draft vocab."""
    out = draft_logits.new_full((*draft_logits.shape[:-1], vocab_size), float("-inf"))
    idx = target_ids(d2t).expand_as(draft_logits)
    return out.scatter(-1, idx, draft_logits)


def restrict_to_draft(target_values: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """(..., V) -> (..., Vd): the entries at the draft vocabulary (probs or log-probs), as is."""
    return target_values.index_select(-1, target_ids(d2t))


def restrict_logprobs(target_logp: torch.Tensor, d2t: torch.Tensor, renormalize: bool = True) -> torch.Tensor:
    """Target log-probs (..., V) restricted to the draft vocab (..., Vd), renormalised by default."""
    r = restrict_to_draft(target_logp.float(), d2t)
    return torch.log_softmax(r, dim=-1) if renormalize else r


def restrict_probs(target_probs: torch.Tensor, d2t: torch.Tensor, renormalize: bool = True) -> torch.Tensor:
    """Target probs (..., V) restricted to the draft vocab (..., Vd), renormalised by default."""
    r = restrict_to_draft(target_probs.float(), d2t)
    return r / r.sum(-1, keepdim=True).clamp_min(1e-30) if renormalize else r
