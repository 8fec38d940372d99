"""The drift experiment in asynchronous mode: frozen and online drafts as GRPO moves the policy
inside AReaL's staleness-bounded loop (`specrl drift --async-staleness 0 1 4`).

One asynchronous GRPO run per staleness bound η (`specrl.async_rl.train_async_rl`: AReaL's
WorkflowExecutor generating ahead of the trainer on specrl's speculative engine, the draft
co-trained online). η = 0 is the synchronous loop in the same harness: AReaL admits no rollout
for the next version before the trainer publishes it. At step 0, every `eval_every` steps and
at the end, the synchronous drift experiment's evaluation (experiments.drift.DriftEvaluator:
plain, frozen and online arms decoding the same held-out prompts with the trainer's current
policy, sampled with coupled noise so every arm emits the same tokens) runs with generation
paused. What the run itself measures: each step's staleness (versions between the trainer and
the first token of the oldest trajectory it consumes), the rollouts' accept length (requests
finished since the previous step), and the step's parts: waiting for AReaL's batch, the policy
update (feature capture included), the policy sync between chunks, and the draft's updates
with their push, which run on the trainer's thread while generation goes on. Each bound also
runs the same loop once more with the frozen draft (no draft training, no evaluation): its step
time against the online run's is what co-training costs the loop. The two runs follow each
other, not interleaved: on this machine wall-clock ratios of separate runs move by 10-20%.

Outputs in DIR: summary.json ({"staleness": {η: {...}}}), metrics.jsonl (one row per RL step
and η), evaluations.jsonl (one row per evaluation point, arm and η). Needs areal 1.0.4
(tests/lanes/areal.sh installs it in .venv-areal).
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path

from experiments.drift import DriftError, DriftEvaluator, get_drift_preset


class AsyncDriftEvaluator(DriftEvaluator):
    """The drift evaluation without the end-of-run extras (reference draft, speed sweep)."""

    def on_end(self, run, summary) -> None:
        self.evaluate(run, step=run.preset.rl_steps)


def run_async_drift(preset: str, out_dir, *, staleness=(0, 1, 4), seed: int = 0, task: str = "arith", cache_dir=None,
                    rl_steps: int | None = None, eval_every: int | None = None, chunk_tokens: int = 16,
                    draft_windows: tuple[str, ...] = ("wait",), log=print) -> dict:
    try:
        from specrl.async_rl import AsyncConfig, train_async_rl
        import areal  # noqa: F401
    except ImportError as err:
        raise DriftError(f"--async-staleness needs areal 1.0.4 (`bash tests/lanes/areal.sh` installs it in "
                         f".venv-areal; then run this command with .venv-areal/bin/specrl): {err}") from None
    t0 = time.perf_counter()
    dpreset = get_drift_preset(preset)
    dpreset = dataclasses.replace(dpreset, reference_every=0, eval_every=eval_every or dpreset.eval_every)
    if rl_steps is not None:
        dpreset = dataclasses.replace(dpreset, rl=dpreset.rl.with_overrides(rl_steps=rl_steps))
    if any(e < 0 for e in staleness):
        raise DriftError(f"--async-staleness takes bounds >= 0, got {list(staleness)}")
    out = Path(out_dir)
    if (out / "summary.json").exists():
        raise DriftError(f"output folder {out} already holds a drift run; choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    per_eta, metric_rows, eval_rows = {}, [], []
    for eta in staleness:
        evaluator = AsyncDriftEvaluator(dpreset, log=log, task=task)
        res = train_async_rl(task, dpreset.rl, spec="online", acfg=AsyncConfig(staleness=eta, chunk_tokens=chunk_tokens,
                                                                  draft_windows=tuple(draft_windows)),
                             seed=seed, cache_dir=cache_dir, callbacks=(evaluator,), log=log)
        rows = res["rows"]
        # the same loop with the frozen draft (no draft training): what co-training costs the loop
        frozen = train_async_rl(task, dpreset.rl, spec="frozen", acfg=AsyncConfig(staleness=eta, chunk_tokens=chunk_tokens),
                                seed=seed, cache_dir=cache_dir, log=log)["rows"]
        metric_rows += [{"staleness_bound": eta, "spec": "online", **r} for r in rows]
        metric_rows += [{"staleness_bound": eta, "spec": "frozen", **r} for r in frozen]
        eval_rows += [{"staleness_bound": eta, **r} for r in evaluator.rows]
        per_eta[eta] = summarize_eta(rows, evaluator.rows, res["summary"], frozen)
        log(f"[drift async η={eta}] " + "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                  for k, v in per_eta[eta].items()))
    with open(out / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in metric_rows)
    with open(out / "evaluations.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in eval_rows)
    summary = {"preset": preset, "task": task, "seed": seed, "rl_steps": dpreset.rl.rl_steps,
               "eval_batch": dpreset.eval_batch, "eval_prompts": dpreset.eval_prompts, "chunk_tokens": chunk_tokens,
               "draft_windows": list(draft_windows),
               "staleness": {str(k): v for k, v in per_eta.items()}, "wall_s": time.perf_counter() - t0}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def summarize_eta(rows: list[dict], evals: list[dict], run_summary: dict, frozen: list[dict]) -> dict:
    """One staleness bound's figures: the evaluation's start and end points, the online run's
    own, and its step time and throughput against the frozen run's."""
    first, last = min(r["step"] for r in evals), max(r["step"] for r in evals)
    pt = {(r["step"], r["arm"]): r for r in evals}
    k = max(1, len(rows) // 4)  # the first and last quarter of the run's steps
    accept = [r.get("rollout/spec_accept_length", 0.0) for r in rows]
    total = sum(r["step_s"] for r in rows)
    draft_share = sum(r["draft_s"] for r in rows) / total  # "between": on the trainer's path
    wait_share = sum(r["draft_wait_s"] for r in rows) / total  # "wait": while the batch was not ready
    return {"staleness_max": run_summary["staleness_max"],
            "staleness_mean": statistics.fmean(r["staleness_mean"] for r in rows),
            "kl_end": pt[(last, "plain")]["kl_from_start"],
            "tau_start": pt[(first, "online")]["accept_length"],
            "tau_frozen_end": pt[(last, "frozen")]["accept_length"],
            "tau_online_end": pt[(last, "online")]["accept_length"],
            "speedup_frozen_end": pt[(last, "frozen")]["speedup"],
            "speedup_online_end": pt[(last, "online")]["speedup"],
            "rollout_accept_first_quarter": statistics.fmean(accept[:k]),
            "rollout_accept_last_quarter": statistics.fmean(accept[-k:]),
            "step_s_median": statistics.median(r["step_s"] for r in rows),
            "wait_s_median": statistics.median(r["wait_s"] for r in rows),
            "draft_share_of_step": draft_share,
            "draft_wait_share_of_step": wait_share,
            "draft_updates_waiting": sum(r["draft_wait_updates"] for r in rows),
            "draft_updates": sum(r.get("train/draft_steps", 0) for r in rows),
            "frozen_step_s_median": statistics.median(r["step_s"] for r in frozen),
            "online_over_frozen_step": statistics.median(r["step_s"] for r in rows)
                                       / statistics.median(r["step_s"] for r in frozen),
            "tokens_per_s_online": sum(r["tokens"] for r in rows) / sum(r["step_s"] for r in rows),
            "tokens_per_s_frozen": sum(r["tokens"] for r in frozen) / sum(r["step_s"] for r in frozen),
            "reward_first_quarter": statistics.fmean(r["reward"] for r in rows[:k]),
            "reward_last_quarter": statistics.fmean(r["reward"] for r in rows[-k:]),
            "spec_faults": run_summary["spec_faults"]}





def headline(summary: dict) -> list[tuple[str, str]]:
    """The figures an asynchronous drift run ends with, one row per staleness bound."""
    return [(f"η = {eta}", f"staleness ≤ {s['staleness_max']}; accept length start {s['tau_start']:.2f}, end frozen "
                          f"{s['tau_frozen_end']:.2f} / online {s['tau_online_end']:.2f}; speed-up end frozen "
                          f"x{s['speedup_frozen_end']:.2f} / online x{s['speedup_online_end']:.2f}; draft "
                          f"{s['draft_share_of_step']:.0%} + {s['draft_wait_share_of_step']:.0%} (waiting) of a step, step x{s['online_over_frozen_step']:.2f} of frozen's; "
                          f"KL {s['kl_end']:.3f}")
            for eta, s in summary["staleness"].items()] + [("wall time", f"{summary['wall_s']:.0f}s")]


__all__ = ["run_async_drift", "summarize_eta", "headline"]
