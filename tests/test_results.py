"""The README's headline figures are read from the JSON results a committed command wrote
(experiments.results), and docs/results.md holds no commit hashes (the JSON carries the version)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from experiments.results import collect, flatten

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"

# Every figure of the README's headline table: as printed there, the result JSON it is read from,
# the key whose median it is, and how it is printed.
HEADLINE: list[tuple[str, str, str, str]] = [
    ('x1.16', 'rl-speed-drift-coupled.json', 'engines.embedded.arms.online.step_speedup', 'x{:.2f}'),
    ('x1.14', 'rl-speed-drift-coupled.json', 'engines.embedded.arms.frozen.step_speedup', 'x{:.2f}'),
    ('x1.00', 'rl-speed-drift-coupled.json', 'engines.embedded.arms.off-b.step_speedup', 'x{:.2f}'),
    ('x1.12', 'rl-speed-drift-coupled.json', 'engines.embedded.arms.frozen-b.step_speedup', 'x{:.2f}'),
    ('x1.40', 'rl-speed-drift-coupled.json', 'engines.embedded.arms.online.rollout_speedup', 'x{:.2f}'),
    ('x1.28', 'rl-speed-drift-coupled.json', 'engines.embedded.arms.frozen.rollout_speedup', 'x{:.2f}'),
    ('3.3%', 'rl-speed-drift-coupled.json', 'engines.embedded.arms.online.cotrain_share_total', '{:.1%}'),
    ('0.879', 'rl-speed-drift-coupled.json', 'engines.embedded.arms.online.heldout_end_over_start_matched', '{:.3f}'),
    ('0.623', 'rl-speed-drift-coupled.json', 'engines.embedded.arms.frozen.heldout_end_over_start_matched', '{:.3f}'),
    ('x1.82', 'rl-speed-drift-cuda.json', 'engines.embedded.arms.online.step_speedup', 'x{:.2f}'),
    ('x1.65', 'rl-speed-drift-cuda.json', 'engines.embedded.arms.frozen.step_speedup', 'x{:.2f}'),
    ('x1.85', 'rl-speed-drift-cuda.json', 'engines.embedded.arms.online.token_step_speedup', 'x{:.2f}'),
    ('x1.60', 'rl-speed-drift-cuda.json', 'engines.embedded.arms.frozen.token_step_speedup', 'x{:.2f}'),
    ('x1.121', 'rl-speed-drift-cuda.json', 'engines.embedded.arms.online.token_step_over_frozen', 'x{:.3f}'),
    ('x1.001', 'rl-speed-drift-cuda.json', 'engines.embedded.arms.frozen-b.token_step_over_frozen', 'x{:.3f}'),
    ('0.960', 'rl-speed-drift-cuda.json', 'engines.embedded.arms.online.heldout_end_over_start_matched', '{:.3f}'),
    ('0.554', 'rl-speed-drift-cuda.json', 'engines.embedded.arms.frozen.heldout_end_over_start_matched', '{:.3f}'),
    ('x1.27', 'rl-speed-coupled.json', 'engines.embedded.arms.online.step_speedup', 'x{:.2f}'),
    ('x1.31', 'rl-speed-coupled.json', 'engines.embedded.arms.frozen.step_speedup', 'x{:.2f}'),
    ('x1.27', 'rl-speed-coupled.json', 'engines.embedded.arms.frozen-b.step_speedup', 'x{:.2f}'),
    ('2.3%', 'rl-speed-coupled.json', 'engines.embedded.arms.online.cotrain_share_total', '{:.1%}'),
    ('1.0%', 'rl-speed-coupled.json', 'engines.embedded.arms.frozen.cotrain_share_total', '{:.1%}'),
    ('x0.97', 'rl-drift-coupled.json', 'engines.embedded.arms.online.step_speedup', 'x{:.2f}'),
    ('x0.97', 'rl-drift-coupled.json', 'engines.embedded.arms.frozen.step_speedup', 'x{:.2f}'),
    ('x1.00', 'rl-drift-coupled.json', 'engines.embedded.arms.off-b.step_speedup', 'x{:.2f}'),
    ('x1.004', 'rl-drift-coupled.json', 'engines.embedded.arms.online.step_over_frozen', 'x{:.3f}'),
    ('x1.004', 'rl-drift-coupled.json', 'engines.embedded.arms.frozen-b.step_over_frozen', 'x{:.3f}'),
    ('0.679', 'drift-quick-coupled.json', 'frozen_end_over_start', '{:.3f}'),
    ('0.695', 'drift-quick-coupled.json', 'online_end_over_start', '{:.3f}'),
    ('1.056', 'drift-quick-coupled.json', 'online_over_frozen_steps_end', '{:.3f}'),
    ('0.630', 'drift-quick-coupled.json', 'online_over_reference_min', '{:.3f}'),
    ('0.536', 'drift-speed-drift-coupled.json', 'frozen_end_over_start', '{:.3f}'),
    ('0.861', 'drift-speed-drift-coupled.json', 'online_end_over_start', '{:.3f}'),
    ('1.531', 'drift-speed-drift-coupled.json', 'online_over_frozen_steps_end', '{:.3f}'),
    ('3.6%', 'drift-speed-drift-coupled.json', 'draft_added_fraction', '{:.1%}'),
    ('x1.90', 'speed-speed.json', 'rows.b1.chain.6.speedup_median', 'x{:.2f}'),
    ('x2.01', 'speed-speed.json', 'rows.b4.chain.6.speedup_median', 'x{:.2f}'),
    ('x2.11', 'speed-speed.json', 'rows.b16.chain.6.speedup_median', 'x{:.2f}'),
    ('x1.30', 'speed-quick.json', 'rows.b1.chain.4.speedup_median', 'x{:.2f}'),
    ('x1.36', 'speed-quick.json', 'rows.b4.chain.4.speedup_median', 'x{:.2f}'),
    ('x1.43', 'speed-quick.json', 'rows.b16.chain.4.speedup_median', 'x{:.2f}'),
    ('x1.96', 'vllm-speed.json', 'rows.b1.vllm-eagle3.chain.6.speedup_median', 'x{:.2f}'),
    ('x1.71', 'vllm-speed.json', 'rows.b4.vllm-eagle3.chain.6.speedup_median', 'x{:.2f}'),
    ('x1.57', 'vllm-speed.json', 'rows.b16.vllm-eagle3.chain.6.speedup_median', 'x{:.2f}'),
]


def _headline_table() -> str:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Headline figures")
    return readme[start:readme.index("\n## ", start + 1)]


@pytest.mark.parametrize("figure,result,key,fmt", HEADLINE)
def test_each_headline_figure_is_the_median_its_json_holds(figure, result, key, fmt):
    data = json.loads((RESULTS / result).read_text())
    assert fmt.format(data["median"][key]) == figure, (result, key)
    assert figure in _headline_table()


def test_every_figure_of_the_headline_table_is_checked():
    """Each x-ratio, accept length and share in the table is one of HEADLINE's (a figure typed in
    by hand, or left over from an earlier run, has no JSON behind it)."""
    table = _headline_table()
    rows = [line for line in table.splitlines() if line.startswith("|") and not line.startswith("|---")][1:]
    cells = " ".join(line.rsplit("|", 2)[1] for line in rows)  # the figure column
    figures = re.findall(r"x\d+\.\d+|\d+\.\d+%|\b\d+\.\d{2,3}\b", cells)
    assert sorted(set(figures)) == sorted({f for f, *_ in HEADLINE})


def test_the_results_page_names_no_commit():
    page = (ROOT / "docs" / "results.md").read_text()
    hashes = [h for h in re.findall(r"\b[0-9a-f]{7,40}\b", page) if re.search(r"[a-f]", h) and re.search(r"\d", h)]
    assert hashes == []


def test_a_result_is_the_median_over_its_runs_with_their_spread(tmp_path):
    for seed, speedup in ((0, 1.2), (1, 1.5), (2, 1.3)):
        run = tmp_path / f"run{seed}"
        run.mkdir()
        summary = {"seed": seed, "machine": {"date": "d", "code_version": "v", "threads": 2},
                   "engines": {"embedded": {"arms": {"online": {"step_speedup": speedup, "curve": [1, 2]}}}},
                   "rows": [{"batch": 4, "mode": "chain", "speedup": speedup + 1}], "same_updates": True}
        (run / "summary.json").write_text(json.dumps(summary))
    r = collect("x", "cmd --seed {seed}", sorted(tmp_path.glob("run*")))
    key = "engines.embedded.arms.online.step_speedup"
    assert (r["median"][key], r["min"][key], r["max"][key], r["n"][key]) == (1.3, 1.2, 1.5, 3)
    assert r["median"]["rows.b4.chain.speedup"] == 2.3 and r["median"]["same_updates"] == 1.0
    assert not any("curve" in k for k in r["median"]) and [x["seed"] for x in r["runs"]] == [0, 1, 2]
    assert flatten({"a": float("nan"), "b": [{"step": 3, "x": 1}]}) == {"b.3.step": 3.0, "b.3.x": 1.0}


def test_an_unfinished_bench_rl_report_is_read_and_a_folder_without_either_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(ValueError, match="holds no summary.json .* nor summary-unfinished.json"):
        collect("x", "cmd", [run])
    (run / "summary-unfinished.json").write_text(json.dumps(
        {"seed": 0, "machine": {"date": "d", "code_version": "v"}, "unfinished": {"steps_summarized": 8}}))
    assert collect("x", "cmd", [run])["median"]["unfinished.steps_summarized"] == 8.0


def test_a_run_timed_beside_other_work_is_marked_and_warned(tmp_path, capsys):
    """`timed_alone` per run: False where a bench rl step or a drift evaluation's timing shared the
    machine (specrl.machine_load), None where the summary predates the measurement."""
    from experiments.results import main

    summaries = {"alone": {"engines": {"embedded": {"shared_steps_n": 0, "others_busy_cores_max": 0.04}}},
                 "bench": {"engines": {"embedded": {"shared_steps_n": 3, "others_busy_cores_max": 1.1}}},
                 "drift": {"rl_steps_shared": 0, "others_busy_cores_eval_max": 0.9},
                 "old": {"engines": {"embedded": {"arms": {}}}}}
    for name, s in summaries.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps({"seed": 0, "machine": {"date": "d"}, **s}))
    runs = [tmp_path / n for n in summaries]
    assert [r["timed_alone"] for r in collect("x", "cmd", runs)["runs"]] == [True, False, False, None]
    assert main(["x", *map(str, runs), "--command", "cmd", "--out-dir", str(tmp_path / "out")]) == 0
    warned = [x for x in capsys.readouterr().out.splitlines() if x.startswith("warning: ")]
    assert len(warned) == 2 and "bench" in warned[0] and "drift" in warned[1]
