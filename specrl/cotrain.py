"""The public plug-in: online speculative-decoding co-training in a few lines of an RL loop.

    cotrain = SpecCoTrainer(draft, CoTrainConfig(mode="online"))
    cotrain.attach(engine, trainer)           # speculation in the engine, feature hook in the trainer
    for step in ...:
        cotrain.begin_step()                  # speculate this step or not (the run choice)
        trajs = engine.generate(...)          # speculative, lossless; long tail trains the draft
        cotrain.on_rollout(trajs)             # acceptance and the rollout's figures (+ engine-side features)
        trainer.step(...)                     # its log-prob forward feeds the feature buffer
        log(cotrain.end_step())               # the step boundary: policy version += 1, draft updates, hot swap

The core drives the engine only through rollout.protocol.DraftReceiver (install a drafter,
switch speculation per step, push fresh weights with a version, read acceptance from
Trajectory.spec and the rollout's figures from Rollout.stats) and takes features from a
rollout.protocol.FeatureSource (the trainer's log-prob forward) or from an engine that captures
them; so the embedded engine and vLLM plug in the same way. The per-rollout choice of whether to
speculate (specrl.run_choice) is the core's: engines only expose the switch.

Co-training as an investment: every 8th answer the trainer's forward captures is held out
(CoTrainConfig.heldout_every); on the newest of them the serving draft's expected accept length
is measured every step (draft_models.ttt.expected_accept_length), whether or not speculation
served the rollout. A trained draft serves only if it is not worse there (the swap gate), the
budget buys updates while the held-out gain they show saves more rollout time than they cost
(specrl.draft_budget, rule "value"), and the run choice is re-timed as soon as the serving draft
is predicted to pay, or no longer to.

Modes: "off" attaches nothing (the host loop runs exactly as without specrl), "frozen"
speculates with the starting draft, "online" also trains it. Every draft-side failure is
caught, logged and counted: speculation falls back to plain decoding; the RL run goes on.
"""
from __future__ import annotations

import copy
import time
import warnings

import torch

from draft_models.checkpoint import check_draft_weights, copy_draft_weights
from draft_models.train import collate
from draft_models.ttt import expected_accept_sums, mean_accept_length, paired_gain
from rollout.drafters import DrafterSpec
from rollout.protocol import DraftReceiver, FeatureSource, Rollout, RolloutStats, summarize_spec_stats
from specrl.buffer import FeatureBuffer
from specrl.config import CoTrainConfig
from specrl.controller import SpeculationController, alpha_from_ratio, expected_accept_length
from specrl.draft_budget import DraftBudget
from specrl.online_trainer import OnlineDraftTrainer
from specrl.overlap import OverlappedBursts
from specrl.run_choice import RunChoice
from specrl.scheduler import DraftScheduler

# Fewer drafted tokens in a rollout than this say nothing about the draft: under the adaptive
# controller a rollout may speculate in one or two re-measuring steps only, and one sequence
# drafting one rejected token read as a collapse of acceptance (the budget's alarm fired on
# `drift` as the controller settled on plain decoding).
MIN_DRAFTED_TOKENS = 32

# The swap gate compares two held-out values measured in different batches (the serving draft's
# per-sequence sums are kept across steps): float rounding alone, about 1e-6 of an accept length,
# must not refuse a candidate that equals the serving draft.
GATE_ROUNDING = 1e-5

# The draft trainer starts no update whose measured time exceeds the window's budget, and only an
# update that runs refreshes that measurement: one slow update (the machine was busy) could stop
# the draft for good. After this many RL steps in a row at which the estimate alone started none,
# the estimate is dropped, so the next window runs one update and measures it afresh. When that
# update overran the step's budget too, the wait for the next such probe doubles, up to
# PROBE_AFTER_MAX steps: an update that truly exceeds the budget overruns it ever more rarely.
PROBE_AFTER = 3
PROBE_AFTER_MAX = 48


