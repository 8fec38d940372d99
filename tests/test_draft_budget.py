"""The acceptance-driven draft budget and the collapse alarm (specrl.draft_budget), on synthetic
accept-length sequences, and their wiring into the co-trainer's metrics."""
import warnings
from types import SimpleNamespace

import pytest

from rollout.protocol import SpecStats
from specrl.config import DraftBudgetConfig
from specrl.draft_budget import DraftBudget

CAP = 8


def _run(seq, cfg=None, kls=None):
    """Feed accept lengths (and optional KLs); the step count granted after each observation."""
    b = DraftBudget(cfg or DraftBudgetConfig(rule="acceptance"))
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for i, a in enumerate(seq):
            b.observe(a, True)
            if kls is not None:
                b.observe_kl(kls[i])
            out.append(b.steps(CAP))
    return b, out


def test_fixed_rule_is_the_cap_whatever_acceptance_does():
    _, steps = _run([3.5, 3.0, 2.0, 1.0, 3.8], DraftBudgetConfig(rule="fixed"))
    assert steps == [CAP] * 5
    assert DraftBudget().steps(1) == 1  # the default: the drift preset's one update per step


def test_steady_acceptance_drops_to_zero_updates():
    cfg = DraftBudgetConfig(rule="acceptance", idle_after=3)
    assert DraftBudget(cfg).steps(CAP) == cfg.base_steps  # nothing observed yet
    _, steps = _run([3.5] * 8, cfg)
    assert steps[:2] == [cfg.base_steps] * 2  # steady, but not long enough
    assert steps[2:] == [0] * 6


def test_falling_acceptance_gets_more_updates_up_to_the_cap():
    cfg = DraftBudgetConfig(rule="acceptance")
    seq = [3.7] * 5 + [3.6, 3.45, 3.3, 3.15, 3.0, 2.8, 2.5, 2.2]
    b, steps = _run(seq, cfg)
    falling = steps[5:]
    assert min(falling) > cfg.base_steps  # every falling step trains more than the steady pace
    assert falling == sorted(falling)  # the deeper the dip below the best, the more updates
    assert falling[-1] == CAP  # and never more than the cap
    assert b.deficit() > 0.2


def test_recovery_returns_to_steady_and_a_lost_peak_is_forgotten():
    cfg = DraftBudgetConfig(rule="acceptance", best_forget=0.2)
    # a dip, then the draft catches up with a policy it can only partly follow (3.3 < the old 3.7)
    _, steps = _run([3.7] * 4 + [3.2, 3.0, 3.1] + [3.3] * 30, cfg)
    assert max(steps[4:7]) > cfg.base_steps
    assert steps[-1] == 0  # the unreachable old best no longer demands updates
    _, never = _run([3.7] * 4 + [3.2, 3.0, 3.1] + [3.3] * 30, DraftBudgetConfig(rule="acceptance", best_forget=0.0))
    assert never[-1] > cfg.base_steps  # without forgetting, the old peak would keep the draft at work


def test_policy_movement_alone_raises_the_budget():
    seq = [3.5] * 10
    kls = [0.0] * 5 + [0.3] * 5
    _, without = _run(seq, DraftBudgetConfig(rule="acceptance", kl_gain=10.0), kls=[0.0] * 10)
    _, with_kl = _run(seq, DraftBudgetConfig(rule="acceptance", kl_gain=10.0), kls=kls)
    assert without[5:] == [0] * 5
    assert all(s >= 1 + 3 for s in with_kl[5:])  # base + ceil(10 * 0.3)
    _, ignored = _run(seq, DraftBudgetConfig(rule="acceptance", kl_gain=0.0), kls=kls)
    assert ignored == without  # kl_gain 0: the KL report changes nothing


def test_rollouts_without_speculation_are_ignored():
    b = DraftBudget(DraftBudgetConfig(rule="acceptance"))
    b.observe(3.5, True)
    b.observe(0.0, False)  # the controller decoded plainly: no acceptance measured
    assert b.ema == 3.5 and b.low_streak == 0


def test_collapse_alarm_warns_once_per_episode():
    b = DraftBudget(DraftBudgetConfig(collapse_patience=2))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for a in (2.7, 2.71, 1.0):
            b.observe(a, True)
        assert not b.alarm and not w  # one low rollout is not yet a collapse
        b.observe(1.0, True)
        assert b.alarm and b.alarms == 1 and len(w) == 1 and "accept length" in str(w[0].message)
        b.observe(1.02, True)
        assert b.alarm and len(w) == 1  # one warning per episode
        b.observe(2.5, True)
        assert not b.alarm  # recovered: re-armed
        b.observe(1.0, True)
        b.observe(1.0, True)
        assert b.alarm and b.alarms == 2 and len(w) == 2
    assert b.metrics(CAP)["rollout/spec_collapse_alarm"] == 1


def test_state_round_trip():
    b, _ = _run([3.7, 3.5, 3.2])
    c = DraftBudget(DraftBudgetConfig(rule="acceptance"))
    c.load_state_dict(b.state_dict())
    assert c.steps(CAP) == b.steps(CAP) and c.state_dict() == b.state_dict()


@pytest.mark.parametrize("bad", [dict(rule="sometimes"), dict(min_steps=-1), dict(ema=0.0), dict(deficit_gain=-1.0),
                                 dict(collapse_accept_length=0.5), dict(base_steps=1.5)])
def test_bad_config_is_refused(bad):
    with pytest.raises(ValueError, match="DraftBudgetConfig"):
        DraftBudgetConfig(**bad)


def _rollout(accepted_per_step: int, steps: int = 10):
    s = SpecStats()
    for _ in range(steps):
        s.record(4, accepted_per_step)
    return [SimpleNamespace(spec=s)]


def test_cotrainer_reports_the_alarm_and_the_budget(tiny_model):
    """The co-trainer wires the rule: its metrics carry the alarm, and its burst is cut to the
    rule's count (zero once acceptance is steady)."""
    from rollout.engine import EmbeddedEngine
    from rollout.speculative import SpecConfig
    from specrl.config import CoTrainConfig, DraftTrainConfig, SchedulerConfig
    from specrl.cotrain import SpecCoTrainer
    from specrl.drafts import new_draft

    draft = new_draft(tiny_model, [[3, 4, 5, 6]], DraftTrainConfig(draft_vocab_size=64))
    sched = SchedulerConfig(draft_steps=DraftBudgetConfig(rule="acceptance", idle_after=2))
    cot = SpecCoTrainer(draft, CoTrainConfig(mode="online", spec=SpecConfig(gamma=4), scheduler=sched,
                                             max_draft_steps=6)).attach(EmbeddedEngine(tiny_model))
    cot.begin_step()
    assert cot.on_rollout(_rollout(2))["rollout/spec_collapse_alarm"] == 0
    cot.on_rollout(_rollout(2))
    assert cot.metrics()["sched/draft_steps_budget"] == 0  # steady: no updates
    cot.on_rollout(_rollout(0))
    with pytest.warns(RuntimeWarning, match="accept length"):
        m = cot.on_rollout(_rollout(0))
    assert m["rollout/spec_collapse_alarm"] == 1
    assert cot.metrics()["sched/draft_steps_budget"] == 6  # acceptance fell from 3 to 1: the cap
