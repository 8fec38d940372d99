"""The contracts between engines, trainers and the co-training core.

An RL loop only ever sees `RolloutEngine` (generate, the policy sync, shutdown), `Trajectory`
and `Rollout` (generate's result: the trajectories and `RolloutStats`, the call's figures); that
is what lets the speculative engine, vLLM and the SGLang backend drop in without the trainer
noticing.

The co-training core (specrl.cotrain.SpecCoTrainer) needs two more things, and only these:
- a `DraftReceiver`: an engine that speculates with the drafter it is given (one door:
  `install_draft(DrafterSpec)`, rollout.drafters), switches speculation on or off per call
  (`set_speculation`), takes fresh draft weights with a version (and says which version it
  holds), and reports acceptance per request in `Trajectory.spec`; what it can do beyond that is
  declared in its `capabilities` (`EngineCapabilities`), never probed;
- a `FeatureSource`: something that computes the policy's hidden states anyway and hands the
  fused EAGLE-3 features over: the policy trainer's own log-prob forward (every RL pipeline has
  one), or an engine whose `generate(capture_features=True)` fills `Trajectory.features`
  (`capabilities.captures_features`).
An engine with idle windows (`capabilities.idle_windows`) calls its `step_hooks` after every
step, which lends the rollout's long tail to draft training. An engine that takes a step policy
(`capabilities.step_policy`) asks it, at every engine step, whether to speculate and how deep,
and tells it what the step did (`StepPolicy`, `StepStats`).
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


class RequestIds:
    """The request ids of an engine's generate() calls. Sampling noise is keyed by (seed, request
    id, token index), so ids are what makes two calls draw the same samples or fresh ones: a call
    that passes none gets fresh ids from this counter (repeated calls on the same prompts draw
    fresh samples, as vLLM and HF do without a per-request seed), while a fresh engine replays
    the same sequence of calls. Pass ids to pin the samples (the RL loop passes step * batch + i)."""

    def __init__(self):
        self.next = 0

    def take(self, request_ids, n: int) -> list[int]:
        """The call's ids: the given ones, checked against the n prompts, or the next n fresh ones."""
        if request_ids is None:
            ids = list(range(self.next, self.next + n))
            self.next += n
            return ids
        ids = [int(r) for r in request_ids]
        if len(ids) != n:
            raise ValueError(f"got {len(ids)} request_ids for {n} prompts")
        return ids


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


def accept_length_ratio_interval(stats_a, stats_b, level: float = 0.95, n_boot: int = 2000,
                                 seed: int = 0) -> tuple[float, float, float]:
    """The ratio of two drafts' accept lengths on the same sequences, with its paired bootstrap
    interval: (ratio, low, high).

    `stats_a[i]` and `stats_b[i]` are the SpecStats of sequence i decoded by draft a and draft b
    (the same prompts, the same emitted tokens: a lossless pair of arms). The bootstrap resamples
    the n sequences with replacement, both arms together, `n_boot` times, and takes the central
    `level` percentile interval of accept_length(a) / accept_length(b); the spread is what a
    different draw of evaluation prompts would give. Resamples in which b verified nothing are
    dropped. An empty or all-zero input gives (nan, nan, nan)."""
    pairs = [(a, b) for a, b in zip(stats_a, stats_b, strict=True) if a is not None and b is not None]
    # (n, 4): accepted and verify steps of a, then of b
    x = torch.tensor([[a.accepted, a.verify_steps, b.accepted, b.verify_steps] for a, b in pairs],
                     dtype=torch.float64).reshape(-1, 4)
    total = x.sum(dim=0)
    if not (total[1] > 0 and total[3] > 0):
        return float("nan"), float("nan"), float("nan")
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(pairs), (n_boot, len(pairs)), generator=g)  # (n_boot, n)
    s = x[idx].sum(dim=1)  # (n_boot, 4)
    keep = (s[:, 1] > 0) & (s[:, 3] > 0)
    s = s[keep]
    boot = ((s[:, 0] + s[:, 1]) / s[:, 1]) / ((s[:, 2] + s[:, 3]) / s[:, 3])
    tail = (1.0 - level) / 2
    lo, hi = torch.quantile(boot, torch.tensor([tail, 1.0 - tail], dtype=torch.float64)).tolist()
    ratio = accept_length(int(total[0]), int(total[1])) / accept_length(int(total[2]), int(total[3]))
    return ratio, lo, hi


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


