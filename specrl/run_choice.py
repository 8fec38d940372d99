"""Speculate or not, per rollout, from the measured speed of whole rollouts (`RunChoice`).

The co-trainer owns it (specrl.cotrain.SpecCoTrainer): at the start of each RL step it switches
the engine's speculation on or off as the choice says (`set_speculation`), and it reports each
rollout's figures (rollout.protocol.RolloutStats) back. The engines know nothing of it.
"""
from __future__ import annotations

import statistics


class RunChoice:
    """Speculate or not, per rollout, from the measured tokens per second of whole rollouts.

    Why whole rollouts. The per-step controller decides from estimates of single engine steps,
    and near break-even those are off by more than its margin (docs/results.md, the RL step on
    the 4-layer models); a rollout's tokens per second is what the run pays. An engine that
    cannot switch its drafter off step by step (vLLM) has only this choice.

    Terms. A *block* is a run of rollouts played with one arm ("spec" or "plain"); its first
    `warmup` rollouts are played, not timed, its next `rollouts` are timed. The first two
    blocks time speculation, then plain decoding; speculation is kept iff the median tokens per
    second of its timed rollouts is at least `margin` times plain's. Tokens per second, not
    seconds per rollout: rollouts hold different prompts. `rewarm`: every block starts with a
    warm-up (a restarted engine's first rollouts run slower); else only the first does.

    `sure`: where the engine estimates each speculating rollout's saving (the embedded engine's
    controller does) and every timed one is estimated at least `sure` times faster than plain,
    speculation is kept without a plain block: an estimate errs by less than that.

    `recheck` > 0: the arm not chosen is timed again (one block) `recheck` rollouts after a
    choice, and each re-check that leaves the choice as it was doubles the wait, up to BACKOFF
    times: the policy and the draft drift. Without it the first choice is final. `calls_left`,
    where the owner knows the run's length (the generate() calls still to come, counting the next
    one; None: open-ended): a re-check, periodic or asked for, is not started unless at least as
    many calls follow its block as the block holds. A choice made later would serve fewer
    rollouts than it cost to time, and in the run's last rollouts none at all.

    `paired` (a free switch only, so without `rewarm`): the plain rollouts are timed in *pairs*,
    each next to a speculating one (the arm not chosen first), and the choice is the median of
    the pairs' ratios (speculating over plain tokens per second) against the margin. Two blocks
    are timed rollouts apart, and a slow spell of the machine over one of them reads as that
    arm's speed (docs/results.md: speculation running at x0.95 of plain read as x1.35 of it, a
    spell having fallen on the plain block); the two rollouts of a pair run back to back, so a
    spell longer than a rollout slows both, and the median leaves out a pair it split. The first
    choice still times its speculating block first, for `sure`; the pairs follow it where the
    estimate is not sure.

    The owner asks `arm()` before each rollout and reports the rollout with `record`."""

    BACKOFF = 8

    def __init__(self, rollouts: int, warmup: int = 1, margin: float = 1.05, recheck: int = 0,
                 sure: float | None = None, rewarm: bool = True, paired: bool = False):
        if rollouts < 1 or warmup < 0 or recheck < 0:
            raise ValueError(f"RunChoice needs rollouts >= 1, warmup >= 0 and recheck >= 0, got {rollouts}, "
                             f"{warmup}, {recheck}")
        if paired and rewarm:
            raise ValueError("RunChoice(paired=True) needs rewarm=False: pairs switch arms every rollout, "
                             "which only a free switch affords")
        self.rollouts, self.warmup, self.margin = int(rollouts), int(warmup), float(margin)
        self.recheck, self.sure, self.rewarm, self.paired = int(recheck), sure, bool(rewarm), bool(paired)
        self.rates: dict[str, list[float]] = {"spec": [], "plain": []}  # the last `rollouts` timed calls per arm
        self.estimated: list[float] = []  # the engine's speed-up estimates of the last timed speculating calls
        self.pairs: list[float] = []  # paired: the ratios (spec over plain tokens/s) of the last paired block
        self._half: tuple[str, float] | None = None  # paired: the first call of a pair, (arm, tokens/s)
        self.calls = 0
        self.speculate: bool | None = None  # the choice, once both arms are timed (or the estimate is sure)
        self.chosen_speedup: float | None = None  # speedup() when the choice was last made
        self.decisions = 0  # choices made so far (the first and every re-check's)
        # the calls still to time, in order: (arm, timed, paired); a warm-up call is played, not timed
        self.queue = self._block("spec", self.warmup, alone=True) + self._block("plain", self.warmup if self.rewarm else 0)
        self.since, self.interval = 0, self.recheck  # calls since the last choice; the wait for the next re-check
        self.calls_left: int | None = None  # set by the owner before each call where the run's length is known
        # re-checks due and not started (too few calls left): a re-check asked for again at the
        # next call (the held-out prediction asks at every step while it holds) is the same one
        self.skipped = 0
        self._skipped_at = -2

    def _block(self, arm: str, warmup: int, alone: bool = False) -> list:
        """The calls that time `arm`: `warmup` untimed, then `rollouts` timed, each followed by one
        of the other arm where paired (unless `alone`: the first choice's speculating block)."""
        if not self.paired or alone:
            return [(arm, False, False)] * warmup + [(arm, True, False)] * self.rollouts
        other = "spec" if arm == "plain" else "plain"
        return [(arm, False, False)] * warmup + [(arm, True, True), (other, True, True)] * self.rollouts

    def arm(self) -> str:
        """"spec" or "plain": how the next generate() call decodes."""
        if self.queue:
            return self.queue[0][0]
        return "spec" if self.speculate else "plain"

    def record(self, arm: str, tokens: int, seconds: float, est_saved_s: float | None = None) -> None:
        """A generate() call decoded as `arm` emitted `tokens` in `seconds`; `est_saved_s`: the
        engine's estimate of the seconds speculation saved in it (None: not estimated)."""
        self.calls += 1
        timing = bool(self.queue)
        _, timed, paired = self.queue.pop(0) if timing else (arm, True, False)
        if timed and seconds > 0:
            self.rates[arm] = (self.rates[arm] + [tokens / seconds])[-self.rollouts:]
            if arm == "spec":
                est = None if est_saved_s is None else (seconds + est_saved_s) / seconds
                self.estimated = (self.estimated + [est])[-self.rollouts:]
        if paired:
            self._pair(arm, tokens / seconds if seconds > 0 else None)
        if timing:
            if self.speculate is None and self.queue and self.queue[0][0] == "plain" and self._sure():
                self.queue = []  # speculation estimated well above plain: nothing to time against
            if not self.queue:
                self._choose()
            return
        self.since += 1
        if self.recheck and self.since >= self.interval:
            self.since = 0
            if self.speculate and self._sure():  # still far above plain: no block of plain calls
                self.interval = min(2 * self.interval, self.BACKOFF * self.recheck)
                return
            self._time_other()

    def _time_other(self) -> None:
        """Queue a block timing the arm not chosen (a paired block starts its list of ratios afresh),
        unless too few calls are left for its choice to serve (`calls_left`)."""
        block = self._block("plain" if self.speculate else "spec", self.warmup if self.rewarm else 0)
        if self.calls_left is not None and self.calls_left - 1 < 2 * len(block):  # calls after the one recorded
            self.skipped += self._skipped_at < self.calls - 1  # once per run of calls that ask
            self._skipped_at = self.calls
            return
        self.queue = block
        self.pairs, self._half = [], None

    def _pair(self, arm: str, rate: float | None) -> None:
        """A paired call: the first of its pair waits for the second, which adds the pair's ratio."""
        if self._half is None:
            self._half = (arm, rate)
            return
        (first, r0), self._half = self._half, None
        if rate and r0 and first != arm:
            spec, plain = (r0, rate) if first == "spec" else (rate, r0)
            self.pairs.append(spec / plain)

    def recheck_now(self) -> None:
        """Time the arm not chosen again now (one block), not at the next periodic re-check: the
        owner has a reason to expect the choice to change (a draft that got better or went stale).
        Nothing happens before the first choice or while a block is being timed."""
        if self.speculate is None or self.queue:
            return
        self.since = 0
        self._time_other()

    def _sure(self) -> bool:
        e = self.estimated
        return (self.sure is not None and len(e) == self.rollouts
                and all(x is not None and x >= self.sure for x in e))

    def _choose(self) -> None:
        speedup = self.speedup()
        choice = self._sure() if speedup is None else speedup >= self.margin  # measured, where it is
        if self.speculate is not None:  # a re-check: one that changes nothing doubles the wait
            same = choice == self.speculate
            self.interval = min(2 * self.interval, self.BACKOFF * self.recheck) if same else self.recheck
        self.speculate, self.chosen_speedup, self.since = choice, speedup, 0
        self.decisions += 1

    def speedup(self) -> float | None:
        """Median speculating over median plain tokens per second (None until both are timed);
        paired: the median of the last paired block's ratios (None before one)."""
        if self.paired:
            return statistics.median(self.pairs) if self.pairs else None
        if not self.rates["spec"] or not self.rates["plain"]:
            return None
        return statistics.median(self.rates["spec"]) / statistics.median(self.rates["plain"])

    def saved_s(self, tokens: int, seconds: float) -> float | None:
        """A decided call's estimated saving: the time plain decoding takes for its tokens at the
        measured rate, less its own (0 once plain decoding is chosen; None before the choice, or
        without a plain rate)."""
        if self.speculate is None:
            return None
        if not self.speculate:
            return 0.0
        if not self.rates["plain"]:
            return None
        return tokens / statistics.median(self.rates["plain"]) - seconds

    def summary(self) -> dict:
        return {"speculate": self.speculate, "speedup": self.chosen_speedup, "rollouts": self.rollouts,
                "warmup": self.warmup, "calls": self.calls, "tokens_per_s": {k: list(v) for k, v in self.rates.items()},
                "estimated_speedup": list(self.estimated), "paired": self.paired, "pair_speedups": list(self.pairs),
                "rechecks_skipped_at_end": self.skipped}

    def state_dict(self) -> dict:
        # rollouts, warmup, margin, recheck, sure and rewarm come from the config
        return {"calls": self.calls, "rates": {k: list(v) for k, v in self.rates.items()}, "speculate": self.speculate,
                "chosen_speedup": self.chosen_speedup, "estimated": list(self.estimated),
                "queue": [list(q) for q in self.queue], "since": self.since, "interval": self.interval,
                "decisions": self.decisions, "pairs": list(self.pairs), "skipped": self.skipped,
                "half": list(self._half) if self._half is not None else None}

    def load_state_dict(self, state: dict) -> None:
        self.calls, self.speculate = int(state["calls"]), state["speculate"]
        self.rates = {k: [float(x) for x in v] for k, v in state["rates"].items()}
        self.estimated = list(state.get("estimated", []))
        self.chosen_speedup = state.get("chosen_speedup", self.speedup() if self.speculate is not None else None)
        if "queue" in state:  # (arm, timed) before pairs existed
            self.queue = [(str(q[0]), bool(q[1]), bool(q[2]) if len(q) > 2 else False) for q in state["queue"]]
        elif self.speculate is not None:  # a saved state without a queue, decided: the choice is final
            self.queue = []
        else:  # a saved state without a queue, still timing: time both blocks again
            self.rates = {"spec": [], "plain": []}
        self.since, self.interval = int(state.get("since", 0)), int(state.get("interval", self.recheck))
        self.decisions = int(state.get("decisions", int(self.speculate is not None)))
        self.pairs = [float(x) for x in state.get("pairs", [])]
        self.skipped = int(state.get("skipped", 0))
        half = state.get("half")
        self._half = (str(half[0]), half[1]) if half is not None else None


