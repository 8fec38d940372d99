"""Where a vLLM step's time goes: the target's forward and the drafter's proposal, timed inside
the worker.

Why inside the worker: vLLM's engine core (and on CPU its one worker) runs in another process,
and its metrics count tokens, not seconds per phase. The speculative speed-up is bounded by
accept_length / (verify_cost + gamma * c) (docs/design.md section 4), whose parts are the wall time of
a plain decode forward, of a verify forward and of one draft step; these timers measure exactly
those on vLLM's own steps, by wrapping two methods of the worker's model runner for the length
of a measurement (`GPUModelRunner._model_forward`, which the CPU runner inherits, and
`propose_draft_token_ids`). The wrappers are instance attributes, removed by `stop`.
"""
from __future__ import annotations

import time

_RECORDS: dict[str, list] = {}  # in the worker process: {"forward": [(tokens, s)], "propose": [s]}


def _start_in_worker(worker) -> None:
    runner = worker.model_runner
    _RECORDS.clear()
    _RECORDS.update(forward=[], propose=[])
    forward, propose = runner._model_forward, runner.propose_draft_token_ids

    def timed_forward(*args, **kwargs):
        ids = kwargs.get("input_ids")
        ids = ids if ids is not None else kwargs.get("inputs_embeds")
        t0 = time.perf_counter()
        out = forward(*args, **kwargs)
        _RECORDS["forward"].append((int(ids.shape[0]) if ids is not None else -1, time.perf_counter() - t0))
        return out

    def timed_propose(*args, **kwargs):
        t0 = time.perf_counter()
        out = propose(*args, **kwargs)
        _RECORDS["propose"].append(time.perf_counter() - t0)
        return out

    runner._model_forward, runner.propose_draft_token_ids = timed_forward, timed_propose


def _stop_in_worker(worker) -> dict:
    runner = worker.model_runner
    for name in ("_model_forward", "propose_draft_token_ids"):
        runner.__dict__.pop(name, None)  # back to the class's methods
    out = {k: list(v) for k, v in _RECORDS.items()}
    _RECORDS.clear()
    return out


class StepTimer:
    """Times the target forwards and draft proposals of one `VLLMEngine` over a block of calls:
    `with StepTimer(engine) as t: engine.generate(...)`, then `t.records`."""

    def __init__(self, engine):
        self.engine = engine
        self.records: dict = {}

    def __enter__(self) -> "StepTimer":
        self.engine.llm.collective_rpc(_start_in_worker)
        return self

    def __exit__(self, *exc) -> None:
        self.records = self.engine.llm.collective_rpc(_stop_in_worker)[0]

    def forward_s(self, tokens: int) -> list[float]:
        """Wall times of the target forwards over exactly `tokens` tokens (a full-batch decode
        step: batch tokens plain, batch * (gamma + 1) in a verify step)."""
        return [s for n, s in self.records.get("forward", []) if n == tokens]

    def propose_s(self) -> list[float]:
        return list(self.records.get("propose", []))


def vllm_step_costs(plain: StepTimer, spec: StepTimer, batch: int, gamma: int) -> dict:
    """The bound's parts (the keys of specrl.bench.engine_step_costs) from vLLM's own steps: the
    lower quartile and median of the plain decode forwards with every slot busy, of the verify forwards with
    every slot busy, and of the drafter's proposal per step divided by gamma (its forward over the
    newly accepted tokens and the chain steps)."""
    from rollout.profile import bound_costs

    plain_steps, verify_steps, proposals = plain.forward_s(batch), spec.forward_s(batch * (gamma + 1)), spec.propose_s()
    samples = {"plain_steps": len(plain_steps), "spec_steps": len(verify_steps), "proposals": len(proposals)}
    return bound_costs(plain_steps, verify_steps, [p / gamma for p in proposals], samples)
