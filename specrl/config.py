"""Every knob of speculative co-training, in one place.

`CoTrainConfig` is what `SpecCoTrainer` takes; it holds the online trainer's settings
(`OnlineDraftConfig`), the scheduler's (`SchedulerConfig`, with the per-step update count of
`DraftBudgetConfig`) and the adaptive controller's (`ControllerConfig`). `DraftTrainConfig` sets
the offline starting draft. Each field is documented where it is declared; modes are `Literal`
types, checked when the config is built (a bad value fails with one line naming the field).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, get_args

from rollout.drafters import SpecConfig
from rollout.drafters.history import HistoryConfig
from target_training.config import require_positive
from target_training.grpo import COMPUTE_DTYPES

Mode = Literal["off", "frozen", "online"]
FeatureSource = Literal["trainer", "engine", "both"]
Window = Literal["tail", "between", "interleaved", "wait"]
SchedulerMode = Literal["sequential", "overlap"]
OverlapUntil = Literal["step", "rollout"]
BudgetRule = Literal["fixed", "acceptance", "value"]
Drafter = Literal["eagle3", "history", "hybrid"]

WINDOWS: tuple[str, ...] = get_args(Window)


def _check_choice(cfg, name: str, kind) -> None:
    value, choices = getattr(cfg, name), get_args(kind)
    if value not in choices:
        raise ValueError(f"{type(cfg).__name__}.{name} must be one of {choices}, got {value!r}")


# ---------------------------------------------------------------------- the offline starting draft
@dataclass
class DraftTrainConfig:
    """The offline EAGLE-3 draft trained on the SFT policy's own rollouts (specrl.drafts)."""

    n_sequences: int = 1024
    """Rollouts sampled from the policy as training data."""
    steps: int = 300
    """AdamW steps of offline training."""
    lr: float = 3e-3
    """Peak learning rate (after a 20-step linear warm-up)."""
    batch_size: int = 32
    """Sequences per step."""
    draft_vocab_size: int = 48
    """Tokens of the draft's vocabulary (the most frequent in the rollouts, plus the special ones)."""
    ttt_steps: int = 4
    """Training-time-test steps: draft positions unrolled per sequence in the loss."""
    temperature: float = 1.0
    """Sampling temperature of the training rollouts."""
    max_new_tokens: int = 64
    """Length cap of the training rollouts."""
    seed: int = 0
    """Seeds the rollouts, the draft's initialisation and the batch order."""

    def __post_init__(self) -> None:
        require_positive(self, ("n_sequences", "steps", "batch_size", "draft_vocab_size", "ttt_steps",
                                "max_new_tokens", "lr"))


