"""Step profiling (rollout.profile) and the
bound's parts measured on the engine's own steps (experiments.bench)."""
import math

import pytest
import torch

from experiments.bench.common import profiled_run
from experiments.bench.speed import engine_step_costs, step_profile
from rollout.engine import EmbeddedEngine, EngineConfig
from rollout.profile import PLAIN_PHASES, SPEC_PHASES, StepProfiler, low_quartile, phase_breakdown
from rollout.protocol import SamplingParams, SpecStats
from rollout.drafters import DrafterSpec, SpecConfig
from specrl.rl_setup import encode_prompts


def test_low_quartile_and_breakdown():
    assert low_quartile([5.0, 1.0, 3.0, 2.0, 4.0]) == 2.0
    assert low_quartile([7.0]) == 7.0
    with pytest.raises(ValueError):
        low_quartile([])
    prof = StepProfiler()
    prof.begin("plain", 2, False)
    prof.mark("forward")
    prof.end()
    out = phase_breakdown(prof.records, PLAIN_PHASES)
    assert out["steps"] == 1 and set(out["phase_s"]) == set(PLAIN_PHASES)
    assert sum(out["phase_s"].values()) == pytest.approx(out["step_s"])


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_profiled_engine_steps(sft_policy, offline_draft, one_thread, mode):
    """A profiler changes no token; every step is recorded with its phases, and the bound's
    parts come out of the real steps."""
    tokenizer, task, policy, _ = sft_policy
    prompts = encode_prompts(tokenizer, task.examples("heldout", 6, 3))
    params = SamplingParams(temperature=0.0, max_new_tokens=24, stop_token_ids=(tokenizer.eos_id,))
    cfg = SpecConfig(mode=mode, gamma=3, tree_topk=3, tree_budget=8)
    plain_engine = EmbeddedEngine(policy, EngineConfig(max_batch=3))
    spec_engine = EmbeddedEngine(policy, EngineConfig(max_batch=3), drafter=DrafterSpec(draft=offline_draft, spec=cfg))
    unprofiled = spec_engine.generate(prompts, params)
    plain_trajs, plain_prof = profiled_run(plain_engine, prompts, params)
    spec_trajs, spec_prof = profiled_run(spec_engine, prompts, params)
    assert plain_engine.profiler is None and spec_engine.profiler is None
    assert [t.token_ids for t in spec_trajs] == [t.token_ids for t in unprofiled] == [t.token_ids for t in plain_trajs]
    assert plain_trajs.stats.engine_steps == len(plain_prof.records)
    assert spec_trajs.stats.engine_steps == len(spec_prof.records)
    spec_steps = spec_prof.select("spec", None, None)
    assert spec_steps and all(r.gamma == 3 for r in spec_steps)
    for r in spec_steps:
        assert set(r.phases) <= set(SPEC_PHASES)
        assert {"draft", "verify_forward", "accept", "cache_features", "emit"} <= set(r.phases)
        assert sum(r.phases.values()) == pytest.approx(r.total_s)
    costs = engine_step_costs(plain_prof, spec_prof, 3, 3)
    assert costs["cost_samples"]["plain_steps"] > 0 and costs["cost_samples"]["spec_steps"] > 0
    assert costs["verify_cost"] > 0 and costs["c"] > 0
    for part in ("target_step_s", "verify_s", "draft_step_s"):  # the quartile never exceeds the median
        assert 0 < costs[part] <= costs[f"{part}_median"]
    prof = step_profile(spec_prof, 3)
    assert prof["spec"]["steps"] == costs["cost_samples"]["spec_steps"]
    # a batch size no step ran at gives no figures rather than wrong ones
    assert engine_step_costs(plain_prof, spec_prof, 7, 3)["c"] is None


def test_interleaved_timing_rotates_the_turn_order():
    """Each repeat starts one engine later than the previous one; results keep the engines' order."""
    from experiments.bench.common import timed_generate_interleaved
    calls = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def generate(self, prompts, params, request_ids=None):
            calls.append((self.name, len(prompts)))
            return []

    engines = {n: Recorder(n) for n in ("plain", "frozen", "online")}
    out = timed_generate_interleaved(engines, [[1]] * 4, None, repeats=4)
    timed = [n for n, k in calls if k == 4]  # the warm-up calls take at most 2 prompts
    assert timed == ["plain", "frozen", "online", "frozen", "online", "plain",
                     "online", "plain", "frozen", "plain", "frozen", "online"]
    assert list(out) == ["plain", "frozen", "online"]


