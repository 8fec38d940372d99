"""specrl inside AReaL's asynchronous RL loop (areal 1.0.4): a speculative engine as an AReaL
`InferenceEngine`, its policy updated while requests are in flight, every token tagged with the
policy version that produced it.

Terms:
- *version*: the policy version the trainer publishes after each update (AReaL's
  `set_version`); a token's version is the version of the weights that produced it.
- *chunk*: the unit of generation between two interruption points. AReaL interrupts a request
  in flight by aborting it on its server and resubmitting prompt + partial answer once the new
  weights are in (areal.infra.remote_inf_engine.RemoteInfEngine.agenerate). Here the engine
  decodes every request `chunk_tokens` tokens at a time; a weight update waits for the chunk in
  flight, at most `chunk_tokens` engine steps, and the next chunk decodes with the new weights.
  A resumed request's prompt is prefilled again (the embedded engine keeps no prefix cache).
- *staleness*: how many versions a trajectory's first token is behind the trainer that consumes
  it; AReaL bounds it by `max_head_offpolicyness` (η) through its StalenessManager's capacity.

`ChunkServer` is the engine side and needs no AReaL: one generation thread serves the chunks of
every coroutine in flight, micro-batched into one `generate` call per chunk round, and forwards
the co-training core's draft calls (`rollout.protocol.DraftReceiver`) between chunks, so a
draft push never touches a chunk in flight nor the policy. `areal_engine(server, config)` wraps
it in AReaL's real `InferenceEngine` class, whose `submit`/`wait`/`prepare_batch` run AReaL's
own `WorkflowExecutor` and `StalenessManager`.

Losslessness holds per chunk, as for any generate call: greedy chunks are the policy version's
argmax tokens and sampled chunks follow its law, whatever the draft; the log-prob of every token
is the serving version's. A chunk's coupled noise is keyed by (request, tokens already decoded),
so a request's draws stay fresh across chunks and do not depend on its batch neighbours.
"""
from __future__ import annotations

import asyncio
import threading
import time
import zlib
from concurrent.futures import Future
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from rollout.protocol import (EngineCapabilities, Rollout, RolloutStats, SamplingParams, SpecStats,
                              summarize_spec_stats)


@dataclass
class Chunk:
    """One request's share of a chunk round."""
    rid: str
    input_ids: list[int]  # prompt + tokens decoded so far
    n_done: int  # tokens decoded so far
    remaining: int  # tokens the request may still decode
    params: SamplingParams  # max_new_tokens unused: the round sets it
    future: Future


@dataclass
class ChunkResult:
    tokens: list[int]
    logprobs: list[float]
    version: int  # the policy version that produced the tokens
    finished: bool  # a stop token ended the request
    spec: SpecStats | None


def merge_spec(total: SpecStats | None, part: SpecStats | None) -> SpecStats | None:
    """Acceptance statistics of a request over its chunks."""
    if part is None:
        return total
    if total is None:
        total = SpecStats()
    for name in ("drafted_per_pos", "accepted_per_pos"):
        a, b = getattr(total, name), getattr(part, name)
        a.extend([0] * (len(b) - len(a)))
        for i, v in enumerate(b):
            a[i] += v
    total.verify_steps += part.verify_steps
    total.drafted += part.drafted
    total.accepted += part.accepted
    return total


def noise_key(rid: str, n_done: int) -> int:
    """The request id of a chunk's coupled noise: a stable hash of (request, tokens decoded)."""
    return zlib.crc32(f"{rid}/{n_done}".encode())


