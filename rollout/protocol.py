"""The contracts between engines, trainers and the co-training core.

An RL loop only ever sees `RolloutEngine` (generate, the last call's figures, the policy sync,
shutdown) and `Trajectory`; that is what lets the speculative engine, vLLM and the SGLang
backend drop in without the trainer noticing.

The co-training core (specrl.cotrain.SpecCoTrainer) needs two more things, and only these:
- a `DraftReceiver`: an engine that speculates with the draft it is given, takes fresh draft
  weights with a version (and says which version it holds), and reports acceptance per
  request in `Trajectory.spec`;
- a `FeatureSource`: something that computes the policy's hidden states anyway and hands the
  fused EAGLE-3 features over: the policy trainer's own log-prob forward (every RL pipeline has
  one), or an engine whose `generate(capture_features=True)` fills `Trajectory.features`
  (its `captures_features` is True).
An engine that also calls `step_hooks` after every step (`IdleWindows`) lends the rollout's
long tail to draft training.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence, runtime_checkable

import torch


MAX_NEW_TOKENS = 1 << 20  # bounds the KV cache an engine sizes from it


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        if not isinstance(self.temperature, (int, float)) or not (math.isfinite(self.temperature)
                                                                   and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.max_new_tokens <= MAX_NEW_TOKENS:
            raise ValueError(f"max_new_tokens must be in [1, {MAX_NEW_TOKENS}], got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def accept_length(accepted: int, verify_steps: int) -> float:
    """Tokens emitted per verify step: the accepted drafts plus the target's own token at each
    step, (accepted + verify_steps) / verify_steps; 0.0 when nothing was verified. The one
    reduction from engine counters to accept length (embedded engine, SGLang, slime, veRL)."""
    return (accepted + verify_steps) / verify_steps if verify_steps else 0.0


@dataclass
class SpecStats:
    """Acceptance statistics of one sequence (speculative engines only)."""

    verify_steps: int = 0
    drafted: int = 0  # draft tokens proposed (along the verified path)
    accepted: int = 0  # draft tokens accepted
    drafted_per_pos: list[int] = field(default_factory=list)  # index = draft depth
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def accept_length(self) -> float:
        """Tokens emitted per verify step (accepted drafts + the target's own token)."""
        return accept_length(self.accepted, self.verify_steps)

    def record(self, depth_drafted: int, n_accepted: int) -> None:
        need = depth_drafted
        for lst in (self.drafted_per_pos, self.accepted_per_pos):
            lst.extend([0] * (need - len(lst)))
        for d in range(depth_drafted):
            self.drafted_per_pos[d] += 1
            if d < n_accepted:
                self.accepted_per_pos[d] += 1
        self.verify_steps += 1
        self.drafted += depth_drafted
        self.accepted += n_accepted


def summarize_spec_stats(stats) -> dict:
    """Accept length, accept rate and per-position accept rate over many sequences' SpecStats."""
    stats = [s for s in stats if s is not None]
    verify = sum(s.verify_steps for s in stats)
    accepted = sum(s.accepted for s in stats)
    drafted = sum(s.drafted for s in stats)
    depth = max((len(s.drafted_per_pos) for s in stats), default=0)
    per_pos = []
    for d in range(depth):
        n = sum(s.drafted_per_pos[d] for s in stats if len(s.drafted_per_pos) > d)
        a = sum(s.accepted_per_pos[d] for s in stats if len(s.accepted_per_pos) > d)
        per_pos.append(a / n if n else 0.0)
    return {"accept_length": accept_length(accepted, verify),
            "accept_rate": accepted / drafted if drafted else 0.0,
            "accept_rate_per_pos": per_pos, "verify_steps": verify, "drafted": drafted}


def same_tokens(trajectories, others) -> bool:
    """Whether two generate() results emitted the same tokens, request by request: the
    losslessness check of every speculative arm against plain decoding."""
    return [t.token_ids for t in trajectories] == [t.token_ids for t in others]


@dataclass
class Trajectory:
    prompt_ids: list[int]
    token_ids: list[int]  # generated tokens, stop token included when one was hit
    logprobs: torch.Tensor  # (n,) float32 target log-prob of each generated token, log_softmax(logits / T)
    finish_reason: str  # "stop" or "length"
    request_id: int = 0
    # Fused EAGLE-3 target features at every position of prompt + response except the last,
    # (P + n - 1, 3H) in half precision; filled when capture was requested.
    features: torch.Tensor | None = None
    spec: SpecStats | None = None

    @property
    def full_ids(self) -> list[int]:
        return self.prompt_ids + self.token_ids


@runtime_checkable
class RolloutEngine(Protocol):
    # Figures of the last generate() call: "wall_s", "tokens", "tokens_per_s" from every engine;
    # "engine_steps" and "spec_faults" (draft faults absorbed in the call) where the engine counts them;
    # "spec_saved_s" (seconds speculation saved, estimated from measured plain steps) where it estimates it.
    last_stats: dict

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 request_ids: Sequence[int] | None = None, capture_features: bool = False) -> list[Trajectory]:
        """Generate one trajectory per prompt. request_ids key the sampling noise (see
        rollout.sampling), so a request's output does not depend on its batch neighbours."""

    def load_policy_weights(self, state_dict: dict) -> None:
        """Policy sync after a trainer step. Never touches draft weights."""

    def runs_in_place(self, module) -> bool:
        """Whether the engine decodes with this very module, so a trainer's update of it needs
        no `load_policy_weights` (the embedded engine sharing the trainer's policy)."""

    def shutdown(self) -> None:
        """Release what the engine started (worker processes, device memory); a no-op for an
        engine that started nothing."""


@runtime_checkable
class DraftReceiver(Protocol):
    """An engine the co-training core can speculate through (embedded, vLLM, SGLang)."""

    def install_draft(self, draft, spec, controller=None) -> None:
        """Speculate with `draft` (an Eagle3Draft; the engine keeps its own copy) under `spec`
        (rollout.speculative.SpecConfig) from the next generate() on. `controller` (optional,
        specrl.controller) picks plain or speculative decoding and the chain length per engine
        step; only an engine whose class attribute `takes_controller` is True accepts one. A
        draft that does not fit the policy raises ValueError with a one-line message."""

    def push_draft(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """Hot swap: fresh draft weights (SGLang names, no embedding) loaded in place. Never
        touches the policy; speculation stays lossless whatever the draft."""

    def draft_weights(self) -> tuple[dict[str, torch.Tensor], int]:
        """The draft weights the engine speculates with now (SGLang names) and their version."""

    @property
    def draft_version(self) -> int | None:
        """The version of the draft the engine speculates with (the last pushed; 0 after
        install_draft); None before any draft was installed."""

    @property
    def draft_faults(self) -> list[str]:
        """One line per draft-side failure the engine absorbed by falling back to plain decoding."""


@runtime_checkable
class FeatureSource(Protocol):
    """A forward over whole sequences (the trainer's log-prob pass) that can tap the policy."""

    def add_feature_hook(self, layer_ids: tuple[int, ...], hook: Callable) -> None:
        """Tap `layer_ids` in every later log-prob forward and call hook(input_ids, output,
        response_mask) with its output (target_training.model.ModelOutput, or any object with its
        `features(layer_ids)` and `logits`; logits None when the forward's are not whole, e.g.
        vocabulary-parallel, and the draft then trains on hard labels)."""


@runtime_checkable
class IdleWindows(Protocol):
    """An engine that calls hook(n_active, n_slots) after every step (the rollout's long tail)."""

    step_hooks: list
