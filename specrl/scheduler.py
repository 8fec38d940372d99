"""Draft training in the idle windows of the shared device, within a time and memory budget.

The draft trainer shares one device with the rollout engine and the policy trainer (docs/design.md
section 1, "Device sharing"). Its work must never delay an RL step by more than its budget, so
the scheduler hands out time, not steps:

- Budget per RL step = budget_fraction * (EMA of the RL step's wall time without draft work),
  clamped to [min_budget_s, max_budget_s]. The EMA subtracts the draft time it granted, so the
  budget is a fraction of the RL work itself and does not feed on its own overhead. Before the
  first step is measured, the base is the RL time elapsed so far in the current step, a lower
  bound on that step, so the budget can only err short.
- Windows, each a sequential call that runs on the caller's thread and adds its time to the
  RL step (only the windows in `windows` ever run):
  "tail" - inside `EmbeddedEngine.generate`'s loop: after an engine step at which at most
    tail_threshold of the slots are still decoding, one draft update runs before the next engine
    step, so the sequences still decoding wait for it (on a device with idle compute in the tail
    the update is cheap; on a saturated CPU it is a plain serial cost);
  "between" - at the co-trainer's step boundary (`SpecCoTrainer.end_step()`), after the policy
    update (so the draft trains on features of the update's own forward), before the next
    rollout;
  "interleaved" - inside the policy update, between its micro-steps: the trainer calls its
    `microstep_hooks` after every optimizer micro-step but the last (GRPOTrainer does, when its
    minibatch_size splits the batch), and the co-trainer runs an update there;
  "wait" - in an asynchronous loop (specrl.async_rl), while the trainer waits for its next batch
    of rollouts, which generation on the other thread is still producing: one update at a time,
    as long as the batch is not ready (`SpecCoTrainer.train_while`).
- A unit of work is started only while budget remains and is told the seconds left; a unit that
  runs past them is the only possible overrun, and it is reported as `sched/overrun_s`.
- Time spent is the larger of what the work reports and what the clock saw, so an asynchronous
  device (work queued, not finished) or a clock that misses device time cannot hide it.

Mode "overlap" replaces the windows: one burst per RL step trains on its own thread (CPU) or
CUDA stream (GPU) while the next step runs (specrl.overlap); only the step boundary's own work
(waiting for a burst still running, starting the next, syncing weights) is charged here, to
"between". With overlap_until="rollout" the burst is collected when the next rollout ends, so
it runs under the rollout only, and the wait for it there is charged too; with rollout_threads
the RL loop runs with that many intra-op threads while the burst is in flight. Contention for
the device is not visible to this accounting; measure it by timing steps with and without
training (`specrl bench overlap`).

Memory: the draft side's resident bytes, measured on the live tensors (the draft's parameters
and gradients, the optimizer state, the feature buffer, and the activations of one update,
measured per record by the online trainer), stay under `memory_budget_bytes`, or by default under
`memory_budget_share` of the draft's device's memory (`memory_limit`). A fixed byte count does
not travel: 256 MiB held a toy draft's update, while one record of a 135M-parameter model's
draft (a 49k-token vocabulary) needs about 240 MB of activations. `fit_batch` shrinks an update's
batch until it fits, or returns 0 and the update is skipped; both are reported.

Errors: with `on_error` set, an exception in a unit of work is counted, its time accounted, and
passed to on_error (which typically turns speculation off until the draft recovers); the RL
step goes on. Without it the exception propagates.
"""
from __future__ import annotations

import os
import time
from typing import Callable

import torch

from specrl.config import WINDOWS, SchedulerConfig

