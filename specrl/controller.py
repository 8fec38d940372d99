"""Adaptive speculation: per engine step, speculate or not, and how far, from measured step times.

Terms. An *arm* is plain decoding (0) or a chain of g draft tokens (a gamma; a tree budget in
tree mode). A *bucket* is a batch-size class (n_active rounded up to `batch_buckets`) with
estimates of its own: EMAs of seconds per step, t_plain and t_spec(g), and of tokens emitted per
sequence per step (the accept length) per gamma. Alpha is one per-token acceptance shared by
every bucket; E(a, g) = (1 - a^(g+1)) / (1 - a) is the iid chain model's accept length. The
*anchors* are the shortest and the longest chain.

Decision. Throughput per sequence is 1 / t_plain for plain decoding and accept_len(g) / t_spec(g)
for chain g; the best chain is played only when it beats plain by `margin`, so below break-even
(large batch, low acceptance) the engine decodes plainly. Step times are measured, not modelled
from costs: the textbook speed-up assumes verifying g+1 tokens costs one target step, which an
MoE target does not honour, by a factor that depends on the batch size (docs/design.md section 4).

Acceptance. accept_len(g) = E(alpha_b, g) * r_g. Alpha is inverted from accepted / drafted through
the chain model (so it does not depend on the gamma it was observed at), its EMAs weighted by
drafted tokens (one sequence drafting one token is a coin flip, not a trend). Each bucket keeps
its own (alpha_b), shrunk toward the one all buckets share while few drafted tokens back it.
One alpha for every bucket swings within each rollout: the full batch's young answers accept
more than the tail's few long ones, and the tail's steps come last, so a shared alpha read at the
next rollout's full-batch steps is the tail's, and it chose chains of 2 where chains of 4-6 ran
15-20% faster than those (docs/results.md, "The step controller's chains at the RL batch"). Shared by the
gammas of its bucket, alpha_b lets a collapse seen on the arm being played lower every estimate
of the bucket at once when the policy drifts from the draft, so speculation switches off instead
of trying each stale gamma in turn. r_g, the arm's measured / modelled accept length in the
bucket, absorbs what the iid model gets wrong (acceptance falling with depth, tree budgets
standing in for gammas); its memory is 1/ema times alpha's and it is shrunk toward 1 while few
drafted tokens back it, so an arm is not abandoned for good after one unlucky dip.

Step times. A speculative step is a verify forward and g draft steps, so per bucket t_spec(g) is
close to a line a + b g, fitted to the chains measured `min_samples` times. Exploration therefore
measures plain decoding and the anchors only; every other chain is known from the line until it
is played and measured itself. That keeps exploration cheap: each speculative sample taken after
plain steps pays the draft's catch-up over the positions it missed. Samples are stored at context
0 (`_Growth`) and filtered for outliers (`_StepTime`).

Exploration is deterministic: a fixed round-robin over plain decoding and the anchors until each
has `min_samples` (a chain also counts as known once alpha has them, e.g. after
`reset_acceptance`). Afterwards one non-chosen arm, rotating, is re-measured `explore_every`
decisions after the decision last changed; each re-measurement that leaves the decision as it was
doubles the wait for the next, up to `explore_backoff` times explore_every, so exploration costs
at most 5 / explore_every of the steps. A re-measurement plays its arm for five steps and renews
its estimate (`_StepTime.renew`). While a chain is played, every other re-measurement is plain
decoding's: every decision is weighed against plain, and nothing else refreshes it. A bucket that
decodes plainly re-measures chains rarely: that is dear (the draft catches up over every position
it missed), and acceptance, what drifts in RL, reaches it through alpha anyway.
"""
from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import asdict

from rollout.protocol import StepStats
from specrl.config import ControllerConfig


