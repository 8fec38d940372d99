"""How many draft updates an RL step gets, driven by acceptance; and the collapse alarm.

Why: a fixed number of updates per RL step trains as much when the draft is in step with the
policy as when the policy is running away from it: acceptance dips while the policy moves
fast, at the same update count. The rule below spends updates where acceptance says they are
needed.

Rule "acceptance" (knobs in `DraftBudgetConfig`), evaluated once per RL step from what the
previous rollouts reported (`observe`, `observe_kl`):
- a_t: the rollout's accept length (only rollouts that speculated count);
- e_t = EMA of a_t (weight `ema`), b_t = running best of e_t, which forgets at rate
  `best_forget` per step towards e_t (so a peak the moved policy can no longer reach stops
  demanding updates after a while);
- deficit d_t = max(0, (b_t - e_t) / b_t - tolerance): how far acceptance has fallen below
  its best, beyond noise;
- falling: a_t < e_{t-1} (the newest rollout is below the trend);
- steps = base_steps + ceil(deficit_gain * d_t) + ceil(kl_gain * kl_t), plus `falling_steps`
  when falling, clipped to [min_steps, cap] (cap = CoTrainConfig.max_draft_steps);
- steady (d_t == 0, not falling, kl_t below kl_steady) for `idle_after` steps in a row: steps =
  min_steps (zero by default), so a draft in step with the policy costs nothing.
Before the first observation the rule gives base_steps. kl_t is the policy's movement the host
reports for the last update (optional: GRPO's k3 KL, an approx-KL, or KL from the start
between two steps); without it the KL terms are zero.

Rule "fixed" (the default): always the cap.

Pricing (`saving_share`, with either rule): an update is bought only with rollout time that
speculation saves. The engine estimates each rollout's saving s_t (`observe_saving`: for every
speculative engine step, the tokens it emitted times the controller's measured seconds per plain
step at that batch size, minus the step's own seconds). S_t = running best of the EMA of s_t,
forgetting like b_t: what a draft in step with the policy is worth per rollout, so a stale draft
(whose saving has fallen) still earns the means to catch up. Each rollout adds
saving_share * S_t to a credit (at most CREDIT_STEPS rollouts' worth); the seconds draft updates
take are taken from it (`spend`); a step runs at most floor(credit / u) updates, u the measured
seconds of one update (one update, while the credit is positive, before u is known). Where
speculation saves nothing, not even with a fresh draft, the draft does not train; where it saves
much, the rule's count decides. Co-training then costs at most saving_share of the best saving,
over any stretch of CREDIT_STEPS rollouts or more.

Rule "value" (co-training as an investment): the co-trainer measures the serving draft's
expected accept length E on held-out sequences of the newest rollouts each step (`observe_heldout`,
draft_models.ttt.expected_accept_length: the same whether or not speculation served them) and
the held-out gain of every trained candidate per full-rate update g (`observe_gain`: a warm-up update
counts by its share of the learning rate, so a probe made during the warm-up is not read as a draft
that learns slowly; the updates it then buys are valued at the full rate, optimistic only for those
still in the warm-up; with `gain_z`, each gain less that many of its standard errors, paired over the
held-out sequences, so a gain the slice cannot tell from noise counts as none). The rollouts' figures
(`observe_rollout`) give the plain rate r (seconds per token: a plain rollout's, or a speculating
one's seconds plus the engine's estimated saving) and the speculating cost c (a speculating
rollout's seconds per token times the serving draft's held-out E when it ran). A draft of held-out
accept length E then saves v(E) = tokens * max(0, r - c / E) seconds per rollout when speculation
is chosen wherever it pays: at the serving draft's own E that is the saving the rollouts measured,
and a better draft speeds speculation up in proportion to its E. (Anchoring c on the rollout's own
accept length instead mixed two scales: the controller shortens chains at a large batch, so the
rollout's accept length sits below the held-out E at the full chain, and v then counted a saving
at the serving draft's E where the run choice had measured speculation slower than plain.) n updates in each of the next m steps (m <= horizon)
are worth sum_{j=1..horizon} (v(E + g n min(j, m)) - v(E)), the rollouts they speed up over the
horizon, and cost n m u (u the measured seconds of one update, its gate included); a step runs
the largest n up to the cap for which some m pays (so a stale draft whose speculation no longer
pays still trains when the gain it shows would bring speculation back within the horizon).
None pays: training stops, and E at that point is kept;
it starts again (a probe of `base_steps` updates, whose gain g is then measured afresh) once E
falls below that by more than `tolerance` (the policy moved), and it probes too while g, r or c
is unknown.

The hard cap (`max_share`, with any rule): draft training, held-out measurement and feature
capture take at most max_share of the wall time over any `share_window` steps (`observe_step`):
a step gets at most the updates whose measured seconds keep the window's share under it. With
bursts every N steps (CoTrainConfig.train_every), the counts granted to the steps in between are
owed to the next burst (`steps(cap, owed)`), and the cap bounds the burst as a whole.

The collapse alarm watches every rollout that speculated, whatever the rule: an accept length
at or below `collapse_accept_length` for `collapse_patience` rollouts in a row means the draft
predicts (almost) nothing, the usual sign of a draft overwritten by a policy sync or lost in a
memory release. It warns once per episode and reports 1 in `rollout/spec_collapse_alarm` while
it lasts; it re-arms when acceptance recovers.
"""
from __future__ import annotations

