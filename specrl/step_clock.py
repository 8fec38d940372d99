"""The wall time of one RL step and its split into parts: the timing arithmetic every RL loop
shares (specrl.train_rl's `rl_step`, specrl.async_rl's `async_step`).

Draft training runs inside other parts of the step (the rollout's tail window, between the
policy update's micro-steps), so each part is counted once, as draft training: the rollout is
the engine's call less its tail window, the update is the trainer's step less the feature
capture and the interleaved window. A step also records the cores other processes kept busy
meanwhile (`perf/others_busy_cores`, specrl.machine_load): a step timed beside another heavy job
is not this run's time alone.
"""
from __future__ import annotations

import time

from rollout.protocol import RolloutStats
from specrl.machine_load import cpu_mark, others_busy_cores

# the parts of a step's wall time besides the rollout (`rollout_s`); `perf/other_s` is what is left
PARTS = ("perf/score_s", "perf/policy_sync_s", "perf/feature_capture_s", "perf/draft_train_s", "perf/update_s")


class StepClock:
    """Laps of one RL step: `lap(name)` closes phase `name`, `elapsed()` is the step so far,
    `others_busy_cores()` the cores other processes kept busy over it."""

    def __init__(self):
        self.start = self._last = time.perf_counter()
        self.laps: dict[str, float] = {}
        self._cpu = cpu_mark()

    def lap(self, name: str) -> float:
        """The seconds since the previous lap (or the start), added to phase `name`."""
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        self.laps[name] = self.laps.get(name, 0.0) + seconds
        return seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def others_busy_cores(self) -> float | None:
        return others_busy_cores(self._cpu)


def step_parts(row: dict, gen: RolloutStats, score_s: float, update_s: float, sync_s: float | None) -> dict:
    """The step's parts, in seconds, from its row (the co-trainer's metrics and `step_s`), the
    rollout's figures, the measured score and trainer-step times and the policy sync's (None for
    an engine that runs the policy module): `rollout_s` (of which `perf/rollout_full_s` at the
    full batch and `perf/rollout_tail_s` in the long tail, where the engine reports them),
    PARTS, and `perf/other_s`, what is left."""
    parts = {"rollout_s": gen.wall_s - row.get("perf/draft_train_tail_s", 0.0),
             "perf/score_s": score_s, "perf/policy_sync_s": sync_s or 0.0,
             "perf/feature_capture_s": row.get("perf/feature_capture_s", 0.0),
             "perf/draft_train_s": row.get("perf/draft_train_s", 0.0)}
    parts["perf/update_s"] = update_s - parts["perf/feature_capture_s"] - row.get("perf/draft_train_interleaved_s", 0.0)
    if gen.full_batch_s is not None:
        parts["perf/rollout_full_s"], parts["perf/rollout_tail_s"] = gen.full_batch_s, gen.tail_s
    parts["perf/other_s"] = row["step_s"] - parts["rollout_s"] - sum(parts[k] for k in PARTS)
    return parts
