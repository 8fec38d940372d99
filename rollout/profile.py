"""Where an engine step's time goes: per-phase wall time of the steps the engine really runs.

Why here and not in a benchmark harness: the parts of the speed-up bound (docs/design.md section 4:
one target step, one verify forward, one draft step) depend on the tokens fed. A verify block
of real drafts wakes more experts than a block of one repeated token, and a real step's
bookkeeping is what the loop wastes. So the engine itself marks the phase boundaries of each
step when a `StepProfiler` is attached (`EmbeddedEngine.profiler`), and the benchmark reads
the costs off real decoding runs on real prompts.

A step is split by `mark(phase)` calls: each mark charges the time since the previous mark
(or the step's start) to `phase`; whatever runs after the last mark until `end()` is charged
to "other" (loop glue, the controller, stop checks of the engine). Phases of a step:

  plain step:        forward (the target's decode forward), features (feature handling for
                     the draft / capture), emit (sampling, log-probs, appending tokens)
  speculative step:  draft_features (assembling the pending target features and tokens),
                     draft (the draft forwards: pending features, then the chain or tree),
                     verify_forward (the target's verify forward), accept (the acceptance
                     rule), cache_features (KV compaction/rollback, accepted features, emitted
                     tokens and their log-probs), emit (handing tokens and statistics back)

On CUDA every mark synchronises the device first, so the phases are true device times (and
the profiled run is a little slower than an unprofiled one); on CPU a mark is one clock read.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

PLAIN_PHASES = ("forward", "features", "emit", "other")
SPEC_PHASES = ("draft_features", "draft", "verify_forward", "accept", "cache_features", "emit", "other")


@dataclass
class StepRecord:
    kind: str  # "plain" or "spec"
    n_active: int  # sequences decoded in this step
    gamma: int  # drafted depth (0 for plain steps)
    fused_prefill: bool  # newly admitted prompts rode along in this step's forward
    phases: dict = field(default_factory=dict)  # phase -> seconds
    total_s: float = 0.0
    call: int = 0  # which timed call of a benchmark the step belongs to (StepProfiler.call when it began)


class StepProfiler:
    """Collects a `StepRecord` per engine step (see the module docstring)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.cuda = torch.device(device).type == "cuda"
        self.records: list[StepRecord] = []
        self._rec: StepRecord | None = None
        self._t0 = self._last = 0.0
        self.call = 0  # stamped on each record: a benchmark sets it to the timed repeat it runs

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def begin(self, kind: str, n_active: int, fused_prefill: bool) -> None:
        self._rec = StepRecord(kind, n_active, 0, fused_prefill, call=self.call)
        self._t0 = self._last = self._now()

    def mark(self, phase: str) -> None:
        if self._rec is None:
            return
        now = self._now()
        self._rec.phases[phase] = self._rec.phases.get(phase, 0.0) + now - self._last
        self._last = now

    def set_gamma(self, gamma: int) -> None:
        if self._rec is not None:
            self._rec.gamma = gamma

    def end(self, kind: str | None = None) -> None:
        """Close the step; `kind` overrides the kind given to begin (a speculative step that
        fell back to plain decoding after a draft fault)."""
        if self._rec is None:
            return
        self.mark("other")
        rec, self._rec = self._rec, None
        if kind is not None:
            rec.kind = kind
        rec.total_s = self._last - self._t0
        self.records.append(rec)

    def select(self, kind: str, n_active: int | None = None, fused_prefill: bool | None = False,
               call: int | None = None) -> list[StepRecord]:
        return [r for r in self.records if r.kind == kind and (n_active is None or r.n_active == n_active)
                and (fused_prefill is None or r.fused_prefill == fused_prefill) and (call is None or r.call == call)]


def tick(profiler: StepProfiler | None, phase: str) -> None:
    """`profiler.mark(phase)` when a profiler is attached; nothing otherwise."""
    if profiler is not None:
        profiler.mark(phase)


def low_quartile(xs: list[float]) -> float:
    """The 25th percentile (nearest rank): the typical time of an uninterrupted step. A step
    the OS preempts takes a whole time slice longer; on a busy machine that is most steps'
    median, on a quiet one the quartile and the median nearly agree."""
    xs = sorted(xs)
    if not xs:
        raise ValueError("no samples")
    return xs[(len(xs) - 1) // 4]


def bound_costs(target_steps: list[float], verify_steps: list[float], draft_steps: list[float],
                cost_samples: dict) -> dict:
    """The bound's parts from per-step samples (seconds; a draft sample is one step's drafting
    divided by its depth): each part's lower quartile and median, and their ratios to the target
    step (specrl.bench.MEASUREMENT). Any sample list empty: every figure None."""
    samples = {"target_step_s": target_steps, "verify_s": verify_steps, "draft_step_s": draft_steps}
    if not all(samples.values()):
        return {**{f"{k}{suffix}": None for k in ("target_step_s", "verify_s", "draft_step_s", "verify_cost", "c")
                   for suffix in ("", "_median")}, "cost_samples": cost_samples}
    out = {k: low_quartile(v) for k, v in samples.items()}
    out.update({f"{k}_median": statistics.median(v) for k, v in samples.items()})
    for suffix in ("", "_median"):
        t1 = out[f"target_step_s{suffix}"]
        out[f"verify_cost{suffix}"] = out[f"verify_s{suffix}"] / t1
        out[f"c{suffix}"] = out[f"draft_step_s{suffix}"] / t1
    return {**out, "cost_samples": cost_samples}


def phase_breakdown(records: list[StepRecord], phases: tuple[str, ...]) -> dict:
    """Mean seconds per step of every phase and its share of the step, over `records`, and
    each phase's lower quartile (the uninterrupted step's, see `low_quartile`)."""
    n = len(records)
    if not n:
        return {"steps": 0}
    total = sum(r.total_s for r in records) / n
    mean = {p: sum(r.phases.get(p, 0.0) for r in records) / n for p in phases}
    return {"steps": n, "step_s": total, "phase_s": mean,
            "phase_fraction": {p: (v / total if total > 0 else 0.0) for p, v in mean.items()},
            # the same, robust to OS preemption on a busy machine: lower quartile of each phase
            "step_s_low_quartile": low_quartile([r.total_s for r in records]),
            "phase_s_low_quartile": {p: low_quartile([r.phases.get(p, 0.0) for r in records]) for p in phases}}
