"""Speculative counters in SGLang's per-request `meta_info`, read the same way everywhere.

Why: SGLang renamed its acceptance counters across versions, and slime, veRL and specrl's own
SGLang client all need the same numbers from them. `parse_spec_meta` reads every name seen so far
and refuses contradictory numbers rather than logging a made-up accept length. sglang 0.5.23
(`TokenizerManager._calculate_spec_decoding_metrics`) reports `spec_verify_ct`,
`spec_num_correct_drafts`, `spec_num_proposed_drafts` (= verify steps x (num_draft_tokens - 1)),
`spec_accept_rate`, `spec_accept_length` (= completion_tokens / verify steps) and
`spec_correct_drafts_histogram`.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from rollout.protocol import SpecStats


class SpecMetaError(ValueError):
    """A meta_info payload carries malformed or contradictory speculative counters."""


VERIFY_KEY = "spec_verify_ct"
# Same quantity under the names of successive SGLang versions (newest first).
ACCEPT_KEYS = ("spec_num_correct_drafts", "spec_accepted_drafts", "spec_accept_token_num")
DRAFT_KEYS = ("spec_num_proposed_drafts", "spec_proposed_drafts", "spec_draft_token_num")
HISTOGRAM_KEYS = ("spec_correct_drafts_histogram", "spec_accept_histogram")
PER_POS_KEYS = ("spec_num_proposed_drafts_by_position", "spec_num_correct_drafts_by_position")
SPEC_KEYS = (VERIFY_KEY, *ACCEPT_KEYS, *DRAFT_KEYS, *HISTOGRAM_KEYS, *PER_POS_KEYS)


def _count(meta: Mapping, key: str) -> int:
    v = meta[key]
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise SpecMetaError(f"meta_info[{key!r}]={v!r} is not a non-negative integer")
    return v


def _counts(meta: Mapping, key: str) -> list[int]:
    v = meta[key]
    if not isinstance(v, (list, tuple)):
        raise SpecMetaError(f"meta_info[{key!r}] must be a list of counts, got {type(v).__name__}")
    return [_count({key: x}, key) for x in v]


def _agreed(meta: Mapping, keys: Sequence[str], read) -> tuple[str | None, object]:
    """The value under the first present key; every other present alias must agree."""
    found = [(k, read(meta, k)) for k in keys if k in meta and meta[k] is not None]
    for k, v in found[1:]:
        if v != found[0][1]:
            raise SpecMetaError(f"contradictory speculative counters: {found[0][0]}={found[0][1]} but {k}={v}")
    return found[0] if found else (None, None)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(1.0, abs(a), abs(b))


def parse_spec_meta(meta_info: Mapping | None) -> SpecStats | None:
    """SpecStats from one request's SGLang meta_info, or None when it carries no speculative counter.

    Reads every name SGLang has used: `spec_verify_ct`; accepted drafts as `spec_num_correct_drafts`
    / `spec_accepted_drafts` / `spec_accept_token_num`; proposed drafts as `spec_num_proposed_drafts`
    / `spec_proposed_drafts` / `spec_draft_token_num`; the per-step histogram
    `spec_correct_drafts_histogram` / `spec_accept_histogram`; per-position counts
    `spec_num_*_drafts_by_position`. Oldest servers report only `spec_verify_ct`: accepted is then
    completion_tokens - verify steps - 1 (the prefill token), proposed stays 0 (rate unknown).
    Per-position counts come from the by-position lists, else from the histogram (depth d is
    reached by every verify step, accepted by those that accepted more than d drafts).
    Raises SpecMetaError on malformed values or numbers that contradict each other."""
    if meta_info is None:
        return None
    if not isinstance(meta_info, Mapping):
        raise SpecMetaError(f"meta_info must be a JSON object, got {type(meta_info).__name__}")
    meta = meta_info
    if not any(k in meta and meta[k] is not None for k in SPEC_KEYS):
        return None
    if VERIFY_KEY not in meta or meta[VERIFY_KEY] is None:
        raise SpecMetaError(f"meta_info has speculative counters but no {VERIFY_KEY}")
    verify = _count(meta, VERIFY_KEY)
    completion = _count(meta, "completion_tokens") if meta.get("completion_tokens") is not None else None
    acc_key, accepted = _agreed(meta, ACCEPT_KEYS, _count)
    drf_key, drafted = _agreed(meta, DRAFT_KEYS, _count)
    hist_key, hist = _agreed(meta, HISTOGRAM_KEYS, _counts)
    if hist is not None and hist:
        if sum(hist) != verify:
            raise SpecMetaError(f"contradictory speculative counters: {hist_key} sums to {sum(hist)} verify steps "
                                f"but {VERIFY_KEY}={verify}")
        weighted = sum(k * n for k, n in enumerate(hist))
        if accepted is None:
            acc_key, accepted = hist_key, weighted
        elif weighted != accepted:
            raise SpecMetaError(f"contradictory speculative counters: {hist_key} implies {weighted} accepted "
                                f"drafts but {acc_key}={accepted}")
    if accepted is None:  # oldest servers: only the verify count
        accepted = max(0, completion - verify - 1) if completion is not None and verify else 0
    drafted = 0 if drafted is None else drafted
    if accepted > drafted and drf_key is not None:
        raise SpecMetaError(f"contradictory speculative counters: {acc_key}={accepted} exceeds {drf_key}={drafted}")
    if completion is not None and accepted > completion:
        raise SpecMetaError(f"contradictory speculative counters: {acc_key}={accepted} exceeds "
                            f"completion_tokens={completion}")
    rate = meta.get("spec_accept_rate")
    if rate is not None and drafted > 0 and not _close(float(rate), accepted / drafted):
        raise SpecMetaError(f"contradictory speculative counters: spec_accept_rate={rate} but "
                            f"{accepted}/{drafted} drafts were accepted")
    length = meta.get("spec_accept_length")
    if length is not None and verify > 0 and completion is not None and not _close(float(length), completion / verify):
        raise SpecMetaError(f"contradictory speculative counters: spec_accept_length={length} but "
                            f"completion_tokens/{VERIFY_KEY} = {completion}/{verify}")
    stats = SpecStats(verify_steps=verify, drafted=drafted, accepted=accepted)
    if all(k in meta and meta[k] is not None for k in PER_POS_KEYS):
        d_pos, a_pos = (_counts(meta, k) for k in PER_POS_KEYS)
        if len(d_pos) != len(a_pos) or any(a > d for a, d in zip(a_pos, d_pos)):
            raise SpecMetaError(f"contradictory speculative counters: per-position accepted {a_pos} vs proposed {d_pos}")
        if sum(d_pos) != drafted or sum(a_pos) != accepted:
            raise SpecMetaError(f"contradictory speculative counters: per-position sums {sum(a_pos)}/{sum(d_pos)} "
                                f"disagree with totals {accepted}/{drafted}")
        stats.drafted_per_pos, stats.accepted_per_pos = d_pos, a_pos
    elif hist:
        depth = len(hist) - 1
        stats.drafted_per_pos = [verify] * depth
        stats.accepted_per_pos = [sum(hist[d + 1:]) for d in range(depth)]
    return stats


