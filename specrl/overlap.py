"""Overlapped draft training: the draft trains while the RL step runs, not inside it.

Why: in the sequential windows (specrl.scheduler) every draft update sits on the RL loop's
critical path, so its whole time is added to the step. Here an update burst runs on its own
thread (CPU, with its own intra-op thread count) or its own CUDA stream (GPU), concurrently with
the next rollout and policy update, and the RL loop only waits if the burst is still running
when the next step boundary comes.

The contract that keeps it safe:
- Two copies of the draft. The burst trains the trainer's copy; the engine decodes with its own
  copy, which only the RL loop's thread writes, at a step boundary (`SpecCoTrainer.end_step`),
  never during a forward. A burst started at the end of step t is therefore swapped in at the
  end of step t+1: one step more staleness than the sequential mode.
- A snapshot of the buffer. The burst's batches are drawn on the RL loop's thread when it starts
  (the same draws the sequential mode would make), so the buffer can keep filling meanwhile.
- A snapshot of the target embedding. The draft reads the policy's embedding, which the policy
  update rewrites in place; the burst reads a copy taken at its start instead, so it never sees
  a half-written update and its result does not depend on timing.
With a time budget that never binds (a fixed update count), a burst's result is the same as the
sequential mode's on the same batches, and the run is reproducible.

What it can gain depends on idle capacity: on a GPU the rollout's long tail and the Python
overhead of small batches leave the device underused; on a CPU the burst competes for the same
cores (and the Python interpreter lock) with the RL loop. `tests/test_overlap.py` checks
correctness; `specrl bench overlap` measures what it hides.
"""
from __future__ import annotations

import contextlib
import copy
import threading
import time

import torch


class _BatchSnapshot:
    """Stands in for the FeatureBuffer inside a burst: hands out the pre-drawn batches in order."""

    def __init__(self, batches: list[list[dict]]):
        self._batches = list(batches)

    def sample(self, n: int, generator=None, prefer_rejected: float = 0.0, min_version=None) -> list[dict]:
        return self._batches.pop(0) if self._batches else []


class OverlappedBursts:
    """At most one burst in flight; `launch` starts one, `collect` ends it (waiting if needed)."""

    def __init__(self, trainer, threads: int = 1):
        self.trainer = trainer
        self.threads = threads
        self._thread: threading.Thread | None = None
        self._result: dict | None = None
        self._error: BaseException | None = None
        self._t_start = self._t_end = 0.0
        self._stream = None
        dev = trainer.draft.fc.weight.device
        if dev.type == "cuda":
            self._stream = torch.cuda.Stream(device=dev)

    @property
    def busy(self) -> bool:
        return self._thread is not None

    def launch(self, buffer, steps: int, batch_size: int, time_budget_s: float, generator, *,
               prefer_rejected: float, min_version: int | None) -> int:
        """Draw `steps` batches now and train on them in the background; returns the batches drawn
        (0: nothing to train on, nothing started)."""
        if self.busy:
            raise RuntimeError("a draft burst is already in flight; collect it first")
        batches = [buffer.sample(batch_size, generator, prefer_rejected=prefer_rejected, min_version=min_version)
                   for _ in range(steps)]
        batches = [b for b in batches if b]
        if not batches:
            return 0
        draft = self.trainer.draft
        live = draft.embed_tokens
        frozen = copy.deepcopy(live).requires_grad_(False)  # the policy update may rewrite `live` meanwhile
        if self._stream is not None:  # the copy is queued on the current stream: the side stream waits for it
            self._stream.wait_stream(torch.cuda.current_stream(live.weight.device))
        self._result = self._error = None
        self._live_embedding = live
        draft.set_target_embedding(frozen)  # restored by collect(), on this thread

        def run() -> None:
            torch.set_num_threads(self.threads)  # this thread's own intra-op pool (OpenMP: per thread)
            self._t_start = time.perf_counter()
            try:
                ctx = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
                with ctx:
                    self._result = self.trainer.train_for(_BatchSnapshot(batches), len(batches), time_budget_s,
                                                          None, batch_size=batch_size)
                if self._stream is not None:
                    self._stream.synchronize()
            except BaseException as err:  # handed to the RL loop's thread at collect()
                self._error = err
            finally:
                self._t_end = time.perf_counter()

        self._thread = threading.Thread(target=run, name="specrl-draft-burst", daemon=True)
        self._thread.start()
        return len(batches)

    def collect(self) -> dict | None:
        """Wait for the burst in flight (if any) and return its train_for result, plus `wait_s`
        (how long this call blocked), `burst_s` (the burst's own wall time) and `hidden_s` (the
        part of it that ran under RL work: burst_s - wait_s). Re-raises the burst's error."""
        if not self.busy:
            return None
        t0 = time.perf_counter()
        self._thread.join()
        wait = time.perf_counter() - t0
        self._thread = None
        self.trainer.draft.set_target_embedding(self._live_embedding)
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        result, self._result = self._result, None
        burst = self._t_end - self._t_start
        return {**result, "wait_s": wait, "burst_s": burst, "hidden_s": max(0.0, burst - wait)}