class ChunkServer:
    """Serves version-tagged chunks of many concurrent requests over one specrl engine (a
    rollout.protocol.RolloutEngine that owns its policy copy: updates come through
    `load_policy_weights`). Thread-safe; `close()` stops the generation thread."""

    def __init__(self, engine, *, chunk_tokens: int = 16, max_batch: int = 64, version: int = 0):
        if chunk_tokens < 1 or max_batch < 1:
            raise ValueError(f"chunk_tokens and max_batch must be >= 1, got {chunk_tokens}, {max_batch}")
        self.engine = engine
        self.chunk_tokens, self.max_batch = chunk_tokens, max_batch
        self._cv = threading.Condition()
        self._queue: list[Chunk] = []
        self._paused = False
        self._busy = False
        self._closed = False
        self._version = version
        self.finished: list[SpecStats | None] = []  # acceptance of each request finished since take_finished
        self.rounds = 0
        self.busy_s = 0.0  # wall time inside generate
        self.wait_for_chunk_s = 0.0  # time updates waited for the chunk in flight
        self._saved_s, self._saved_rounds = 0.0, 0  # speculation's estimated saving, over the rounds since take_finished
        self._window = [0.0, 0, False]  # generate's seconds and tokens since take_finished, and whether it speculated
        self._thread = threading.Thread(target=self._loop, name="specrl-chunk-server", daemon=True)
        self._thread.start()

    # -- requests ---------------------------------------------------------------------------
    def submit(self, rid: str, input_ids: list[int], n_done: int, remaining: int, params: SamplingParams) -> Future:
        fut: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the chunk server is closed")
            self._queue.append(Chunk(rid, list(input_ids), n_done, remaining, params, fut))
            self._cv.notify_all()
        return fut

    async def generate(self, rid: str, prompt: list[int], params: SamplingParams,
                       wait_while=lambda: False) -> tuple[list[int], list[float], list[int], str, SpecStats | None]:
        """One request to its end: (tokens, log-probs, version per token, "stop" | "length",
        acceptance). Between chunks it waits while `wait_while()` holds (AReaL's paused executor)."""
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        spec = None
        reason = "length"
        while len(tokens) < params.max_new_tokens:
            while wait_while():
                await asyncio.sleep(0.01)
            fut = self.submit(rid, prompt + tokens, len(tokens), params.max_new_tokens - len(tokens), params)
            res: ChunkResult = await asyncio.wrap_future(fut)
            tokens += res.tokens
            logprobs += res.logprobs
            versions += [res.version] * len(res.tokens)
            spec = merge_spec(spec, res.spec)
            if res.finished:
                reason = "stop"
                break
        with self._cv:
            self.finished.append(spec)
        return tokens, logprobs, versions, reason, spec

    # -- updates (between chunks) -----------------------------------------------------------
    def pause_generation(self) -> None:
        """Let the chunk in flight finish, start no other until `continue_generation`."""
        t0 = time.perf_counter()
        with self._cv:
            self._paused = True
            while self._busy:
                self._cv.wait()
        self.wait_for_chunk_s += time.perf_counter() - t0

    def continue_generation(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def _between_chunks(self, fn):
        with self._cv:
            was_paused = self._paused
        if was_paused:
            return fn()
        self.pause_generation()
        try:
            return fn()
        finally:
            self.continue_generation()

    def load_policy_weights(self, state_dict: dict, version: int) -> None:
        """The policy update: the next chunk of every request decodes with these weights, and its
        tokens carry `version`. Never touches the draft."""
        def load():
            self.engine.load_policy_weights(state_dict)
            self._version = int(version)
        self._between_chunks(load)

    @property
    def version(self) -> int:
        return self._version

    def take_finished(self) -> Rollout:
        """The requests finished since the last call, as the co-training core reads a rollout:
        each item's `spec` is a request's acceptance, and `stats` sums the chunk rounds since the
        last call (their seconds and tokens, and the seconds speculation saved, the engine's
        estimate where it makes one; a priced draft budget pays its updates from it)."""
        with self._cv:
            out, self.finished = self.finished, []
            (seconds, tokens, speculated), self._window = self._window, [0.0, 0, False]
            stats = RolloutStats(wall_s=seconds, tokens=tokens, speculated=speculated,
                                 spec_saved_s=self._saved_s if self._saved_rounds else None)
            self._saved_s, self._saved_rounds = 0.0, 0
        return Rollout([SimpleNamespace(spec=s) for s in out], stats)

    # -- DraftReceiver: the co-training core's calls, between chunks ------------------------
    @property
    def capabilities(self) -> EngineCapabilities:
        """The engine's drafters and step policy; features come from the trainer's log-prob
        forward, and the asynchronous loop has no per-rollout switch nor idle windows of its own."""
        caps = self.engine.capabilities
        return EngineCapabilities(drafters=caps.drafters, step_policy=caps.step_policy, acceptance=caps.acceptance)

    def install_draft(self, drafter, policy=None) -> None:
        self._between_chunks(lambda: self.engine.install_draft(drafter, policy))

    def set_speculation(self, on: bool) -> None:
        self._between_chunks(lambda: self.engine.set_speculation(on))

    @property
    def speculating(self) -> bool:
        return self.engine.speculating

    def push_draft(self, weights: dict[str, torch.Tensor], version: int) -> None:
        self._between_chunks(lambda: self.engine.push_draft(weights, version))

    def draft_weights(self):
        return self._between_chunks(self.engine.draft_weights)

    @property
    def draft_version(self):
        return self.engine.draft_version

    @property
    def draft_faults(self) -> list[str]:
        return self.engine.draft_faults

    # -- the generation thread --------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (self._paused or not self._queue):
                    self._cv.wait()
                if self._closed:
                    return
                batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch:]
                self._busy = True
                version = self._version
            try:
                self._run_round(batch, version)
            except BaseException as err:  # a target-side failure fails the round's requests, not the server
                for c in batch:
                    if not c.future.done():
                        c.future.set_exception(err)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _run_round(self, batch: list[Chunk], version: int) -> None:
        # one generate call per distinct sampling setting (an RL batch has one)
        groups: dict[tuple, list[Chunk]] = {}
        for c in batch:
            p = c.params
            groups.setdefault((p.temperature, p.top_p, p.top_k, p.stop_token_ids, p.seed), []).append(c)
        t0 = time.perf_counter()
        done = []
        for chunks in groups.values():
            n = min(self.chunk_tokens, max(c.remaining for c in chunks))
            p = chunks[0].params
            params = SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_new_tokens=n,
                                    stop_token_ids=p.stop_token_ids, seed=p.seed)
            trajs = self.engine.generate([c.input_ids for c in chunks], params,
                                         request_ids=[noise_key(c.rid, c.n_done) for c in chunks])
            with self._cv:
                self._window[0] += trajs.stats.wall_s
                self._window[1] += trajs.stats.tokens
                self._window[2] |= trajs.stats.speculated
                if trajs.stats.spec_saved_s is not None:
                    self._saved_s += trajs.stats.spec_saved_s
                    self._saved_rounds += 1
            for c, t in zip(chunks, trajs):
                keep = min(len(t.token_ids), c.remaining)  # a longer round decodes past this request's end
                stopped = t.finish_reason == "stop" and keep == len(t.token_ids)
                done.append((c.future, ChunkResult(list(t.token_ids[:keep]), t.logprobs[:keep].tolist(), version,
                                                   stopped, t.spec)))
        self.busy_s += time.perf_counter() - t0
        self.rounds += 1
        for fut, result in done:  # the round's counters are in before any request sees its result
            fut.set_result(result)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            for c in self._queue:
                c.future.cancel()
            self._queue = []
            self._cv.notify_all()
        self._thread.join(timeout=30)

    def acceptance(self) -> dict:
        """Accept length over the requests finished since the last `take_finished`."""
        with self._cv:
            return summarize_spec_stats(self.finished)


