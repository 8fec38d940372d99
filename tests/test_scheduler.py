"""DraftScheduler with a fake clock: budgets, windows, tail detection, memory."""
from __future__ import annotations

import pytest

from specrl.config import WINDOWS, SchedulerConfig
from specrl.scheduler import DraftScheduler
from specrl.scheduler import device_memory_bytes as sched_device_memory


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


def unit(clock, seconds, log=None):
    """A unit of draft work that takes `seconds` on the fake clock and reports it."""
    def work(remaining):
        if log is not None:
            log.append(remaining)
        clock.advance(seconds)
        return seconds
    return work


def warmed(cfg, clock, rl_s=10.0):
    """A scheduler whose step-time EMA has seen one RL step of rl_s seconds."""
    s = DraftScheduler(cfg, clock=clock)
    s.begin_step()
    clock.advance(rl_s)
    s.end_step()
    return s


def test_config_validation():
    for bad in (dict(budget_fraction=-0.1), dict(budget_fraction=1.5), dict(min_budget_s=-1),
                dict(min_budget_s=2.0, max_budget_s=1.0), dict(tail_threshold=0.0), dict(tail_threshold=1.2),
                dict(memory_budget_bytes=0), dict(memory_budget_share=0.0), dict(memory_budget_share=1.5), dict(windows=("tail", "lunch")), dict(windows="tail"), dict(ema=0)):
        with pytest.raises(ValueError, match="SchedulerConfig"):
            SchedulerConfig(**bad)
    assert SchedulerConfig(windows=["between"]).windows == ("between",)


def test_budget_respected_overrun_is_one_unit_and_reported():
    clock = FakeClock()
    s = warmed(SchedulerConfig(budget_fraction=0.1), clock)  # budget 1.0 s
    s.begin_step()
    clock.advance(5.0)
    seen, ran = [], 0
    for _ in range(10):
        ran += s.run_window("between", unit(clock, 0.3, seen)) > 0
    assert ran == 4  # 0.3, 0.6, 0.9 < 1.0, then 1.2: nothing starts once the budget is spent
    assert seen == pytest.approx([1.0, 0.7, 0.4, 0.1])  # each unit is told what is left
    r = s.end_step()
    assert r["sched/budget_s"] == pytest.approx(1.0)
    assert r["perf/draft_train_s"] == pytest.approx(1.2)
    assert r["sched/overrun_s"] == pytest.approx(0.2)  # less than the one unit (0.3 s) that crossed the line


def test_windows_accounted_separately_and_disabled_never_run():
    clock = FakeClock()
    s = warmed(SchedulerConfig(budget_fraction=0.5, windows=("tail", "between")), clock)  # budget 5 s
    s.begin_step()
    called = []

    def never(remaining):
        called.append(remaining)
        return 0.0

    assert s.run_window("interleaved", never) == 0.0 and not called
    assert s.on_engine_step(1, 8, unit(clock, 0.5)) is True
    assert s.on_engine_step(2, 8, unit(clock, 0.5)) is True
    assert s.run_window("between", unit(clock, 1.0)) == pytest.approx(1.0)
    r = s.end_step(step_wall_s=20.0)
    assert r["perf/draft_train_tail_s"] == pytest.approx(1.0)
    assert r["perf/draft_train_between_s"] == pytest.approx(1.0)
    assert r["perf/draft_train_interleaved_s"] == 0.0
    assert r["perf/draft_train_s"] == pytest.approx(2.0)
    with pytest.raises(ValueError):
        s.run_window("lunch", never)

    s2 = warmed(SchedulerConfig(budget_fraction=0.5, windows=("between",)), clock)
    s2.begin_step()
    assert s2.on_engine_step(1, 8, never) is False and not called  # tail disabled


def test_tail_detection():
    clock = FakeClock()
    s = warmed(SchedulerConfig(budget_fraction=0.1, tail_threshold=0.25), clock)
    s.begin_step()
    assert [s.on_engine_step(n, 16) for n in (16, 8, 5, 4, 1, 0)] == [False, False, False, True, True, False]
    assert s.on_engine_step(1, 0) is False
    s.run_window("between", unit(clock, 5.0))  # budget gone
    assert s.on_engine_step(1, 16) is False
    assert s.is_tail(1, 16)  # still the tail, just no budget left


def test_budget_ema_adapts_to_step_time_and_excludes_draft_time():
    clock = FakeClock()
    cfg = SchedulerConfig(budget_fraction=0.1, ema=0.5)
    s = DraftScheduler(cfg, clock=clock)
    for wall in (10.0, 10.0, 30.0, 30.0, 30.0):
        s.begin_step()
        clock.advance(wall)
        s.end_step()
    assert s.step_ema_s == pytest.approx(10 + 20 * (1 - 0.5 ** 3))
    assert s.budget_s == pytest.approx(0.1 * s.step_ema_s)
    # draft time inside the step is not RL work: a 10 s step with 1 s of draft work counts 9 s
    s2 = warmed(SchedulerConfig(budget_fraction=0.2, ema=1.0), clock)  # budget 2 s
    s2.begin_step()
    clock.advance(9.0)
    s2.run_window("between", unit(clock, 1.0))
    r = s2.end_step()
    assert r["sched/rl_step_s"] == pytest.approx(9.0) and s2.step_ema_s == pytest.approx(9.0)
    # clamps
    s3 = warmed(SchedulerConfig(budget_fraction=0.5, min_budget_s=0.2, max_budget_s=1.5), clock)
    assert s3.budget_s == pytest.approx(1.5)
    s4 = warmed(SchedulerConfig(budget_fraction=0.01, min_budget_s=0.2), clock, rl_s=1.0)
    assert s4.budget_s == pytest.approx(0.2)