class SpecCoTrainer:
    def __init__(self, draft, config: CoTrainConfig | None = None):
        self.config = cfg = config or CoTrainConfig()
        self.policy_version = 0
        self.engine = None
        self.trainer = None
        self.controller = None
        self.run_choice = None  # speculate or not per rollout, from whole rollouts (specrl.run_choice)
        self.draft_trainer = None
        self.faults = 0
        self._faults_seen = 0  # engine draft faults already reported by on_rollout
        self._engine_version = 0  # version of the draft the engine speculates with
        self._step_metrics: dict = {}
        self._rollout_metrics: dict = {}
        self._train_metrics: list[dict] = []  # draft-training results of the current RL step
        self._t_step = time.perf_counter()
        self._sync_s = 0.0
        self._capture_s0 = 0.0
        self._overlap = None  # the overlapped-burst runner (online mode, SchedulerConfig.mode "overlap")
        self.history = None  # the history drafter's store (drafter "history" or "hybrid"): rollout.drafters.history
        if cfg.mode == "off":
            return
        if cfg.drafter != "eagle3":
            from rollout.drafters.history import HistoryStore

            self.history = HistoryStore(cfg.history)
        # the engine speculates with its own copy; the trainer's copy is pushed when it improves
        self.controller = SpeculationController(cfg.controller) if cfg.adaptive else None
        self.draft = draft
        self.buffer = FeatureBuffer(cfg.buffer_bytes, seed=cfg.seed, heldout_every=cfg.heldout_every,
                                    heldout_records=cfg.heldout_records, heldout_per_prompt=cfg.heldout_per_prompt)
        # a frozen draft is measured on held-out sequences, not trained: capture those only
        self.buffer.heldout_only = cfg.mode == "frozen"
        self.heldout = None  # the serving draft's held-out expected accept length, this step
        self._heldout_s = 0.0  # seconds spent measuring drafts on held-out sequences this step
        self._idle_measure = (0.0, 0.0, 0)  # (seconds of the last serving measurement, of the last step, steps since)
        self._gate = {"refused": 0, "accepted": 0, "floor": 0}  # swap gate decisions since the start
        self._gate_step: dict = {}  # this step's gate figures
        self._serving = None  # online: a copy of the serving draft (the gate's yardstick)
        self._serving_value = (None, None)  # (held-out rows seen, the serving draft's value on them)
        self._serving_sums: dict = {}  # the serving draft's per-sequence held-out sums (heldout_accept_length)
        self._candidate = None  # the gated candidate's held-out value, until it serves
        self._candidate_sums: dict = {}  # ... and its per-sequence sums, which then are the serving draft's
        self._waiting = False  # a trained candidate waits, unpushed, for the first held-out answers
        # updates since the last gate, at the full learning rate (a warm-up update counts by its share):
        # the gain per update the budget extrapolates is that of a full-rate update
        self._updates_since_push = 0.0
        self._recheck = None  # "spec" or "plain": the run choice re-timed because of the draft
        self._choice_heldout = None  # the serving draft's held-out accept length when the run choice was made
        self._choice_seen = None  # RunChoice.decisions when _choice_heldout was taken
        self.draft_trainer = OnlineDraftTrainer(draft, cfg.online) if cfg.mode == "online" else None
        self._start = None  # online with gate_floor: a copy of the starting draft, the gate's floor
        self._start_sums: dict = {}  # ... and its per-sequence held-out sums (its weights never change)
        if self.draft_trainer is not None and cfg.heldout_every:
            self._serving = copy.deepcopy(draft)
            if cfg.gate_floor:
                self._start = copy.deepcopy(draft)
        # the memory bound is a share of the memory of the device the draft trains on
        first = next(draft.parameters(), None) if isinstance(draft, torch.nn.Module) else None
        self.scheduler = DraftScheduler(cfg.scheduler, on_error=self._on_draft_error,
                                        device=first.device if first is not None else "cpu")
        self._memory_warned = False  # the first update skipped for memory warns, once per run
        # updates per RL step (fixed or acceptance-driven) and the collapse alarm (every speculating mode)
        self.budget = DraftBudget(cfg.scheduler.draft_steps)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self._draft_steps_this_rl_step = 0
        self._burst_s, self._granted = 0.0, None
        self._trains_now = True  # this RL step's boundary runs draft updates (CoTrainConfig.train_every)
        self._owed = 0  # updates the budget granted the steps since the last burst (they join the next)
        # the stale step-time estimate (PROBE_AFTER): steps in a row it shut, the wait before the
        # next probe, whether one is under way, the probes run; timing state, not checkpointed
        self._shut, self._shut_steps, self._probe_after, self._probing = False, 0, PROBE_AFTER, False
        self.step_time_probes = 0
        self._overlap = (OverlappedBursts(self.draft_trainer, cfg.scheduler.overlap_threads)
                         if self.draft_trainer is not None and cfg.scheduler.mode == "overlap" else None)
        self._burst: dict | None = None  # an overlapped burst collected but not yet reported
        self._threads_outside_burst: int | None = None  # the RL loop's thread count, while rollout_threads holds
        self._overlap_s = self._wait_s = 0.0
        self._mem: dict = {}  # the last memory plan's measured breakdown
        self._mem_shrunk = self._mem_skipped = 0  # bursts of this RL step cut or skipped by the memory budget

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
        caps, c = engine.capabilities, self.config.controller
        if self.controller is not None:
            if caps.switch is not None and c.run_rollouts:
                # speculate or not per rollout, from whole rollouts' speed: above the per-step
                # controller where a switch is free (so re-checked), or instead of it where a switch
                # is a restart (vLLM: the first choice is final)
                self.run_choice = (RunChoice(c.run_rollouts, c.run_warmup, c.margin, c.run_recheck, c.run_sure,
                                             rewarm=False, paired=c.run_paired) if caps.switch == "free"
                                   else RunChoice(c.run_rollouts, c.run_warmup, c.margin))
            elif not caps.step_policy:
                how = "ControllerConfig.run_rollouts is 0" if caps.switch is not None else "nor a choice per run"
                warnings.warn(f"{type(engine).__name__} takes no per-step controller ({how}): it speculates on "
                              f"every step, as CoTrainConfig.spec says", RuntimeWarning)
            if not caps.step_policy:
                self.controller = None
        engine.install_draft(DrafterSpec(self.config.drafter, draft=self.draft, spec=self.config.spec,
                                         history=self.history), self.controller)
        measured = self.draft is not None and self.config.heldout_every > 0 and isinstance(trainer, FeatureSource)
        if not measured:  # nothing captures held-out answers: hold no prompt out of the engine's features
            self.buffer.heldout_every = 0
        if self.draft_trainer is None:
            if measured:  # a frozen draft: the held-out sequences only, to measure it
                self._add_capture(trainer)
            return self
        source = self.config.feature_source
        if source in ("engine", "both") and not caps.captures_features:
            raise ValueError(f"feature_source={source!r}: {type(engine).__name__} does not capture features; "
                             f"use feature_source='trainer'")
        if trainer is not None and (source in ("trainer", "both") or measured):
            if not isinstance(trainer, FeatureSource):
                raise TypeError(f"{type(trainer).__name__} is not a rollout.protocol.FeatureSource")
            self.buffer.heldout_only = source == "engine"  # the engine feeds training; the trainer the held-out slice
            self._add_capture(trainer)
        sequential = self._overlap is None  # overlapped: the burst is the only window
        if sequential and "tail" in self.config.scheduler.windows and caps.idle_windows:
            engine.step_hooks.append(self._tail_hook)
        if sequential and trainer is not None and "interleaved" in self.config.scheduler.windows:
            if not hasattr(trainer, "microstep_hooks"):
                raise ValueError("the 'interleaved' window needs a trainer with microstep_hooks "
                                 "(called between the policy update's micro-steps)")
            trainer.microstep_hooks.append(self._interleaved_hook)
        return self

    def _add_capture(self, trainer) -> None:
        """Capture features in the trainer's log-prob forward (no extra forward), whatever the run
        choice: a draft measured or trained while plain decoding is chosen can earn its way back."""
        layer_ids = tuple(self.draft.cfg.aux_layer_ids)  # = the policy's taps (install_draft checks)
        trainer.add_feature_hook(layer_ids, self.buffer.logprob_hook(layer_ids, self.draft.d2t,
                                                                     lambda: self.policy_version))

    def serving_draft(self):
        """A copy of the draft the engine speculates with now, as a module (what experiments
        evaluate), read through the protocol (`draft_weights`); None without a draft model."""
        if not self.enabled or self.draft is None:
            return None
        draft = copy.deepcopy(self.draft)  # the structure (and the target embedding's reference)
        copy_draft_weights(draft, self.engine.draft_weights()[0])
        return draft

    @property
    def enabled(self) -> bool:
        return self.config.mode != "off"

    @property
    def acceptance(self) -> str:
        """How the attached engine accepts sampled drafts (EngineCapabilities.acceptance; "rejection"
        before an engine is attached): the held-out acceptance is read under the same rule."""
        caps = getattr(self.engine, "capabilities", None)
        return caps.acceptance if caps is not None else "rejection"

    @property
    def capture_engine_features(self) -> bool:
        """Pass as generate(capture_features=...) when the engine is a feature source."""
        return self.config.mode == "online" and self.config.feature_source in ("engine", "both")

    def _observe_run(self, stats: RolloutStats | None) -> float | None:
        """Report the rollout to the run choice; returns the seconds speculation saved in it, as
        the priced budget reads them: the engine's estimate where it makes one (from measured
        plain steps), else the run choice's (tokens at the measured plain rate, less the time);
        0 once plain decoding is chosen; None when unknown."""
        if stats is None:
            return None
        choice, saved = self.run_choice, stats.spec_saved_s
        if choice is None:
            return saved
        # the rollout alone: draft training in its tail window would be charged to the arm that ran it
        seconds = stats.rollout_s
        choice.record("spec" if stats.speculated else "plain", stats.tokens, seconds,
                      saved if stats.speculated else None)
        if saved is None:
            if not stats.speculated and choice.speculate is False:
                saved = 0.0  # plain decoding chosen: speculation saves nothing
            elif not self.engine.capabilities.step_policy:
                saved = choice.saved_s(stats.tokens, seconds)
        return saved

    # -- RL loop hooks --------------------------------------------------------------------
    def begin_step(self, steps_left: int | None = None) -> None:
        """Open an RL step: the run choice switches the engine's speculation on or off for its
        rollout, and the step's draft-time accounting starts. `steps_left`: the RL steps still to
        run, this one included, where the loop knows (one rollout each; the run choice starts no
        re-check its choice could not pay back, RunChoice.calls_left); None: open-ended."""
        if not self.enabled:
            return
        if self.run_choice is not None:
            self.run_choice.calls_left = steps_left
            self.engine.set_speculation(self.run_choice.arm() == "spec")
        self.scheduler.begin_step()
        self._draft_steps_this_rl_step = 0
        self._burst_s = 0.0  # seconds of the draft updates recorded this step (priced budgets pay them)
        self._granted = None
        self._mem_shrunk = self._mem_skipped = 0
        self._overlap_s = self._wait_s = 0.0
        self._train_metrics = []
        self._t_step = time.perf_counter()
        self._sync_s = 0.0
        self._capture_s0 = self.buffer.capture_seconds
        self._heldout_s = 0.0
        self._gate_step = {}
        self._recheck = None
        self._shut = False
        self._trains_now = self.policy_version % self.config.train_every == 0

    def on_rollout(self, trajectories) -> dict:
        """Acceptance statistics of a rollout batch, and the rollout's figures (a Rollout's
        `stats`) for the run choice and the priced budget (and its features, for the engine
        source)."""
        if not self.enabled:
            return {}
        stats = trajectories.stats if isinstance(trajectories, Rollout) else None
        if stats is not None and stats.temperature is not None:
            self.buffer.heldout_temperature = stats.temperature  # the trainer's forward over them comes next
        saved = self._observe_run(stats)
        agg = summarize_spec_stats(t.spec for t in trajectories)
        self._rollout_metrics = {
            "rollout/spec_accept_length": agg["accept_length"],
            "rollout/spec_accept_rate": agg["accept_rate"],
            "rollout/spec_verify_steps": agg["verify_steps"],
            "rollout/spec_accept_rate_per_pos": agg["accept_rate_per_pos"],
            # draft-side faults that switched speculation off for a generate call: in this
            # rollout, and since the start (never silent: a run that lost its speed-up says why)
            "rollout/spec_faults": len(self.engine.draft_faults) - self._faults_seen,
            "rollout/spec_faults_total": len(self.engine.draft_faults),
        }
        if self.run_choice is not None:  # 1/0 once decided, None while the first rollouts are timed
            self._rollout_metrics["rollout/spec_run_choice"] = (None if self.run_choice.speculate is None
                                                                else int(self.run_choice.speculate))
            self._rollout_metrics["rollout/spec_run_speedup"] = self.run_choice.chosen_speedup
            self._rollout_metrics["rollout/spec_run_rechecks_skipped"] = self.run_choice.skipped  # near the run's end
        self._faults_seen = len(self.engine.draft_faults)
        if self.history is not None:  # per-source acceptance of this rollout, then its answers join the history
            self._rollout_metrics.update(self.history.metrics())
            self.history.add_rollout(trajectories)
            self._rollout_metrics["perf/history_s"] = self.history.take_seconds()
        signal = agg["accept_length"]
        measured = agg["verify_steps"] > 0 and agg["drafted"] >= MIN_DRAFTED_TOKENS
        if self.controller is not None and measured:
            # the controller picks the chain length per step, and a shorter chain emits fewer
            # tokens per verify however good the draft: the budget reads acceptance at the
            # configured chain instead, E(alpha, gamma) with alpha the per-token acceptance
            alpha = alpha_from_ratio(agg["accept_rate"], agg["drafted"] / agg["verify_steps"])
            signal = expected_accept_length(alpha, self.config.spec.gamma)
            self._rollout_metrics["rollout/spec_accept_length_at_gamma"] = signal
        self.budget.observe(signal, measured)
        self.budget.observe_saving(saved)
        if stats is not None:
            self.budget.observe_rollout(stats.tokens, stats.rollout_s, stats.speculated,
                                        agg["accept_length"] if measured else None, saved)
        self._rollout_metrics.update({"rollout/spec_collapse_alarm": int(self.budget.alarm),
                                      "rollout/spec_collapse_alarms": self.budget.alarms})
        if self.capture_engine_features:
            self.buffer.add_trajectories(trajectories, self.policy_version)
        if self._overlap is not None and self.config.scheduler.overlap_until == "rollout":
            t0 = time.perf_counter()  # the burst ran under the rollout only: the policy update runs alone
            self.wait_for_draft()
            self.scheduler.charge("between", time.perf_counter() - t0)
        return self._rollout_metrics

    def train_while(self, waiting) -> int:
        """The "wait" window of an asynchronous loop: draft updates, one at a time, while
        `waiting()` holds (the trainer's next batch is not ready yet) and the step's update count
        and time budget last; each update is pushed to the engine. Returns the updates run.
        Sequential mode only (the overlapped mode has its own thread)."""
        if self.draft_trainer is None or self._overlap is not None:
            return 0
        n = 0
        while waiting():
            before = self._draft_steps_this_rl_step
            self.scheduler.run_window("wait", lambda remaining: self._train_burst(remaining, 1))
            if self._draft_steps_this_rl_step == before:
                break
            n += 1
        return n

    def end_step(self, kl: float | None = None, train: bool = True) -> dict:
        """The step boundary, after the policy update: the policy moved (its version += 1; `kl`,
        if the host measures it, is how far, and the acceptance-driven budget spends more draft
        updates on large moves), then draft updates within the scheduler's remaining budget and
        their hot swap (`train`; overlapped mode, SchedulerConfig.mode: collect the burst started
        at the previous boundary, waiting if it still runs, swap it in, start the next), then the
        step's accounting. Returns the metrics to log."""
        if not self.enabled:
            return {}
        self.policy_version += 1
        self.budget.observe_kl(kl)
        t0 = time.perf_counter()
        if self._trains_now or self.draft_trainer is None:
            self._measure_serving()  # outside the scheduler's windows: it never starves the updates
        else:  # between bursts (train_every): the serving draft is measured when it is next gated
            self.heldout = None
        self._heldout_s = time.perf_counter() - t0
        # what this step's co-training has spent before its updates: the hard cap counts it
        self.budget.spent_now = self.buffer.capture_seconds - self._capture_s0 + self._heldout_s
        self._follow_draft()
        if train and self._overlap is not None:
            t0 = time.perf_counter()
            self._overlap_boundary()
            self.scheduler.charge("between", time.perf_counter() - t0)
        elif train and self.draft_trainer is not None and self._trains_now:
            self.scheduler.run_window("between", self._train_burst)
            self._owed = 0
        elif train and self.draft_trainer is not None:  # between bursts: this step's grant joins the next burst
            self._owed += self.budget.steps(self.config.max_draft_steps)
        if self._waiting and self._trains_now and self.buffer.heldout and self._overlap is None:
            # a candidate that waited for held-out answers, gated at a burst's boundary like the others
            t0 = time.perf_counter()
            self._push_weights()
            self.scheduler.charge("between", time.perf_counter() - t0)
        self._follow_draft()  # again with the draft that serves now
        if self.draft_trainer is not None:
            self._probe_stale_step_time()
        step_s = time.perf_counter() - self._t_step
        self._idle_measure = (self._idle_measure[0], step_s, self._idle_measure[2])
        report = self.scheduler.end_step(step_s)
        # the serving draft's held-out measurement is draft time too (perf/draft_heldout_s: its share)
        report["perf/draft_train_s"] = report.get("perf/draft_train_s", 0.0) + self._heldout_s
        self._granted = self.budget.steps(self.config.max_draft_steps)  # this step's count, before paying for it
        self.budget.spend(self._burst_s + self._sync_s, self._draft_steps_this_rl_step)  # updates and their swaps
        capture_s = self.buffer.capture_seconds - self._capture_s0
        self.budget.observe_step(step_s, report["perf/draft_train_s"] + capture_s)
        self.budget.close_step(self.config.max_draft_steps)
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
            m.update(self.budget.metrics(self.config.max_draft_steps))
            if self._granted is not None:
                m["sched/draft_steps_budget"] = self._granted
            m["train/draft_version"] = self.draft_trainer.version
            m["perf/draft_sync_s"] = self._sync_s
            m["perf/feature_capture_s"] = self.buffer.capture_seconds - self._capture_s0
            # all the online draft adds to the RL step: training and weight sync (both inside the
            # scheduler's windows, so in draft_train_s) plus feature capture in the trainer's forward
            m["perf/draft_overhead_s"] = m.get("perf/draft_train_s", 0.0) + m["perf/feature_capture_s"]
            m.update(self._mem)
            if self._overlap is not None:
                m["perf/draft_overlap_s"] = self._overlap_s  # burst time that ran under RL work
                m["perf/draft_wait_s"] = self._wait_s  # the step boundary waiting for the burst
            m["sched/step_time_probes"] = self.step_time_probes
            m["sched/memory_shrunk"] = self._mem_shrunk
            m["sched/memory_skipped"] = self._mem_skipped
            m["buffer/entries"] = len(self.buffer)
            m["buffer/bytes"] = self.buffer.nbytes
        if self.heldout is not None or self.draft_trainer is not None:
            m["sched/heldout_accept_length"] = self.heldout  # the serving draft's, on the newest held-out sequences
            m["perf/draft_heldout_s"] = self._heldout_s
            m.setdefault("perf/feature_capture_s", self.buffer.capture_seconds - self._capture_s0)  # frozen: held-out rows
            m.update(self._gate_step)
            m["train/draft_refused_total"] = self._gate["refused"]
            m["train/draft_gated_total"] = self._gate["accepted"] + self._gate["refused"]
            if self._start is not None:
                m["train/draft_floor_restores_total"] = self._gate["floor"]
            if self._recheck is not None:
                m["sched/run_recheck"] = self._recheck
        m["train/draft_faults"] = self.faults
        return m

    # -- held-out measurement, swap gate, run choice --------------------------------------
    def _heldout_value(self, draft, sums: dict | None = None) -> float | None:
        """`draft`'s expected accept length on the held-out sequences at the configured chain;
        None without any, or without an answer token among them. `sums`: what is known of this
        draft per sequence (heldout_accept_length), kept up to date."""
        value = heldout_accept_length(draft, self.buffer.heldout, self.config.spec.gamma, sums,
                                      coupled=self.acceptance == "coupled")
        return None if value is None or value[0] != value[0] else value[0]

    def _measure_serving(self) -> None:
        """The serving draft's held-out expected accept length on the newest held-out sequences
        (those the trainer's forward captured in this step), for the budget and the metrics; while
        the draft is idle, only as often as CoTrainConfig.heldout_idle_share allows (None on the
        steps it waits: the budget keeps the last value)."""
        if self.draft is None or not self.config.heldout_every:
            return
        measure_s, step_s, waited = self._idle_measure
        choice = self.run_choice
        idle = choice is not None and choice.speculate is False and not (
            self.draft_trainer is not None and self.budget.steps(self.config.max_draft_steps) > 0)
        if idle and measure_s > 0 and step_s > 0 and (waited + 1) * self.config.heldout_idle_share * step_s < measure_s:
            self.heldout = None
            self._idle_measure = (measure_s, step_s, waited + 1)
            return
        t0 = time.perf_counter()
        try:
            self.heldout = self._serving_heldout()
        except Exception as err:  # a measurement failure never stops the RL run
            self._on_draft_error(err)
            self.heldout = None
        self._idle_measure = (time.perf_counter() - t0, step_s, 0)
        self.budget.observe_heldout(self.heldout)

    def _serving_heldout(self) -> float | None:
        """The serving draft's held-out value, measured once per set of held-out sequences (the
        trainer's forward adds some every step; the serving draft changes only through the gate,
        which then knows its value), and on each sequence once: a step measures only the
        sequences that are new since the last one."""
        rows, value = self._serving_value
        if rows != self.buffer.rows_seen:
            value = self._heldout_value(self._serving if self._serving is not None else self.draft, self._serving_sums)
            self._serving_value = (self.buffer.rows_seen, value)
        return value

    def _gate_passes(self) -> bool | None:
        """The swap gate: the trained candidate serves only if its held-out expected accept length
        is at least (1 - gate_tolerance) times the serving draft's on the same sequences, and, with
        CoTrainConfig.gate_floor, the starting draft's too. A refused candidate is counted, and the
        trainer goes on from the serving draft's weights, or from the starting draft's where that
        one measures above the serving draft: the starting draft then serves again (it passes here
        as the candidate, with its known value, and is pushed like one). Before any held-out answer
        has come by (one prompt in CoTrainConfig.heldout_every), the candidate is not pushed: None,
        and the trainer keeps it; the first burst's boundary with held-out answers gates it."""
        if self._serving is None:
            return True
        # nothing to measure it on yet: it waits (None), unrefused, in the trainer, where held-out
        # answers will come (the capture records soft targets); a hard-label capture holds
        # nothing out and its candidates serve unmeasured
        self._waiting = not self.buffer.heldout and self.buffer.soft_targets and self.buffer.heldout_every > 0
        if not self.buffer.heldout:
            return None if self._waiting else True
        updates, self._updates_since_push = self._updates_since_push, 0.0
        self._candidate, self._candidate_sums = None, {}
        try:
            cand = self._heldout_value(self.draft_trainer.draft, self._candidate_sums)
            serve = self._serving_heldout()
            start = self._heldout_value(self._start, self._start_sums) if self._start is not None else None
        except Exception as err:
            self._on_draft_error(err)
            return False
        if cand is None or serve is None:
            return True
        se = self._gain_error()
        self.budget.observe_gain(cand - serve, updates, se)
        self._gate_step.update({"sched/candidate_accept_length": cand, "sched/gate_serving_accept_length": serve,
                                "sched/candidate_gain_se": se})
        floor = serve if start is None else max(serve, start)
        if start is not None:
            self._gate_step["sched/gate_start_accept_length"] = start
        if cand >= floor * (1.0 - self.config.gate_tolerance) - GATE_ROUNDING:
            self._gate["accepted"] += 1
            self._candidate = cand  # its value, once it serves (_push_weights)
            return True
        self._gate["refused"] += 1
        self._gate_step["train/draft_refused"] = self._gate_step.get("train/draft_refused", 0) + 1
        back = self._start if start is not None and start > serve + GATE_ROUNDING else self._serving
        with torch.no_grad():
            self.draft_trainer.draft.load_state_dict(back.state_dict())
        self.draft_trainer.version += 1  # the trainer's weights changed (back to the serving or the starting ones)
        if back is self._serving:
            self._engine_version = self.draft_trainer.version  # ... which the engine serves: nothing to push
            return False
        self._gate["floor"] += 1
        self._candidate, self._candidate_sums = start, dict(self._start_sums)
        return True

    def _gain_error(self) -> float:
        """The standard error of the candidate's held-out gain over the serving draft's, paired
        over the held-out sequences both were just measured on (0 where one of them lacks a
        sequence's sums)."""
        cand, serve = self._candidate_sums, self._serving_sums
        records = [r for r in self.buffer.heldout if id(r) in cand and id(r) in serve]
        if len(records) != len(self.buffer.heldout):
            return 0.0
        try:
            return paired_gain([cand[id(r)][1] for r in records], [serve[id(r)][1] for r in records])[1]
        except ValueError:  # sums of different rows: no error to take off
            return 0.0

    def _follow_draft(self) -> None:
        """The run choice follows the draft. The choice was made from a measured speed-up S of
        speculating over plain decoding, with a serving draft of held-out accept length E0; a
        verify step emits E tokens, so the same rollouts with a draft of held-out E are predicted
        at S * E / E0. Plain decoding chosen and the prediction reaching the choice's margin ->
        time speculation again at the next rollout; speculation chosen and the prediction falling
        below it -> time plain decoding again. Each re-timing makes a new choice, with E0 the
        draft's E then, so a prediction the measurement contradicts is not re-timed again until the
        draft moves further. Engines whose switch is free only (vLLM: the periodic re-check)."""
        choice, e = self.run_choice, self.heldout
        if choice is None or choice.speculate is None or choice.queue or e is None:
            return
        if self.engine.capabilities.switch != "free":  # a restart (vLLM): the periodic re-check alone
            return
        if self._choice_seen != choice.decisions:  # a new choice: the draft it was made with
            self._choice_seen, self._choice_heldout = choice.decisions, e
        if choice.chosen_speedup is None:  # kept on a sure estimate, nothing timed to scale
            return
        predicted = choice.chosen_speedup * e / self._choice_heldout
        if (predicted >= choice.margin) == choice.speculate:
            return
        choice.recheck_now()
        if choice.queue:  # not started where the run ends too soon for it (RunChoice.calls_left)
            self._recheck = "spec" if predicted >= choice.margin else "plain"

    # -- internals ------------------------------------------------------------------------
    def _tail_hook(self, n_active: int, n_slots: int) -> None:
        """Runs inside the engine's generate (inference mode): leave it to train."""
        def work(remaining: float) -> float:
            with torch.inference_mode(False), torch.enable_grad():
                return self._train_burst(remaining, 1)

        self.scheduler.on_engine_step(n_active, n_slots, work=work)

    def _interleaved_hook(self, done: int, total: int) -> None:
        """Runs between two micro-steps of the policy update (grad mode on): one draft update."""
        self.scheduler.run_window("interleaved", lambda remaining: self._train_burst(remaining, 1))

    def _memory_plan(self) -> int:
        """The batch size the next update may use under the memory budget (0: skip it), with the
        measured breakdown kept for the metrics. Before AdamW's first step its two moments per
        parameter are projected; activations are the trainer's measured bytes per record (zero
        before the first update, which therefore only the other terms can stop)."""
        mem = self.draft_trainer.memory_bytes()
        opt = mem["optimizer"] or 2 * mem["params"]
        fixed = mem["params"] + mem["grads"] + opt + self.buffer.nbytes
        per_record = self.draft_trainer.activation_bytes_per_record or 0.0
        batch = self.draft_trainer.config.batch_size
        fit = self.scheduler.fit_batch(fixed, per_record, batch)
        self._mem = {"mem/draft_params_bytes": mem["params"], "mem/draft_grads_bytes": mem["grads"],
                     "mem/draft_optimizer_bytes": opt, "mem/buffer_bytes": self.buffer.nbytes,
                     "mem/draft_activation_bytes": int(per_record * (fit or batch)),
                     "mem/draft_total_bytes": int(fixed + per_record * (fit or batch))}
        if fit == 0:
            self._mem_skipped += 1
            if not self._memory_warned:  # a draft that never trains again must not be silent
                self._memory_warned = True
                mib = lambda b: f"{b / 2**20:.0f} MiB"  # noqa: E731
                warnings.warn(f"draft update skipped: its resident bytes ({mib(fixed)}) and one record's "
                              f"activations ({mib(per_record)}) exceed the draft's memory budget "
                              f"({mib(self.scheduler.memory_limit_bytes)}); raise SchedulerConfig.memory_budget_share "
                              f"or memory_budget_bytes (sched/memory_skipped counts the skipped updates)",
                              RuntimeWarning)
        elif fit < batch:
            self._mem_shrunk += 1
        return fit

    def _plan_burst(self, spent: int, max_steps: int | None = None) -> tuple[int, int] | None:
        """The next burst's (updates, batch size), or None: too few records, nothing left of the
        step's update count once `spent` are deducted, or not even one record fits the memory
        budget (skipped, reported in the metrics). The count is the cap, or what the
        acceptance-driven rule grants from the rollouts observed so far (so the tail window goes by
        the previous step's rollout)."""
        if len(self.buffer) < self.config.min_buffer_records or not self._trains_now:
            return None
        left = self.budget.steps(self.config.max_draft_steps, self._owed) - spent
        steps = left if max_steps is None else min(left, max_steps)
        if steps <= 0:
            return None
        batch = self._memory_plan()
        return (steps, batch) if batch else None

    def _train_burst(self, remaining_s: float, max_steps: int | None = None) -> float:
        """Run a planned burst now (the sequential windows) and swap its weights in."""
        t0 = time.perf_counter()
        plan = self._plan_burst(self._draft_steps_this_rl_step, max_steps)
        if plan is None:
            return time.perf_counter() - t0
        steps, batch = plan
        before, rollbacks = self.draft_trainer.version, self.draft_trainer.counters["rollbacks"]
        try:
            result = self.draft_trainer.train_for(self.buffer, steps, remaining_s, self.generator,
                                                  min_version=self.min_train_version(), batch_size=batch)
        except Exception as err:  # OOM, NaN or a bug on the draft side: never stop the RL run
            self._on_draft_error(err)
            return time.perf_counter() - t0
        finally:  # rollbacks to finite weights (the trainer warned) are draft faults too
            self.faults += self.draft_trainer.counters["rollbacks"] - rollbacks
        self._record_burst(result)
        if self.draft_trainer.version != before:
            self._push_weights()
        return time.perf_counter() - t0

    def min_train_version(self) -> int | None:
        """Oldest policy version the draft may train on (config.recent_versions, and at least the
        versions since the last burst; None: all)."""
        recent = self.config.recent_versions and max(self.config.recent_versions, self.config.train_every)
        return max(0, self.policy_version - recent) if recent else None

    def _probe_stale_step_time(self) -> None:
        """At the step boundary, after the bursts: see PROBE_AFTER."""
        if self._draft_steps_this_rl_step:
            if self._probing:  # the probe ran: its measurement is the estimate now
                fits = self.draft_trainer.step_seconds <= self.scheduler.budget_s
                self._probe_after = PROBE_AFTER if fits else min(2 * self._probe_after, PROBE_AFTER_MAX)
            self._shut_steps, self._probing = 0, False
        elif self._shut:
            self._shut_steps += 1
            if self._shut_steps >= self._probe_after:
                self.draft_trainer.step_seconds = None
                self._shut_steps, self._probing = 0, True
                self.step_time_probes += 1

    def _record_burst(self, result: dict) -> None:
        """Count a burst's steps and keep its last step's metrics (with the burst's mean loss)."""
        self._shut |= bool(result.get("shut"))
        self._draft_steps_this_rl_step += result["steps"]
        self._updates_since_push += result.get("full_rate_updates", result["steps"])
        self._burst_s += result.get("seconds", 0.0)
        if result.get("last"):
            self._train_metrics.append(result["last"] | {"draft_loss": result["mean_loss"]})

    def _push_weights(self) -> None:
        """Hot swap the trainer's weights into the engine's draft, after checking them (names,
        shapes, finite): the engine never sees weights that would turn speculation off. A refused
        or failed swap is counted and logged as such; the engine keeps its previous version.
        Not attached to an engine (training a draft from the trainer's features alone): nothing
        to swap into, and that is not a fault."""
        if self.engine is None:
            return
        t_sync = time.perf_counter()  # the gate's measurements count as the swap's cost
        if not self._gate_passes():  # refused, or waiting for held-out answers (None)
            self._sync_s += time.perf_counter() - t_sync
            return
        version = self.draft_trainer.version
        try:
            weights = self.draft_trainer.export_weights()
            problem = check_draft_weights(weights, self.draft.state_dict())
            if problem is not None:
                raise ValueError(f"weights refused: {problem}")
            self.engine.push_draft(weights, version)
        except Exception as err:
            self.faults += 1
            msg = str(err).splitlines()[0] if str(err) else ""
            warnings.warn(f"draft hot swap to version {version} failed ({type(err).__name__}: {msg}); the engine "
                          f"keeps draft version {self._engine_version}", RuntimeWarning)
            return
        finally:
            self._sync_s += time.perf_counter() - t_sync
        self._engine_version = version
        if self._serving is not None:  # the gate's yardstick is now this draft, whose value the gate knows
            self._serving.load_state_dict(self.draft_trainer.draft.state_dict())
            self._serving_sums = self._candidate_sums if self._candidate is not None else {}
            if self._candidate is not None:
                self.heldout, self._serving_value = self._candidate, (self.buffer.rows_seen, self._candidate)
                self.budget.observe_heldout(self._candidate)
        self._candidate, self._candidate_sums = None, {}
        # the controller keeps its acceptance estimates across the swap: its EMAs follow the new draft
        # within a few steps, where forgetting them made it re-explore every arm, plain decoding
        # included, after every update (every rollout, at one update per RL step)

    def _overlap_boundary(self) -> None:
        """Overlapped mode, at a step boundary (no forward in flight): finish the burst started at
        the previous boundary, swap its weights into the engine's draft, start the next burst on
        the buffer as it is now."""
        self.wait_for_draft()
        if self._burst is not None:
            res, self._burst = self._burst, None
            self._record_burst(res)
            self._overlap_s += res["hidden_s"]
            self._wait_s += res["wait_s"]
        if self.draft_trainer.version != self._engine_version:
            self._push_weights()
        # the burst launched here trains under the next step: the one collected above does not count against it
        plan = self._plan_burst(0)
        if plan is None:
            return
        steps, batch = plan
        budget = self.scheduler.budget_s  # the same time budget per step as the sequential windows
        launched = self._overlap.launch(self.buffer, steps, batch, budget, self.generator,
                                        prefer_rejected=self.config.online.prefer_rejected,
                                        min_version=self.min_train_version())
        threads = self.config.scheduler.rollout_threads
        if launched and threads is not None:  # leave the burst its cores until it is collected
            self._threads_outside_burst = torch.get_num_threads()
            torch.set_num_threads(threads)

    def wait_for_draft(self) -> None:
        """Wait for the overlapped burst in flight, if any (a step boundary, a checkpoint, or a
        benchmark handing the machine to another arm); its result waits in self._burst and is
        reported, and its weights swapped into the engine, at the next step boundary as usual."""
        if self._overlap is not None and self._overlap.busy:
            try:
                self._burst = self._overlap.collect()
            except Exception as err:  # the burst failed: its update is dropped, the RL run goes on
                self._on_draft_error(err)
            finally:
                if self._threads_outside_burst is not None:
                    torch.set_num_threads(self._threads_outside_burst)
                    self._threads_outside_burst = None

    def _on_draft_error(self, err: Exception) -> None:
        self.faults += 1
        warnings.warn(f"draft training step failed and was skipped ({type(err).__name__}: {err})", RuntimeWarning)

    # -- checkpointing --------------------------------------------------------------------
    def state_dict(self) -> dict:
        if not self.enabled:
            return {"mode": "off"}
        self.wait_for_draft()  # a consistent draft trainer; the engine swap still waits for the boundary
        # drafter "history" holds no draft; its store of answers is not saved (a resumed run drafts
        # from the answers it produces from then on: the same tokens, fewer accepted at first)
        engine_draft, engine_version = self.engine.draft_weights() if self.draft is not None else (None, 0)
        return {"mode": self.config.mode, "policy_version": self.policy_version,
                "engine_draft": engine_draft, "engine_draft_version": engine_version,
                "draft_trainer": self.draft_trainer.state_dict() if self.draft_trainer is not None else None,
                # the buffer's records too: the next draft updates sample them, so an exact resume needs them
                "buffer": self.buffer.state_dict(include_tensors=True), "scheduler": self.scheduler.state_dict(),
                "controller": self.controller.state_dict() if self.controller is not None else None,
                "run_choice": self.run_choice.state_dict() if self.run_choice is not None else None,
                "generator": self.generator.get_state(), "faults": self.faults, "budget": self.budget.state_dict(),
                "gate": dict(self._gate), "choice_heldout": self._choice_heldout, "choice_seen": self._choice_seen,
                "owed": self._owed}

    def load_state_dict(self, state: dict) -> None:
        if state.get("mode") != self.config.mode:
            raise ValueError(f"co-training state is for mode {state.get('mode')!r}, this run uses {self.config.mode!r}")
        if not self.enabled:
            return
        self.policy_version = state["policy_version"]
        faults = 0
        if self.draft_trainer is not None:
            self.draft_trainer.load_state_dict(state["draft_trainer"])  # refuses non-finite weights itself
            faults += self.draft_trainer.counters["rollbacks"] - state["draft_trainer"].get(
                "counters", {}).get("rollbacks", 0)
        if self.draft is not None:  # drafter "history" holds no draft
            faults += self._restore_engine_draft(state)
        self.buffer.load_state_dict(state["buffer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.controller is not None and state["controller"] is not None:
            self.controller.load_state_dict(state["controller"])
        if self.run_choice is not None and state.get("run_choice") is not None:  # absent in older checkpoints
            self.run_choice.load_state_dict(state["run_choice"])
        self.generator.set_state(state["generator"])
        self.faults = state["faults"] + faults
        self.budget.load_state_dict(state.get("budget", {}))  # absent in checkpoints written before it
        self._gate = {**self._gate, **state.get("gate", {})}  # "floor" absent in older checkpoints
        self._choice_heldout, self._choice_seen = state.get("choice_heldout"), state.get("choice_seen")
        self._owed = int(state.get("owed", 0))
        if self._serving is not None:  # the gate's yardstick: the draft the engine serves
            copy_draft_weights(self._serving, self.engine.draft_weights()[0])
        self._serving_value, self._serving_sums = (None, None), {}

    def _restore_engine_draft(self, state: dict) -> int:
        """Push the checkpoint's engine draft; a non-finite one is replaced by the trainer's (or the
        starting) draft and counted as a fault (the return value)."""
        problem = check_draft_weights(state["engine_draft"], self.draft.state_dict())
        if problem is None:
            self.engine.push_draft(state["engine_draft"], state["engine_draft_version"])
            self._engine_version = state["engine_draft_version"]
            return 0
        # a NaN engine draft would turn speculation off for good: use the trainer's (or the starting) one
        weights = self.draft_trainer.export_weights() if self.draft_trainer is not None else None
        if weights is not None and check_draft_weights(weights, self.draft.state_dict()) is None:
            self.engine.push_draft(weights, self.draft_trainer.version)
            self._engine_version, which = self.draft_trainer.version, "trainer"
        else:
            which = "starting"  # install_draft gave the engine the starting draft
        warnings.warn(f"the resumed engine draft is unusable ({problem}); speculating with the "
                      f"{which} draft instead", RuntimeWarning)
        return 1


def heldout_accept_length(draft, records, gamma: int, sums: dict | None = None, *,
                          coupled: bool = False) -> tuple[float, list[float]] | None:
    """`draft`'s expected accept length with chains of `gamma` on held-out buffer records
    (FeatureBuffer.heldout, with soft targets), and its per-depth acceptance
    (draft_models.ttt.expected_accept_sums, sampled decoding: accepted by rejection sampling, or
    by coupled sampling with `coupled`, the engine's rule); None without records. The draft
    is measured in eval mode and left in the mode it was in.
    sums: {id(record): (record, its sums)} already measured for this same draft (the caller
    empties it when the draft's weights change): only the other records are measured, then the
    dict holds exactly `records`' sums (each kept with its record, so no id is reused).
    Each record is measured at the temperature its soft targets are at (its "temperature", 1.0
    where it has none; 0: greedy, acceptance by argmax), the rollouts' own."""
    if not records:
        return None
    sums = {} if sums is None else sums
    todo: dict[float, list] = {}
    for r in records:
        if id(r) not in sums:
            todo.setdefault(float(r.get("temperature", 1.0)), []).append(r)
    if todo:
        w = draft.fc.weight
        was = draft.training
        draft.eval()
        try:
            for temp, group in todo.items():
                batch = collate(group, w.device, w.dtype, soft=True)
                new = expected_accept_sums(draft, batch["features"], batch["input_ids"], batch["target_logp"],
                                           batch["loss_mask"], gamma, greedy=temp == 0.0,
                                           temperature=temp if temp > 0.0 else 1.0, coupled=coupled)
                sums.update((id(r), (r, s)) for r, s in zip(group, new))
        finally:
            draft.train(was)
    keep = {id(r) for r in records}
    for key in [k for k in sums if k not in keep]:
        del sums[key]
    return mean_accept_length([sums[id(r)][1] for r in records])


def brief(metrics: dict) -> str:
    """A co-training step's metrics (`SpecCoTrainer.end_step`) in one line for the console; the
    dict itself is for a logger (its keys are the field's metric names)."""
    parts = []
    if metrics.get("rollout/spec_verify_steps"):
        parts.append(f"accept length {metrics['rollout/spec_accept_length']:.2f}")
    elif "rollout/spec_verify_steps" in metrics:
        parts.append("decoded plainly")
    if "train/draft_version" in metrics:
        loss = metrics.get("train/draft_loss")
        parts.append(f"draft version {metrics['train/draft_version']} (+{metrics['train/draft_steps']} updates"
                     + (f", loss {loss:.3f})" if loss is not None else ")"))
        parts.append(f"co-training {metrics['perf/draft_overhead_s']:.2f}s")
    if metrics.get("rollout/spec_run_choice") is not None:
        parts.append("speculation " + ("kept" if metrics["rollout/spec_run_choice"] else "off") + " for the run")
    if metrics.get("train/draft_faults"):
        parts.append(f"{metrics['train/draft_faults']} draft faults absorbed")
    return ", ".join(parts) or "co-training off"