def sampling_params(gconfig, seed: int = 0) -> SamplingParams:
    """AReaL's GenerationHyperparameters as specrl's SamplingParams; what specrl cannot honour
    is refused in one line."""
    if gconfig.n_samples != 1:
        raise ValueError(f"n_samples must be 1 per request (AReaL groups requests itself), got {gconfig.n_samples}")
    for name, off in (("min_new_tokens", 0), ("frequency_penalty", 0.0), ("ignore_eos", False),
                      ("use_beam_search", False)):
        if getattr(gconfig, name, off) not in (off, None):
            raise ValueError(f"GenerationHyperparameters.{name}={getattr(gconfig, name)!r} is not supported by specrl's engines")
    if getattr(gconfig, "stop", None):
        raise ValueError("GenerationHyperparameters.stop (stop strings) is not supported: use stop_token_ids")
    # AReaL's "no top-k" is a huge top_k (its default, 1e8) or a value <= 0; specrl's is 0
    top_k = int(gconfig.top_k) if gconfig.top_k is not None and 0 < gconfig.top_k < 2**31 else 0
    return SamplingParams(temperature=0.0 if gconfig.greedy else float(gconfig.temperature), top_p=float(gconfig.top_p),
                          top_k=top_k,
                          max_new_tokens=int(gconfig.max_new_tokens), stop_token_ids=tuple(gconfig.stop_token_ids or ()),
                          seed=seed)


_ENGINE_CLASS = None


def areal_engine(server: ChunkServer, config, *, seed: int = 0):
    """`server` as an instance of AReaL's real `areal.api.engine_api.InferenceEngine` (areal
    1.0.4 must be installed); `config` is AReaL's InferenceEngineConfig (consumer_batch_size,
    max_head_offpolicyness = η, max_concurrent_rollouts). Call `initialize()` before use."""
    return _engine_class()(server, config, seed)