def test_first_step_budget_is_a_fraction_of_elapsed_rl_time():
    clock = FakeClock()
    s = DraftScheduler(SchedulerConfig(budget_fraction=0.1), clock=clock)
    s.begin_step()
    assert s.remaining_s == 0.0 and s.on_engine_step(1, 8) is False
    clock.advance(20.0)
    assert s.budget_s == pytest.approx(2.0)
    s.run_window("between", unit(clock, 1.0))
    assert s.budget_s == pytest.approx(2.0)  # draft time is not counted as RL time
    r = s.end_step()
    assert r["sched/budget_s"] == pytest.approx(2.0) and r["sched/overrun_s"] == 0.0


def test_time_is_the_larger_of_reported_and_clock():
    clock = FakeClock()
    s = warmed(SchedulerConfig(budget_fraction=0.5), clock)
    s.begin_step()
    assert s.run_window("between", lambda rem: 0.7) == pytest.approx(0.7)  # clock did not move
    assert s.run_window("between", lambda rem: clock.advance(0.4)) == pytest.approx(0.4)  # reports None
    assert s.end_step()["perf/draft_train_between_s"] == pytest.approx(1.1)


def test_errors_are_accounted_and_handed_over():
    clock = FakeClock()
    seen = []
    s = DraftScheduler(SchedulerConfig(budget_fraction=0.5), clock=clock, on_error=seen.append)
    s.load_state_dict(warmed(SchedulerConfig(), clock).state_dict())

    def oom(remaining):
        clock.advance(0.25)
        raise MemoryError("draft OOM")

    s.begin_step()
    assert s.run_window("between", oom) == pytest.approx(0.25)
    assert s.errors == 1 and isinstance(seen[0], MemoryError)
    assert s.end_step()["perf/draft_train_between_s"] == pytest.approx(0.25)
    strict = warmed(SchedulerConfig(budget_fraction=0.5), clock)
    strict.begin_step()
    with pytest.raises(MemoryError):
        strict.run_window("between", oom)


def test_memory_budget():
    s = DraftScheduler(SchedulerConfig(memory_budget_bytes=1000))
    assert s.memory_ok(0) and s.memory_ok(1000) and not s.memory_ok(1001)
    assert DraftScheduler(SchedulerConfig(memory_budget_bytes=None, memory_budget_share=None)).memory_ok(2**40)


def test_the_default_memory_budget_is_a_share_of_the_device(monkeypatch):
    """The default bound scales with the device: a fixed byte count sized for a toy draft starved
    a real model's draft of every update after its first (240 MB of activations per record)."""
    import specrl.scheduler as sched

    monkeypatch.setattr(sched, "device_memory_bytes", lambda device: 24 * 2**30)
    s = DraftScheduler(SchedulerConfig())
    assert s.memory_limit_bytes == int(0.1 * 24 * 2**30)
    assert s.fit_batch(160e6, 240e6, 8) == 8  # the 135M-parameter draft's update fits at 10% of 24 GiB
    assert DraftScheduler(SchedulerConfig(memory_budget_share=0.5)).memory_limit_bytes == 12 * 2**30
    assert DraftScheduler(SchedulerConfig(memory_budget_bytes=1000)).memory_limit_bytes == 1000  # bytes win
    monkeypatch.setattr(sched, "device_memory_bytes", lambda device: None)
    assert DraftScheduler(SchedulerConfig()).memory_limit_bytes is None  # unknown memory: no limit


def test_device_memory_is_read_from_the_machine():
    total = sched_device_memory("cpu")
    assert total is not None and total > 2**28  # any machine that runs the tests has more than 256 MiB


def test_report_keys():
    clock = FakeClock()
    r = warmed(SchedulerConfig(), clock).end_step(step_wall_s=1.0)
    for key in ("perf/draft_train_s", "perf/draft_train_tail_s", "perf/draft_train_between_s",
                "sched/budget_s", "sched/overrun_s"):
        assert key in r
    assert {f"perf/draft_train_{w}_s" for w in WINDOWS} <= set(r)


def test_fit_batch_shrinks_then_skips():
    s = DraftScheduler(SchedulerConfig(memory_budget_bytes=1000))
    assert s.fit_batch(400, 50.0, 8) == 8  # 400 + 8 * 50 = 800 fits
    assert s.fit_batch(600, 50.0, 16) == 8  # 600 + 16 * 50 does not: the largest batch that fits
    assert s.fit_batch(990, 50.0, 16) == 0  # not even one record
    assert s.fit_batch(1000, 0.0, 16) == 16  # exactly at the limit with nothing per record
    assert s.fit_batch(1200, 0.0, 16) == 0  # the resident part alone is over
    assert DraftScheduler(SchedulerConfig(memory_budget_bytes=None, memory_budget_share=None)).fit_batch(
        2**40, 2**30, 16) == 16
