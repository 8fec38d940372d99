"""The public plug-in: online speculative-decoding co-training in a few lines of an RL loop.

    cotrain = SpecCoTrainer(draft, CoTrainConfig(mode="online"))
    cotrain.attach(engine, trainer)           # speculation in the engine, feature hook in the trainer
    for step in ...:
        cotrain.begin_step()
        trajs = engine.generate(...)          # speculative, lossless; long tail trains the draft
        cotrain.on_rollout(trajs)             # acceptance statistics (+ engine-side features)
        trainer.step(...)                     # its log-prob forward feeds the feature buffer
        cotrain.on_policy_update()            # the policy moved: version += 1
        cotrain.train_draft()                 # idle window between steps; hot-swaps fresh weights
        log(cotrain.metrics())

The core drives the engine only through rollout.protocol.DraftReceiver (install a draft, push
fresh weights with a version, read acceptance from Trajectory.spec) and takes features from a
rollout.protocol.FeatureSource (the trainer's log-prob forward) or from an engine that captures
them; so the embedded engine and vLLM plug in the same way.

Modes: "off" attaches nothing (the host loop runs exactly as without specrl), "frozen"
speculates with the starting draft, "online" also trains it. Every draft-side failure is
caught, logged and counted: speculation falls back to plain decoding; the RL run goes on.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import torch

from rollout.protocol import DraftReceiver, FeatureSource, IdleWindows, summarize_spec_stats
from rollout.speculative import SpecConfig
from specrl.buffer import FeatureBuffer
from specrl.controller import ControllerConfig, SpeculationController
from specrl.online_trainer import OnlineDraftConfig, OnlineDraftTrainer
from specrl.scheduler import DraftScheduler, SchedulerConfig

MODES = ("off", "frozen", "online")
SOURCES = ("trainer", "engine", "both")


@dataclass
class CoTrainConfig:
    mode: str = "online"
    spec: SpecConfig = field(default_factory=SpecConfig)
    adaptive: bool = False  # let a SpeculationController pick plain/gamma per batch size
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    feature_source: str = "trainer"  # where the buffer's features come from
    buffer_bytes: int = 64 << 20
    online: OnlineDraftConfig = field(default_factory=OnlineDraftConfig)
    recent_versions: int = 0  # train on features of the last N policy versions only (0: all)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_draft_steps: int = 64  # per RL step, across windows
    min_buffer_records: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"CoTrainConfig.mode must be one of {MODES}, got {self.mode!r}")
        if self.feature_source not in SOURCES:
            raise ValueError(f"CoTrainConfig.feature_source must be one of {SOURCES}, got {self.feature_source!r}")
        if self.buffer_bytes <= 0 or self.max_draft_steps < 0 or self.min_buffer_records <= 0 or self.recent_versions < 0:
            raise ValueError("CoTrainConfig: buffer_bytes and min_buffer_records must be positive, max_draft_steps >= 0")


class SpecCoTrainer:
    def __init__(self, draft, config: CoTrainConfig | None = None):
        self.config = cfg = config or CoTrainConfig()
        self.policy_version = 0
        self.engine = None
        self.trainer = None
        self.controller = None
        self.draft_trainer = None
        self.faults = 0
        self._step_metrics: dict = {}
        self._rollout_metrics: dict = {}
        self._train_metrics: list[dict] = []  # draft-training results of the current RL step
        self._t_step = time.perf_counter()
        self._sync_s = 0.0
        self._capture_s0 = 0.0
        if cfg.mode == "off":
            return
        # the engine speculates with its own copy; the trainer's copy is pushed when it improves
        self.controller = SpeculationController(cfg.controller) if cfg.adaptive else None
        self.draft = draft
        self.buffer = FeatureBuffer(cfg.buffer_bytes, seed=cfg.seed)
        self.draft_trainer = OnlineDraftTrainer(draft, cfg.online) if cfg.mode == "online" else None
        self.scheduler = DraftScheduler(cfg.scheduler, on_error=self._on_draft_error)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self._draft_steps_this_rl_step = 0

    # -- wiring ---------------------------------------------------------------------------
    def attach(self, engine, trainer=None) -> "SpecCoTrainer":
        """Speculate in `engine` (a DraftReceiver); with an online draft and a trainer (a
        FeatureSource), capture features in the trainer's log-prob forward (no extra forward) and,
        where the engine has idle windows, train in the rollout's long tail."""
        self.engine, self.trainer = engine, trainer
        if self.config.mode == "off":
            return self
        if not isinstance(engine, DraftReceiver):
            raise TypeError(f"{type(engine).__name__} cannot speculate (it is not a rollout.protocol.DraftReceiver)")
        engine.install_draft(self.draft, self.config.spec, controller=self.controller)
        if self.draft_trainer is None:
            return self
        source = self.config.feature_source
        if source in ("engine", "both") and not getattr(engine, "captures_features", False):
            raise ValueError(f"feature_source={source!r}: {type(engine).__name__} does not capture features; "
                             f"use feature_source='trainer'")
        if trainer is not None and source in ("trainer", "both"):
            if not isinstance(trainer, FeatureSource):
                raise TypeError(f"{type(trainer).__name__} is not a rollout.protocol.FeatureSource")
            layer_ids = tuple(self.draft.cfg.aux_layer_ids)  # = the policy's taps (install_draft checks)
            trainer.add_feature_hook(layer_ids, self.buffer.logprob_hook(layer_ids, self.draft.d2t,
                                                                         lambda: self.policy_version))
        if "tail" in self.config.scheduler.windows and isinstance(engine, IdleWindows):
            engine.step_hooks.append(self._tail_hook)
        return self

    @property
    def speculator(self):
        """The embedded engine's Speculator (tests and experiments that inspect its draft)."""
        return getattr(self.engine, "speculator", None) if self.enabled else None

    @property
    def enabled(self) -> bool:
        return self.config.mode != "off"

    @property
    def capture_engine_features(self) -> bool:
        """Pass as generate(capture_features=...) when the engine is a feature source."""
        return self.config.mode == "online" and self.config.feature_source in ("engine", "both")

    # -- RL loop hooks --------------------------------------------------------------------
    def begin_step(self) -> None:
        if not self.enabled:
            return
        self.scheduler.begin_step()
        self._draft_steps_this_rl_step = 0
        self._train_metrics = []
        self._t_step = time.perf_counter()
        self._sync_s = 0.0
        self._capture_s0 = self.buffer.capture_seconds

    def on_rollout(self, trajectories) -> dict:
        """Acceptance statistics of a rollout batch (and its features, for the engine source)."""
        if not self.enabled:
            return {}
        agg = summarize_spec_stats(t.spec for t in trajectories)
        self._rollout_metrics = {
            "rollout/spec_accept_length": agg["accept_length"],
            "rollout/spec_accept_rate": agg["accept_rate"],
            "rollout/spec_verify_steps": agg["verify_steps"],
            "rollout/spec_accept_rate_per_pos": agg["accept_rate_per_pos"],
            "rollout/spec_faults": len(self.engine.draft_faults),
        }
        if self.capture_engine_features:
            self.buffer.add_trajectories(trajectories, self.policy_version)
        return self._rollout_metrics

    def on_policy_update(self) -> None:
        if self.enabled:
            self.policy_version += 1

    def train_draft(self, window: str = "between") -> dict:
        """Run draft updates within the scheduler's remaining budget, then hot-swap the weights."""
        if self.draft_trainer is None:
            return {}
        self.scheduler.run_window(window, self._train_burst)
        return self.metrics()

    def end_step(self) -> dict:
        """Close the RL step's accounting; returns the metrics to log."""
        if not self.enabled:
            return {}
        report = self.scheduler.end_step(time.perf_counter() - self._t_step)
        self._step_metrics = report
        return self.metrics()

    def metrics(self) -> dict:
        if not self.enabled:
            return {}
        m = dict(self._rollout_metrics)
        m.update(self._step_metrics)
        if self.draft_trainer is not None:
            losses = [t["draft_loss"] for t in self._train_metrics if "draft_loss" in t]
            m["train/draft_loss"] = sum(losses) / len(losses) if losses else None
            m["train/draft_steps"] = self._draft_steps_this_rl_step
            m["train/draft_version"] = self.draft_trainer.version
            m["perf/draft_sync_s"] = self._sync_s
            m["perf/feature_capture_s"] = self.buffer.capture_seconds - self._capture_s0
            # all the online draft adds to the RL step: training and weight sync (both inside the
            # scheduler's windows, so in draft_train_s) plus feature capture in the trainer's forward
            m["perf/draft_overhead_s"] = m.get("perf/draft_train_s", 0.0) + m["perf/feature_capture_s"]
            m["buffer/entries"] = len(self.buffer)
            m["buffer/bytes"] = self.buffer.nbytes
        m["train/draft_faults"] = self.faults
        return m

    # -- internals ------------------------------------------------------------------------
    def _tail_hook(self, n_active: int, n_slots: int) -> None:
        """Runs inside the engine's generate (inference mode): leave it to train."""
        def work(remaining: float) -> float:
            with torch.inference_mode(False), torch.enable_grad():
                return self._train_burst(remaining, 1)

        self.scheduler.on_engine_step(n_active, n_slots, work=work)

    def _train_burst(self, remaining_s: float, max_steps: int | None = None) -> float:
        t0 = time.perf_counter()
        if len(self.buffer) < self.config.min_buffer_records:
            return 0.0
        if not self.scheduler.memory_ok(self.buffer.nbytes):
            return 0.0
        left = self.config.max_draft_steps - self._draft_steps_this_rl_step
        steps = left if max_steps is None else min(left, max_steps)
        if steps <= 0:
            return 0.0
        before = self.draft_trainer.version
        try:
            recent = self.config.recent_versions
            min_version = max(0, self.policy_version - recent) if recent else None
            result = self.draft_trainer.train_for(self.buffer, steps, remaining_s, self.generator,
                                                  min_version=min_version)
        except Exception as err:  # OOM, NaN or a bug on the draft side: never stop the RL run
            self._on_draft_error(err)
            return time.perf_counter() - t0
        self._draft_steps_this_rl_step += result["steps"]
        if result.get("last"):
            self._train_metrics.append(result["last"] | {"draft_loss": result["mean_loss"]})
        if self.draft_trainer.version != before:
            t_sync = time.perf_counter()
            try:
                self.engine.push_draft(self.draft_trainer.export_weights(), self.draft_trainer.version)
            except Exception as err:  # the engine keeps its previous draft; speculation stays lossless
                self._on_draft_error(err)
            if self.controller is not None:
                self.controller.reset_acceptance()
            self._sync_s += time.perf_counter() - t_sync
        return time.perf_counter() - t0

    def _on_draft_error(self, err: Exception) -> None:
        self.faults += 1
        warnings.warn(f"draft training step failed and was skipped ({type(err).__name__}: {err})", RuntimeWarning)

    # -- checkpointing --------------------------------------------------------------------
    def state_dict(self) -> dict:
        if not self.enabled:
            return {"mode": "off"}
        engine_draft, engine_version = self.engine.draft_weights()
        return {"mode": self.config.mode, "policy_version": self.policy_version,
                "engine_draft": engine_draft, "engine_draft_version": engine_version,
                "draft_trainer": self.draft_trainer.state_dict() if self.draft_trainer is not None else None,
                "buffer": self.buffer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "controller": self.controller.state_dict() if self.controller is not None else None,
                "generator": self.generator.get_state(), "faults": self.faults}

    def load_state_dict(self, state: dict) -> None:
        if state.get("mode") != self.config.mode:
            raise ValueError(f"co-training state is for mode {state.get('mode')!r}, this run uses {self.config.mode!r}")
        if not self.enabled:
            return
        self.policy_version = state["policy_version"]
        self.engine.push_draft(state["engine_draft"], state["engine_draft_version"])
        if self.draft_trainer is not None:
            self.draft_trainer.load_state_dict(state["draft_trainer"])
        self.buffer.load_state_dict(state["buffer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.controller is not None and state["controller"] is not None:
            self.controller.load_state_dict(state["controller"])
        self.generator.set_state(state["generator"])
        self.faults = state["faults"]
