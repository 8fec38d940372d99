"""`specrl bench overlap`: what online draft training adds to the RL step, sequential versus overlapped (prints and saves JSON).

The co-training is the drift runs' with a fixed count (presets.DRIFT_COTRAIN_FIXED: one update of
12 sequences per RL step, features from the trainer's forward) on the chosen preset's model, task and RL sizes.

Four copies of one RL run take turns in blocks of consecutive RL steps, the arms' order rotating
from block to block (so a slow spell of a shared machine, or the position in a round, hits them
alike): "none" speculates with the starting draft and trains nothing (CoTrainConfig mode
"frozen"); "sequential" and "overlap" co-train online in the two scheduler modes; "overlap_rollout"
overlaps too, but its burst runs under the rollout only, with the RL loop at one intra-op thread
meanwhile, and is collected before the policy update. The first three decode the same tokens
(speculation is lossless) and apply the same policy updates, so the RL work is the same (checked);
for "overlap_rollout", whose rollout runs on one thread, the JSON says whether it did. To keep
the speculation the same too, the online copies do not hot-swap their draft into the engine in this benchmark (a patched `load_draft_weights`): every copy
decodes with the starting draft, and the only difference left is the draft training itself.

Blocks, not single steps: an overlapped burst launched at the end of a step runs during the next
step, so with turns of one step it would run under *another arm's* step and bill its cost there
(even to "none", which trains nothing). At the end of an
overlap block the RL loop waits for the burst in flight (`SpecCoTrainer.wait_for_draft`), and
that wait is added to the block's last step: the overlap arm pays for every burst it started.

added_fraction[mode] = mean step time of mode / mean step time of "none" - 1, over the same steps
(`added_fraction_median` uses medians instead, robust to a preempted step).
For the overlapped arms the JSON also gives the burst time that ran under RL work (`perf/draft_overlap_s`)
and the step boundary's wait for a burst still running (`perf/draft_wait_s`).

`bench_overlap_phases` (`specrl bench overlap --phases`) asks where inside the RL step an
overlapped burst could hide: it times one rollout phase, a speculative `generate()` at one batch
size, three ways in turns: alone, followed in line by K draft updates (sequential), and with the
same K updates running on their own thread from the call's start (overlap). Both with the
RL loop at 2 intra-op threads (the default, both cores) and at 1 (leaving the second core to the
burst). added = wall / alone - 1; overlap wins where its added is below the sequential one.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from experiments.bench.common import machine_info, turn_order
from rollout.engine import EmbeddedEngine, EngineConfig
from specrl.cotrain import SpecCoTrainer
from specrl.drafts import starting_draft
from specrl.presets import DRIFT_COTRAIN_FIXED, RunPreset, get_preset
from specrl.rl_setup import build_task_and_policy, encode_prompts, rollout_params
from specrl.run_dir import METRICS_FILE
from specrl.train_rl import RLRun, rl_step
from target_training.grpo import GRPOTrainer

MODES = ("none", "sequential", "overlap", "overlap_rollout")
# "overlap_rollout": the burst runs under the rollout only, with the RL loop at one intra-op thread
# meanwhile, and is collected before the policy update (SchedulerConfig overlap_until, rollout_threads)
OVERLAP_ROLLOUT = {"mode": "overlap", "overlap_until": "rollout", "rollout_threads": 1}


class StartingDraftEngine(EmbeddedEngine):
    """An embedded engine that takes a pushed draft's version but not its weights: every arm
    speculates with the starting draft, so the arms differ only in how the draft trains."""

    pushed_version = 0

    def push_draft(self, weights: dict, version: int) -> None:
        self.pushed_version = version

    @property
    def draft_version(self) -> int | None:
        return self.pushed_version


def _setup(task_name: str, preset_name: str, out_dir, seed: int, cache_dir, log):
    """The output folder, the preset, its policy and cached offline draft, and the RL prompt pool."""
    from target_training.sft import default_cache_dir

    preset = get_preset(preset_name)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer, task, policy, _ = build_task_and_policy(task_name, preset, cache_dir, log)
    draft, _ = starting_draft(policy, tokenizer, task, preset, seed,
                              Path(cache_dir) if cache_dir else default_cache_dir(), log=log)
    pool = task.examples("train", max(512, preset.prompts_per_step * 8), seed + 1)
    torch.manual_seed(seed)
    return out, preset, tokenizer, task, policy, draft, pool


def _arm(mode: str, policy, draft, preset: RunPreset, seed: int, out: Path, tokenizer, task, pool) -> RLRun:
    """One arm: its own copy of the policy and draft, engine, trainer and co-trainer, as an RL run
    whose steps `rl_step` takes (its metrics.jsonl in out/arms/MODE)."""
    policy = copy.deepcopy(policy)
    draft = copy.deepcopy(draft)
    draft.set_target_embedding(policy.embed_tokens)
    cfg = DRIFT_COTRAIN_FIXED  # one update per RL step, the same count in both modes
    if mode == "none":
        cfg = dataclasses.replace(cfg, mode="frozen", seed=seed)
    else:
        sched = OVERLAP_ROLLOUT if mode == "overlap_rollout" else {"mode": mode}
        cfg = dataclasses.replace(cfg, mode="online", seed=seed,
                                  scheduler=dataclasses.replace(cfg.scheduler, **sched))
    engine = StartingDraftEngine(policy, EngineConfig(max_batch=preset.max_batch))
    trainer = GRPOTrainer(policy, preset.grpo)
    cot = SpecCoTrainer(draft, cfg).attach(engine, trainer)
    arm_out = out / "arms" / mode
    arm_out.mkdir(parents=True, exist_ok=True)
    (arm_out / METRICS_FILE).unlink(missing_ok=True)  # a rerun into the same folder starts its rows afresh
    return RLRun(preset, seed, arm_out, arm_out, tokenizer, task, policy, engine, trainer, cot, pool=pool)


def bench_overlap(task_name: str, preset_name: str, out_dir, *, steps: int = 8, warmup: int = 2, seed: int = 0,
                  block: int = 4, cache_dir=None, log=print) -> dict:
    if steps <= 0 or warmup < 0 or block <= 0:
        raise ValueError(f"bench overlap needs steps > 0, warmup >= 0 and block > 0, got {steps}, {warmup}, {block}")
    out, preset, tokenizer, task, policy, draft, pool = _setup(task_name, preset_name, out_dir, seed, cache_dir, log)
    arms = {m: _arm(m, policy, draft, preset, seed, out, tokenizer, task, pool) for m in MODES}
    steps_of = {m: [] for m in MODES}
    total = warmup + steps
    for k, start in enumerate(range(0, total, block)):
        for mode in turn_order(MODES, k):  # rotated from block to block
            rows = steps_of[mode]
            for step in range(start, min(start + block, total)):
                rows.append(rl_step(arms[mode], step))
            t0 = time.perf_counter()
            arms[mode].cotrain.wait_for_draft()  # the overlap arm pays for the burst it left running
            rows[-1]["step_s"] += time.perf_counter() - t0
    losses = {m: [r["loss"] for r in rows] for m, rows in steps_of.items()}
    if not (losses["none"] == losses["sequential"] == losses["overlap"]):
        raise RuntimeError("the arms' policy updates differ: the benchmark would compare different work")
    timed = {m: rows[warmup:] for m, rows in steps_of.items()}
    mean = {m: sum(r["step_s"] for r in rows) / len(rows) for m, rows in timed.items()}
    median = {m: statistics.median(r["step_s"] for r in rows) for m, rows in timed.items()}
    trained, overlapped = MODES[1:], ("overlap", "overlap_rollout")
    result = {
        "preset": preset_name, "steps": steps, "warmup": warmup, "block": block,
        "step_s_mean": mean, "step_s_median": median,
        "added_fraction": {m: mean[m] / mean["none"] - 1.0 for m in trained},
        "added_fraction_median": {m: median[m] / median["none"] - 1.0 for m in trained},
        # one intra-op thread may round a logit differently and flip a sampled token, so this arm's
        # updates are compared and reported rather than required to match
        "overlap_rollout_same_updates": losses["overlap_rollout"] == losses["none"],
        "sequential_draft_train_s_mean": sum(r["perf/draft_train_s"] for r in timed["sequential"]) / steps,
        "overlap_hidden_s_mean": {m: sum(r["perf/draft_overlap_s"] for r in timed[m]) / steps for m in overlapped},
        "overlap_wait_s_mean": {m: sum(r["perf/draft_wait_s"] for r in timed[m]) / steps for m in overlapped},
        "draft_steps_per_rl_step": {m: sum(r["train/draft_steps"] or 0 for r in timed[m]) / steps for m in trained},
        "per_step": {m: [r["step_s"] for r in rows] for m, rows in timed.items()},
        "machine": machine_info(),
    }
    (out / "bench_overlap.json").write_text(json.dumps(result, indent=1))
    return result


def bench_overlap_phases(task_name: str, preset_name: str, out_dir, *, batches=(1, 4, 16, 64), updates: int = 2,
                         repeats: int = 5, seed: int = 0, cache_dir=None, log=print) -> dict:
    """Where an overlapped burst hides and where it competes (module docstring). The buffer is
    filled by two co-trained RL steps first; the rollout engine speculates with the starting
    draft (chains, the drift runs' gamma), the burst trains the co-trainer's own copy."""
    from rollout.drafters import DrafterSpec
    from specrl.overlap import OverlappedBursts

    if updates <= 0 or repeats <= 0 or not batches or any(b <= 0 for b in batches):
        raise ValueError(f"bench overlap --phases needs updates > 0, repeats > 0 and positive batches, "
                         f"got {updates}, {repeats}, {batches}")
    out, preset, tokenizer, task, policy, draft, pool = _setup(task_name, preset_name, out_dir, seed, cache_dir, log)
    arm = _arm("sequential", policy, draft, preset, seed, out, tokenizer, task, pool)
    for step in range(2):  # features in the buffer, as in a run
        rl_step(arm, step)
    cot = arm.cotrain
    trainer, buffer, gen = cot.draft_trainer, cot.buffer, cot.generator
    batch_size, prefer = cot.config.online.batch_size, cot.config.online.prefer_rejected
    bursts = OverlappedBursts(trainer, threads=1)
    params = rollout_params(preset, tokenizer, seed)
    main_threads = torch.get_num_threads()
    version0 = trainer.version

    def alone(engine, prompts):
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        return time.perf_counter() - t0, None

    def sequential(engine, prompts):
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        t1 = time.perf_counter()
        trainer.train_for(buffer, updates, float("inf"), gen, batch_size=batch_size)
        t2 = time.perf_counter()
        return t2 - t0, t2 - t1

    def overlap(engine, prompts):
        t0 = time.perf_counter()
        bursts.launch(buffer, updates, batch_size, float("inf"), gen, prefer_rejected=prefer, min_version=None)
        engine.generate(prompts, params)
        res = bursts.collect()
        return time.perf_counter() - t0, res["burst_s"]

    arms = {"alone": alone, "sequential": sequential, "overlap": overlap}
    rows = []
    try:
        for b in batches:
            prompts = encode_prompts(tokenizer, task.examples("heldout", 2 * b, seed + 5))
            engine = EmbeddedEngine(arm.policy, EngineConfig(max_batch=b),
                                    drafter=DrafterSpec(draft=draft, spec=cot.config.spec))
            for threads in sorted({main_threads, 1}, reverse=True):
                torch.set_num_threads(threads)
                engine.generate(prompts, params)  # warm-up
                walls = {a: [] for a in arms}
                burst = {"sequential": [], "overlap": []}  # the updates' own seconds, per arm that trains
                for r in range(repeats):
                    for name in turn_order(arms, r):
                        wall, b_s = arms[name](engine, prompts)
                        walls[name].append(wall)
                        if b_s is not None:
                            burst[name].append(b_s)
                med = {a: statistics.median(w) for a, w in walls.items()}
                row = {"batch": b, "main_threads": threads, "updates": updates,
                       "generate_s": med["alone"], "sequential_s": med["sequential"], "overlap_s": med["overlap"],
                       "update_s_in_line": statistics.median(burst["sequential"]),
                       "burst_s_overlapped": statistics.median(burst["overlap"]),
                       "added_sequential": med["sequential"] / med["alone"] - 1.0,
                       "added_overlap": med["overlap"] / med["alone"] - 1.0,
                       "walls": walls}
                row["overlap_wins"] = row["added_overlap"] < row["added_sequential"]
                rows.append(row)
                log(f"batch {b:>3} main threads {threads}: generate {row['generate_s']:.3f}s; added sequential "
                    f"{row['added_sequential']:+.3f}, overlap {row['added_overlap']:+.3f} (updates {updates}: in line "
                    f"{row['update_s_in_line']:.3f}s, overlapped burst {row['burst_s_overlapped']:.3f}s)")
    finally:
        torch.set_num_threads(main_threads)
    result = {"benchmark": "overlap_phases", "preset": preset_name, "updates": updates, "repeats": repeats,
              "draft_updates_done": trainer.version - version0,  # every timed update really trained
              "statistic": "median over repeats; arms in turns, order rotated each repeat", "rows": rows,
              "machine": machine_info()}
    (out / "bench_overlap_phases.json").write_text(json.dumps(result, indent=1))
    return result


def headline(result: dict) -> list[tuple[str, str]]:
    """The figures an overlap run ends with: each co-training mode's added step time."""
    if result.get("benchmark") == "overlap_phases":
        return [(f"batch {r['batch']}, {r['main_threads']} thread(s)",
                 f"added sequential {r['added_sequential']:+.3f}, overlap {r['added_overlap']:+.3f}")
                for r in result["rows"]]
    rows = [(f"added step time, {m}", f"{result['added_fraction'][m]:+.3f} (median {result['added_fraction_median'][m]:+.3f})")
            for m in result["added_fraction"]]
    rows.append(("draft training in line", f"{result['sequential_draft_train_s_mean']:.3f}s per RL step"))
    rows += [(f"burst under RL work, {m}", f"{result['overlap_hidden_s_mean'][m]:.3f}s hidden, "
                                          f"{result['overlap_wait_s_mean'][m]:.3f}s waited per RL step")
             for m in result["overlap_hidden_s_mean"]]
    rows.append(("same policy updates with one rollout thread", str(result["overlap_rollout_same_updates"])))
    return rows
