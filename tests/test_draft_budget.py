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
    from rollout.drafters import SpecConfig
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


# -- pricing: draft updates bought with the rollout time speculation saves ------------------------
def _priced(share=0.5, rule="fixed"):
    return DraftBudget(DraftBudgetConfig(rule=rule, saving_share=share, best_forget=0.0))


def test_pricing_needs_a_saving_estimate():
    """Without an estimate (an engine or a fixed chain that does not estimate) the count rule decides."""
    b = _priced()
    b.observe_saving(None)
    assert not b.priced and b.steps(CAP) == CAP


def test_pricing_buys_updates_with_the_saving():
    """A saving of 1.0 s per rollout at share 0.5 earns 0.5 s of draft training per step: with
    updates of 0.2 s measured, two a step, and the credit falls by what they took."""
    b = _priced()
    b.observe_saving(1.0)
    assert b.credit == pytest.approx(0.5)
    assert b.steps(CAP) == 1  # the cost of an update is not yet known: one, to measure it
    b.spend(0.2, 1)
    assert b.credit == pytest.approx(0.3) and b.update_s == pytest.approx(0.2)
    b.observe_saving(1.0)
    assert b.steps(CAP) == 4  # 0.8 s of credit at 0.2 s an update
    assert b.steps(3) == 3  # never beyond the cap
    b.spend(0.8, 4)
    assert b.steps(CAP) == 0  # spent


def test_no_saving_no_updates_and_credit_is_bounded():
    b = _priced()
    for _ in range(5):
        b.observe_saving(-0.05)  # speculation cost time: nothing to spend
    assert b.steps(CAP) == 0 and b.credit == 0.0
    for _ in range(100):
        b.observe_saving(1.0)
    assert b.credit == pytest.approx(10 * 0.5)  # at most CREDIT_STEPS rollouts' worth


def test_a_stale_draft_still_earns_at_its_best_saving():
    """The saving falls when the draft falls behind the policy; the credit keeps accruing at the
    best saving seen (the worth of a draft in step with the policy), so the draft can catch up."""
    b = _priced()
    b.observe_saving(1.0)
    b.spend(0.5, 1)
    for _ in range(3):
        b.observe_saving(0.0)
    assert b.credit == pytest.approx(3 * 0.5)


def test_pricing_caps_the_acceptance_rule():
    """The acceptance rule asks for updates; the credit pays for fewer, and the smaller count wins."""
    b = _priced(share=0.1, rule="acceptance")
    b.observe(3.5, True)
    b.observe(2.0, True)  # acceptance fell: the rule asks for more than its base
    b.observe_saving(1.0)
    b.spend(0.05, 1)  # 0.05 s of the 0.1 s credit; updates cost 0.05 s
    unpriced = DraftBudget(DraftBudgetConfig(rule="acceptance", best_forget=0.0))
    unpriced.observe(3.5, True)
    unpriced.observe(2.0, True)
    assert unpriced.steps(CAP) > 1 and b.steps(CAP) == 1


