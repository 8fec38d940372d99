"""The drift experiment, the speed sweep and the analysis notebook, on CI-sized runs.

The quick preset's numbers are measured by `specrl drift --preset quick` (README); here we check
that the machinery produces every promised output, that one seed reproduces the summary exactly
(apart from the documented timing fields) and that the notebook runs on a real output folder."""
import json
import os
import statistics
from pathlib import Path

import pytest

from experiments.drift import DRIFT_PRESETS, TIMING_FIELDS, DriftError, deterministic_part, get_drift_preset, run_drift
from specrl.cli import main

REQUIRED = ("tau_start", "tau_frozen_end", "tau_online_end", "tau_reference_end", "speedup_frozen_end",
            "speedup_online_end", "speedup_online_over_frozen_end", "online_over_frozen_steps_end", "reward_start",
            "reward_end", "kl_end", "wall_s", "seed")
PLOTS = ("accept_length.png", "speedup.png", "reward.png", "acceptance_heatmap.png", "speedup_vs_batch.png")


@pytest.fixture(scope="session")
def drift_runs(tmp_path_factory, sft_policy):
    cache = sft_policy[3]
    root = tmp_path_factory.mktemp("drift")
    quiet = dict(cache_dir=cache, progress=False, log=lambda *a: None)
    first = run_drift("ci", root / "a", seed=1, deep_target="ci", **quiet)  # the sweep's deeper target: CI-sized
    second = run_drift("ci", root / "b", seed=1, plots=False, **quiet)
    return root, first, second