import math
import warnings

from specrl.config import DraftBudgetConfig

CREDIT_STEPS = 10  # the pricing credit holds at most this many rollouts' earnings

class DraftBudget:
    """Per-step draft-update count (`steps(cap)`) and the collapse alarm; state is checkpointable."""

    def __init__(self, config: DraftBudgetConfig | None = None):
        self.config = config or DraftBudgetConfig()
        self.ema: float | None = None
        self.best: float | None = None
        self.last: float | None = None
        self.falling = False
        self.kl = 0.0
        self.steady_streak = 0
        self.low_streak = 0  # rollouts in a row at or below the collapse threshold
        self.alarm = False
        self.alarms = 0  # collapse episodes so far
        self.saving: float | None = None  # the last rollout's estimated saving (seconds)
        self.saving_ema: float | None = None
        self.saving_best: float | None = None  # S_t (pricing)
        self.credit = 0.0  # seconds of draft training paid for and not yet spent
        self.update_s: float | None = None  # EMA of the measured seconds of one draft update
        # rule "value"
        self.heldout: float | None = None  # E: the serving draft's held-out expected accept length
        self.heldout_stop: float | None = None  # E when training last stopped (None: training)
        self.gain: float | None = None  # g: held-out gain per update of the recent candidates
        self.plain_rate: float | None = None  # r: plain seconds per token
        self.spec_cost: float | None = None  # c: speculating seconds per token x the serving draft's held-out E
        self.tokens: float | None = None  # tokens per rollout
        self.window: list[list[float]] = []  # [step seconds, co-training seconds] of the last steps
        self.spent_now = 0.0  # co-training seconds the current step has spent already (capture, measurement)

    # -- observations ------------------------------------------------------------------------
    def observe(self, accept_length: float, speculated: bool) -> None:
        """One rollout's accept length; `speculated` False (no verify step) is ignored."""
        if not speculated or not math.isfinite(accept_length):
            return
        c = self.config
        self._watch_collapse(accept_length)
        prev = self.ema
        self.falling = prev is not None and accept_length < prev * (1.0 - c.tolerance)
        self.ema, self.best = self._ema_and_best(accept_length, prev, self.best)
        self.last = accept_length
        self.steady_streak = self.steady_streak + 1 if self._steady() else 0

    def observe_kl(self, kl: float | None) -> None:
        """The policy's movement in its last update, as the host measures it (None: unknown)."""
        known = kl is not None and math.isfinite(kl) and self.config.kl_gain > 0  # kl_gain 0: KL is ignored
        self.kl = float(kl) if known else 0.0
        if self.kl >= self.config.kl_steady:  # a moving policy ends a steady spell at once
            self.steady_streak = 0

    def observe_saving(self, saved_s: float | None) -> None:
        """One rollout's estimated saving from speculation, in seconds (None: not estimated)."""
        c = self.config
        if c.saving_share is None or saved_s is None or not math.isfinite(saved_s):
            return
        self.saving = float(saved_s)
        self.saving_ema, self.saving_best = self._ema_and_best(self.saving, self.saving_ema, self.saving_best)
        earn = c.saving_share * max(0.0, self.saving_best)
        self.credit = min(self.credit + earn, CREDIT_STEPS * earn)

    def observe_rollout(self, tokens: int, seconds: float, speculated: bool, accept_length: float | None,
                        saved_s: float | None) -> None:
        """A rollout's figures, for rule "value": its tokens, seconds, whether it speculated, its
        measured accept length (None: too few drafted tokens to tell) and the engine's estimate of
        the seconds speculation saved. Call it after the held-out value of the draft that served
        the rollout (observe_heldout), so c is anchored on that draft's E."""
        if tokens <= 0 or seconds <= 0:
            return
        a = self.config.ema
        ema = lambda old, x: x if old is None else old + a * (x - old)  # noqa: E731
        self.tokens = ema(self.tokens, float(tokens))
        if not speculated:
            self.plain_rate = ema(self.plain_rate, seconds / tokens)
            return
        if saved_s is not None and math.isfinite(saved_s):
            self.plain_rate = ema(self.plain_rate, (seconds + saved_s) / tokens)
        if accept_length is not None and math.isfinite(accept_length) and accept_length >= 1.0:
            ref = self.heldout if self.heldout is not None else accept_length  # before any held-out value
            self.spec_cost = ema(self.spec_cost, seconds * ref / tokens)

    def observe_heldout(self, accept_length: float | None) -> None:
        """The serving draft's held-out expected accept length this step (rule "value")."""
        if accept_length is None or not math.isfinite(accept_length):
            return
        self.heldout = float(accept_length)
        stop = self.heldout_stop
        if stop is not None and self.heldout < stop * (1.0 - self.config.tolerance):
            self.heldout_stop, self.gain = None, None  # the policy moved: probe again

    def observe_gain(self, gain: float, updates: float, se: float = 0.0) -> None:
        """A trained candidate's held-out accept length over the serving draft's (negative for a
        candidate the gate refused), after `updates` updates counted at the full learning rate (a
        warm-up update at a tenth of it counts 0.1): g is the gain of a full-rate update, which is
        what the updates bought from then on are. `se`: the gain's standard error, of which
        `gain_z` are taken off it first."""
        if updates <= 0 or not math.isfinite(gain):
            return
        per = (gain - self.config.gain_z * se) / updates
        self.gain = per if self.gain is None else self.gain + self.config.ema * (per - self.gain)

    def observe_step(self, step_s: float, cotrain_s: float) -> None:
        """An RL step's wall seconds and the co-training seconds inside them (the hard cap)."""
        self.window = (self.window + [[float(step_s), float(cotrain_s)]])[-self.config.share_window:]
        self.spent_now = 0.0

    def value_s(self, accept_length: float) -> float | None:
        """v(E): rollout seconds a draft of held-out accept length E saves per rollout, where
        speculation is chosen when it pays (None: the rates are not measured yet)."""
        if self.plain_rate is None or self.spec_cost is None or self.tokens is None:
            return None
        return self.tokens * max(0.0, self.plain_rate - self.spec_cost / max(accept_length, 1.0))

    def _share_cap(self) -> int | None:
        """Updates this step may run under the hard cap (None: no cap)."""
        c = self.config
        if c.max_share is None:
            return None
        past = self.window[-(c.share_window - 1):] if c.share_window > 1 else []
        if not past:
            return None  # nothing measured yet: the first step's updates are what measures u
        base = past[-1][0] - past[-1][1]  # this step without co-training, as the last one
        step_total, cotrain_total = sum(p[0] for p in past), sum(p[1] for p in past)
        # this step's co-training (already spent, plus x seconds of updates) keeps the window under the
        # share: cotrain_total + spent_now + x <= max_share * (step_total + base + spent_now + x)
        allowed = (c.max_share * (step_total + base) - cotrain_total - (1.0 - c.max_share) * self.spent_now) \
            / (1.0 - c.max_share)
        if allowed <= 0:
            return 0
        return int(allowed / self.update_s) if self.update_s else 1

    def _value_steps(self, cap: int) -> int:
        """Rule "value": updates this step (see the module docstring)."""
        c = self.config
        if self.heldout_stop is not None:
            return 0
        if self.gain is None or self.heldout is None or self.value_s(self.heldout) is None:
            return min(cap, max(1, c.base_steps))  # probe: measure the gain of a few updates
        u = self.update_s or 0.0
        base = self.value_s(self.heldout)
        for n in range(cap, 0, -1):
            for m in range(1, c.horizon + 1):  # n updates in each of the next m steps
                worth = sum(self.value_s(self.heldout + self.gain * n * min(j, m)) - base
                            for j in range(1, c.horizon + 1))
                if worth > n * m * u:
                    return n
        return 0

    def close_step(self, cap: int) -> None:
        """The step is over (rule "value"): where no count of updates up to `cap` pays for itself
        on what was measured, training stops until the serving draft's held-out acceptance falls."""
        if (self.config.rule == "value" and self.heldout_stop is None and self.gain is not None
                and self.heldout is not None and self.value_s(self.heldout) is not None
                and self._value_steps(cap) == 0):
            self.heldout_stop = self.heldout

    def spend(self, seconds: float, updates: int) -> None:
        """Draft updates took `seconds` in all (`updates` of them); priced runs pay from the credit."""
        if updates <= 0:
            return
        if self.config.saving_share is not None:
            self.credit -= seconds
        per = seconds / updates
        self.update_s = per if self.update_s is None else self.update_s + self.config.ema * (per - self.update_s)

    @property
    def priced(self) -> bool:
        """Whether pricing decides (configured, and the engine has estimated a saving)."""
        return self.config.saving_share is not None and self.saving_best is not None

    def affordable(self) -> int | None:
        """Updates the credit pays for (None: not priced)."""
        if not self.priced:
            return None
        if self.credit <= 0.0:
            return 0
        if self.update_s is None:
            return 1
        return int(self.credit / max(self.update_s, 1e-9))

    # -- decision ----------------------------------------------------------------------------
    def deficit(self) -> float:
        if self.ema is None or not self.best:
            return 0.0
        return max(0.0, (self.best - self.ema) / self.best - self.config.tolerance)

    def steps(self, cap: int, owed: int = 0) -> int:
        """Draft updates this RL step may run: the rule's count (at most `cap`) plus `owed`, the
        counts granted to the steps since the last burst (CoTrainConfig.train_every), the whole
        within the hard cap."""
        share = self._share_cap()
        n = self._rule_steps(cap if share is None else min(cap, share)) + max(0, owed)
        paid = None if self.config.rule == "value" else self.affordable()
        for bound in (share, paid):
            n = n if bound is None else min(n, bound)
        return n

    def _rule_steps(self, cap: int) -> int:
        """The rule's count for one step, at most `cap` (the hard cap and pricing not applied)."""
        c = self.config
        if c.rule == "value":
            return max(0, self._value_steps(cap))
        if c.rule == "fixed":
            n = cap
        elif self.ema is None:
            n = c.base_steps
        elif self.steady_streak >= c.idle_after:
            n = c.min_steps
        else:
            n = (c.base_steps + math.ceil(c.deficit_gain * self.deficit()) + math.ceil(c.kl_gain * self.kl)
                 + (c.falling_steps if self.falling else 0))
        return max(0, min(cap, max(c.min_steps, n)))

    def metrics(self, cap: int) -> dict:
        m = {} if self.config.rule != "value" else {
            "sched/heldout_gain_per_update": self.gain, "sched/value_training": int(self.heldout_stop is None),
            "sched/heldout_saving_s": None if self.heldout is None else self.value_s(self.heldout)}
        return m | {"sched/draft_steps_budget": self.steps(cap), "sched/accept_ema": self.ema,
                "sched/accept_best": self.best, "sched/accept_deficit": self.deficit(),
                "rollout/spec_collapse_alarm": int(self.alarm), "rollout/spec_collapse_alarms": self.alarms,
                "sched/spec_saving_s": self.saving, "sched/spec_saving_best_s": self.saving_best,
                "sched/draft_credit_s": self.credit if self.priced else None}

    # -- internals ---------------------------------------------------------------------------
    def _ema_and_best(self, x: float, ema: float | None, best: float | None) -> tuple[float, float]:
        """The EMA after observing x (weight `ema`) and its running best, which forgets toward the
        EMA at rate `best_forget` per observation (acceptance's e_t, b_t; pricing's S_t)."""
        c = self.config
        ema = x if ema is None else ema + c.ema * (x - ema)
        if best is None or ema >= best:
            return ema, ema
        return ema, best - c.best_forget * (best - ema)

    def _steady(self) -> bool:
        return self.deficit() == 0.0 and not self.falling and self.kl < self.config.kl_steady

    def _watch_collapse(self, accept_length: float) -> None:
        c = self.config
        if accept_length > c.collapse_accept_length:
            self.low_streak, self.alarm = 0, False
            return
        self.low_streak += 1
        if self.low_streak >= c.collapse_patience and not self.alarm:
            self.alarm = True
            self.alarms += 1
            warnings.warn(f"speculation accept length {accept_length:.3f} has stayed at or below "
                          f"{c.collapse_accept_length} for {self.low_streak} rollouts: the draft predicts almost "
                          f"nothing (overwritten by a policy sync, lost in a memory release, or untrained?)",
                          RuntimeWarning)

    # -- checkpointing -----------------------------------------------------------------------
    _STATE = ("ema", "best", "last", "falling", "kl", "steady_streak", "low_streak", "alarm", "alarms",
              "saving", "saving_ema", "saving_best", "credit", "update_s", "heldout", "heldout_stop", "gain",
              "plain_rate", "spec_cost", "tokens", "window")

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in self._STATE}

    def load_state_dict(self, state: dict) -> None:
        for k in self._STATE:
            if k in state:
                setattr(self, k, state[k])
