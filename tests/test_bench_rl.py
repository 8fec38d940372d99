"""`specrl bench rl`: arms of one GRPO run taking turns, each step split into its parts.

Timings are not asserted (they belong to the benchmark's JSON); what is checked is what the
figures rest on: every arm did the same RL work, the parts add up to the step, the ratios are
the ratios of the saved rows' medians, and the arms really differ in what they switch on."""
import dataclasses
import json
import statistics
import sys

import pytest

from experiments.bench.rl import PARTS, bench_rl, summarize
from specrl.cli import main
from specrl.run_dir import RUN_FILE, RunDirError


@pytest.fixture(scope="module")
def bench(sft_policy, tmp_path_factory):
    cache = sft_policy[3]
    out = tmp_path_factory.mktemp("bench") / "rl"
    summary = bench_rl("arith", "ci", out, steps=3, segment=1, warmup=1, cache_dir=cache,
                       arms=("off", "frozen", "online", "online-fixed"), log=lambda *a: None)
    return out, summary


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_summary_shape_and_same_updates(bench):
    out, s = bench
    saved = json.loads((out / "summary.json").read_text())
    assert saved["engines"].keys() == {"embedded"} and saved["model"] == "tiny"
    arms = saved["engines"]["embedded"]["arms"]
    assert list(arms) == ["off", "frozen", "online", "online-fixed"]
    for m in arms.values():
        for key in ("step_s", "rollout_s", "cotrain_share", "step_speedup", "rollout_speedup"):
            assert isinstance(m[key], float)
    assert saved["engines"]["embedded"]["same_updates"] is True
    assert (out / "rl_step.png").stat().st_size > 0