class DraftScheduler:
    """Grants draft-training time in idle windows; one begin_step() / end_step() per RL step."""

    def __init__(self, config: SchedulerConfig | None = None, clock: Callable[[], float] = time.perf_counter,
                 on_error: Callable[[BaseException], None] | None = None, device: torch.device | str = "cpu"):
        self.config = config or SchedulerConfig()
        self.clock, self.on_error = clock, on_error
        self.memory_limit_bytes = memory_limit(self.config, device)  # None: no limit
        self.step_ema_s: float | None = None  # EMA of RL step wall time without draft work
        self.steps = self.errors = 0
        self.last_error: BaseException | None = None
        self._t0: float | None = None
        self._spent = dict.fromkeys(WINDOWS, 0.0)

    # -- per RL step -------------------------------------------------------------------------
    def begin_step(self) -> None:
        self._t0 = self.clock()
        self._spent = dict.fromkeys(WINDOWS, 0.0)

    @property
    def spent_s(self) -> float:
        return sum(self._spent.values())

    @property
    def budget_s(self) -> float:
        """This step's draft budget in seconds."""
        if self.step_ema_s is not None:
            base = self.step_ema_s
        else:  # nothing measured yet: the RL time of this step so far
            base = 0.0 if self._t0 is None else max(0.0, self.clock() - self._t0 - self.spent_s)
        return self._clamp(self.config.budget_fraction * base)

    @property
    def remaining_s(self) -> float:
        return max(0.0, self.budget_s - self.spent_s)

    def is_tail(self, n_active: int, n_slots: int) -> bool:
        return n_slots > 0 and 0 < n_active <= self.config.tail_threshold * n_slots

    def on_engine_step(self, n_active: int, n_slots: int, work: Callable[[float], float] | None = None) -> bool:
        """True when the rollout is in its long tail, the tail window is enabled and budget
        remains: the caller then runs one draft update (or passes it as `work`, run here)."""
        self._ensure_step()
        ok = self.is_tail(n_active, n_slots) and "tail" in self.config.windows and self.remaining_s > 0
        if ok and work is not None:
            self.run_window("tail", work)
        return ok

    def run_window(self, name: str, work: Callable[[float], float | None]) -> float:
        """Run one unit of `work(remaining_seconds)` in window `name` if that window is enabled
        and budget remains; returns the seconds accounted to it (0.0 when it did not run)."""
        if name not in WINDOWS:
            raise ValueError(f"unknown window {name!r}; windows are {WINDOWS}")
        self._ensure_step()
        remaining = self.remaining_s
        if name not in self.config.windows or remaining <= 0:
            return 0.0
        t0 = self.clock()
        try:
            reported = work(remaining)
        except Exception as exc:
            spent = max(0.0, self.clock() - t0)
            self._spent[name] += spent
            if self.on_error is None:
                raise
            self.errors, self.last_error = self.errors + 1, exc
            self.on_error(exc)
            return spent
        spent = max(self.clock() - t0, float(reported or 0.0), 0.0)
        self._spent[name] += spent
        return spent

    def charge(self, name: str, seconds: float) -> None:
        """Account draft time spent outside run_window (the overlapped mode's step boundary:
        waiting for the burst, starting the next, syncing weights) to window `name`."""
        self._ensure_step()
        self._spent[name] += max(0.0, float(seconds))

    def end_step(self, step_wall_s: float | None = None) -> dict:
        """Close the RL step (wall time measured by the caller, or by the clock since
        begin_step) and report where the draft time went."""
        self._ensure_step()
        if step_wall_s is None:
            step_wall_s = self.clock() - self._t0
        draft = self.spent_s
        rl = max(0.0, float(step_wall_s) - draft)
        base = self.step_ema_s if self.step_ema_s is not None else rl
        budget = self._clamp(self.config.budget_fraction * base)
        self.step_ema_s = rl if self.step_ema_s is None else self.step_ema_s + self.config.ema * (rl - self.step_ema_s)
        self.steps += 1
        self._t0 = None
        report = {"perf/draft_train_s": draft}
        report.update({f"perf/draft_train_{w}_s": self._spent[w] for w in WINDOWS})
        report.update({"sched/budget_s": budget, "sched/overrun_s": max(0.0, draft - budget),
                       "sched/rl_step_s": rl, "sched/rl_step_ema_s": self.step_ema_s})
        return report

    # -- memory ------------------------------------------------------------------------------
    def memory_ok(self, bytes_in_use: int) -> bool:
        """Whether `bytes_in_use` of draft-side memory fits the budget."""
        limit = self.memory_limit_bytes
        return limit is None or bytes_in_use <= limit

    def fit_batch(self, fixed_bytes: int, per_record_bytes: float, batch_size: int) -> int:
        """The largest batch <= batch_size whose update fits the memory budget, 0 if none does:
        fixed_bytes (parameters, gradients, optimizer state, buffer) plus per_record_bytes of
        activations per record."""
        limit = self.memory_limit_bytes
        if limit is None or fixed_bytes + per_record_bytes * batch_size <= limit:
            return batch_size
        if fixed_bytes >= limit or per_record_bytes <= 0:
            return 0
        return max(0, min(batch_size, int((limit - fixed_bytes) // per_record_bytes)))

    # -- checkpointing -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"step_ema_s": self.step_ema_s, "steps": self.steps, "errors": self.errors}

    def load_state_dict(self, state: dict) -> None:
        self.step_ema_s, self.steps, self.errors = state["step_ema_s"], int(state["steps"]), int(state["errors"])

    # -- internals ---------------------------------------------------------------------------
    def _ensure_step(self) -> None:
        if self._t0 is None:  # a caller that skipped begin_step: the step starts now
            self.begin_step()

    def _clamp(self, budget: float) -> float:
        c = self.config
        budget = max(c.min_budget_s, budget)
        return budget if c.max_budget_s is None else min(c.max_budget_s, budget)


def device_memory_bytes(device: torch.device | str) -> int | None:
    """The memory of `device`: a CUDA device's total memory, or the machine's physical memory for
    the CPU; None where it cannot be read."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type == "cpu":
        try:
            return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (ValueError, OSError, AttributeError):  # not a POSIX system
            return None
    return None


def memory_limit(config: SchedulerConfig, device: torch.device | str = "cpu") -> int | None:
    """The draft side's memory bound in bytes: `memory_budget_bytes`, else `memory_budget_share` of
    `device`'s memory; None: no limit (neither is set, or the device's memory is unknown)."""
    if config.memory_budget_bytes is not None:
        return int(config.memory_budget_bytes)
    if config.memory_budget_share is None:
        return None
    total = device_memory_bytes(device)
    return None if total is None else int(config.memory_budget_share * total)