def expected_accept_length(alpha: float, gamma: float) -> float:
    """Tokens emitted per verify step with per-token acceptance alpha and gamma drafts."""
    if alpha >= 1.0 - 1e-12:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def alpha_from_ratio(ratio: float, depth: float) -> float:
    """Per-token acceptance a such that a chain of `depth` drafts accepts `ratio` of them.

    E[accepted] / depth = (E(a, depth) - 1) / depth is increasing in a: solve by bisection.
    """
    ratio = min(max(ratio, 0.0), 1.0)
    if depth <= 1.0 or ratio in (0.0, 1.0):
        return ratio
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if (expected_accept_length(mid, depth) - 1.0) / depth < ratio:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


class _Ema:
    """EMA that starts as a (mass-weighted) running mean until the weight w takes over, so a
    slow warm-up step is not sticky."""

    __slots__ = ("value", "n", "mass")

    def __init__(self, value: float = 0.0, n: int = 0, mass: float | None = None):
        self.value, self.n = float(value), int(n)
        self.mass = float(n if mass is None else mass)

    def update(self, x: float, w: float, mass: float = 1.0) -> None:
        self.n, self.mass = self.n + 1, self.mass + mass
        self.value += max(w, mass / self.mass) * (float(x) - self.value)

    def state(self) -> list:
        return [self.value, self.n, self.mass]