def _engine_class():
    global _ENGINE_CLASS
    if _ENGINE_CLASS is not None:
        return _ENGINE_CLASS
    try:
        from areal.api.engine_api import InferenceEngine
        from areal.api.io_struct import ModelResponse
        from areal.api.workflow_api import RolloutWorkflow
        from areal.infra.remote_inf_engine import GroupedRolloutWorkflow
        from areal.infra.workflow_executor import WorkflowExecutor
    except ImportError as err:
        raise ImportError(f"specrl.integrations.areal needs areal 1.0.4 (see tests/lanes/areal.sh): {err}") from err
    import logging

    log = logging.getLogger("specrl.areal")

    class SpecRLInferenceEngine(InferenceEngine):
        """An AReaL inference engine over a specrl ChunkServer (see the module docstring)."""

        def __init__(self, server: ChunkServer, config, seed: int = 0):
            self.server, self.config, self.seed = server, config, seed
            self._version = server.version
            self._executor = None

        # lifecycle
        def initialize(self, *args, train_data_parallel_size: int | None = None, **kwargs):
            self._executor = WorkflowExecutor(config=self.config, inference_engine=self)
            self._executor.initialize(train_data_parallel_size=train_data_parallel_size or 1)

        def destroy(self):
            if self._executor is not None:
                self._executor.destroy()
                self._executor = None

        @property
        def initialized(self) -> bool:
            return self._executor is not None

        @property
        def workflow_executor(self):
            return self._executor

        # generation
        async def agenerate(self, req):
            t0 = time.perf_counter()
            params = sampling_params(req.gconfig, self.seed)
            limit = getattr(req.gconfig, "max_tokens", None)
            if limit is not None and limit - len(req.input_ids) < params.max_new_tokens:
                if limit - len(req.input_ids) <= 0:
                    raise RuntimeError(f"prompt of {len(req.input_ids)} tokens leaves nothing under max_tokens={limit}")
                params = SamplingParams(**{**params.__dict__, "max_new_tokens": limit - len(req.input_ids)})
            tokens, logprobs, versions, reason, spec = await self.server.generate(
                req.rid, list(req.input_ids), params, wait_while=self._executor.is_paused)
            resp = ModelResponse(input_tokens=list(req.input_ids), output_tokens=tokens, output_logprobs=logprobs,
                                 output_versions=versions, stop_reason=reason, tokenizer=req.tokenizer,
                                 latency=time.perf_counter() - t0)
            resp.spec = spec  # specrl's acceptance statistics of this response
            return resp

        # versions and weights
        def set_version(self, version: int) -> None:
            self._version = int(version)

        def get_version(self) -> int:
            return self._version

        def load_policy_weights(self, state_dict: dict, version: int) -> None:
            """In-process policy update (the trainer shares the process): between chunks."""
            self.server.load_policy_weights(state_dict, version)

        def update_weights_from_disk(self, meta):
            """Load a state dict saved with torch.save or safetensors at `meta.path`."""
            fut: Future = Future()
            try:
                path = str(meta.path)
                if path.endswith(".safetensors"):
                    from safetensors.torch import load_file

                    sd = load_file(path)
                else:
                    sd = torch.load(path, map_location="cpu", weights_only=True)
                self.server.load_policy_weights(sd, meta.version if meta.version is not None else self._version)
                fut.set_result(None)
            except Exception as err:  # AReaL reads the error from the future
                fut.set_exception(err)
            return fut

        def pause_generation(self):
            self.server.pause_generation()

        def continue_generation(self):
            self.server.continue_generation()

        # AReaL's executor
        def _resolve(self, workflow, workflow_kwargs, group_size):
            if isinstance(workflow, type) and issubclass(workflow, RolloutWorkflow):
                workflow = workflow(**(workflow_kwargs or {}))
            if not isinstance(workflow, RolloutWorkflow):
                raise TypeError(f"workflow must be an areal RolloutWorkflow, got {type(workflow).__name__}")
            return GroupedRolloutWorkflow(workflow, group_size, log) if group_size > 1 else workflow

        def submit(self, data, workflow, workflow_kwargs=None, should_accept_fn=None, group_size=1, task_id=None,
                   is_eval=False):
            return self._executor.submit(data, workflow=self._resolve(workflow, workflow_kwargs, group_size),
                                         should_accept_fn=should_accept_fn, task_id=task_id, is_eval=is_eval)

        def wait(self, count, timeout=None, raise_timeout=True):
            return self._executor.wait(count, timeout=timeout, raise_timeout=raise_timeout)

        def wait_for_task(self, task_id, timeout=None, raise_timeout=True):
            return self._executor.wait_for_task(task_id, timeout=timeout, raise_timeout=raise_timeout)

        def rollout_batch(self, data, workflow, workflow_kwargs=None, group_size=1):
            return self._executor.rollout_batch(data=data, workflow=self._resolve(workflow, workflow_kwargs, group_size))

        def prepare_batch(self, dataloader, workflow, workflow_kwargs=None, should_accept_fn=None, group_size=1,
                          dynamic_bs=False):
            return self._executor.prepare_batch(dataloader=dataloader,
                                                workflow=self._resolve(workflow, workflow_kwargs, group_size),
                                                should_accept_fn=should_accept_fn, dynamic_bs=dynamic_bs)

        def pause(self):
            self._executor.pause()

        def resume(self):
            self._executor.resume()

        def export_stats(self) -> dict[str, float]:
            acc = self.server.acceptance()
            return {"spec/accept_length": acc["accept_length"], "spec/accept_rate": acc["accept_rate"]}

    _ENGINE_CLASS = SpecRLInferenceEngine
    return _ENGINE_CLASS


__all__ = ["ChunkServer", "ChunkResult", "areal_engine", "sampling_params", "merge_spec", "noise_key"]