def choice_history(rows) -> dict | None:
    """An RL run's per-rollout choice, from its metric rows (`rollout/spec_run_choice`: 1, 0, or
    None while its first rollouts are timed): the choice at the end, the speed-up it was made on,
    the step it was first made, the steps where a re-check changed it, how many steps ended
    with speculation chosen (`speculating_steps`; where it cannot pay, each is a wrong one) and
    the re-checks not started because the run was about to end. None for a run without a choice
    per rollout."""
    rows = [r for r in rows if "rollout/spec_run_choice" in r]
    if not rows:
        return None
    decided = [r for r in rows if r["rollout/spec_run_choice"] is not None]
    return {"speculate": bool(decided[-1]["rollout/spec_run_choice"]) if decided else None,
            "speedup": decided[-1].get("rollout/spec_run_speedup") if decided else None,
            "decided_at_step": decided[0]["step"] if decided else None,
            "changed_at_steps": [r["step"] for p, r in zip(decided, decided[1:])
                                 if r["rollout/spec_run_choice"] != p["rollout/spec_run_choice"]],
            "speculating_steps": sum(1 for r in decided if r["rollout/spec_run_choice"]),
            "rechecks_skipped_at_end": rows[-1].get("rollout/spec_run_rechecks_skipped", 0)}


def describe(history: dict | None) -> str:
    """A run choice's history (`choice_history`) in words; '' for a run without one."""
    if not history:
        return ""
    if history["speculate"] is None:
        return "speculation for the run not decided yet (its first rollouts are timed)"
    changes = history.get("changed_at_steps") or []
    first = history["speculate"] if len(changes) % 2 == 0 else not history["speculate"]  # each change flips it
    line = f"speculation for the run {'kept' if first else 'switched off'} at step {history['decided_at_step']}"
    if changes:
        line += f", changed at steps {changes}, {'on' if history['speculate'] else 'off'} at the end"
    if history.get("rechecks_skipped_at_end"):
        line += f", no re-check in the run's last rollouts ({history['rechecks_skipped_at_end']} due)"
    speedup = history.get("speedup")
    timed = f"x{speedup:.3f}" if speedup is not None else "not timed: the estimate was sure"
    return f"{line} (speculating over plain, tokens/s: {timed})"
