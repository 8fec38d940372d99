"""`specrl bench update` end to end on the CI preset: every arm updates from the same weights, the
answer-position update equals the full one in fp32, and bf16 shows its gap; the same for the
draft's update, where skipping the prompt rows changes the loss by rounding only."""
import json


def test_bench_update_on_the_ci_preset(tmp_path, sft_policy):
    from experiments.bench.update import ARMS, bench_update

    summary = bench_update("arith", "ci", tmp_path / "out", seed=0, cache_dir=sft_policy[3], repeats=1,
                           log=print)
    rows = {r["arm"]: r for r in summary["rows"]}
    assert set(rows) == set(ARMS) | {"full-fp32-b"}
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["benchmark"] == "update"
    assert rows["full-fp32-b"]["delta_gap"] == 0.0 and rows["full-fp32-b"]["logprob_gap_max"] == 0.0
    assert rows["answer-fp32"]["logprob_gap_max"] < 1e-5 and rows["answer-fp32"]["delta_gap"] < 1e-3
    assert rows["answer-fp32"]["loss"] == rows["full-fp32"]["loss"] or \
        abs(rows["answer-fp32"]["loss"] - rows["full-fp32"]["loss"]) < 1e-6
    assert 0 < rows["answer-bf16"]["logprob_gap_mean"] < 0.05 and rows["answer-bf16"]["delta_gap"] > 1e-3
    assert rows["full-fp32"]["engine_gap_max"] < 1e-4  # the trainer's fp32 log-probs are the engine's
    assert all(r["seconds"] > 0 for r in rows.values())
    drafts = {r["arm"]: r for r in summary["draft_rows"]}
    assert set(drafts) == {"draft-all-rows", "draft-fp32", "draft-bf16", "draft-fp32-b"}
    assert drafts["draft-fp32"]["loss_gap"] < 1e-5 and drafts["draft-fp32-b"]["loss_gap"] < 1e-5
    assert 0 < drafts["draft-bf16"]["loss_gap"] < 0.05 * drafts["draft-all-rows"]["draft_loss"]
    assert all(r["seconds"] > 0 and r["heldout_seconds"] > 0 for r in drafts.values())