def test_drift_outputs(drift_runs):
    root, summary, _ = drift_runs
    out = root / "a"
    for key in REQUIRED:
        assert key in summary, key
    assert json.loads((out / "summary.json").read_text()) == summary
    for name in PLOTS:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    from specrl.cli import format_end  # what `specrl drift` ends with: the headline figures and the files

    end = format_end("drift", summary, out).splitlines()
    assert len(end) < 12 and any(line.split()[:2] == ["accept", "length"] for line in end)
    assert any("speedup_vs_batch.png" in line for line in end)
    uncounted = "\n".join(format_end("drift", {**summary, "online_over_frozen_steps_end": None}, out).splitlines())
    assert "engine steps: not counted" in uncounted  # vLLM does not count them: no made-up x0.000
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    preset = get_drift_preset("ci")
    steps = sorted({r["step"] for r in rows})
    assert steps == list(range(0, preset.rl.rl_steps + 1, preset.eval_every))
    assert preset.reference_every == 1
    rl_rows = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert summary["train_every"] == preset.rl.cotrain.train_every == 1
    assert summary["draft_updates"] == sum(r["train/draft_steps"] for r in rl_rows) > 0
    assert summary["draft_refused"] <= summary["draft_gated"]
    assert summary["draft_gated"] == max(r.get("train/draft_gated_total") or 0 for r in rl_rows)
    ratios = []
    for step in steps:  # every point has the four arms (reference_every=1) and the online/reference ratio
        pts = {r["arm"]: r for r in rows if r["step"] == step}
        assert set(pts) == {"plain", "frozen", "online", "reference"}
        ratio = pts["online"]["online_over_reference"]
        assert ratio == pts["online"]["accept_length"] / pts["reference"]["accept_length"]
        ratios.append(ratio)
    assert ratios[0] == 1.0  # step 0: online and reference are both the starting draft
    below, beyond = [], []
    for step in steps:  # online over frozen with its bootstrap interval at every point
        pts = {r["arm"]: r for r in rows if r["step"] == step}
        o = pts["online"]
        assert o["online_over_frozen"] == pytest.approx(o["accept_length"] / pts["frozen"]["accept_length"])
        assert o["online_over_frozen_low"] <= o["online_over_frozen"] <= o["online_over_frozen_high"]
        if step == 0:  # the same draft: no spread
            assert o["online_over_frozen_low"] == o["online_over_frozen_high"] == 1.0
        else:
            below += [step] if o["online_over_frozen"] < 1.0 else []
            beyond += [step] if o["online_over_frozen_high"] < 1.0 else []
    assert summary["online_below_frozen_points"] == below and summary["online_below_frozen_beyond_noise"] == beyond
    assert summary["online_below_frozen_n"] == len(below) and summary["online_below_frozen_beyond_noise_n"] == len(beyond)
    end = {r["arm"]: r for r in rows if r["step"] == steps[-1]}
    assert all(isinstance(r["engine_steps"], int) and r["engine_steps"] > 0 for r in end.values())
    assert summary["online_over_frozen_steps_end"] == end["frozen"]["engine_steps"] / end["online"]["engine_steps"]
    per_repeat = [o / f for o, f in zip(end["online"]["tokens_per_s_repeats"], end["frozen"]["tokens_per_s_repeats"])]
    assert len(per_repeat) == (preset.final_timing_repeats or preset.timing_repeats)
    assert summary["speedup_online_over_frozen_end"] == pytest.approx(statistics.median(per_repeat))
    assert summary["online_over_reference_min"] == min(ratios)
    assert summary["reference_steps"] == steps
    assert 0.0 < summary["draft_added_fraction"] < 1.0  # measured 0.34-0.35 on the 2-core CI box
    added = sum(r["perf/draft_train_s"] + r["perf/feature_capture_s"] for r in
                [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()])
    assert added > 0
    # one row per RL step in the RL run's own log, with the co-training metrics
    rl_rows = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rl_rows] == list(range(preset.rl.rl_steps))
    assert all(r["train/draft_steps"] <= preset.rl.cotrain.max_draft_steps for r in rl_rows)
    assert sum(r["train/draft_steps"] for r in rl_rows) > 0
    # the policy moved away from the frozen draft, whose accept length fell (seed 1: 2.75 -> 2.26);
    # the online draft was retrained and kept more of it (2.55), close to a draft retrained from
    # scratch on the current policy (lowest online/reference ratio 0.996)
    assert summary["kl_end"] > 0
    assert summary["tau_frozen_end"] < summary["tau_start"] - 0.2
    assert summary["tau_online_end"] > summary["tau_frozen_end"] + 0.1
    assert summary["online_over_reference_min"] > 0.9
    # whether the timings had the machine to themselves: measured for every RL step and timed window
    assert all(r["perf/others_busy_cores"] >= 0.0 for r in rl_rows)
    assert summary["others_busy_cores_rl_max"] == max(r["perf/others_busy_cores"] for r in rl_rows)
    assert summary["rl_steps_shared"] == sum(r["perf/others_busy_cores"] > 0.1 for r in rl_rows)
    assert all(r["others_busy_cores"] >= 0.0 for r in rows if r["arm"] == "plain")
    assert summary["others_busy_cores_eval_max"] >= max(r["others_busy_cores"] for r in rows if r["arm"] == "plain")
    # the deep target's sweep: plain, chain and adaptive at every sweep batch, lossless, with the bound's parts
    deep = summary["speedup_vs_batch_deep_target"]
    assert [(r["batch"], r["mode"]) for r in deep] == [(b, m) for b in preset.speed_batches
                                                       for m in ("plain", "chain", "adaptive")]
    for r in deep:
        assert r["preset"] == "ci" and r["target_layers"] > 0 and r["tokens_per_s"] > 0
        if r["mode"] == "chain":
            assert r["identical_to_plain"] and r["gamma"] == preset.rl.cotrain.spec.gamma
            assert r["c"] > 0 and r["bound"] == pytest.approx(r["accept_length"] / (r["verify_cost"] + r["gamma"] * r["c"]),
                                                              rel=1e-3)


def test_drift_same_seed_same_summary(drift_runs):
    _, first, second = drift_runs
    a, b = deterministic_part(first), deterministic_part(second)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert set(first) - set(a) == set(TIMING_FIELDS) | {"timing_fields", "machine"}
    assert first["timing_fields"] == list(TIMING_FIELDS)


