"""The embedded rollout engine: batched generation on one CPU or GPU in plain PyTorch.

Requests are admitted into a fixed number of slots of a static KV cache; a finished slot
is refilled from the queue at once (continuous batching), because RL rollouts have a long
tail of few long answers. Each step decodes every active slot. With a speculative decoder
attached (rollout.speculative), a step drafts and verifies several tokens instead; the
slot bookkeeping, stopping rules, log-probs and feature capture stay the same.

Sampling is keyed by (seed, request id, token index) in "coupled" mode (the default), so a
request's output does not depend on which slot or batch it ran in.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import torch

from rollout.protocol import SamplingParams, SpecStats, Trajectory
from rollout.sampling import policy_logprobs, process_logits, sample
from target_training.model import KVCache, MoETransformer


class PromptTooLongError(ValueError):
    pass


@dataclass
class EngineConfig:
    max_batch: int = 16  # slots in the KV cache
    max_len: int | None = None  # cache length per slot; defaults to the model's max_seq_len
    sampling_mode: str = "coupled"  # "coupled" (counter-based Gumbel) or "rng" (torch generator)

    def __post_init__(self) -> None:
        if self.max_batch <= 0:
            raise ValueError(f"EngineConfig.max_batch must be positive, got {self.max_batch}")
        if self.max_len is not None and self.max_len <= 0:
            raise ValueError(f"EngineConfig.max_len must be positive, got {self.max_len}")
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


class EmbeddedEngine:
    def __init__(self, model: MoETransformer, config: EngineConfig | None = None, speculator=None):
        self.model = model.eval()
        self.config = config or EngineConfig()
        self.max_len = self.config.max_len or model.cfg.max_seq_len
        self.speculator = speculator  # rollout.speculative.Speculator or None (plain decoding)
        if speculator is not None:
            speculator.check_target(model)
        self.generator = torch.Generator(device="cpu")
        self.last_stats: dict = {}
        # called as hook(n_active, n_slots) after every engine step: the rollout's long tail is
        # an idle window for co-located work (specrl's draft trainer uses it)
        self.step_hooks: list = []

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    # -- protocol -------------------------------------------------------------------------
    def load_policy_weights(self, state_dict: dict) -> None:
        """Policy sync. Only the target's own parameters are written; the draft lives apart."""
        self.model.load_state_dict(state_dict, strict=True)

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 request_ids: Sequence[int] | None = None, capture_features: bool = False) -> list[Trajectory]:
        if len(prompts) == 0:
            return []
        request_ids = list(range(len(prompts))) if request_ids is None else list(request_ids)
        if len(request_ids) != len(prompts):
            raise ValueError(f"got {len(request_ids)} request_ids for {len(prompts)} prompts")
        states = [self._new_state(i, rid, p, params) for i, (rid, p) in enumerate(zip(request_ids, prompts))]
        self.generator.manual_seed(params.seed)
        n_slots = min(self.config.max_batch, len(states))
        spec = self.speculator.begin(n_slots, self.max_len) if self.speculator is not None else None
        slack = self.speculator.block_slack() if spec is not None else 0
        cache = KVCache.for_model(self.model.cfg, n_slots, self.max_len + slack, self.device,
                                  self.model.embed_tokens.weight.dtype)
        pending = deque(states)
        slots: list[SlotState | None] = [None] * n_slots
        t0, steps = time.perf_counter(), 0
        while pending or any(s is not None for s in slots):
            free = [i for i, s in enumerate(slots) if s is None]
            admit = [(i, pending.popleft()) for i in free[: len(pending)]]
            if admit:
                for i, st in admit:
                    slots[i] = st
                self._prefill(cache, admit, params, capture_features, spec)
            active = [i for i, s in enumerate(slots) if s is not None and s.finish_reason is None]
            if active:
                act_states = [slots[i] for i in active]
                t_step = time.perf_counter()
                if spec is not None and spec.should_speculate(len(active)):
                    L = cache.lengths[torch.tensor(active)].clone()
                    try:
                        result = spec.step(self, cache, active, act_states, params, capture_features)
                        spec.observe(len(active), time.perf_counter() - t_step, result)
                    except Exception as err:  # draft-side failure: never stop the rollout
                        cache.rollback(torch.tensor(active), L)
                        spec.on_fault(err)
                        self._decode_step(cache, active, act_states, params, capture_features, spec)
                else:
                    self._decode_step(cache, active, act_states, params, capture_features, spec)
                    if spec is not None:
                        spec.observe(len(active), time.perf_counter() - t_step, None)
                steps += 1
                for hook in self.step_hooks:
                    hook(len(active), n_slots)
            for i, s in enumerate(slots):
                if s is not None and s.finish_reason is not None:
                    slots[i] = None
        wall = time.perf_counter() - t0
        n_tokens = sum(len(s.tokens) for s in states)
        self.last_stats = {"wall_s": wall, "tokens": n_tokens, "tokens_per_s": n_tokens / max(wall, 1e-9),
                           "engine_steps": steps}
        return [self._to_trajectory(s, capture_features) for s in states]

    # -- internals ------------------------------------------------------------------------
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
                         spec=SpecStats() if self.speculator is not None else None)

    def _prefill(self, cache: KVCache, admit, params: SamplingParams, capture: bool, spec) -> None:
        slot_ids = torch.tensor([i for i, _ in admit], device=self.device)
        lens = torch.tensor([len(s.prompt) for _, s in admit], device=self.device)
        T = int(lens.max())
        ids = torch.zeros(len(admit), T, dtype=torch.long, device=self.device)
        for r, (_, s) in enumerate(admit):
            ids[r, : len(s.prompt)] = torch.tensor(s.prompt)
        cache.reset(slot_ids)
        out = self.model(ids, cache=cache, slots=slot_ids, tap_layers=self.tap_layers(capture, spec))
        cache.rollback(slot_ids, lens)  # drop the right padding
        rows = torch.arange(len(admit), device=self.device)
        last_logits = out.logits[rows, lens - 1]  # (B, V)
        states = [s for _, s in admit]
        if capture or spec is not None:
            feats = out.features(self.model.cfg.feature_layer_ids)  # (B, T, 3H)
            if capture:
                for r, s in enumerate(states):
                    s.features.append(feats[r, : len(s.prompt)].to(torch.float16).cpu())
            if spec is not None:
                spec.on_prefill(slot_ids, ids, feats, lens)
        self._emit(states, last_logits, params)

    def _decode_step(self, cache: KVCache, active: list[int], states: list[SlotState], params: SamplingParams,
                     capture: bool, spec=None) -> None:
        slot_ids = torch.tensor(active, device=self.device)
        ids = torch.tensor([[s.last_token] for s in states], device=self.device)
        out = self.model(ids, cache=cache, slots=slot_ids, tap_layers=self.tap_layers(capture, spec))
        if capture:
            feats = out.features(self.model.cfg.feature_layer_ids)
            for r, s in enumerate(states):
                s.features.append(feats[r].to(torch.float16).cpu())
        if spec is not None:
            spec.on_plain_step(slot_ids, ids, out)
        self._emit(states, out.logits[:, -1], params)

    def tap_layers(self, capture: bool, spec) -> tuple[int, ...]:
        return self.model.cfg.feature_layer_ids if (capture or spec is not None) else ()

    def _emit(self, states: list[SlotState], logits: torch.Tensor, params: SamplingParams) -> None:
        """Sample one token per state from logits (B, V) and append it."""
        logp = process_logits(logits, params.temperature, params.top_k, params.top_p)
        if params.greedy:
            tok = logp.argmax(-1)
        else:
            rids = torch.tensor([s.request_id for s in states], device=logits.device)
            steps = torch.tensor([len(s.tokens) for s in states], device=logits.device)
            tok = sample(logp, mode=self.config.sampling_mode, generator=self.generator, seed=params.seed,
                         request_ids=rids, steps=steps)
        lp = policy_logprobs(logits, params.temperature).gather(-1, tok[:, None])[:, 0]
        for s, t, l in zip(states, tok.tolist(), lp.tolist()):
            self.append_token(s, t, l, params)

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