class _StepTime(_Ema):
    """Seconds per step of one arm: an EMA of the median of its last WINDOW steps (the lower
    median while fewer are in). A step the OS preempts, or one that carries an admission's
    prefill, is a long sample, not a property of the arm: fed to the EMA as it is, it makes the
    arm look slower, and an arm that looks slower is re-measured only once per `explore_every`
    decisions, so it would stay abandoned. Such steps can come in pairs, hence a window of five
    rather than three; a lasting change passes the filter from its third step on.

    A re-measurement (`renew`) is different: the arm was not played for a while, so its old
    samples are stale, not evidence. Its next SETTLE + RENEW samples are taken alone, and the
    median of the last RENEW replaces the estimate, so a stale estimate is corrected at once
    rather than a few samples at a time. The first SETTLE are a switch's, not the arm's: on the
    CPU engine the first plain steps after a run of chains run slow (and a chain's first step
    pays the draft's catch-up), so the renewed estimate leaves them out."""

    __slots__ = ("recent", "renewing")
    WINDOW = 5
    SETTLE = 2
    RENEW = 3

    def __init__(self, value: float = 0.0, n: int = 0, mass: float | None = None, recent=(), renewing=False):
        super().__init__(value, n, mass)
        self.recent = [float(x) for x in recent][-self.WINDOW:]
        self.renewing = bool(renewing)

    def renew(self) -> None:
        self.recent, self.renewing = [], True

    def update(self, x: float, w: float, mass: float = 1.0) -> None:
        self.recent = (self.recent + [float(x)])[-self.WINDOW:]
        if self.renewing:
            if len(self.recent) == self.SETTLE + self.RENEW:
                self.renewing = False
                settled = sorted(self.recent[self.SETTLE:])
                super().update(settled[(self.RENEW - 1) // 2], 1.0, mass)
            return
        ordered = sorted(self.recent)
        super().update(ordered[(len(ordered) - 1) // 2], w, mass)

    def state(self) -> list:
        return [*super().state(), list(self.recent), self.renewing]


class _Growth:
    """How a bucket's step time grows with context: t(L) = t0 (1 + k L), L the mean cached tokens
    per active sequence at the step, k shared by every arm of the bucket: plain steps and chains
    grow alike over a rollout, their ratio unchanged, so arms measured at different contexts (a
    re-measurement of plain late in a phase, a chain early in the next) must not be compared
    as they are. Every arm's samples are stored at context 0 (divided by 1 + k L), where the
    arms compare as they would at one context; k is fitted on runs of CHUNK steps of one arm (Theil-Sen: a preempted step does
    not tilt it) whose contexts span at least SPAN tokens, and kept as an EMA of those fits."""

    __slots__ = ("k", "n", "arm", "run")
    CHUNK = 16
    SPAN = 8.0
    EMA = 0.2

    def __init__(self, k: float = 0.0, n: int = 0, arm: int = -1, run=()):
        self.k, self.n, self.arm = float(k), int(n), int(arm)
        self.run = [(float(c), float(t)) for c, t in run]

    def factor(self, context: float | None) -> float:
        return 1.0 + self.k * context if context is not None else 1.0

    def add(self, arm: int, context: float, seconds: float) -> None:
        if arm != self.arm:
            self.arm, self.run = arm, []
        self.run.append((float(context), float(seconds)))
        if len(self.run) < self.CHUNK:
            return
        run, self.run = self.run, []
        cs = [c for c, _ in run]
        if max(cs) - min(cs) < self.SPAN:
            return
        slope = statistics.median([(t2 - t1) / (c2 - c1) for i, (c1, t1) in enumerate(run)
                                   for c2, t2 in run[i + 1:] if c2 != c1])
        t0 = statistics.median([t - slope * c for c, t in run])
        if t0 <= 0:
            return
        k = min(max(slope / t0, 0.0), 0.1)  # time does not shrink with context; 0.1: +10% per token is no growth model
        self.n += 1
        self.k += max(self.EMA, 1.0 / self.n) * (k - self.k)

    def state(self) -> list:
        return [self.k, self.n, self.arm, [list(x) for x in self.run]]


class _Alpha:
    """Per-token acceptance from EMAs of accepted / drafted and of drafted per sequence,
    inverted through the chain model when read (inverting each step first would be biased: the
    inverse is far from linear when one sequence drafts a few tokens). An observation moves the
    EMAs in proportion to its drafted tokens (up to `ema` from alpha_tokens on): one sequence
    drafting one token is a coin flip, not a measurement to follow."""

    def __init__(self, state=None):
        state = state or [[0.0, 0, 0.0], [0.0, 0, 0.0]]
        self.ratio, self.depth = _Ema(*state[0]), _Ema(*state[1])
        self._value = None  # the inversion (a bisection) is read every decision: computed once per update

    @property
    def n(self) -> int:
        return self.ratio.n

    @property
    def value(self) -> float:
        if self._value is None:
            self._value = alpha_from_ratio(self.ratio.value, self.depth.value) if self.n else 0.0
        return self._value

    def update(self, accepted: float, drafted: float, n_active: int, ema: float, tokens: int) -> None:
        w = ema * min(1.0, drafted / tokens)
        self.ratio.update(accepted / drafted, w, drafted)
        self.depth.update(drafted / n_active, w, drafted)
        self._value = None

    def state(self) -> list:
        return [self.ratio.state(), self.depth.state()]


_PER_ARM = ("spec", "acc", "fit", "model")


class _Bucket:
    def __init__(self, gammas):
        # seconds per step, at context 0 (_Growth): plain decoding, and each chain
        self.plain = _StepTime()
        self.spec = {g: _StepTime() for g in gammas}
        self.growth = _Growth()
        self.context = None  # mean cached tokens per sequence at the bucket's last timed step
        self.forget_acceptance(gammas)
        self.decisions = self.rr = self.since = self.rotate = 0
        self.interval = 0  # decisions between two re-measurements (set at the first exploiting decision)
        self.last_best = -1  # the arm exploited at the last decision (-1: none yet)
        self.re_arm = 0  # a re-measurement's arm (re_left, the steps it still plays: forget_acceptance)

    def forget_acceptance(self, gammas) -> None:
        """New acceptance EMAs, and no re-measurement pending: one was chosen on what is forgotten."""
        self.alpha = _Alpha()  # this bucket's per-token acceptance
        self.acc = {g: _Ema() for g in gammas}  # measured tokens emitted per sequence per step
        self.fit = {g: _Ema() for g in gammas}  # the same, slow and weighted by drafted tokens
        self.model = {g: _Ema() for g in gammas}  # E(alpha, g) at the same samples, same weights
        self.re_left = 0  # steps a re-measurement still plays

    def time(self, arm: int, seconds: float, context: float | None, ema: float) -> None:
        """One timed step of `arm` (0: plain) at `context` cached tokens per sequence (None: unknown)."""
        if context is not None:
            self.growth.add(arm, context, seconds)
            self.context = float(context)
        (self.plain if arm == 0 else self.spec[arm]).update(seconds / self.growth.factor(context), ema)

    def state(self) -> dict:
        per_arm = {k: {g: e.state() for g, e in getattr(self, k).items()} for k in _PER_ARM}
        counters = [self.decisions, self.rr, self.since, self.rotate, self.interval, self.last_best,
                    self.re_arm, self.re_left]
        return {"plain": self.plain.state(), "counters": counters, "growth": self.growth.state(),
                "context": self.context, "alpha": self.alpha.state(), **per_arm}

    def load(self, s: dict) -> None:
        self.plain = _StepTime(*s["plain"])  # a saved state without `recent`: empty
        self.growth = _Growth(*s.get("growth", ()))  # a saved state without `growth`: k = 0
        self.context = s.get("context")
        self.alpha = _Alpha(s.get("alpha"))  # a saved state without one: the shared alpha stands in
        for k in _PER_ARM:
            kind = _StepTime if k == "spec" else _Ema
            setattr(self, k, {int(g): kind(*v) for g, v in s[k].items()})
        counters = [int(x) for x in s["counters"]] + [0, -1, 0, 0][len(s["counters"]) - 4:]  # a saved state may hold 4 or 6
        (self.decisions, self.rr, self.since, self.rotate, self.interval, self.last_best,
         self.re_arm, self.re_left) = counters


class SpeculationController:
    """Chooses per engine step: 0 (plain decoding) or the gamma to speculate with."""

    def __init__(self, config: ControllerConfig | None = None):
        self.config = config or ControllerConfig()
        self.arms = (0,) + self.config.gammas
        self.buckets = {b: _Bucket(self.config.gammas) for b in self.config.batch_buckets}
        self.alpha = _Alpha()
        self.decisions, self._step_gamma = 0, None  # the gamma decided for the current engine step

    # -- engine hooks ----------------------------------------------------------------------
    def bucket_of(self, n_active: int) -> int:
        if n_active < 1:
            raise ValueError(f"n_active must be >= 1, got {n_active}")
        b = self.config.batch_buckets
        return b[min(bisect.bisect_left(b, n_active), len(b) - 1)]

    def should_speculate(self, n_active: int) -> bool:
        """decide(n_active) > 0; the gamma is kept for the following gamma_for_step()."""
        self._step_gamma = self.decide(n_active)
        return self._step_gamma > 0

    def gamma_for_step(self) -> int:
        if self._step_gamma is None:
            raise RuntimeError("gamma_for_step() called before should_speculate()")
        return self._step_gamma

    def decide(self, n_active: int) -> int:
        b = self.buckets[self.bucket_of(n_active)]
        b.decisions += 1
        self.decisions += 1
        arms = self.arms
        explored = (0,) + self._anchors
        for k in range(len(explored)):  # a fixed round-robin over plain and the anchors still unknown
            i = (b.rr + k) % len(explored)
            if not self._known(b, explored[i]):
                b.rr = i + 1
                return explored[i]
        if b.re_left > 0:  # a re-measurement's next step
            b.re_left -= 1
            return b.re_arm
        best = self._best(b)
        every = self.config.explore_every
        if best != b.last_best:  # a new decision is watched closely again: re-measured `every` decisions on
            b.interval, b.last_best, b.since = every, best, 0
        b.since += 1
        if every and b.since >= b.interval:
            # each re-measurement that leaves the decision as it was doubles the wait for the next
            b.since, b.rotate = 0, b.rotate + 1
            b.interval = min(2 * b.interval, every * self.config.explore_backoff)
            others = [a for a in arms if a not in (best, 0)]
            if best != 0 and (b.rotate % 2 or not others):
                arm = 0  # while a chain is played, every other re-measurement is plain decoding's:
                # every decision is made against it, and nothing else refreshes it
            else:
                arm = others[(b.rotate // 2 if best != 0 else b.rotate - 1) % len(others)]
            return self._remeasure(b, arm)
        return best

    @staticmethod
    def _remeasure(b: _Bucket, arm: int) -> int:
        """Start a re-measurement of `arm`: SETTLE + RENEW steps in a row; the median of the last
        RENEW replaces its stale estimate (_StepTime.renew). Returns the arm, to play now."""
        (b.plain if arm == 0 else b.spec[arm]).renew()
        b.re_arm, b.re_left = arm, _StepTime.SETTLE + _StepTime.RENEW - 1
        return arm

    def exploited(self, n_active: int) -> int | None:
        """The arm this batch size's bucket plays when not re-measuring (0: plain decoding), or
        None while it still explores; no decision is counted."""
        b = self.buckets[self.bucket_of(n_active)]
        return None if self._exploring(b) else self._best(b)

    def plain_seconds(self, n_active: int) -> float | None:
        """Measured seconds of a plain engine step at this batch size (its bucket's estimate, at
        the context of the bucket's last timed step), or None."""
        b = self.buckets[self.bucket_of(n_active)]
        return b.plain.value * b.growth.factor(b.context) if b.plain.n else None

    def max_depth(self) -> int:
        return max(self.config.gammas)

    def observe(self, step: StepStats) -> None:
        """What an engine step did (rollout.protocol.StepPolicy): a plain step's time, or a
        speculative step's time and acceptance. A step whose time is not its decoding alone
        (seconds None) still tells acceptance."""
        if step.gamma:
            self.observe_spec(step.n_active, step.gamma, step.seconds, step.tokens_per_seq, step.accepted,
                              step.drafted, step.context)
        elif step.seconds is not None:
            self.observe_plain(step.n_active, step.seconds, step.context)

    def observe_plain(self, n_active: int, seconds: float, context: float | None = None) -> None:
        """One plain step over n_active sequences holding `context` cached tokens each on average
        (None: unknown, taken as the context the estimates are stored at)."""
        self.buckets[self.bucket_of(n_active)].time(0, seconds, context, self.config.ema)

    def observe_spec(self, n_active: int, gamma: int, seconds: float | None, tokens_emitted_per_seq: float,
                     accepted: int, drafted: int, context: float | None = None) -> None:
        """One speculative step over n_active sequences: its wall time (None: not representative,
        e.g. a step that also ran a prefill), the mean tokens it emitted per sequence (bonus token
        included), the accepted / drafted token counts, and the mean cached tokens per sequence
        before the step (as for observe_plain)."""
        if gamma not in self.config.gammas:
            raise ValueError(f"gamma {gamma} is not one of the controller's gammas {self.config.gammas}")
        cfg = self.config
        b = self.buckets[self.bucket_of(n_active)]
        if seconds is not None:
            b.time(gamma, seconds, context, cfg.ema)
        if drafted <= 0:
            return
        b.acc[gamma].update(tokens_emitted_per_seq, cfg.ema)
        self.alpha.update(accepted, drafted, n_active, cfg.ema, cfg.alpha_tokens)
        b.alpha.update(accepted, drafted, n_active, cfg.ema, cfg.alpha_tokens)
        w = cfg.ema * cfg.ema * min(1.0, drafted / cfg.alpha_tokens)  # 1/ema times alpha's memory
        b.fit[gamma].update(tokens_emitted_per_seq, w, drafted)
        b.model[gamma].update(expected_accept_length(self._alpha(b), gamma), w, drafted)

    def reset_acceptance(self) -> None:
        """Forget acceptance (after a draft hot swap or a big policy change); costs are kept.
        Spec arms count as unknown again until re-measured, so each bucket re-explores briefly."""
        self.alpha = _Alpha()
        for b in self.buckets.values():
            b.forget_acceptance(self.config.gammas)

    # -- estimates -------------------------------------------------------------------------
    def _known(self, b: _Bucket, arm: int) -> bool:
        m = self.config.min_samples
        if arm == 0:
            return b.plain.n >= m
        timed = b.spec[arm].n >= m or (arm not in self._anchors and self._time_line(b) is not None)
        return timed and (b.acc[arm].n >= m or self.alpha.n >= m)

    def _exploring(self, b: _Bucket) -> bool:
        """Whether plain decoding or an anchor of this bucket is still unmeasured (every other
        chain is known once the anchors are: from the line through them)."""
        return not all(self._known(b, a) for a in (0,) + self._anchors)

    @property
    def _anchors(self) -> tuple:
        """The chains exploration measures: the shortest and the longest."""
        g = self.config.gammas
        return (min(g), max(g))

    def _time_line(self, b: _Bucket) -> tuple[float, float] | None:
        """(a, b) of the least-squares line t_spec(g) = a + b g through the chains of this bucket
        measured min_samples times, or None while fewer than two are."""
        pts = [(g, e.value) for g, e in b.spec.items() if e.n >= self.config.min_samples]
        if len(pts) < 2:
            return None
        mg = sum(g for g, _ in pts) / len(pts)
        mt = sum(t for _, t in pts) / len(pts)
        slope = sum((g - mg) * (t - mt) for g, t in pts) / sum((g - mg) ** 2 for g, _ in pts)
        return mt - slope * mg, slope

    def _spec_seconds(self, b: _Bucket, g: int, line: tuple | None | bool = False) -> float | None:
        """Seconds per speculative step of chain g: measured (min_samples times), else from the
        bucket's line (`line`, if the caller has it), else what few samples there are, else None."""
        e = b.spec[g]
        if e.n >= self.config.min_samples:
            return e.value
        line = self._time_line(b) if line is False else line
        if line is not None:
            return max(line[0] + line[1] * g, 1e-9)
        return e.value if e.n else None

    def _alpha(self, b: _Bucket) -> float:
        """The bucket's per-token acceptance, shrunk toward the shared one until it rests on
        min_samples * alpha_tokens drafted tokens."""
        if not self.config.bucket_alpha:
            return self.alpha.value
        prior = self.config.min_samples * self.config.alpha_tokens
        own = b.alpha.ratio.mass  # drafted tokens behind it (0, and its value 0, before any)
        return (own * b.alpha.value + prior * self.alpha.value) / (own + prior)

    def _accept_len(self, b: _Bucket, g: int) -> float | None:
        """E(alpha_b, g) times this arm's measured / modelled ratio (slow memory), shrunk
        toward 1 until it rests on min_samples * alpha_tokens drafted tokens. Without any alpha
        yet: the measured EMA, or None."""
        fit = b.fit[g]
        if not self.alpha.n:
            return b.acc[g].value if b.acc[g].n else None
        ratio = fit.value / max(b.model[g].value, 1e-12) if fit.n else 1.0
        prior = self.config.min_samples * self.config.alpha_tokens
        return (fit.mass * ratio + prior) / (fit.mass + prior) * expected_accept_length(self._alpha(b), g)

    def _rates(self, b: _Bucket) -> tuple[float | None, dict]:
        """Per-sequence tokens per second of plain decoding and of each measured gamma."""
        plain = 1.0 / max(b.plain.value, 1e-12) if b.plain.n else None
        line = self._time_line(b)
        secs = {g: self._spec_seconds(b, g, line) for g in self.config.gammas}
        acc = {g: self._accept_len(b, g) for g, t in secs.items() if t is not None}
        return plain, {g: a / max(secs[g], 1e-12) for g, a in acc.items() if a is not None}

    def _best(self, b: _Bucket) -> int:
        plain, spec = self._rates(b)
        if not spec:
            return 0
        g = max(spec, key=lambda k: (spec[k], -k))  # ties: the shorter chain
        return g if plain is None or spec[g] >= self.config.margin * plain else 0

    def summary(self) -> dict:
        """Per touched bucket: chosen gamma (None while exploring), measured costs, accept
        lengths, t_spec / t_plain (= verify_cost + g c, measured) and estimated speedups."""
        out = {"alpha": self.alpha.value if self.alpha.n else None, "decisions": self.decisions, "buckets": {}}
        for key, b in self.buckets.items():
            if not (b.decisions or b.plain.n or any(e.n for e in b.spec.values())):
                continue
            plain, spec = self._rates(b)
            exploring = self._exploring(b)
            chosen = None if exploring else self._best(b)
            speedup = {g: r / plain for g, r in spec.items()} if plain else {}
            h = b.growth.factor(b.context)  # seconds are reported at the bucket's last context
            out["buckets"][key] = {
                "gamma": chosen, "exploring": exploring, "decisions": b.decisions,
                "alpha": self._alpha(b) if self.alpha.n else None,
                "context": b.context, "context_growth": b.growth.k,
                "t_plain_s": b.plain.value * h if b.plain.n else None,
                "t_spec_s": {g: e.value * h for g, e in b.spec.items() if e.n},
                # the seconds the decision uses: measured, or from the line through the measured chains
                "t_spec_used_s": {g: t * h for g in self.config.gammas if (t := self._spec_seconds(b, g)) is not None},
                "accept_len": {g: self._accept_len(b, g) for g in spec},
                "accept_len_measured": {g: e.value for g, e in b.acc.items() if e.n},
                "spec_cost_ratio": {g: e.value / max(b.plain.value, 1e-12)
                                    for g, e in b.spec.items() if e.n and b.plain.n},
                "speedup": speedup,
                "est_speedup": None if chosen is None else (speedup[chosen] if chosen else 1.0),
            }
        return out

    # -- checkpointing ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"config": asdict(self.config), "alpha": self.alpha.state(),
                "decisions": self.decisions, "buckets": {k: b.state() for k, b in self.buckets.items()}}

    def load_state_dict(self, state: dict) -> None:
        cfg = state["config"]
        if (tuple(cfg["gammas"]) != self.config.gammas
                or tuple(cfg["batch_buckets"]) != self.config.batch_buckets):
            raise ValueError("controller state has other gammas or batch buckets than this config")
        self.alpha = _Alpha(state["alpha"])
        self.decisions = int(state["decisions"])
        for k, s in state["buckets"].items():
            self.buckets[int(k)].load(s)
        self._step_gamma = None


def batch_schedule(speedups: dict[int, float], gamma: int, max_batch: int, margin: float = 1.05) -> list[tuple]:
    """A speculation schedule by batch size for an engine that takes one (vLLM's
    num_speculative_tokens_per_batch_size), from the speed-ups of chains of `gamma` over plain
    decoding measured on that engine at a few batch sizes: chains where the measured speed-up is
    at least `margin`, plain decoding (0 draft tokens) elsewhere. A batch size between two
    measured ones follows the nearer on a log scale. Returns ((first, last, draft tokens), ...)
    covering 1..max_batch, neighbouring ranges with the same setting merged."""
    if not speedups or max_batch < 1:
        raise ValueError("batch_schedule needs measured speed-ups and max_batch >= 1")
    measured = sorted(speedups)
    rows: list[list[int]] = []
    for b in range(1, max_batch + 1):
        near = min(measured, key=lambda m: (abs(math.log(b) - math.log(m)), m))
        k = gamma if speedups[near] >= margin else 0
        if rows and rows[-1][2] == k:
            rows[-1][1] = b
        else:
            rows.append([b, b, k])
    return [tuple(r) for r in rows]