# ---------------------------------------------------------------------- the online trainer
@dataclass
class OnlineDraftConfig:
    """The online draft trainer (specrl.online_trainer): AdamW on TTT loss over buffer records."""

    lr: float = 1e-3
    """AdamW learning rate."""
    batch_size: int = 16
    """Buffer records per update (the memory budget may shrink it)."""
    ttt_steps: int | None = None
    """Training-time-test steps; None: the draft config's ttt_steps."""
    acceptance_weight: float = 0.0
    """> 0 adds ttt_loss's expected-acceptance term."""
    max_grad_norm: float = 1.0
    """Gradient-norm clipping."""
    prefer_rejected: float = 0.5
    """Share of each batch drawn from records with rejected draft tokens (FeatureBuffer.sample)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up over the first updates: a fresh AdamW's first steps are
    sign-like (size ~lr on every weight) and would knock a well-trained starting draft off its
    optimum."""
    snapshot_every: int = 8
    """Updates between copies of the last finite weights (what a rollback restores)."""
    compute_dtype: str = "fp32"
    """The update's forward and backward: "fp32", "bf16" (autocast; the weights and AdamW stay
    fp32) or "auto" (bf16 where the device computes it natively, as GRPOConfig.compute_dtype).
    Held-out measurements and the engine's draft stay in the draft's own dtype."""

    MAX_BATCH_SIZE = 1 << 16  # records per update; more would not fit any device (checked before collate)

    def __post_init__(self) -> None:
        def bad(name: str, why: str):
            raise ValueError(f"OnlineDraftConfig.{name} {why}, got {getattr(self, name)!r}")

        for name in ("lr", "max_grad_norm"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not (v > 0 and math.isfinite(v)):
                bad(name, "must be a positive finite number")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size <= 0:
            bad("batch_size", "must be a positive integer")
        if self.batch_size > self.MAX_BATCH_SIZE:
            bad("batch_size", f"must be at most {self.MAX_BATCH_SIZE}")
        if isinstance(self.snapshot_every, bool) or not isinstance(self.snapshot_every, int) or self.snapshot_every <= 0:
            bad("snapshot_every", "must be a positive integer")
        if self.ttt_steps is not None and (isinstance(self.ttt_steps, bool) or not isinstance(self.ttt_steps, int)
                                           or self.ttt_steps <= 0):
            bad("ttt_steps", "must be None or a positive integer")
        for name in ("acceptance_weight", "weight_decay"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not (v >= 0 and math.isfinite(v)):
                bad(name, "must be a non-negative finite number")
        if not isinstance(self.prefer_rejected, (int, float)) or not 0.0 <= self.prefer_rejected <= 1.0:
            bad("prefer_rejected", "must lie in [0, 1]")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            bad("warmup_steps", "must be a non-negative integer")
        if self.compute_dtype not in COMPUTE_DTYPES:
            bad("compute_dtype", f"must be one of {COMPUTE_DTYPES}")


# ---------------------------------------------------------------------- updates per RL step
@dataclass
class DraftBudgetConfig:
    """How many draft updates an RL step gets, and the collapse alarm (specrl.draft_budget, whose
    docstring states the rule)."""

    rule: BudgetRule = "fixed"
    """"fixed": the cap (CoTrainConfig.max_draft_steps) every step; "acceptance": more updates
    when acceptance falls below its best or the policy moves; "value": updates while the rollout
    seconds their measured held-out gain saves over `horizon` rollouts exceed their measured cost
    (needs the held-out slice, CoTrainConfig.heldout_every > 0)."""
    min_steps: int = 0
    """Floor, used when steady."""
    base_steps: int = 1
    """Updates per step while acceptance holds but is not yet steady."""
    falling_steps: int = 1
    """Extra updates when the newest rollout is below the trend."""
    deficit_gain: float = 40.0
    """Extra updates per unit of relative accept-length deficit."""
    kl_gain: float = 0.0
    """Extra updates per unit of reported policy KL (0: ignore KL)."""
    kl_steady: float = 0.05
    """A KL below this counts as a policy at rest."""
    tolerance: float = 0.02
    """Relative deficit treated as noise."""
    ema: float = 0.5
    """Weight of the newest accept length in its EMA."""
    best_forget: float = 0.05
    """Per step, the running best moves this fraction of the way to the EMA."""
    idle_after: int = 3
    """Steady steps in a row before dropping to min_steps."""
    saving_share: float | None = None
    """Price draft updates by what speculation saves: draft training may spend at most this
    share of the rollout seconds that speculation saves at its best (the engine's estimate,
    `RolloutStats.spec_saved_s`), kept as a running credit (specrl.draft_budget). None: the
    count rule alone decides. Needs an engine that estimates its saving (the embedded engine
    under the adaptive controller); elsewhere the count rule alone decides."""
    horizon: int = 10
    """Rule "value": the rollouts over which a held-out gain is valued (the draft is retrained or
    goes stale within about this many steps)."""
    gain_z: float = 0.0
    """Rule "value": the held-out gain counted for a trained candidate is the measured one less
    this many of its standard errors (paired over the held-out sequences,
    draft_models.ttt.paired_gain), so a gain the slice cannot tell from noise buys no updates
    (0: the measured gain)."""
    max_share: float | None = None
    """Hard cap: draft training, held-out measurement and feature capture take at most this share
    of the RL step's wall time over any `share_window` steps (None: no cap)."""
    share_window: int = 10
    """Steps over which `max_share` holds."""
    collapse_accept_length: float = 1.05
    """An accept length at or below this with speculation on counts as a collapse."""
    collapse_patience: int = 2
    """Collapsed rollouts in a row before the alarm."""

    def __post_init__(self) -> None:
        _check_choice(self, "rule", BudgetRule)
        for name in ("min_steps", "base_steps", "falling_steps", "idle_after"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"DraftBudgetConfig.{name} must be a non-negative integer, got {v!r}")
        for name in ("deficit_gain", "kl_gain", "kl_steady", "tolerance", "best_forget", "gain_z"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"DraftBudgetConfig.{name} must be a non-negative finite number, got {v!r}")
        if not 0.0 < self.ema <= 1.0:
            raise ValueError(f"DraftBudgetConfig.ema must be in (0, 1], got {self.ema}")
        if not 0.0 <= self.best_forget <= 1.0:
            raise ValueError(f"DraftBudgetConfig.best_forget must be in [0, 1], got {self.best_forget}")
        if self.saving_share is not None and not (isinstance(self.saving_share, (int, float)) and
                                                  0.0 < self.saving_share <= 1.0):
            raise ValueError(f"DraftBudgetConfig.saving_share must be None or in (0, 1], got {self.saving_share!r}")
        for name in ("horizon", "share_window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"DraftBudgetConfig.{name} must be a positive integer, got {v!r}")
        if self.max_share is not None and not (isinstance(self.max_share, (int, float)) and 0.0 < self.max_share < 1.0):
            raise ValueError(f"DraftBudgetConfig.max_share must be None or in (0, 1), got {self.max_share!r}")
        if self.rule == "value" and self.saving_share is not None:
            raise ValueError("DraftBudgetConfig: rule 'value' prices updates by their held-out gain; leave saving_share None")
        if self.collapse_accept_length < 1.0:
            raise ValueError(f"DraftBudgetConfig.collapse_accept_length must be >= 1, got {self.collapse_accept_length}")
        if self.collapse_patience < 1:
            raise ValueError(f"DraftBudgetConfig.collapse_patience must be >= 1, got {self.collapse_patience}")


# ---------------------------------------------------------------------- when the draft trains
@dataclass
class SchedulerConfig:
    """When and how long the draft trains on the shared device (specrl.scheduler, whose docstring
    describes the windows and the overlap mode)."""

    budget_fraction: float = 0.05
    """Draft time per RL step, as a fraction of the RL step's own time."""
    min_budget_s: float = 0.0
    """Lower clamp of the per-step time budget (seconds)."""
    max_budget_s: float | None = None
    """Upper clamp of the per-step time budget (seconds); None: none."""
    tail_threshold: float = 0.25
    """"tail" window: opens once n_active / n_slots is at most this."""
    memory_budget_bytes: int | None = None
    """Bound on the draft side's resident bytes (weights, gradients, optimizer, buffer, one
    update's activations); None: `memory_budget_share` of the device's memory."""
    memory_budget_share: float | None = 0.1
    """Where memory_budget_bytes is None, the bound as a share of the memory of the device the
    draft trains on (CUDA: the device's total memory; CPU: the machine's physical memory). None
    (with memory_budget_bytes None): no limit."""
    windows: tuple[Window, ...] = ("tail", "between")
    """The enabled windows, a subset of WINDOWS."""
    ema: float = 0.3
    """Weight of the newest RL step in the step-time EMA."""
    draft_steps: DraftBudgetConfig = field(default_factory=DraftBudgetConfig)
    """How many updates a step may run (the cap is CoTrainConfig.max_draft_steps)."""
    mode: SchedulerMode = "sequential"
    """"sequential": the windows, on the RL loop's thread; "overlap": one burst per RL step runs
    on its own thread / CUDA stream while the next step runs, swapped in at the step boundary
    (specrl.overlap)."""
    overlap_threads: int = 1
    """Overlap: intra-op threads of the burst's thread (CPU)."""
    overlap_until: OverlapUntil = "step"
    """Overlap: how long a burst may run. "step": until the next step boundary (under the rollout
    and the policy update); "rollout": it is collected when the rollout ends
    (SpecCoTrainer.on_rollout), so the policy update, which keeps every core busy, runs alone."""
    rollout_threads: int | None = None
    """Overlap: the RL loop's own intra-op threads while a burst runs (None: unchanged). On a CPU,
    1 leaves a core to the burst: small-batch decoding gains little from a second thread
    (specrl bench overlap --phases)."""

    def __post_init__(self) -> None:
        if isinstance(self.windows, str):
            raise ValueError(f"SchedulerConfig.windows must be a tuple of names, got the string {self.windows!r}")
        self.windows = tuple(self.windows)
        bad = [w for w in self.windows if w not in WINDOWS]
        checks = [
            (0.0 <= self.budget_fraction <= 1.0, f"budget_fraction must be in [0, 1], got {self.budget_fraction}"),
            (self.min_budget_s >= 0.0, f"min_budget_s must be >= 0, got {self.min_budget_s}"),
            (self.max_budget_s is None or self.max_budget_s >= self.min_budget_s,
             f"max_budget_s must be None or >= min_budget_s, got {self.max_budget_s} < {self.min_budget_s}"),
            (0.0 < self.tail_threshold <= 1.0, f"tail_threshold must be in (0, 1], got {self.tail_threshold}"),
            (self.memory_budget_bytes is None or self.memory_budget_bytes > 0,
             f"memory_budget_bytes must be None or positive, got {self.memory_budget_bytes}"),
            (self.memory_budget_share is None or 0.0 < self.memory_budget_share <= 1.0,
             f"memory_budget_share must be None or in (0, 1], got {self.memory_budget_share}"),
            (not bad, f"windows must be among {WINDOWS}, got {bad}"),
            (0.0 < self.ema <= 1.0, f"ema must be in (0, 1], got {self.ema}"),
            (isinstance(self.overlap_threads, int) and self.overlap_threads > 0,
             f"overlap_threads must be a positive integer, got {self.overlap_threads!r}"),
            (self.rollout_threads is None or (isinstance(self.rollout_threads, int)
                                              and not isinstance(self.rollout_threads, bool) and self.rollout_threads > 0),
             f"rollout_threads must be None or a positive integer, got {self.rollout_threads!r}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"SchedulerConfig.{msg}")
        _check_choice(self, "mode", SchedulerMode)
        _check_choice(self, "overlap_until", OverlapUntil)


# ---------------------------------------------------------------------- adaptive speculation
@dataclass
class ControllerConfig:
    """The adaptive speculation controller (specrl.controller): speculate or not, and how far,
    per batch size, from measured step times."""

    gammas: tuple = (1, 2, 3, 4, 6)
    """Candidate chain lengths (tree budgets in tree mode)."""
    margin: float = 1.05
    """Speculate only if its estimated throughput is at least margin times plain decoding's."""
    ema: float = 0.2
    """EMA weight of a new measurement (a running mean until 1/ema samples)."""
    explore_every: int = 50
    """Re-measure one non-chosen arm this many decisions after the decision last changed (0: never)."""
    explore_backoff: int = 8
    """Each re-measurement that leaves a bucket's decision unchanged doubles its wait for the next,
    up to this many times explore_every."""
    min_samples: int = 3
    """Samples per arm before exploiting."""
    batch_buckets: tuple = (1, 2, 4, 8, 16, 32, 64)
    """Batch-size buckets (n_active rounded up), each with its own estimates."""
    alpha_tokens: int = 16
    """Drafted tokens one observation needs to move alpha by a full `ema`."""
    bucket_alpha: bool = True
    """Each batch-size bucket estimates its chains' accept lengths from its own per-token
    acceptance (shrunk toward the shared one while it has drafted few tokens); False: from the
    one acceptance all buckets share, which a rollout's tail pulls down before the next
    rollout's full batch reads it (`bench rl`'s `-shared` arms measure the difference)."""
    run_rollouts: int = 3
    """Rollouts timed speculating, then as many decoding plainly (each beside a speculating one
    where `run_paired`), before the run keeps the faster (specrl.run_choice.RunChoice): above
    the per-step controller on the embedded engine, instead of it on vLLM 0.32, which cannot
    switch its drafter off step by step; 0: no such choice."""
    run_warmup: int = 3
    """Rollouts played but not timed at the start of each of those blocks on vLLM (after its
    restart), of the first block only on the embedded engine (while its per-step controller
    explores)."""
    run_recheck: int = 10
    """Embedded engine: rollouts after a run choice before the other arm is timed again, doubling
    while the choice holds (up to 8x); 0: the first choice is final (always so on vLLM). A loop that
    passes the steps left (SpecCoTrainer.begin_step) gets no re-check within the run's last
    rollouts, where its choice could not pay back its block."""
    run_sure: float = 1.25
    """Embedded engine: keep speculating without timing plain rollouts while the per-step
    controller estimates each timed speculating rollout at least this much faster than plain."""
    run_paired: bool = True
    """Embedded engine: time the arm not chosen in pairs, each of its rollouts next to one of the
    chosen arm, and choose on the median of the pairs' ratios (RunChoice `paired`): a slow spell
    of the machine then slows both halves of a pair, where over one block it reads as that arm's
    speed. False: one block of each arm, compared by their medians. Engines whose switch is a
    restart (vLLM) time blocks either way."""

    def __post_init__(self) -> None:
        self.gammas = tuple(int(g) for g in self.gammas)
        self.batch_buckets = tuple(int(b) for b in self.batch_buckets)
        if not self.gammas or min(self.gammas) < 1 or len(set(self.gammas)) != len(self.gammas):
            raise ValueError(f"ControllerConfig.gammas must be distinct positive ints, got {self.gammas}")
        if not self.margin >= 1.0:
            raise ValueError(f"ControllerConfig.margin must be >= 1.0, got {self.margin}")
        if not 0.0 < self.ema <= 1.0:
            raise ValueError(f"ControllerConfig.ema must be in (0, 1], got {self.ema}")
        for name, low in (("explore_every", 0), ("explore_backoff", 1), ("min_samples", 1), ("alpha_tokens", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"ControllerConfig.{name} must be >= {low}, got {getattr(self, name)}")
        if self.run_recheck < 0 or not self.run_sure >= 1.0:
            raise ValueError(f"ControllerConfig.run_recheck must be >= 0 and run_sure >= 1, "
                             f"got {self.run_recheck}, {self.run_sure}")
        if self.run_rollouts < 0 or self.run_warmup < 1:
            raise ValueError(f"ControllerConfig.run_rollouts must be >= 0 and run_warmup >= 1, "
                             f"got {self.run_rollouts}, {self.run_warmup}")
        b = self.batch_buckets
        if not b or b[0] < 1 or any(x >= y for x, y in zip(b, b[1:])):
            raise ValueError(f"ControllerConfig.batch_buckets must be increasing positive ints, got {b}")


# ---------------------------------------------------------------------- the plug-in
@dataclass
class CoTrainConfig:
    """The co-training plug-in (specrl.cotrain.SpecCoTrainer)."""

    mode: Mode = "online"
    """"off": attach nothing (the host loop runs as without specrl); "frozen": speculate with the
    starting draft; "online": also train it."""
    spec: SpecConfig = field(default_factory=SpecConfig)
    """Speculation in the engine: chain or tree, and how many draft tokens."""
    drafter: Drafter = "eagle3"
    """Who drafts: the EAGLE-3 head; "history": drafts from the in-flight siblings of a prompt's
    group and from earlier answers to it (rollout.drafters.history: no model, nothing to train; mode
    "frozen"); "hybrid": per row and step, whichever of the two promises more accepted tokens
    (the EAGLE-3 head trains online as usual). history and hybrid draft chains, on the embedded
    engine."""
    history: HistoryConfig = field(default_factory=HistoryConfig)
    """The history drafter's settings (drafter "history" or "hybrid")."""
    adaptive: bool = False
    """Let a SpeculationController pick plain decoding or a gamma per batch size."""
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    """The controller's settings (with `adaptive`)."""
    feature_source: FeatureSource = "trainer"
    """Where the buffer's target features come from: the trainer's log-prob forward, an engine
    that captures them, or both."""
    buffer_bytes: int = 64 << 20
    """Size of the feature buffer."""
    online: OnlineDraftConfig = field(default_factory=OnlineDraftConfig)
    """The online trainer's settings."""
    recent_versions: int = 0
    """Train on features of the last N policy versions only (0: all)."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """When and how long the draft trains."""
    max_draft_steps: int = 64
    """Cap on draft updates per RL step, across windows."""
    min_buffer_records: int = 8
    """Records the buffer must hold before the draft trains (the held-out answers not counted)."""
    seed: int = 0
    """Seeds the buffer's sampling."""
    heldout_every: int = 8
    """One prompt in N is held out (0: none), chosen by a hash of its tokens: no draft trains on any
    answer to it, from the trainer's forward or the engine's features, in any epoch, so the held-out
    answers measure what the coming rollouts' new prompts will see, not what the draft remembers of
    a GRPO group whose sibling answers it trained on. The trainer's forward captures the held-out
    answers (heldout_per_prompt of each); the newest `heldout_records` of them measure drafts: the
    serving draft's expected accept length each step (also in "frozen" mode, which then captures
    these sequences only), the swap gate and the "value" budget rule
    (draft_models.ttt.expected_accept_length), at the rollouts' sampling temperature."""
    heldout_records: int = 16
    """Held-out sequences kept (the newest)."""
    heldout_per_prompt: int = 2
    """Answers kept per held-out prompt and policy version (the rest of its group is dropped):
    the held-out sequences then span more prompts, the unit the measurement's noise comes from."""
    heldout_idle_share: float = 0.01
    """While the serving draft neither serves (plain decoding chosen) nor trains (no update this
    step), measuring it is worth little: it only watches for a fall that would restart training or
    a rise that would re-time speculation. It then runs every k-th step, k the smallest that keeps
    the last measurement's seconds within this share of the RL step (1.0: every step)."""
    train_every: int = 1
    """Draft updates run at every Nth RL step's boundary only (steps 0, N, 2N, ...), as one burst that
    is gated and swapped once: the updates the budget grants the steps in between join that burst
    (the budget's hard cap still bounds it over its window), the burst samples the policy versions
    since the last one (at least `recent_versions` of them), and the serving draft is measured on
    held-out sequences at those boundaries only. The held-out measurement and the gate cost about
    half an update each time they run; at N > 1 they are paid once per N steps, so the same share of
    the step buys more updates, each served up to N - 1 steps later (the field trains its drafters
    every 5 to 10 RL steps). Sequential scheduler mode only."""
    gate_tolerance: float = 0.0
    """Swap gate: a trained draft replaces the serving one only if its held-out expected accept
    length is at least (1 - gate_tolerance) times the serving draft's, measured on the same
    held-out sequences; else it is refused, counted, and training goes on from the serving draft."""
    gate_floor: bool = True
    """The swap gate measures the starting draft too, on the same held-out sequences, and keeps it
    as a floor: a candidate must clear it as well, and where the serving draft has fallen below
    it, a refused candidate hands the engine back the starting draft, from which training goes on.
    Small steps the gate passed one by one against the serving draft cannot add up to a draft
    worse than the one the run started with, on the newest data. It costs one more draft forward
    over the new held-out sequences per gate (the starting draft's weights never change, so each
    sequence is measured once). The starting draft is the one the co-trainer was built with, also
    on resume."""

    def __post_init__(self) -> None:
        _check_choice(self, "mode", Mode)
        _check_choice(self, "feature_source", FeatureSource)
        _check_choice(self, "drafter", Drafter)
        if self.drafter != "eagle3" and self.spec.mode != "chain":
            raise ValueError(f"CoTrainConfig.drafter={self.drafter!r} drafts chains; got spec.mode={self.spec.mode!r}")
        if self.drafter == "history" and self.mode == "online":
            raise ValueError("CoTrainConfig.drafter='history' has no draft to train: use mode='frozen', "
                             "or drafter='hybrid' to train the EAGLE-3 head beside it")
        for name in ("buffer_bytes", "min_buffer_records"):
            if getattr(self, name) <= 0:
                raise ValueError(f"CoTrainConfig.{name} must be positive, got {getattr(self, name)}")
        if self.scheduler.draft_steps.rule == "value" and not self.heldout_every:
            raise ValueError("the 'value' budget rule measures drafts on held-out sequences: CoTrainConfig.heldout_every "
                             "must be > 0")
        if not 0.0 < self.heldout_idle_share <= 1.0:
            raise ValueError(f"CoTrainConfig.heldout_idle_share must be in (0, 1], got {self.heldout_idle_share}")
        if not 0.0 <= self.gate_tolerance < 1.0:
            raise ValueError(f"CoTrainConfig.gate_tolerance must be in [0, 1), got {self.gate_tolerance}")
        if self.train_every < 1:
            raise ValueError(f"CoTrainConfig.train_every must be >= 1, got {self.train_every}")
        if self.train_every > 1 and self.scheduler.mode != "sequential":
            raise ValueError(f"CoTrainConfig.train_every={self.train_every} trains in bursts at step boundaries: it needs "
                             f"scheduler.mode='sequential', got {self.scheduler.mode!r}")
        for name in ("max_draft_steps", "recent_versions", "heldout_every", "heldout_records"):
            if getattr(self, name) < 0:
                raise ValueError(f"CoTrainConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.heldout_per_prompt < 1:
            raise ValueError(f"CoTrainConfig.heldout_per_prompt must be >= 1, got {self.heldout_per_prompt}")