def test_the_engine_prices_its_saving_as_plain_decoding_of_the_same_tokens():
    """spec_saved_s: plain decoding's steps for the call's tokens (each row's length, rows joining
    as slots free), each at its batch size's measured plain-step time, less the call's measured
    step time; 0 without a speculative step, None while a batch size has no plain time, and
    None without a controller."""
    from rollout.drafters import DrafterSpec, SpecConfig
    from rollout.protocol import StepStats
    from rollout.speculative import Speculator, plain_batch_sizes
    from specrl.config import ControllerConfig
    from specrl.controller import SpeculationController

    # rows of 5, 3, 3 and 1 tokens (the first from the prefill), 4 at a time; then 2 at a time
    assert plain_batch_sizes([5, 3, 3, 1], 4) == [3, 3, 1, 1]
    assert plain_batch_sizes([3, 3, 3], 2) == [2, 2, 1, 1]
    assert plain_batch_sizes([1, 1], 4) == []

    drafter = DrafterSpec("custom", spec=SpecConfig(gamma=2), proposer=lambda n, m: None)
    none = Speculator(drafter).begin(4, 16)
    none.settle([5, 3], 4, 0.1, 1)
    assert none.saved_s is None  # no controller: no estimate

    def priced(plain_s: dict[int, float], lengths, decode_s, spec_steps=1):
        controller = SpeculationController(ControllerConfig(gammas=(1, 2), batch_buckets=(1, 2, 4)))
        session = Speculator(drafter, controller).begin(4, 16)
        for n, t in plain_s.items():
            session.observe(StepStats(n, t))
        session.settle(lengths, 4, decode_s, spec_steps)
        return session.saved_s

    # launch-bound (every step 0.05 s whatever its rows): 4 plain steps for these rows, the
    # longest row's, cost 0.20 s; rows' mean tokens would have counted 2.5 steps
    gpu = {4: 0.05, 2: 0.05, 1: 0.05}
    assert priced(gpu, [5, 3, 3, 1], 0.12) == pytest.approx(4 * 0.05 - 0.12)
    # a step's cost growing with its rows: the tail's steps of one row are cheap
    cpu = {4: 0.08, 2: 0.04, 1: 0.02}
    assert priced(cpu, [5, 3, 3, 1], 0.12) == pytest.approx(2 * 0.08 + 2 * 0.02 - 0.12)
    assert priced(cpu, [5, 3, 3, 1], 0.12, spec_steps=0) == 0.0  # nothing speculated: nothing saved
    assert priced({4: 0.08}, [5, 3, 3, 1], 0.12) is None  # one row's steps: no plain time measured
    # a step that also ran new requests' prefill (no time reported): its acceptance still reaches
    # the controller, and no plain time is taken from it
    controller = SpeculationController(ControllerConfig(gammas=(1, 2)))
    session = Speculator(drafter, controller).begin(4, 16)
    session.observe(StepStats(4, 0.05))
    session.observe(StepStats(4, 0.10, gamma=2, tokens_per_seq=3.0, accepted=8, drafted=8))
    alpha_n, spec_n = controller.alpha.n, controller.buckets[4].spec[2].n
    session.observe(StepStats(4, None))
    session.observe(StepStats(4, None, gamma=2, tokens_per_seq=3.0, accepted=8, drafted=8))
    assert controller.plain_seconds(4) == pytest.approx(0.05)
    assert controller.buckets[4].spec[2].n == spec_n and controller.alpha.n == alpha_n + 1


def test_priced_state_round_trip():
    b = _priced()
    b.observe_saving(1.0)
    b.spend(0.2, 1)
    c = _priced()
    c.load_state_dict(b.state_dict())
    assert c.state_dict() == b.state_dict() and c.steps(CAP) == b.steps(CAP)


@pytest.mark.parametrize("share", [0.0, 1.5, -0.1])
def test_bad_saving_share_is_refused(share):
    with pytest.raises(ValueError, match="saving_share"):
        DraftBudgetConfig(saving_share=share)


# ---------------------------------------------------------------- rule "value"
def _valued(**kw):
    b = DraftBudget(DraftBudgetConfig(rule="value", base_steps=2, **kw))
    # plain: 5 s per 1000 tokens; speculating: 2.5 s per 1000 tokens at accept length 2 (a verify step's cost)
    b.observe_rollout(1000, 5.0, False, None, None)
    b.observe_rollout(1000, 2.5, True, 2.0, None)
    return b


def test_the_value_rule_probes_while_the_gain_is_unknown_then_trains_while_the_gain_pays():
    b = DraftBudget(DraftBudgetConfig(rule="value", base_steps=2))
    assert b.steps(8) == 2  # nothing measured: a probe
    b = _valued()
    b.observe_heldout(2.0)
    assert b.steps(8) == 2  # the gain per update is not measured yet: a probe
    b.spend(1.0, 2)  # 0.5 s per update
    b.observe_gain(0.2, 2)  # +0.1 accept length per update: 8 updates save ~0.8 s per rollout for 10 rollouts
    assert b.steps(8) == 8
    assert b.value_s(3.0) == pytest.approx(1000 * (0.005 - 0.005 / 3.0))


def test_the_value_rule_stops_when_the_gain_flattens_and_starts_again_when_held_out_acceptance_falls():
    b = _valued()
    b.observe_heldout(2.0)
    b.spend(1.0, 2)
    b.observe_gain(0.0001, 2)  # the draft has stopped improving
    assert b.steps(8) == 0
    b.close_step(8)
    assert b.heldout_stop == 2.0 and b.metrics(8)["sched/value_training"] == 0
    b.observe_heldout(1.99)  # within the tolerance: still stopped
    assert b.steps(8) == 0
    b.observe_heldout(1.8)  # the policy moved: probe again
    assert b.heldout_stop is None and b.gain is None and b.steps(8) == 2


def test_gain_z_counts_a_gain_within_its_noise_as_none():
    """The same measured gain of +0.2 over 2 updates buys 8 updates when counted as measured, and
    none once 2 of its standard errors (0.15 each) are taken off it: training stops there."""
    for z, want in ((0.0, 8), (2.0, 0)):
        b = _valued(gain_z=z)
        b.observe_heldout(2.0)
        b.spend(1.0, 2)
        b.observe_gain(0.2, 2, se=0.15)
        assert b.gain == pytest.approx((0.2 - z * 0.15) / 2)
        assert b.steps(8) == want
    b = _valued(gain_z=2.0)
    b.observe_heldout(2.0)
    b.spend(1.0, 2)
    b.observe_gain(0.2, 2, se=0.01)  # well beyond its noise: bought as before
    assert b.steps(8) == 8
    with pytest.raises(ValueError, match="gain_z"):
        DraftBudgetConfig(gain_z=-1.0)