def test_drift_refuses_existing_output_and_bad_preset(drift_runs, tmp_path, capsys):
    root, _, _ = drift_runs
    with pytest.raises(DriftError, match="already holds a drift run"):
        run_drift("ci", root / "a", progress=False)
    assert main(["drift", "--preset", "huge", "--out", str(tmp_path / "x")]) == 2
    assert "--preset: invalid choice: 'huge'" in capsys.readouterr().err
    assert main(["drift", "--preset", "ci", "--reference-every", "-1", "--out", str(tmp_path / "y")]) == 2
    assert "--reference-every must be >= 0, got -1" in capsys.readouterr().err and not (tmp_path / "y").exists()
    with pytest.raises(DriftError, match="reference_every"):  # the API's own check
        run_drift("ci", tmp_path / "z", reference_every=-1, progress=False)


def test_drift_train_every_makes_the_online_draft_train_in_bursts(sft_policy, tmp_path, capsys):
    quiet = dict(cache_dir=sft_policy[3], progress=False, plots=False, log=lambda *a: None)
    summary = run_drift("ci", tmp_path / "e", seed=1, train_every=2, reference_every=0, **quiet)
    rows = [json.loads(line) for line in (tmp_path / "e" / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert summary["train_every"] == 2
    assert [r["step"] for r in rows if r["train/draft_steps"] > 0] == [0, 2]  # the ci preset's 4 steps
    assert summary["draft_updates"] == sum(r["train/draft_steps"] for r in rows)
    assert main(["drift", "--preset", "ci", "--train-every", "0", "--out", str(tmp_path / "f")]) == 2
    assert "--train-every must be in [1, 99], got 0" in capsys.readouterr().err and not (tmp_path / "f").exists()


def test_analysis_notebook_executes(drift_runs, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    root, summary, _ = drift_runs
    nb = nbformat.read(Path(__file__).parents[1] / "notebooks" / "analysis.ipynb", as_version=4)
    os.environ["SPECRL_RUN"] = str(root / "a")
    try:
        nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                resources={"metadata": {"path": str(Path(__file__).parents[1])}}).execute()
    finally:
        del os.environ["SPECRL_RUN"]
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert f"{summary['tau_start']:.3f}" in text
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert len(images) == len(PLOTS)


def test_speed_sweep(sft_policy, tmp_path):
    """`specrl bench speed` with lists of chain lengths and tree budgets: one arm each, plus the
    adaptive arm over 1..the longest chain."""
    from experiments.bench.speed import bench_speed

    summary = bench_speed("arith", "ci", tmp_path, [2], gammas=(1, 3), tree_budgets=(4,), repeats=1,
                          prompts_per_batch=1, temperature=1.0, cache_dir=sft_policy[3], log=lambda *a: None)
    assert [r["mode"] for r in summary["rows"]] == ["plain", "chain", "chain", "tree", "adaptive"]
    assert summary["rows"][-1]["gammas"] == [1, 2, 3]
    spec = [r for r in summary["rows"] if r["mode"] in ("chain", "tree")]
    assert [(r["mode"], r["gamma"], r["tree_budget"]) for r in spec] == [("chain", 1, None), ("chain", 3, None),
                                                                         ("tree", 4, 4)]
    for r in spec:
        assert r["identical_to_plain"]
        assert 1.0 <= r["accept_length"] <= r["gamma"] + 1
        assert r["bound"] == pytest.approx(r["accept_length"] / (r["verify_cost"] + r["gamma"] * r["c"]), rel=1e-3)
        assert r["bound_median"] == pytest.approx(
            r["accept_length"] / (r["verify_cost_median"] + r["gamma"] * r["c_median"]), rel=1e-3)
        assert r["efficiency_median"] == pytest.approx(r["speedup_median"] / r["bound_median"], rel=1e-3)
        assert r["speedup_median"] == pytest.approx(r["speedup"], rel=1e-3)  # one repeat: best = median
        # the saved step times (seconds, a few ms or less) reproduce the saved ratios: not rounded away
        assert r["verify_s"] / r["target_step_s"] == pytest.approx(r["verify_cost"], rel=1e-4)
        assert r["draft_step_s"] / r["target_step_s"] == pytest.approx(r["c"], rel=1e-4)
    for name in ("speedup_vs_gamma.png", "speedup_vs_tree_budget.png", "speedup_vs_batch.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("name", sorted(DRIFT_PRESETS))
def test_drift_presets_cotrain_as_the_rl_presets_do_or_fix_every_decision(name):
    """The drift experiment's online arm co-trains with the RL presets' one configuration
    (presets.cotrained), so what it shows is what train-rl and bench rl get; the CI presets decide
    nothing from measured times instead (the same seed gives the same online draft,
    test_drift_same_seed_same_summary on `ci`): the chain at every step, a wide time budget for a
    count of updates, no pricing."""
    from specrl.presets import cotrained

    cot = get_drift_preset(name).rl.cotrain
    if name.startswith("ci"):
        assert cot.adaptive is False and cot.scheduler.draft_steps.saving_share is None
        assert cot.scheduler.draft_steps.rule == "fixed" and cot.scheduler.draft_steps.max_share is None
        assert cot.scheduler.min_budget_s >= 3600 and cot.scheduler.windows == ("between",)
    else:
        assert cot == cotrained(cot.spec, cot.online.compute_dtype)


def test_full_and_quick_presets_track_the_reference_at_every_point():
    assert get_drift_preset("full").reference_every == 1
    assert get_drift_preset("quick").reference_every == 1  # a fresh reference per point: online / reference per point


def test_drift_preset_rejects_an_unknown_deep_target(tmp_path, capsys):
    assert get_drift_preset("full").deep_target == "speed" and get_drift_preset("quick").deep_target == ""
    assert main(["drift", "--preset", "ci", "--deep-target", "huge", "--out", str(tmp_path / "z")]) == 2
    assert "deep_target must be a model preset" in capsys.readouterr().err and not (tmp_path / "z").exists()


def test_drift_preset_rejects_bad_final_timing_repeats():
    from experiments.drift import DriftPreset
    quick = get_drift_preset("quick")
    assert quick.final_timing_repeats > quick.timing_repeats  # the headline end-of-run ratios get more turns
    for bad in (-1, 1.5, True):
        with pytest.raises(DriftError, match="final_timing_repeats"):
            DriftPreset(rl=quick.rl, final_timing_repeats=bad)


@pytest.mark.slow
def test_compiled_draft_measurement(sft_policy, tmp_path):
    """experiments.compile_draft: every arm decodes plain decoding's tokens (a compiled draft can
    only change acceptance, and only by rounding), and every arm is timed and saved."""
    from experiments.compile_draft import run
    summary = run(tmp_path, preset="ci", batches=(2,), repeats=1, prompts_per_batch=2, cache_dir=sft_policy[3],
                  log=lambda *a: None)
    rows = {r["arm"]: r for r in summary["rows"]}
    assert set(rows) == {"plain", "eager", "compiled", "static"}
    assert all(r["identical_to_plain"] and r["tokens_per_s"] > 0 for r in rows.values())
    for arm in ("compiled", "static"):
        assert rows[arm]["engine_steps"] > 0 and rows[arm]["compile_warmup_s"] > 0
    for arm in ("eager", "static"):  # the profiled run's full-batch phases
        assert rows[arm]["draft_ms"] > 0 and rows[arm]["verify_forward_ms"] > 0
    assert json.loads((tmp_path / "summary.json").read_text())["rows"] == summary["rows"]


@pytest.mark.slow
def test_engine_options_measurement(sft_policy, tmp_path):
    """experiments.engine_options: plain and chain decoding under every option, every engine
    with the default plain engine's tokens, the ratios taken per repeat and saved."""
    from experiments.engine_options import OPTIONS, run
    summary = run(tmp_path, preset="ci", batches=(2,), repeats=2, prompts_per_batch=2, cache_dir=sft_policy[3],
                  log=lambda *a: None)
    rows = {r["mode"]: r for r in summary["rows"]}
    assert set(rows) == {"plain", "chain"}
    for r in rows.values():
        assert r["identical_to_plain_exact"] and r["compiled_failures"] == 0
        for option in OPTIONS:
            assert r[f"tokens_per_s_{option}"] > 0 and len(r[f"{option}_over_exact_repeats"]) == 2
    assert rows["chain"]["chain_over_plain_median_compiled"] > 0
    assert json.loads((tmp_path / "summary.json").read_text())["rows"] == summary["rows"]


@pytest.mark.slow
def test_compiled_target_measurement(sft_policy, tmp_path):
    """experiments.compile_target: each shape within the dense dispatch timed eager and compiled,
    the compiled logits within rounding of eager's; larger blocks are skipped, not compiled."""
    from experiments.compile_target import run
    summary = run(tmp_path, preset="ci", batches=(1, 8), calls=3, cache_dir=sft_policy[3], log=lambda *a: None)
    shapes = {(r["batch"], r["block"]) for r in summary["rows"]}
    assert (1, 1) in shapes and (8, 1) in shapes and (8, 5) not in shapes  # 40 tokens: beyond the dense size
    for r in summary["rows"]:
        assert r["compiled_us"] > 0 and r["eager_us"] > 0 and r["max_abs_logit_diff_x1e6"] < 100


def test_the_loss_comparison_trains_both_objectives_on_the_same_data_and_measures_them(sft_policy, tmp_path):
    """experiments.loss_compare on the CI preset: the starting draft and one copy per arm (objective
    or precision), each measured on the held-out answers and by decoding the same prompts (the same
    tokens in every arm: speculation is lossless); an existing summary is never overwritten, an
    unknown arm is refused."""
    from experiments.loss_compare import ARMS, compare, main

    r = compare("arith", "ci", tmp_path / "l", seed=0, rl_steps=3, updates=5, arms=tuple(ARMS), on_policy=True,
                cache_dir=sft_policy[3], log=lambda *a: None)
    assert set(r["arms"]) == {"start", *ARMS} and r["same_tokens"] is True
    assert r["arms"]["ce-bf16"]["loss_last"] != r["arms"]["ce"]["loss_last"]  # the precision arm did differ
    assert r["train_records"] > 0 and r["heldout_records"] > 0
    for m in r["arms"].values():
        assert 1.0 <= m["heldout_expected_accept_length"] <= 1 + r["gamma"]
        assert 1.0 <= m["measured_accept_length"] <= 1 + r["gamma"]
    ce, lr, batch = r["arms"]["ce"], r["arms"]["lr-x4"], r["arms"]["batch-x2"]
    assert lr["lr"] == 4 * ce["lr"] and batch["batch_size"] == 2 * ce["batch_size"] and lr["loss_last"] != ce["loss_last"]
    # the curve: the starting draft at 0 s, then after 4 and 5 updates, its last point the arm's final draft
    assert [p["step"] for p in ce["curve"]] == [0, 4, 5] and ce["curve"][0]["seconds"] == 0.0
    assert ce["curve"][1]["seconds"] < ce["curve"][2]["seconds"]
    assert ce["curve"][-1]["heldout"] == pytest.approx(ce["heldout_expected_accept_length"])
    assert [p["heldout"] for p in ce["heldout_at_ce_seconds"]] == pytest.approx([p["heldout"] for p in ce["curve"][1:]])
    assert [p["step"] for p in lr["heldout_at_ce_seconds"]] == [4, 5]  # every arm read at ce's seconds
    start = r["arms"]["start"]["heldout_expected_accept_length"]
    for p, q in zip(lr["heldout_at_ce_seconds"], ce["heldout_at_ce_seconds"]):
        if p["heldout"] is not None and q["heldout"] > start:  # the arm's gain over the start, over ce's
            assert p["gain_over_ce"] == pytest.approx((p["heldout"] - start) / (q["heldout"] - start))
    assert main(["--preset", "ci", "--out", str(tmp_path / "l")]) == 2  # summary.json is there: refused
    assert main(["--preset", "ci", "--arms", "ce,fp8", "--out", str(tmp_path / "m")]) == 2


def test_the_near_tie_replay_recomputes_the_tokens_the_run_decoded(sft_policy, tmp_path):
    """experiments.near_ties on the CI preset: one step replayed with speculation off, then every
    answer's tokens are the argmax of the recomputed perturbed scores (the noise keyed as the run
    keys it), the gaps are margins (>= 0); bad input and a used folder exit with code 2."""
    from experiments.near_ties import main, near_ties

    r = near_ties("ci", tmp_path / "n", seed=0, step=1, answers=(0, 3), cache_dir=sft_policy[3], log=lambda *a: None)
    assert r["agree"] is True and r["tokens"] > 0 and set(r["answers"]) == {"0", "3"}
    assert all(g >= 0 for g in r["smallest_gaps"]) and r["smallest_gaps"] == sorted(r["smallest_gaps"])
    assert all(a["agree"] and 0 < a["tokens"] <= r["tokens"] for a in r["answers"].values())
    assert r["smallest_gap"] == r["smallest_gaps"][0] <= r["second_smallest_gap"]
    assert all(a["smallest_gap"] == a["smallest"][0][1] >= r["smallest_gap"] for a in r["answers"].values())
    assert main(["--preset", "ci", "--step", "1", "--out", str(tmp_path / "n")]) == 2  # summary.json is there
    assert main(["--preset", "ci", "--step", "1", "--answer", "16", "--out", str(tmp_path / "m")]) == 2
    assert main(["--preset", "ci", "--step", "-1", "--out", str(tmp_path / "m")]) == 2
    assert not (tmp_path / "m").exists()


def test_an_arm_is_read_at_the_seconds_of_another_between_its_measured_points():
    """loss_compare.read_at: linear between the curve's points, exact at them, None past the last."""
    from experiments.loss_compare import curve_points, read_at

    curve = [{"seconds": 0.0, "heldout": 4.0}, {"seconds": 1.0, "heldout": 5.0}, {"seconds": 3.0, "heldout": 4.0}]
    assert read_at(curve, 0.5) == pytest.approx(4.5) and read_at(curve, 2.0) == pytest.approx(4.5)
    assert read_at(curve, 1.0) == pytest.approx(5.0) and read_at(curve, 3.5) is None
    assert curve_points(64) == [4, 8, 16, 32, 64] and curve_points(5) == [4, 5] and curve_points(3) == [3]


def test_the_draft_precision_comparison_trains_fp32_and_bf16_on_the_same_batches(sft_policy, tmp_path):
    """experiments.draft_precision on the CI preset: both arms start from the same draft, train on
    the same batches (their first losses differ by bf16 rounding only) and are measured on the same
    held-out answers; an existing summary and a held-out share that leaves nothing to train on are
    refused with exit code 2."""
    from experiments.draft_precision import DTYPES, compare, main

    r = compare("arith", "ci", tmp_path / "p", seed=0, answers=12, heldout=4, updates=3, cache_dir=sft_policy[3],
                log=lambda *a: None)
    assert set(r["arms"]) == set(DTYPES) and 1.0 <= r["start"] <= 1 + r["gamma"]
    fp32, bf16 = r["arms"]["fp32"], r["arms"]["bf16"]
    assert fp32["loss_first"] != bf16["loss_first"] and abs(bf16["loss_first"] / fp32["loss_first"] - 1) < 0.05
    assert all(1.0 <= a["heldout_expected_accept_length"] <= 1 + r["gamma"] for a in r["arms"].values())
    assert main(["--preset", "ci", "--out", str(tmp_path / "p")]) == 2  # summary.json is there: refused
    assert main(["--preset", "ci", "--answers", "4", "--heldout", "4", "--out", str(tmp_path / "q")]) == 2


def test_the_busy_neighbour_runs_the_command_beside_seeded_spells(tmp_path, capsys):
    """experiments.busy_neighbour: the command's exit status comes back and the neighbour ends
    with it; the spells are a function of the seed alone; bad arguments get one line and 2."""
    import sys

    from experiments.busy_neighbour import SPELL_S, WAIT_S, main, spells

    log = tmp_path / "spells.txt"
    assert main(["3", str(log), "--", sys.executable, "-c", "import sys; sys.exit(3)"]) == 3
    first = spells(7, 20)
    assert first == spells(7, 20) and first != spells(8, 20)
    assert all(WAIT_S[0] <= w <= WAIT_S[1] and SPELL_S[0] <= s <= SPELL_S[1] for w, s in first)
    for bad in (["x", str(log), "--", "true"], ["1", str(log), "true"], ["1", "--", "true"]):
        assert main(bad) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1