@dataclass
class RolloutStats:
    """The figures of one generate() call, carried by the `Rollout` it describes (every engine
    fills wall_s and tokens; the rest where the engine counts it, None elsewhere)."""

    wall_s: float  # the call's wall time
    tokens: int  # tokens generated
    speculated: bool = False  # the call ran with its drafter (set_speculation on and a drafter installed)
    hook_s: float = 0.0  # of wall_s, the time spent in step hooks (co-located draft training in the tail)
    engine_steps: int | None = None  # target forwards that decoded (plain or verify)
    spec_steps: int | None = None  # of them, the speculative ones
    full_batch_s: float | None = None  # wall time of the steps at the full batch
    tail_s: float | None = None  # and of the long tail's smaller ones
    spec_faults: int = 0  # draft-side faults absorbed in the call (it then decoded plainly)
    spec_saved_s: float | None = None  # seconds speculation saved: plain decoding of the same tokens, priced (SpecSession.settle)
    temperature: float | None = None  # the call's sampling temperature (0: greedy); None where not reported

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.wall_s, 1e-9)

    @property
    def rollout_s(self) -> float:
        """The rollout's own time: the wall time less what the step hooks ran inside it."""
        return self.wall_s - self.hook_s


class Rollout(list):
    """What generate() returns: the trajectories, one per prompt in prompt order (a list), and
    `stats`, the call's figures (None for a list built outside an engine)."""

    def __init__(self, trajectories=(), stats: RolloutStats | None = None):
        super().__init__(trajectories)
        self.stats = stats


@dataclass
class StepStats:
    """One engine step, as the engine reports it to its step policy."""

    n_active: int  # sequences the step decoded
    seconds: float | None = None  # its wall time; None where new prompts' prefill rode along in it
    context: float | None = None  # mean cached tokens per sequence before the step
    gamma: int = 0  # tokens drafted along a path; 0 for a plain step
    tokens_per_seq: float = 1.0  # tokens emitted per sequence
    accepted: int = 0  # draft tokens accepted, over the rows
    drafted: int = 0  # draft tokens verified, over the rows


@runtime_checkable
class StepPolicy(Protocol):
    """Per engine step: speculate or not, how deep, and how wide (specrl.controller.
    SpeculationController is the adaptive one)."""

    def should_speculate(self, n_active: int) -> bool:
        """Whether the next step over n_active sequences speculates."""

    def gamma_for_step(self) -> int:
        """The chain length (or tree depth) of the step just decided to speculate."""

    def exploited(self, n_active: int) -> int | None:
        """The chain it plays at this batch size once settled (0: plain decoding), None while it
        still explores: the engine sizes a step's fused forward from it before the decision."""

    def max_depth(self) -> int:
        """The deepest chain it may ask for (the engine sizes its caches from it)."""

    def plain_seconds(self, n_active: int) -> float | None:
        """Measured seconds of a plain step of this batch size (None before any)."""

    def observe(self, stats: StepStats) -> None:
        """What a step did."""


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can do beyond generating, declared by its class."""

    drafters: tuple[str, ...] = ()  # DrafterSpec methods install_draft takes (rollout.drafters.METHODS)
    step_policy: bool = False  # install_draft(..., policy=StepPolicy): speculation decided per engine step
    switch: str | None = None  # what set_speculation costs: "free", "restart" (a restart without the drafter), None: no switch
    captures_features: bool = False  # generate(capture_features=True) fills Trajectory.features
    idle_windows: bool = False  # step_hooks are called after every engine step
    # how sampled (temperature > 0) drafts are accepted: "rejection" (speculative sampling: vLLM,
    # SGLang, the embedded engine's "rng" mode) or "coupled" (draft and target draw with the same
    # Gumbel noise; the embedded engine's default). A draft's held-out acceptance is read under it.
    acceptance: str = "rejection"

    def __post_init__(self) -> None:
        if self.acceptance not in ("rejection", "coupled"):
            raise ValueError(f"EngineCapabilities.acceptance must be 'rejection' or 'coupled', got {self.acceptance!r}")


@runtime_checkable
class RolloutEngine(Protocol):
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 request_ids: Sequence[int] | None = None, capture_features: bool = False) -> Rollout:
        """Generate one trajectory per prompt. request_ids key the sampling noise (see
        rollout.sampling), so a request's output does not depend on its batch neighbours; without
        them the engine draws fresh ones (`RequestIds`)."""

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

    capabilities: EngineCapabilities

    def install_draft(self, drafter, policy: StepPolicy | None = None) -> None:
        """Speculate with `drafter` (rollout.drafters.DrafterSpec; the engine keeps its own copy
        of a draft model) from the next generate() on, speculation switched on. `policy`
        decides per engine step (only where `capabilities.step_policy`). A drafter the engine
        does not take, or a draft that does not fit the policy, raises ValueError in one line."""

    def set_speculation(self, on: bool) -> None:
        """Speculate in the next generate() calls or decode plainly, without the drafter (what
        that costs: `capabilities.switch`). A drafter must be installed to switch it on."""

    @property
    def speculating(self) -> bool:
        """Whether the next generate() call speculates (a drafter installed, the switch on)."""

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


