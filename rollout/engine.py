"""The embedded rollout engine: batched generation on one CPU or GPU in plain PyTorch.

Requests are admitted into a fixed number of slots of a static KV cache; a finished slot
is refilled from the queue at once (continuous batching), because RL rollouts have a long
tail of few long answers. Each step decodes every active slot; the prompts of requests just
admitted ride along in the same forward (chunked-prefill style), so an admission does not
cost a forward of its own. By default one request more than the decode batch is admitted and
prefilled ahead (`EngineConfig.prefill_ahead`), so a freed slot is taken at once by a request
that already has its first token. With a speculator attached (rollout.speculative), a step
asks its proposer for a draft (rollout.proposer), verifies it with one target forward
(rollout.verify) and commits the verdict; the slot bookkeeping, stopping rules, log-probs and
feature capture stay the engine's. The speculation modules never call back into the engine.
A drafter comes in through `install_draft(DrafterSpec)` only (rollout.drafters), and speculation
is switched on or off per call with `set_speculation`; whoever decides that (the co-trainer's
choice per rollout) lives outside the engine.

Sampling is keyed by (seed, request id, token index) in "coupled" mode (the default), so a
request's output does not depend on which slot or batch it ran in; a call without request ids
gets fresh ones from the engine's counter (rollout.protocol.RequestIds). In "rng" mode a generate call
draws from a torch generator on the model's device, seeded from the seed and the call's request
ids (`rng_seed`): calls with fresh ids (the RL loop's, step * batch + i) draw fresh randomness,
and the same seed and ids give the same samples.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from rollout.compiled import CompiledForwards
from rollout.drafters import METHODS
from rollout.profile import StepProfiler, tick
from rollout.proposer import SpecStep, Verdict
from rollout.protocol import (EngineCapabilities, RequestIds, Rollout, RolloutStats, SamplingParams, SpecStats,
                              StepStats, Trajectory)
from rollout.sampling import policy_logprobs, process_logits, sample
from rollout.spec_sampling import SpecSampling
from rollout.transfer import download, hand_back, settle, upload
from rollout.verify import verify
from target_training.model import MOE_DISPATCHES, KVCache, ModelOutput, MoETransformer

if TYPE_CHECKING:
    from rollout.speculative import SpecSession


class PromptTooLongError(ValueError):
    pass


def cached_len(states) -> int:
    """The longest target KV cache among these requests, from the host (`SlotState.n_cached`)."""
    return max(s.n_cached for s in states)


def rng_seed(seed: int, request_ids: Sequence[int]) -> int:
    """The seed of an "rng"-mode generate call's random stream: a hash of the sampling seed and
    all the call's request ids, in order. A constant seed with fresh request ids gives a fresh
    stream; the same seed and ids give the same stream on every run."""
    key = repr((int(seed), [int(r) for r in request_ids])).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & (2 ** 63 - 1)


MAX_BATCH = 4096  # KV-cache slots; the cache is allocated from it up front
CPU_FUSE_MAX_PADDING = 96  # EngineConfig.fuse_max_padding's default on CPU (fusing's break-even there)


@dataclass
class EngineConfig:
    max_batch: int = 16  # slots in the KV cache
    max_len: int | None = None  # cache length per slot; defaults to the model's max_seq_len
    sampling_mode: str = "coupled"  # "coupled" (counter-based Gumbel) or "rng" (torch generator)
    # requests admitted and prefilled ahead of a free decode slot (extra KV-cache slots): when a
    # sequence finishes, a waiting request takes its place in the very next step, instead of that
    # step carrying its prompt's prefill and decoding one sequence fewer. With speculation that
    # decode step is worth tau tokens, and short answers admit often.
    prefill_ahead: int = 1
    # "exact": every forward bitwise equal to the training dispatch; "dense": decode and verify
    # blocks of up to MoE.DENSE_DISPATCH_MAX_TOKENS tokens run every expert on every token, with
    # no host read inside the step and a faster MoE at small blocks, equal to "exact" only to
    # rounding (target_training.model.MoE). Plain and speculative decoding use the same dispatch.
    moe_dispatch: str = "exact"
    # compile the target's decode and verify forwards of small blocks into static graphs
    # (rollout.compiled: dense MoE dispatch, fixed key count, eager fallback per shape)
    compile_forwards: bool = False
    # admitted prompts ride along in a step's forward only if that adds at most this many
    # padding tokens: fusing pads every decode row to the prompt's width (and the prompt to the
    # verify block's), and on a CPU, past about 100 padding tokens, the one forward costs more
    # than the two it replaces. 0: only when nothing is padded. None (the default): 96 on CPU;
    # no limit on an accelerator, where a padding token costs little next to a forward's
    # launches (an assumption, not a measurement).
    fuse_max_padding: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.max_batch <= MAX_BATCH:
            raise ValueError(f"EngineConfig.max_batch must be in [1, {MAX_BATCH}], got {self.max_batch}")
        if isinstance(self.prefill_ahead, bool) or not isinstance(self.prefill_ahead, int) \
                or not 0 <= self.prefill_ahead <= self.max_batch:
            raise ValueError(f"EngineConfig.prefill_ahead must be an integer in [0, max_batch], got {self.prefill_ahead!r}")
        if self.max_len is not None and self.max_len <= 0:
            raise ValueError(f"EngineConfig.max_len must be positive, got {self.max_len}")
        if not isinstance(self.compile_forwards, bool):
            raise ValueError(f"EngineConfig.compile_forwards must be True or False, got {self.compile_forwards!r}")
        if self.fuse_max_padding is not None and (isinstance(self.fuse_max_padding, bool)
                                                  or not isinstance(self.fuse_max_padding, int)
                                                  or self.fuse_max_padding < 0):
            raise ValueError(f"EngineConfig.fuse_max_padding must be None or an integer >= 0, "
                             f"got {self.fuse_max_padding!r}")
        if self.moe_dispatch not in MOE_DISPATCHES:
            raise ValueError(f"EngineConfig.moe_dispatch must be one of {MOE_DISPATCHES}, got {self.moe_dispatch!r}")
        if self.sampling_mode not in ("coupled", "rng"):
            raise ValueError(f"EngineConfig.sampling_mode must be 'coupled' or 'rng', got {self.sampling_mode!r}")


@dataclass
class SlotState:
    """One request occupying a cache slot."""

    index: int  # position in the generate() call's prompt list
    request_id: int
    prompt: list[int]
    max_new: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    features: list[torch.Tensor] = field(default_factory=list)
    spec: SpecStats | None = None
    finish_reason: str | None = None

    @property
    def last_token(self) -> int:
        return self.tokens[-1]

    @property
    def n_cached(self) -> int:
        """Entries of this request in the target's KV cache: every token but the last emitted one
        has been fed. Known on the host, so nothing is read back from the device for it."""
        return len(self.prompt) + len(self.tokens) - 1


@dataclass
class Prefill:
    """Newly admitted requests whose prompts still need their forward."""

    slots: torch.Tensor  # (B,) cache slots
    ids: torch.Tensor  # (B, T) prompts, right-padded
    lens: torch.Tensor  # (B,) prompt lengths
    request_ids: torch.Tensor  # (B,)
    states: list[SlotState]
    slot_list: list[int]  # `slots` on the host
    done: bool = False


@dataclass
class _Run:
    """What every step of one generate() call shares."""

    cache: KVCache
    params: SamplingParams
    capture: bool  # fill Trajectory.features
    spec: SpecSession | None  # the call's speculation (rollout.speculative); None: plain decoding


class EmbeddedEngine:
    def __init__(self, model: MoETransformer, config: EngineConfig | None = None, drafter=None, policy=None):
        self.model = model.eval()
        self.config = config or EngineConfig()
        self.max_len = self.config.max_len or model.cfg.max_seq_len
        self._speculator = None  # rollout.speculative.Speculator, from install_draft; None: plain decoding
        if self.config.sampling_mode != "coupled":  # sampled drafts are accepted by rejection sampling
            self.capabilities = dataclasses.replace(EmbeddedEngine.capabilities, acceptance="rejection")
        self._speculate = False  # set_speculation: whether the next calls use the drafter
        self.compiled = CompiledForwards(model) if self.config.compile_forwards else None  # rollout.compiled
        self.generator: torch.Generator | None = None  # "rng" mode's stream; made on the model's device
        self.request_ids = RequestIds()  # fresh ids for calls that pass none
        if drafter is not None:
            self.install_draft(drafter, policy)
        # called as hook(n_active, n_slots) after every engine step (n_slots: the most sequences a
        # step decodes, prefill_ahead slots excluded): the rollout's long tail is
        # an idle window for co-located work (specrl's draft trainer uses it)
        self.step_hooks: list = []
        # optional: per-phase wall time of every engine step (rollout.profile; benchmarks only)
        self.profiler: StepProfiler | None = None

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    # -- protocol -------------------------------------------------------------------------
    capabilities = EngineCapabilities(drafters=METHODS, step_policy=True, switch="free", captures_features=True,
                                      idle_windows=True, acceptance="coupled")  # "rejection" in "rng" mode

    def load_policy_weights(self, state_dict: dict) -> None:
        """Policy sync. Only the target's own parameters are written; the draft lives apart."""
        self.model.load_state_dict(state_dict, strict=True)

    def runs_in_place(self, module) -> bool:
        return module is self.model

    def shutdown(self) -> None:
        """Nothing to release: the engine runs in the caller's process, on its modules."""

    # -- DraftReceiver (rollout.protocol) --------------------------------------------------
    def install_draft(self, drafter, policy=None) -> None:
        """Speculate with `drafter` (rollout.drafters.DrafterSpec; a draft model is copied) from
        the next call on, speculation on; `policy` (rollout.protocol.StepPolicy) decides per step."""
        from rollout.speculative import Speculator  # loaded only when a drafter is installed

        if drafter.method not in self.capabilities.drafters:
            raise ValueError(f"the embedded engine takes drafters {self.capabilities.drafters}, got {drafter.method!r}")
        if drafter.draft is not None:
            drafter = dataclasses.replace(drafter, draft=copy.deepcopy(drafter.draft))
        speculator = Speculator(drafter, policy)
        speculator.check_target(self.model)
        self._speculator, self._speculate = speculator, True

    def set_speculation(self, on: bool) -> None:
        """Speculate in the next calls or decode plainly; free on this engine (nothing restarts)."""
        if on and self._speculator is None:
            raise ValueError("set_speculation(True) needs a drafter: install_draft first")
        self._speculate = bool(on)

    @property
    def speculating(self) -> bool:
        """Whether the next call speculates."""
        return self._speculator is not None and self._speculate

    def push_draft(self, weights: dict, version: int) -> None:
        self._speculator.load_draft_weights(weights, version)

    def draft_weights(self) -> tuple[dict, int]:
        return {k: v.clone() for k, v in self._speculator.draft.state_dict().items()}, self._speculator.version

    @property
    def draft_faults(self) -> list[str]:
        return self._speculator.faults if self._speculator is not None else []

    @property
    def draft_version(self) -> int | None:
        """The version of the draft weights in use; None without a drafter."""
        return self._speculator.version if self._speculator is not None else None

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 request_ids: Sequence[int] | None = None, capture_features: bool = False) -> Rollout:
        if len(prompts) == 0:
            return Rollout([], RolloutStats(0.0, 0, temperature=params.temperature))
        request_ids = self.request_ids.take(request_ids, len(prompts))
        states = [self._new_state(i, rid, p, params) for i, (rid, p) in enumerate(zip(request_ids, prompts))]
        self._seed_generator(params.seed, request_ids)
        n_decode = min(self.config.max_batch, len(states))  # sequences decoded per step, at most
        n_slots = min(self.config.max_batch + self.config.prefill_ahead, len(states))  # KV-cache slots
        spec = self._speculator.begin(n_slots, self.max_len) if self.speculating else None
        slack = self._speculator.block_slack() if spec is not None else 0
        cache = KVCache.for_model(self.model.cfg, n_slots, self.max_len + slack, self.device,
                                  self.model.embed_tokens.weight.dtype)
        run = _Run(cache, params, capture_features, spec)
        pending = deque(states)
        slots: list[SlotState | None] = [None] * n_slots
        t0, steps = time.perf_counter(), 0
        phase_s = {"full": 0.0, "tail": 0.0}  # wall time of steps at the full batch and of the tail's smaller ones
        spec_steps, hook_s = 0, 0.0
        while pending or any(s is not None for s in slots):
            free = [i for i, s in enumerate(slots) if s is None]
            admit = [(i, pending.popleft()) for i in free[: len(pending)]]
            for i, st in admit:
                slots[i] = st
            new = {i for i, _ in admit}
            active = self._decoding(slots, n_decode, new)
            prefill = self._plan_prefill(admit) if admit else None
            if prefill is not None and not self._can_fuse(cache, [slots[i] for i in active], prefill, slack,
                                                          spec.block_width(len(active)) if spec is not None else 1):
                # nothing to fuse with, or no room: prefill on its own; the new requests join this step
                self._run_prefill(run, prefill)
                prefill = None
                active = self._decoding(slots, n_decode)
            if active:
                act_states = [slots[i] for i in active]
                # the controller's step times grow with the context (not needed without speculation)
                context = sum(s.n_cached for s in act_states) / len(act_states) if spec is not None else None
                t_step = time.perf_counter()
                prof = self.profiler
                if spec is not None and spec.should_speculate(len(active)):
                    spec_steps += 1
                    if prof is not None:
                        prof.begin("spec", len(active), prefill is not None)
                    lengths = [s.n_cached for s in act_states]  # to roll back to after a fault (host values)
                    try:
                        result = self._spec_step(run, active, act_states, prefill)
                        result.seconds = None if prefill is not None else time.perf_counter() - t_step
                        result.context = context
                        spec.observe(result)
                        kind = None
                    except Exception as err:  # draft-side failure: never stop the rollout
                        cache.rollback(*upload(active, lengths, device=cache.lengths.device))
                        spec.on_fault(err)
                        self._decode_step(run, active, act_states, None if prefill is None or prefill.done else prefill)
                        kind = "fault"
                    if prof is not None:
                        prof.end(kind)
                else:
                    if prof is not None:
                        prof.begin("plain", len(active), prefill is not None)
                    self._decode_step(run, active, act_states, prefill)
                    if spec is not None:
                        spec.observe(StepStats(len(active), None if prefill is not None else time.perf_counter() - t_step,
                                               context))
                    if prof is not None:
                        prof.end()
                steps += 1
                phase_s["full" if len(active) == n_decode else "tail"] += time.perf_counter() - t_step
                if self.step_hooks:
                    t_hooks = time.perf_counter()
                    for hook in self.step_hooks:
                        hook(len(active), n_decode)
                    hook_s += time.perf_counter() - t_hooks
            for i, s in enumerate(slots):
                if s is not None and s.finish_reason is not None:
                    slots[i] = None
        if spec is not None:
            spec.settle([len(s.tokens) for s in states], n_decode, phase_s["full"] + phase_s["tail"], spec_steps)
        stats = RolloutStats(wall_s=time.perf_counter() - t0, tokens=sum(len(s.tokens) for s in states),
                             speculated=spec is not None, hook_s=hook_s, engine_steps=steps, spec_steps=spec_steps,
                             full_batch_s=phase_s["full"], tail_s=phase_s["tail"],
                             spec_faults=int(spec is not None and spec.faulted),
                             spec_saved_s=spec.saved_s if spec is not None else None, temperature=params.temperature)
        if capture_features:
            settle(self.device)  # the features' copies to the host (`download`) have landed
        return Rollout([self._to_trajectory(s, capture_features) for s in states], stats)

    # -- internals ------------------------------------------------------------------------
    def _seed_generator(self, seed: int, request_ids: list[int]) -> None:
        """Seed the "rng" stream of one generate call (`rng_seed`), on the model's device: a
        generator on another device is refused by the sampling ops (a model moved since the last
        call gets a new one)."""
        if self.generator is None or self.generator.device != self.device:
            self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(rng_seed(seed, request_ids))

    @staticmethod
    def _decoding(slots: list, n_decode: int, exclude=()) -> list[int]:
        """The slots this step decodes: unfinished, prefilled requests (not `exclude`, whose
        prompts ride along this step), the n_decode earliest admitted, in slot order."""
        ready = [i for i, s in enumerate(slots) if s is not None and s.finish_reason is None and i not in exclude]
        return sorted(sorted(ready, key=lambda i: slots[i].index)[:n_decode])

    def _new_state(self, index: int, request_id: int, prompt: Sequence[int], params: SamplingParams) -> SlotState:
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError(f"prompt {index} is empty")
        vocab = self.model.cfg.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt {index} has token ids outside the vocabulary [0, {vocab})")
        room = self.max_len - len(prompt)
        if room <= 0:
            raise PromptTooLongError(f"prompt {index} has {len(prompt)} tokens; the context window holds {self.max_len}")
        return SlotState(index, int(request_id), prompt, min(params.max_new_tokens, room),
                         spec=SpecStats() if self._speculator is not None else None)

    def _plan_prefill(self, admit) -> "Prefill":
        """The admitted prompts as one right-padded block, built on the host and uploaded."""
        width = max(len(s.prompt) for _, s in admit)
        ids, slot_ids, lens, rids = upload([s.prompt + [0] * (width - len(s.prompt)) for _, s in admit],
                                           [i for i, _ in admit], [len(s.prompt) for _, s in admit],
                                           [s.request_id for _, s in admit], device=self.device)
        return Prefill(slot_ids, ids, lens, rids, [s for _, s in admit], [i for i, _ in admit])

    def _can_fuse(self, cache: KVCache, states: list[SlotState], prefill: "Prefill", slack: int,
                  width: int = 1) -> bool:
        """Whether the prompts ride along the forward of the step decoding `states`, whose blocks
        are about `width` tokens wide (1 plain, a verify block speculating): only if padding every
        row to the widest adds at most `EngineConfig.fuse_max_padding` tokens (where limited), and
        every row has the padded width's room left in its slot (lengths from the host, `cached_len`)."""
        if not states:
            return False
        prompt_width = prefill.ids.shape[1]
        padding = len(states) * max(prompt_width - width, 0) + len(prefill.states) * max(width - prompt_width, 0)
        limit = self.config.fuse_max_padding
        if limit is None and self.device.type == "cpu":  # the default: limited on CPU only
            limit = CPU_FUSE_MAX_PADDING
        if limit is not None and padding > limit:
            return False
        return cache.max_len - cached_len(states) >= max(prompt_width, slack, 1)

    def _run_prefill(self, run: _Run, prefill: "Prefill") -> None:
        run.cache.reset(prefill.slots)
        out = self.model(prefill.ids, cache=run.cache, slots=prefill.slots, tap_layers=self.tap_layers(run),
                         key_len=prefill.ids.shape[1], moe_dispatch=self.config.moe_dispatch)  # slots just reset
        self._finish_prefill(run, prefill, out)

    def _finish_prefill(self, run: _Run, prefill: "Prefill", out, rows=slice(None)) -> None:
        """The prompts' forward is done (rows `rows` of `out`): drop the right padding, hand the
        features on, and sample each request's first token from its last prompt position."""
        run.cache.rollback(prefill.slots, prefill.lens, check=False)  # each prompt fits its padded block
        lens, spec = prefill.lens, run.spec
        last_logits = out.logits[rows][torch.arange(len(prefill.states), device=self.device), lens - 1]  # (B, V)
        feats = None
        if run.capture or (spec is not None and spec.proposer.uses_features):
            feats = out.features(self.model.cfg.feature_layer_ids)[rows]  # (B, T, 3H)
            if run.capture:
                on_host = download(feats, torch.float16)  # (B, T, 3H)
                for r, s in enumerate(prefill.states):
                    s.features.append(on_host[r, : len(s.prompt)])
        if spec is not None:
            spec.proposer.prefilled(prefill.slot_list, feats, [len(s.prompt) for s in prefill.states])
        prefill.done = True
        self._emit(prefill.states, last_logits, run.params, prefill.request_ids, torch.zeros_like(lens))

    def forward(self, run: _Run, slots: torch.Tensor, ids: torch.Tensor, prefill: "Prefill | None" = None, *,
                positions=None, attn_mask=None, key_len: int | None = None) -> ModelOutput:
        """The target forward of one engine step for rows `slots` (ids (B, T); positions and
        attn_mask as in MoETransformer.forward), taps on when features are wanted.

        With `prefill`, the prompts of newly admitted requests ride along in the same forward
        (chunked-prefill style): every row is padded to the longest block, the padding is rolled
        back, and the new requests get their first token. One forward instead of two, which on a
        small or overhead-bound model is most of an admission's cost. The returned output and the
        slots' cache lengths are exactly what the unfused call would leave. key_len: the keys
        the step's rows read (KVCache.begin_block), from the host's lengths (`cached_len`)."""
        taps, cache = self.tap_layers(run), run.cache
        if prefill is None:
            def eager() -> ModelOutput:
                return self.model(ids, cache=cache, slots=slots, positions=positions, attn_mask=attn_mask,
                                  tap_layers=taps, key_len=key_len, moe_dispatch=self.config.moe_dispatch)

            if self.compiled is None:
                return eager()
            return self.compiled(ids, cache=cache, slots=slots, positions=positions, attn_mask=attn_mask,
                                 tap_layers=taps, eager=eager)
        B, T = ids.shape
        n_new, T_new = prefill.ids.shape
        W = max(T, T_new)
        start = cache.lengths[slots]  # (B,)
        all_ids = torch.zeros(B + n_new, W, dtype=torch.long, device=ids.device)
        all_ids[:B, :T], all_ids[B:, :T_new] = ids, prefill.ids
        all_pos = torch.cat([start, torch.zeros_like(prefill.lens)])[:, None] + torch.arange(W, device=ids.device)
        if positions is not None:
            all_pos[:B, :T] = positions
        mask = None
        if attn_mask is not None:  # the step's own mask in its corner, causal everywhere else
            mask = torch.ones(W, W, dtype=torch.bool, device=ids.device).tril().repeat(B + n_new, 1, 1)
            mask[:B, :T, :T] = attn_mask
        cache.reset(prefill.slots)
        out = self.model(all_ids, cache=cache, slots=torch.cat([slots, prefill.slots]), positions=all_pos,
                         attn_mask=mask, tap_layers=taps, key_len=None if key_len is None else key_len - T + W,
                         moe_dispatch=self.config.moe_dispatch)
        cache.rollback(slots, start + T, check=False)  # the step's rows keep their T tokens
        self._finish_prefill(run, prefill, out, rows=slice(B, None))
        return ModelOutput(logits=out.logits[:B, :T], hidden=out.hidden[:B, :T],
                           taps={k: v[:B, :T] for k, v in out.taps.items()})

    def _decode_step(self, run: _Run, active: list[int], states: list[SlotState],
                     prefill: "Prefill | None" = None) -> None:
        # the step's host values in one copy: slots, last tokens, request ids and token counts (sampling)
        slot_ids, ids, rids, n_tokens = upload(active, [[s.last_token] for s in states], [s.request_id for s in states],
                                               [len(s.tokens) for s in states], device=self.device)
        out = self.forward(run, slot_ids, ids, prefill, key_len=cached_len(states) + 1)
        tick(self.profiler, "forward")
        if run.capture:
            on_host = download(out.features(self.model.cfg.feature_layer_ids), torch.float16)  # (B, 1, 3H)
            for r, s in enumerate(states):
                s.features.append(on_host[r])
        if run.spec is not None:
            run.spec.proposer.decoded(active, out)
        tick(self.profiler, "features")
        self._emit(states, out.logits[:, -1], run.params, rids, n_tokens)
        tick(self.profiler, "emit")

    def _spec_step(self, run: _Run, active: list[int], states: list[SlotState],
                   prefill: "Prefill | None" = None) -> StepStats:
        """Draft, verify and commit for the active slots; `prefill` (newly admitted prompts) rides
        along in the verify forward (`forward`).

        The proposer drafts (rollout.proposer); `verify` scores the draft with the target as a
        function and applies the acceptance rule (rollout.verify); the target cache keeps the
        accepted run; `_commit` emits. From the verify forward on, nothing is read back from the
        device until `_commit` hands the emitted tokens back in one transfer; the draft's health
        check (NaN or +inf logits) travels with it, and a bad draft is raised as a fault before
        any slot state changes (`generate` then rolls the target cache back and decodes plainly).
        A failure of the target's verify forward is the target's, not a draft fault: it is marked
        (`SpecSession.target_error`) and the session raises it again, out of `generate`."""
        spec, cache = run.spec, run.cache
        # the step's host values in one copy: slots, last tokens x_L, request ids, and the index of each x_{L+1}
        slots, roots, rids, first_steps = upload(active, [s.last_token for s in states], [s.request_id for s in states],
                                                 [len(s.tokens) for s in states], device=cache.lengths.device)
        L = cache.lengths[slots]  # (B,)
        depth = spec.depth()  # the caches carry `block_slack` spare positions for the verify block
        prof = self.profiler
        if prof is not None:
            prof.set_gamma(depth)
        sampling = SpecSampling(run.params, depth, rids, first_steps, sampling_mode=self.config.sampling_mode,
                                generator=self.generator, vocab_size=self.model.cfg.vocab_size)
        # every block's key length comes from the host (`cached_len`, KVCache.begin_block)
        step = SpecStep(active=active, slots=slots, lengths=L, roots=roots, states=states, key_len=cached_len(states),
                        depth=depth, sampling=sampling, profiler=prof)
        proposal = spec.proposer.propose(step)

        def target(ids, positions=None, attn_mask=None, key_len=None) -> ModelOutput:
            try:
                return self.forward(run, slots, ids, prefill, positions=positions, attn_mask=attn_mask,
                                    key_len=key_len)
            except Exception as err:  # the target's own failure, not the draft's: the session raises it again
                spec.target_error = err
                raise

        verdict = verify(step, proposal, target, self.tap_layers(run))
        if verdict.kv_positions is not None:  # a tree: the accepted path's entries move to L ..
            cache.compact(slots, verdict.kv_positions, L)
        cache.rollback(slots, L + verdict.counts, check=False)
        return self._commit(run, step, verdict, proposal.health)

    def _commit(self, run: _Run, step: SpecStep, v: Verdict, health: torch.Tensor | None) -> StepStats:
        """Emit every row's accepted run and record its statistics; the proposer gets the runs.

        The hand-back is one transfer of (tokens, counts, the draft's health) plus the log-probs
        (and a tree's drafted depths); the health check raises before any slot state changes.
        Stop tokens and length budgets are then applied on the host by the token-by-token rule
        (`append_token`), on at most W tokens per row."""
        B, W = v.emitted.shape
        if health is None:  # a proposer with nothing to check
            health = torch.zeros((), device=v.emitted.device)
        per_row_depths = isinstance(v.drafted_depths, torch.Tensor)
        columns = (v.emitted, v.counts, health.expand(B), v.logprobs) + ((v.drafted_depths,) if per_row_depths else ())
        rows = hand_back(*columns)  # (B, 2W + 2), plus a last column for a tree's drafted depths
        on_host = download(v.features, torch.float16) if run.capture else None  # (B, W, 3H)
        if not rows[0][W + 1] < math.inf:  # NaN or +inf
            raise FloatingPointError("draft produced NaN or infinite logits")
        counts = [int(row[W]) for row in rows]
        run.spec.proposer.accepted(step.active, v, counts)
        emitted_total = drafted_total = 0
        for r, (st, row, k) in enumerate(zip(step.states, rows, counts)):
            lp_row = row[W + 2:2 * W + 2]
            drafted_depth = int(row[-1]) if per_row_depths else v.drafted_depths
            if run.capture:
                st.features.append(on_host[r, :k])
            if st.spec is not None:
                st.spec.record(drafted_depth, k - 1)
            emitted_total += k
            drafted_total += drafted_depth
            for token, logprob in zip(map(int, row[:k]), lp_row[:k]):
                if not self.append_token(st, token, logprob, run.params):
                    break  # a stop token or the length budget: the rest is dropped
        tick(self.profiler, "emit")
        return StepStats(n_active=B, gamma=step.depth, tokens_per_seq=emitted_total / B, accepted=emitted_total - B,
                         drafted=drafted_total)

    def tap_layers(self, run: _Run) -> tuple[int, ...]:
        """The target layers a forward taps: the EAGLE-3 feature layers when features are
        captured or the proposer uses them; none otherwise."""
        spec = run.spec
        wanted = run.capture or (spec is not None and spec.proposer.uses_features)
        return self.model.cfg.feature_layer_ids if wanted else ()

    def _emit(self, states: list[SlotState], logits: torch.Tensor, params: SamplingParams, request_ids: torch.Tensor,
              n_tokens: torch.Tensor) -> None:
        """Sample one token per state from logits (B, V) and append it (request ids and token
        counts (B,) on the device: the coupled noise's keys)."""
        logp = process_logits(logits, params.temperature, params.top_k, params.top_p)
        if params.greedy:
            tok = logp.argmax(-1)
        else:
            tok = sample(logp, mode=self.config.sampling_mode, generator=self.generator, seed=params.seed,
                         request_ids=request_ids, steps=n_tokens)
        lp = policy_logprobs(logits, params.temperature).gather(-1, tok[:, None])[:, 0]
        for s, (t, l) in zip(states, hand_back(tok, lp)):
            self.append_token(s, int(t), l, params)

    @staticmethod
    def append_token(s: SlotState, token: int, logprob: float, params: SamplingParams) -> bool:
        """Append one token; returns False once the state has finished (stop token or budget)."""
        if s.finish_reason is not None:
            return False
        s.tokens.append(token)
        s.logprobs.append(logprob)
        if token in params.stop_token_ids:
            s.finish_reason = "stop"
        elif len(s.tokens) >= s.max_new:
            s.finish_reason = "length"
        return s.finish_reason is None

    @staticmethod
    def _to_trajectory(s: SlotState, capture: bool) -> Trajectory:
        feats = None
        if capture:
            n_pos = len(s.prompt) + len(s.tokens) - 1  # the last token was never fed back
            feats = torch.cat(s.features, 0)[:n_pos]
        return Trajectory(prompt_ids=s.prompt, token_ids=s.tokens, logprobs=torch.tensor(s.logprobs, dtype=torch.float32),
                          finish_reason=s.finish_reason or "length", request_id=s.request_id, features=feats, spec=s.spec)