def test_answer_lengths_are_the_off_arms_answers(bench):
    out, s = bench
    lens = [n for r in _rows(out / "embedded" / "off" / "metrics.jsonl") for n in r["rollout/response_lens"]]
    d = s["engines"]["embedded"]["response_lengths"]
    assert d["answers"] == len(lens) == 3 * 16  # 3 steps of 4 prompts x 4 answers
    assert (d["min"], d["max"], d["median"]) == (min(lens), max(lens), sorted(lens)[len(lens) // 2])
    assert d["at_cap"] == sum(n >= 48 for n in lens) / len(lens)  # the ci preset's max_new_tokens


def test_ratios_are_the_rows_medians(bench):
    out, s = bench
    arms = s["engines"]["embedded"]["arms"]
    rows = {a: [r for r in _rows(out / "embedded" / a / "metrics.jsonl") if r["step"] >= 1] for a in arms}
    off = statistics.median(r["step_s"] for r in rows["off"])
    for a, m in arms.items():
        assert m["step_s"] == statistics.median(r["step_s"] for r in rows[a])
        assert m["step_speedup"] == pytest.approx(off / m["step_s"])
        assert m["total_step_speedup"] == pytest.approx(sum(r["step_s"] for r in rows["off"])
                                                        / sum(r["step_s"] for r in rows[a]))
    assert arms["off"]["cotrain_share"] == 0.0
    assert arms["frozen"]["cotrain_share"] > 0.0  # its held-out answers captured and measured each step
    assert arms["online"]["cotrain_share"] > 0.0  # the online arm trains its draft, in the step
    assert arms["off"]["spec_step_fraction"] == 0.0
    assert arms["online-fixed"]["spec_step_fraction"] == 1.0  # the fixed chain speculates at every step


def test_parts_add_up_to_the_step(bench):
    out, _ = bench
    for arm in ("off", "online"):
        for r in _rows(out / "embedded" / arm / "metrics.jsonl"):
            parts = sum(r[k] for k in PARTS.values() if k not in ("perf/rollout_full_s", "perf/rollout_tail_s"))
            assert parts + r["rollout_s"] == pytest.approx(r["step_s"], rel=1e-9)
            assert r["perf/other_s"] >= -1e-9
            assert r["perf/rollout_full_s"] + r["perf/rollout_tail_s"] <= r["rollout_s"] + 1e-9
            assert r["perf/rollout_tail_s"] > 0.0  # the last sequences finish one by one


def test_different_updates_are_reported():
    """A planted difference in one arm's loss at one step turns same_updates off."""
    def row(step, loss):
        return {"step": step, "step_s": 1.0, "rollout_s": 0.5, "pg_loss": loss, "kl_ref": 0.0, "reward": 1.0,
                "response_len": 3.0, "perf/update_s": 0.4}
    same = {"off": [row(0, 0.1), row(1, 0.2)], "frozen": [row(0, 0.1), row(1, 0.2)]}
    assert summarize(same, [(0, 2)], 0)["same_updates"] is True
    differ = {"off": [row(0, 0.1), row(1, 0.2)], "frozen": [row(0, 0.1), row(1, 0.2000001)]}
    assert summarize(differ, [(0, 2)], 0)["same_updates"] is False


def test_bad_arms_and_a_used_folder_are_refused(bench, capsys):
    out, _ = bench
    assert main(["bench", "rl", "--preset", "ci", "--out", str(out), "--arms", "off,frozen"]) == 2
    assert "already holds a bench rl run" in capsys.readouterr().err
    assert main(["bench", "rl", "--preset", "ci", "--out", str(out.parent / "x"), "--arms", "off,fast"]) == 2
    assert "unknown arm 'fast'" in capsys.readouterr().err
    assert main(["bench", "rl", "--preset", "ci", "--out", str(out.parent / "y"), "--arms", "frozen,online"]) == 2
    assert "including off" in capsys.readouterr().err
    assert not (out.parent / "x").exists() and not (out.parent / "y").exists()


def test_a_folder_a_crashed_run_left_is_reused(bench, sft_policy, tmp_path, capsys):
    """A crash leaves arm folders and no summary.json: a new run deletes those arm folders (saying
    so), nothing else, and finishes; the finished folder is then refused in one line."""
    import shutil

    out, _ = bench
    crashed = tmp_path / "rl"
    shutil.copytree(out / "embedded", crashed / "embedded")  # what a crash after some steps leaves
    (crashed / "notes.txt").write_text("mine")
    (crashed / "embedded" / "mine").mkdir()
    (crashed / "embedded" / "mine" / "keep.txt").write_text("mine")
    lines = []
    s = bench_rl("arith", "ci", crashed, steps=2, segment=1, warmup=1, cache_dir=sft_policy[3],
                 arms=("off", "frozen"), log=lines.append)
    assert s["engines"]["embedded"]["same_updates"] is True
    assert [x for x in lines if "unfinished" in x] == [
        f"[bench rl] {crashed} holds an unfinished bench rl run (no summary.json): deleting its arm folders in "
        f"{crashed / 'embedded'} (off, frozen, online, online-fixed) and replacing them with this run's"]
    assert sorted(p.name for p in (crashed / "embedded").iterdir()) == ["frozen", "mine", "off"]
    assert [r["step"] for r in _rows(crashed / "embedded" / "off" / "metrics.jsonl")] == [0, 1]  # this run's rows only
    assert (crashed / "notes.txt").read_text() == (crashed / "embedded" / "mine" / "keep.txt").read_text() == "mine"
    assert sum("legend:" in x for x in lines) == 1
    assert main(["bench", "rl", "--preset", "ci", "--out", str(crashed)]) == 2
    err = capsys.readouterr().err
    assert "already holds a bench rl run" in err and err.count("\n") == 1


def test_an_unfinished_run_is_reported_from_the_segments_every_arm_completed(bench, tmp_path, capsys):
    """`--report-unfinished` summarizes the whole segments every arm completed, as a finished run
    is summarized, into summary-unfinished.json; it runs nothing and changes no arm folder; a
    second report, or one with too few steps, is refused in one line (exit 2)."""
    import shutil

    out, _ = bench
    cut = tmp_path / "rl"
    shutil.copytree(out / "embedded", cut / "embedded")
    online = cut / "embedded" / "online" / "metrics.jsonl"
    online.write_text("".join(line + "\n" for line in online.read_text().splitlines()[:2]))  # killed mid-turn
    before = {p: p.read_bytes() for p in cut.rglob("*") if p.is_file()}
    argv = ["bench", "rl", "--preset", "ci", "--arms", "off,frozen,online,online-fixed", "--segment", "1",
            "--report-unfinished", "--out", str(cut)]
    assert main(argv) == 0
    saved = json.loads((cut / "summary-unfinished.json").read_text())
    assert saved["steps"] == 2 and saved["unfinished"] == {
        "steps_run": {"off": 3, "frozen": 3, "online": 2, "online-fixed": 3}, "steps_summarized": 2}
    rows = {a: _rows(out / "embedded" / a / "metrics.jsonl")[:2] for a in ("off", "frozen", "online", "online-fixed")}
    want = summarize(rows, [(0, 1), (1, 2)], 1)
    assert saved["engines"]["embedded"]["arms"] == json.loads(json.dumps(want["arms"]))
    assert {p: p.read_bytes() for p in before} == before and not (cut / "summary.json").exists()
    capsys.readouterr()
    assert main(argv) == 2
    assert "summary-unfinished.json exists; it is not replaced" in capsys.readouterr().err
    few = tmp_path / "few"
    shutil.copytree(cut / "embedded", few / "embedded")
    online = few / "embedded" / "online" / "metrics.jsonl"
    online.write_text(online.read_text().splitlines()[0] + "\n")
    assert main([*argv[:-1], str(few)]) == 2
    err = capsys.readouterr().err
    assert "every arm completed 1 step(s); a report needs a whole segment" in err and err.count("\n") == 1


def test_an_unpriced_arm_takes_its_count_of_updates_from_its_name(tmp_path):
    """online-unpriced-N: the count rule with N updates every step and no hard cap (the budget's
    settings otherwise); N outside 1-999 is no arm; an unfinished run's folder of such an arm is
    cleared like any arm's."""
    from experiments.bench.rl import arm_setup, clear_unfinished
    from specrl.presets import get_preset

    base = get_preset("speed-drift")
    mode, p2 = arm_setup("online-unpriced-2", base)
    _, p8 = arm_setup("online-unpriced", base)
    steps = p2.cotrain.scheduler.draft_steps
    assert mode == "online" and p2.cotrain.max_draft_steps == 2 and p8.cotrain.max_draft_steps == 8
    assert steps.rule == "fixed" and steps.max_share is None and p2.cotrain.online == base.cotrain.online
    for bad in ("online-unpriced-0", "online-unpriced-x", "online-unpriced-1000", "online-unpriced-02"):
        with pytest.raises(ValueError, match="unknown arm"):
            arm_setup(bad, base)
    (tmp_path / "embedded" / "online-unpriced-2").mkdir(parents=True)
    (tmp_path / "embedded" / "online-unpriced-2" / RUN_FILE).write_text("{}")
    clear_unfinished(tmp_path, "embedded", ("off", "online-unpriced-2"), log=lambda *a: None)
    assert not (tmp_path / "embedded" / "online-unpriced-2").exists()


def test_an_every_n_arm_is_the_budgeted_online_arm_training_in_bursts(tmp_path):
    """online-every-N: the preset's co-training (its value budget and hard cap) with
    train_every=N; N outside 1-99 is no arm; its unfinished folder is cleared like any arm's."""
    from experiments.bench.rl import arm_setup, clear_unfinished
    from specrl.presets import get_preset

    base = get_preset("speed-drift")
    mode, p2 = arm_setup("online-every-2", base)
    assert mode == "online" and p2.cotrain.train_every == 2 and base.cotrain.train_every != 2
    assert p2.cotrain.scheduler == base.cotrain.scheduler and p2.cotrain.max_draft_steps == base.cotrain.max_draft_steps
    for bad in ("online-every-0", "online-every-100", "online-every-04", "online-every-"):
        with pytest.raises(ValueError, match="unknown arm"):
            arm_setup(bad, base)
    (tmp_path / "embedded" / "online-every-4").mkdir(parents=True)
    (tmp_path / "embedded" / "online-every-4" / RUN_FILE).write_text("{}")
    clear_unfinished(tmp_path, "embedded", ("off", "online-every-4"), log=lambda *a: None)
    assert not (tmp_path / "embedded" / "online-every-4").exists()


def test_held_out_end_over_start_is_also_read_at_the_steps_every_arm_measured():
    """An arm measured every 2nd step (train_every=2) and one measured every step: the matched
    figure reads both at steps 0, 2, 4 and 8, 10, 12 (the first and last 3 common steps), where the
    plain figure reads the every-step arm at 0-2 and 10-12; without gaps the two are equal."""
    from experiments.bench.rl import add_matched_heldout

    every = [5.0, 4.0, 4.0, 3.0, 3.0, 3.0, 3.0, 3.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    bursts = [x if i % 2 == 0 else None for i, x in enumerate([5.0, 5.0, 4.5, 4.5, 4.0, 4.0, 4.0, 4.0, 3.0, 3.0,
                                                                3.0, 3.0, 3.0])]
    arms = {"off": {"accept_length_heldout_curve": [None] * 13},
            "online": {"accept_length_heldout_curve": every}, "online-every-2": {"accept_length_heldout_curve": bursts}}
    add_matched_heldout(arms)
    assert arms["online"]["heldout_matched_steps"] == [0, 2, 4, 6, 8, 10, 12] and "heldout_matched_steps" not in arms["off"]
    assert arms["online"]["heldout_end_over_start_matched"] == pytest.approx(2.0 / 4.0)
    assert arms["online-every-2"]["heldout_end_over_start_matched"] == pytest.approx(3.0 / 4.5)
    alone = {"online": {"accept_length_heldout_curve": every}}
    add_matched_heldout(alone)
    assert alone["online"]["heldout_end_over_start_matched"] == pytest.approx(2.0 / ((5.0 + 4.0 + 4.0) / 3))


def test_frozen_b_is_a_second_frozen_run_and_ratios_over_frozen_are_the_rows_medians():
    """frozen-b is set up as frozen is (the noise floor of a ratio between speculating arms), and
    online-zN as online with DraftBudgetConfig.gain_z = N; every
    arm's step_over_frozen is frozen's median step over its own, total_step_over_frozen the summed
    ratio, over the timed steps only; without a frozen arm there is none."""
    from experiments.bench.rl import arm_setup, report
    from specrl.presets import get_preset

    base = get_preset("ci")
    assert arm_setup("frozen-b", base) == arm_setup("frozen", base) == ("frozen", base)
    assert base.cotrain.controller.run_paired  # the configuration times the arm not chosen in pairs
    for arm, mode in (("frozen-blocks", "frozen"), ("frozen-blocks-b", "frozen"), ("online-blocks", "online")):
        got, blocks = arm_setup(arm, base)  # the run choice timed in blocks, nothing else changed
        assert got == mode and not blocks.cotrain.controller.run_paired
        assert dataclasses.replace(blocks.cotrain.controller, run_paired=True) == base.cotrain.controller
    assert base.cotrain.controller.bucket_alpha  # the configuration: each batch size its own acceptance
    for arm, mode in (("frozen-shared", "frozen"), ("online-shared", "online")):
        got, shared = arm_setup(arm, base)  # one acceptance for every batch size, nothing else changed
        assert got == mode and not shared.cotrain.controller.bucket_alpha
        assert dataclasses.replace(shared.cotrain.controller, bucket_alpha=True) == base.cotrain.controller
    for arm, mode in (("frozen-paired", "frozen"), ("frozen-paired-b", "frozen"), ("online-paired", "online")):
        assert arm_setup(arm, base) == (mode, base)  # pairs set explicitly: the preset itself
    mode, z2 = arm_setup("online-z2", base)  # online with gains counted less 2 standard errors, nothing else
    assert mode == "online" and z2.cotrain.scheduler.draft_steps.gain_z == 2.0 and base.cotrain.scheduler.draft_steps.gain_z == 0.0
    assert dataclasses.replace(z2.cotrain.scheduler.draft_steps, gain_z=0.0) == base.cotrain.scheduler.draft_steps
    for bad in ("online-z10", "online-z", "online-z-1"):
        with pytest.raises(ValueError, match="unknown arm"):
            arm_setup(bad, base)
    # The configuration's budget counts gains less GAIN_Z errors; online-z0 is that budget counting
    # the measured gain, and differs from it in nothing else.
    from specrl.presets import GAIN_Z
    speed = get_preset("speed")
    assert GAIN_Z == 2.0 and speed.cotrain.scheduler.draft_steps.gain_z == GAIN_Z
    mode, z0 = arm_setup("online-z0", speed)
    assert mode == "online" and z0.cotrain.scheduler.draft_steps.gain_z == 0.0
    assert dataclasses.replace(z0.cotrain.scheduler.draft_steps, gain_z=GAIN_Z) == speed.cotrain.scheduler.draft_steps

    def row(step, s):
        return {"step": step, "step_s": s, "rollout_s": s / 2, "perf/update_s": 0.4}
    times = {"off": [9.0, 4.0, 4.0, 4.0], "frozen": [9.0, 2.0, 3.0, 4.0], "frozen-b": [1.0, 2.0, 2.5, 2.5],
             "online": [9.0, 6.0, 2.0, 4.0]}
    rows = {a: [row(i, s) for i, s in enumerate(ts)] for a, ts in times.items()}
    s = summarize(rows, [(0, 4)], 1)
    arms = s["arms"]
    assert arms["frozen"]["step_over_frozen"] == 1.0
    assert arms["frozen-b"]["step_over_frozen"] == pytest.approx(3.0 / 2.5)
    assert arms["online"]["step_over_frozen"] == pytest.approx(3.0 / 4.0)
    assert arms["online"]["total_step_over_frozen"] == pytest.approx(9.0 / 12.0)  # step 0 is warm-up
    assert arms["off"]["step_over_frozen"] == pytest.approx(3.0 / 4.0)
    line = [x for x in report({"preset": "ci", "steps": 4, "segment": 4, "warmup_steps": 1,
                               "engines": {"embedded": s}}) if x.startswith("  over frozen")]
    assert line == ["  over frozen (frozen's time over the arm's; frozen-b's is the noise of such a ratio): "
                    "frozen-b step x1.200 (every step x1.286), online step x0.750 (every step x0.750)"]
    del rows["frozen"], rows["frozen-b"]
    assert "step_over_frozen" not in summarize(rows, [(0, 4)], 1)["arms"]["online"]


def test_the_projection_at_offs_own_share_gives_the_measured_step_back():
    """The projection's model (a step of rollout share f runs f / R + (1 - f)(1 + k) of off's) is
    exact where the parts are: steps of a fixed rollout, update and co-training. At off's own
    share it returns the measured step speed-up, and at the field's shares it follows the formula;
    both are reported beside each other, labelled a projection."""
    from experiments.bench.rl import PROJECTED_ROLLOUT_SHARES, projected_step_speedup, report

    def row(step, rollout, cotrain=0.0):  # a step of rollout + a 2 s update + its co-training
        return {"step": step, "step_s": rollout + 2.0 + cotrain, "rollout_s": rollout, "perf/update_s": 2.0,
                "perf/draft_train_s": cotrain, "perf/feature_capture_s": 0.0}
    rows = {"off": [row(i, 3.0) for i in range(4)], "online": [row(i, 1.5, 0.1) for i in range(4)],
            "bursts": [row(i, 1.5, 0.3 if i == 1 else 0.0) for i in range(4)]}  # trains at one step in three
    s = summarize(rows, [(0, 4)], 1)
    p = s["projection"]["arms"]["online"]
    assert p["rollout_speedup"] == pytest.approx(2.0) and p["cotrain_over_update"] == pytest.approx(0.05)
    # co-training counted as a mean over the timed steps: a burst's cost is in it (a median reads 0)
    assert s["projection"]["arms"]["bursts"]["cotrain_over_update"] == pytest.approx(0.05)
    own = p["at_own_share"]
    assert own["share"] == pytest.approx(0.6)  # off: 3 s of rollout in a 5 s step
    assert own["measured_step_speedup"] == pytest.approx(5.0 / 3.6)
    assert own["step_speedup"] == pytest.approx(5.0 / 3.6)  # the model gives the measurement back
    for f in PROJECTED_ROLLOUT_SHARES:
        assert p["step_speedup"][str(f)] == pytest.approx(1.0 / (f / 2.0 + (1.0 - f) * 1.05))
    assert projected_step_speedup(1.0, 2.0, 0.05) == pytest.approx(2.0)  # all rollout: the rollout's speed-up
    line = [x for x in report({"preset": "ci", "steps": 4, "segment": 4, "warmup_steps": 1,
                               "engines": {"embedded": s}}) if x.startswith("  projection")]
    assert line[0] == ("  projection (from measured parts, not a measurement) online: step x at rollout share "
                       "65% 1.44, 85% 1.72, 95% 1.90; at off's own 60% 1.39 (measured 1.39)")


def test_gate_counts_are_the_runs_totals():
    """The gate's counters are running totals: a run's counts are the largest any row holds, also
    where the last row carries none (an RL step cut short); a run with no gate has None."""
    from experiments.bench.common import gate_counts

    rows = [{"train/draft_gated_total": 1, "train/draft_refused_total": 0, "train/draft_floor_restores_total": 0},
            {"train/draft_gated_total": 3, "train/draft_refused_total": 1, "train/draft_floor_restores_total": 1},
            {"step": 2}]
    assert gate_counts(rows) == {"draft_gated": 3, "draft_refused": 1, "draft_floor_restores": 1}
    assert gate_counts([{"step": 0}]) == {"draft_gated": None, "draft_refused": None, "draft_floor_restores": None}


def test_gate_over_start_reads_each_gate_that_measured_the_starting_draft():
    """One entry per row whose gate measured the starting draft, the serving and candidate values
    over its value, and whether the floor's running total rose at that gate (not at another)."""
    from experiments.bench.common import gate_over_start

    gate = {"sched/gate_serving_accept_length": 1.8, "sched/candidate_accept_length": 2.1}
    rows = [{"step": 0, **gate, "sched/gate_start_accept_length": 2.0, "train/draft_floor_restores_total": 0},
            {"step": 1, "train/draft_floor_restores_total": 0},  # no gate
            {"step": 2, **gate, "sched/gate_start_accept_length": 2.4, "train/draft_floor_restores_total": 1},
            {"step": 3, **gate, "sched/gate_start_accept_length": 1.5, "train/draft_floor_restores_total": 1},
            {"step": 4, **gate}]  # a gate without the floor
    got = gate_over_start(rows)
    assert [g["step"] for g in got] == [0, 2, 3] and [g["floor_restored"] for g in got] == [False, True, False]
    assert got[0]["serving_over_start"] == pytest.approx(0.9) and got[0]["candidate_over_start"] == pytest.approx(1.05)
    assert got[2]["serving_over_start"] == pytest.approx(1.2)


def test_a_folder_in_an_arms_way_is_refused_and_kept(tmp_path):
    (tmp_path / "embedded" / "off").mkdir(parents=True)
    (tmp_path / "embedded" / "off" / "data.txt").write_text("mine")
    with pytest.raises(RunDirError, match="not a bench rl arm folder"):
        bench_rl("arith", "ci", tmp_path, steps=2, log=lambda *a: None)
    assert (tmp_path / "embedded" / "off" / "data.txt").read_text() == "mine"


def test_the_table_has_a_legend():
    """Under the table, once: what x means, total x beside step x, spec steps, the draft updates each
    training arm bought and why, and the sure estimate where a run choice line names it."""
    from experiments.bench.rl import report

    def row(step, **kw):
        return {"step": step, "step_s": 1.0, "rollout_s": 0.5, "perf/update_s": 0.4, **kw}

    rows = {"off": [row(i) for i in range(3)],
            "online": [row(i, **{"train/draft_steps": 2, "sched/draft_credit_s": 0.1, "sched/spec_saving_s": 0.25,
                                 "rollout/spec_run_choice": 1, "rollout/spec_run_speedup": None,
                                 "perf/draft_train_s": 0.3, "perf/draft_heldout_s": 0.05, "perf/draft_sync_s": 0.04,
                                 "perf/feature_capture_s": 0.01}) for i in range(3)],
            "online-unpriced": [row(i, **{"train/draft_steps": 3, "sched/draft_credit_s": None,
                                          "sched/draft_steps_budget": 3}) for i in range(3)]}
    s = summarize(rows, [(0, 3)], warmup=1)
    assert s["arms"]["online"]["draft_updates"] == 4 and s["arms"]["online-unpriced"]["draft_updates"] == 6
    assert "draft_updates" not in s["arms"]["off"]
    # where the co-training seconds of the 2 timed steps went: they add up to what the share divides
    parts = s["arms"]["online"]["cotrain_parts_s"]
    assert parts == pytest.approx({"updates": 0.42, "heldout": 0.1, "gate_and_swap": 0.08, "capture": 0.02})
    assert sum(parts.values()) == pytest.approx(s["arms"]["online"]["cotrain_share_total"] * 2 * 1.0)
    lines = report({"preset": "p", "steps": 3, "segment": 3, "warmup_steps": 1, "engines": {"embedded": s}})
    text = "\n".join(lines)
    assert sum("legend:" in x for x in lines) == 1 and "above 1 the arm is faster than off" in text
    assert "total x: off's summed step time over the arm's" in text and "the warm-up steps do not" in text
    assert "spec steps: the share of engine steps that verified a draft" in text
    assert ("draft updates over the timed steps: online 4 (priced: bought with the rollout time speculation saves, "
            "0.250s saved per rollout (median)); online-unpriced 6 (not priced: the count rule, 3 per step (median))"
            in text)
    assert ("co-training seconds over the timed steps: online 0.62s: updates 0.42s (0.105s each), held-out "
            "measurement 0.10s, gate and swap 0.08s, feature capture 0.02s; online-unpriced 0.00s" in text)
    assert "the estimate was sure: every timed speculating rollout was estimated" in text
    first = next(i for i, x in enumerate(lines) if "legend:" in x)
    assert first > max(i for i, x in enumerate(lines) if x.startswith("  online-unpriced"))  # under the table


def test_an_uncached_start_shows_its_progress_on_a_terminal(tmp_path, capsys, monkeypatch):
    """From an empty cache the warm start and the offline draft take minutes on the larger presets,
    and the RL steps as long again: on a terminal each shows a bar with the time left; progress=False
    shows none."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # the captured stderr, seen as a terminal
    bench_rl("arith", "ci", tmp_path / "rl", steps=1, warmup=0, arms=("off", "frozen"), cache_dir=tmp_path / "cache",
             log=lambda *a: None)
    err = capsys.readouterr().err
    for bar in ("sft warm start: 100%", "draft rollouts: 100%", "draft features: 100%", "draft training: 100%",
                "bench rl steps: 100%"):
        assert bar in err
    assert "60/60 [" in err and "40/40 [" in err  # the ci preset's SFT and draft steps, with elapsed<left
    bench_rl("arith", "ci", tmp_path / "rl2", steps=1, warmup=0, arms=("off", "frozen"), cache_dir=tmp_path / "cache",
             progress=False, log=lambda *a: None)
    assert capsys.readouterr().err == ""


def test_history_arms_draft_from_the_group_and_change_no_update(sft_policy, tmp_path):
    """The history and hybrid arms (rollout.history) beside off on a small prompt pool, so the
    later steps revisit prompts: the same policy updates as off, and every speculative row drafted
    by the arm's sources. (The ci policy samples near-random answers, so drafts from them are rarely
    accepted; test_history checks that revisited prompts draft from earlier answers.)"""
    s = bench_rl("arith", "ci", tmp_path / "rl", steps=4, segment=2, warmup=1, cache_dir=sft_policy[3],
                 arms=("off", "history", "history-past", "hybrid"), prompt_pool=4, log=lambda *a: None)
    e = s["engines"]["embedded"]
    assert e["same_updates"] is True and s["prompt_pool"] == 4
    rows = {a: _rows(tmp_path / "rl" / "embedded" / a / "metrics.jsonl") for a in ("history", "history-past", "hybrid")}
    assert all(r["rollout/history_rows_share"] == 1.0 for a in ("history", "history-past") for r in rows[a]
               if r["rollout/spec_verify_steps"])
    assert any(r.get("rollout/eagle3_rows_share", 0) > 0 for r in rows["hybrid"])
    assert e["arms"]["history"]["history_s"] is not None and e["arms"]["hybrid"]["cotrain_share"] > 0


def test_a_run_choice_is_reported_with_the_step_it_was_made():
    """An arm whose engine speculates per run (vLLM) reports whether it kept speculation, the
    measured ratio and the step of the decision; before it, the report says the choice is pending."""
    from experiments.bench.rl import report, summarize

    def row(step, choice=None, speedup=None):
        r = {"step": step, "step_s": 1.0, "rollout_s": 0.5, "perf/update_s": 0.4}
        if step >= 0:
            r.update({"rollout/spec_run_choice": choice, "rollout/spec_run_speedup": speedup})
        return r

    rows = {"off": [{"step": i, "step_s": 1.0, "rollout_s": 0.5, "perf/update_s": 0.4} for i in range(4)],
            "frozen": [row(0), row(1), row(2, 0, 0.84), row(3, 0, 0.84)]}
    s = summarize(rows, [(0, 4)], warmup=1)
    assert s["arms"]["frozen"]["run_choice"] == {"speculate": False, "speedup": 0.84, "decided_at_step": 2,
                                                 "changed_at_steps": [], "speculating_steps": 0,
                                                 "rechecks_skipped_at_end": 0}
    assert "run_choice" not in s["arms"]["off"]
    lines = report({"preset": "p", "steps": 4, "segment": 4, "warmup_steps": 1, "engines": {"vllm": s}})
    assert any("switched off at step 2" in x and "x0.840" in x for x in lines)
    flips = summarize({"off": rows["off"], "frozen": [row(0), row(1, 0, 0.9), row(2, 1, 1.2), row(3, 1, None)]},
                      [(0, 4)], warmup=1)  # re-checked at step 2; kept on the estimate at step 3
    assert flips["arms"]["frozen"]["run_choice"]["changed_at_steps"] == [2]
    assert flips["arms"]["frozen"]["run_choice"]["speculating_steps"] == 2  # steps 2 and 3 ended speculating
    lines = report({"preset": "p", "steps": 4, "segment": 4, "warmup_steps": 1, "engines": {"embedded": flips}})
    assert any("switched off at step 1, changed at steps [2], on at the end" in x and "not timed" in x for x in lines)
    pending = summarize({"off": rows["off"], "frozen": [row(i) for i in range(4)]}, [(0, 4)], warmup=1)
    assert pending["arms"]["frozen"]["run_choice"]["speculate"] is None


def test_the_closing_summary_says_when_speculation_was_switched_off(tmp_path):
    """What a finished `bench rl` and `train-rl` print last says when the run choice switched
    speculation off, and bench rl's gives the ratio over every step (restarts and timed rollouts
    included) beside the median one."""
    from experiments.bench.rl import headline, summarize
    from specrl.cli import _train_rl_headline
    from specrl.run_choice import choice_history

    off = [{"step": i, "step_s": 1.0, "rollout_s": 0.5, "perf/update_s": 0.4} for i in range(4)]
    arm = [{**r, "step_s": 2.0 if r["step"] < 2 else 1.0, "rollout/spec_run_choice": None if r["step"] < 2 else 0,
            "rollout/spec_run_speedup": 0.9} for r in off]
    s = summarize({"off": off, "frozen": arm}, [(0, 4)], warmup=1)
    (_, line), = [h for h in headline({"engines": {"vllm": s}}) if h[0] == "vllm frozen"]
    assert "step x1.00 (every step x0.75)" in line and "switched off at step 2" in line, line
    summary = {"reward_start": 0.1, "reward_end": 0.2, "greedy_accuracy_start": 0.3, "greedy_accuracy_end": 0.4,
               "rl_steps": 4, "wall_s": 9.0, "run_choice": choice_history(arm)}
    assert any(k == "speculation" and "switched off at step 2" in v for k, v in _train_rl_headline(summary))


def test_per_token_ratios_compare_arms_whose_answers_differ_in_length():
    """Where the arms' RL runs part (on CUDA), one policy may write answers twice as long as
    another's: a step ratio then mixes the draft's speed with the answers' length. The per-token
    ratios divide each step by the tokens its answers hold, so two arms decoding at the same speed
    per token read 1 whatever their lengths, and a faster one reads its speed-up."""
    from experiments.bench.rl import report

    def row(step, per_token, lens):  # a step whose time is per_token seconds for each answer token
        return {"step": step, "step_s": per_token * sum(lens), "rollout_s": 0.8 * per_token * sum(lens),
                "response_len": sum(lens) / len(lens), "rollout/response_lens": lens}
    short, long = [10, 20, 30], [20, 40, 60]
    rows = {"off": [row(i, 0.02, short) for i in range(4)],
            "frozen": [row(i, 0.01, long) for i in range(4)],  # twice off's speed per token, answers twice as long
            "frozen-b": [row(i, 0.01, short) for i in range(4)],  # frozen's speed, off's answers
            "online": [row(i, 0.008, long if i % 2 else short) for i in range(4)]}  # 1.25x frozen per token
    s = summarize(rows, [(0, 4)], 1)
    a = s["arms"]
    assert a["frozen"]["step_speedup"] == pytest.approx(1.0)  # the step ratio hides the draft's x2
    assert a["frozen"]["token_step_speedup"] == pytest.approx(2.0)
    assert a["frozen"]["total_token_step_speedup"] == pytest.approx(2.0)
    assert a["frozen-b"]["step_over_frozen"] == pytest.approx(2.0)  # the A/A arm reads x2 by its answers' length
    assert a["frozen-b"]["token_step_over_frozen"] == pytest.approx(1.0)  # and x1 per token
    assert a["online"]["token_step_over_frozen"] == pytest.approx(1.25)
    assert a["online"]["total_token_step_over_frozen"] == pytest.approx(1.25)
    assert not s["same_updates"]
    lines = report({"preset": "ci", "steps": 4, "segment": 4, "warmup_steps": 1, "engines": {"embedded": s}})
    assert any(x.startswith("    per answer token over frozen: ") and "online x1.250" in x and "frozen-b x1.000" in x
               for x in lines)


def test_a_finished_run_is_summarized_again_from_its_saved_steps(bench, tmp_path, capsys):
    """`--report-again` summarizes a finished run's saved steps with the code at hand into
    summary-again.json: the same summary as its steps give, summary.json and the arm folders
    untouched; asked again, or of a run with no summary.json, it is refused in one line (exit 2)."""
    import shutil

    out, _ = bench
    run = tmp_path / "rl"
    shutil.copytree(out, run)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    argv = ["bench", "rl", "--preset", "ci", "--arms", "off,frozen,online,online-fixed", "--segment", "1",
            "--report-again", "--out", str(run)]
    assert main(argv) == 0
    again = json.loads((run / "summary-again.json").read_text())
    first = json.loads((run / "summary.json").read_text())
    assert again["again"]["steps_summarized"] == first["steps"] == 3
    assert again["engines"]["embedded"]["arms"] == first["engines"]["embedded"]["arms"]  # same code, same figures
    assert {p: p.read_bytes() for p in before} == before
    capsys.readouterr()
    assert main(argv) == 2
    assert "summary-again.json exists; it is not replaced" in capsys.readouterr().err
    (run / "summary.json").unlink()
    (run / "summary-again.json").unlink()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "holds no finished bench rl run" in err and err.count("\n") == 1


def test_steps_timed_beside_other_work_are_reported():
    """A step during which other processes kept the machine busy (perf/others_busy_cores, from
    specrl.machine_load) is counted and named in the report; a run alone says nothing."""
    from experiments.bench.rl import report

    def row(step, busy):
        return {"step": step, "step_s": 1.0, "rollout_s": 0.5, "perf/others_busy_cores": busy}

    alone = summarize({"off": [row(i, 0.02) for i in range(4)], "frozen": [row(i, 0.03) for i in range(4)]}, [(0, 4)], 1)
    assert alone["shared_steps_n"] == 0 and alone["others_busy_cores_max"] == pytest.approx(0.03)
    shared = summarize({"off": [row(i, 0.02) for i in range(4)],
                        "frozen": [row(i, 1.3 if i == 2 else 0.02) for i in range(4)]}, [(0, 4)], 1)
    assert shared["shared_steps"] == [["frozen", 2, 1.3]] and shared["shared_steps_n"] == 1
    head = {"preset": "ci", "steps": 4, "segment": 4, "warmup_steps": 1}
    said = [x for x in report({**head, "engines": {"embedded": shared}}) if "machine was shared" in x]
    assert len(said) == 1 and "1 timed step(s)" in said[0] and "frozen step 2" in said[0]
    assert not [x for x in report({**head, "engines": {"embedded": alone}}) if "machine was shared" in x]
    before = summarize({"off": [{"step": i, "step_s": 1.0, "rollout_s": 0.5} for i in range(3)]}, [(0, 3)], 1)
    assert before["others_busy_cores_max"] is None and before["shared_steps_n"] == 0  # rows from before the field