def test_the_value_rule_trains_a_draft_that_no_longer_pays_when_its_gain_would_bring_speculation_back():
    """A stale draft whose speculation no longer pays (its verify steps cost 28 ms per 1000 tokens
    at accept length 1, so it breaks even with plain decoding at 5.6): updates that would lift it
    past break-even within the horizon are bought, though one step's updates alone would not."""
    b = DraftBudget(DraftBudgetConfig(rule="value", base_steps=2))
    b.observe_rollout(1000, 5.0, False, None, None)
    b.observe_rollout(1000, 14.0, True, 2.0, None)  # a verify step costs 14 s x 2 / 1000 tokens
    b.observe_heldout(2.0)  # v(2.0) = 0: speculating is 14 s against plain's 5 s
    b.spend(0.02, 2)
    b.observe_gain(0.4, 2)  # 0.2 per update: 8 updates a step, break-even (5.6) after 3 steps
    assert b.value_s(2.0) == 0.0 and b.value_s(2.0 + 0.2 * 8) == 0.0
    assert b.steps(8) == 8


def test_the_value_of_the_serving_draft_is_the_saving_its_rollouts_measured_whatever_their_chain_length():
    """c is anchored on the serving draft's held-out E (at the full chain), not on the rollout's
    accept length (which the controller's shorter chains keep lower): v(E) at the serving draft's E
    is what speculation saved, and a rollout slower than plain gives that draft no value at all."""
    b = DraftBudget(DraftBudgetConfig(rule="value", base_steps=2))
    b.observe_heldout(3.0)  # the serving draft: E 3.0 at the full chain
    b.observe_rollout(1000, 5.0, False, None, None)
    b.observe_rollout(1000, 2.5, True, 2.0, None)  # its rollout: accept length 2.0 at the chains it ran
    assert b.value_s(3.0) == pytest.approx(5.0 - 2.5)  # anchored on 2.0, v(3.0) would read 3.33 s
    assert b.value_s(6.0) == pytest.approx(1000 * (0.005 - 0.0025 * 3.0 / 6.0))  # twice E: twice as fast
    slow = DraftBudget(DraftBudgetConfig(rule="value", base_steps=2))
    slow.observe_heldout(3.0)
    slow.observe_rollout(1000, 5.0, False, None, None)
    slow.observe_rollout(1000, 5.5, True, 2.0, None)  # speculating measured slower than plain
    assert slow.value_s(3.0) == 0.0 and slow.value_s(3.0 * 5.5 / 5.0 + 0.01) > 0.0


def test_the_hard_cap_keeps_cotraining_under_its_share_of_the_step_over_the_window():
    b = _valued(max_share=0.05, share_window=10)
    b.observe_heldout(2.0)
    b.spend(1.0, 2)
    b.observe_gain(0.2, 2)
    for _ in range(9):
        b.observe_step(10.0, 0.2)  # 2% so far
    # the window's 9 steps hold 1.8 s of 90 s; this step (9.8 s without co-training) may add
    # (0.05 * (90 + 9.8) - 1.8) / 0.95 = 3.36 s: 6 updates of 0.5 s
    assert b.steps(8) == 6
    b.spent_now = 0.95  # this step's capture and measurement so far: (4.99 - 1.8 - 0.9025) / 0.95 = 2.41 s left
    assert b.steps(8) == 4
    for _ in range(9):
        b.observe_step(10.0, 0.6)  # already 6%: nothing this step
    assert b.steps(8) == 0


def test_a_burst_adds_the_counts_owed_to_the_steps_before_it_within_the_hard_cap():
    """CoTrainConfig.train_every: the counts granted to the steps between bursts join the burst,
    and the window's hard cap bounds the whole burst, owed updates included."""
    b = _valued(max_share=0.05, share_window=10)
    b.observe_heldout(2.0)
    b.spend(1.0, 2)
    b.observe_gain(0.2, 2)
    for _ in range(9):
        b.observe_step(10.0, 0.0)  # steps between bursts spend nothing
    # (0.05 * (90 + 10) - 0) / 0.95 = 5.26 s: 10 updates of 0.5 s
    assert b.steps(2) == 2 and b.steps(2, owed=4) == 6 and b.steps(2, owed=9) == 10
    b.config.max_share = None
    assert b.steps(2, owed=9) == 11