def test_bound_parts_come_from_the_timed_calls_on_cpu(sft_policy, offline_draft, one_thread):
    """On CPU the profiler rides along the timed repeats: the bound's samples are those repeats'
    full-batch steps, pooled (twice one profiled run's for 2 repeats), and no profiler is left on."""
    from experiments.bench.speed import EmbeddedArms, measure_batch
    tokenizer, task, policy, _ = sft_policy
    prompts = encode_prompts(tokenizer, task.examples("heldout", 6, 3))
    params = SamplingParams(temperature=0.0, max_new_tokens=24, stop_token_ids=(tokenizer.eos_id,))
    cfg = SpecConfig(mode="chain", gamma=3)
    _, plain_prof = profiled_run(EmbeddedEngine(policy, EngineConfig(max_batch=3)), prompts, params)
    _, spec_prof = profiled_run(EmbeddedEngine(policy, EngineConfig(max_batch=3), drafter=DrafterSpec(draft=offline_draft, spec=cfg)),
                                prompts, params)
    one_run = engine_step_costs(plain_prof, spec_prof, 3, 3)["cost_samples"]
    plain_row, chain_row = measure_batch(EmbeddedArms(policy, offline_draft, [cfg]), prompts, params, 3, repeats=2)
    assert chain_row["cost_samples"] == {k: 2 * v for k, v in one_run.items()}
    assert chain_row["identical_to_plain"] and chain_row["c"] > 0
    assert plain_row["profile"]["plain"]["steps"] == 2 * one_run["plain_steps"]
    factors = chain_row["efficiency_factors"]  # the efficiency, split into where it goes
    assert set(factors) == {"outside_full_batch_steps", "loop_around_forwards", "mean_over_quartile"}
    assert factors["loop_around_forwards"] < 1.0  # the loop around the forwards is never free
    assert math.prod(factors.values()) == pytest.approx(chain_row["efficiency"], rel=1e-9)
    assert len(chain_row["speedup_repeats"]) == 2 and 0 < chain_row["efficiency_paired"] < 10


def test_paired_efficiency_divides_each_repeat_by_its_own_bound():
    """efficiency_paired = median over repeats of (repeat's speed-up) / (bound from that repeat's
    medians); the pooled figures are untouched by the per-repeat costs."""
    from types import SimpleNamespace

    from experiments.bench.speed import spec_row

    traj = SimpleNamespace(token_ids=[1, 2, 3], spec=SpecStats())
    for _ in range(4):
        traj.spec.record(3, 2)  # tau = 3
    timed = {"trajectories": [traj], "tokens_per_s": 30.0, "tokens_per_s_repeats": [30.0, 20.0, 27.0]}
    plain = {"trajectories": [traj], "tokens_per_s": 10.0, "tokens_per_s_repeats": [10.0, 10.0, 9.0]}
    pooled = {"verify_cost": 1.2, "c": 0.1, "verify_cost_median": 1.5, "c_median": 0.2}
    repeats = [{"verify_cost_median": v, "c_median": c} for v, c in ((1.0, 0.25), (1.5, 0.125), (1.2, 0.2))]
    row = spec_row(1, SpecConfig(mode="chain", gamma=4), timed, plain, pooled, {}, repeats)
    # repeat bounds 3 / 2 = 1.5, 3 / 2 = 1.5, 3 / 2 = 1.5; speed-ups 3, 2, 3
    assert row["speedup_repeats"] == [3.0, 2.0, 3.0]
    assert row["efficiency_paired"] == pytest.approx(2.0)
    assert row["bound"] == pytest.approx(3 / 1.6) and row["bound_median"] == pytest.approx(3 / 2.3)
    assert spec_row(1, SpecConfig(mode="chain", gamma=4), timed, plain, pooled, {})["efficiency_paired"] is None


def test_machine_info_names_the_cpu_and_its_bf16(tmp_path, monkeypatch):
    """A result says which CPU it ran on (two x86_64 machines here differ twofold in the real
    model's update) and whether "auto" precision meant bf16 there."""
    from pathlib import Path

    from experiments.bench import common
    from target_training.grpo import native_bf16

    info = common.machine_info()
    assert info["cpu_bf16"] is native_bf16(torch.device("cpu"))
    fake = tmp_path / "cpuinfo"
    fake.write_text("processor\t: 0\nvendor_id\t: X\nmodel name\t: Example CPU 9000 @ 2.0GHz\nflags\t: fpu\n")
    real_path = Path
    monkeypatch.setattr(common, "Path", lambda p: real_path(fake) if p == "/proc/cpuinfo" else real_path(p))
    assert common.cpu_model() == "Example CPU 9000 @ 2.0GHz"
    monkeypatch.setattr(common, "Path", lambda p: real_path(tmp_path / "absent"))
    assert common.cpu_model() == (common.platform.processor() or common.platform.machine())
