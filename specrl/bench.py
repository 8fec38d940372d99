"""Generation benchmarks: numbers go to stdout and to DIR/summary.json, never into unit tests.

Every figure in one summary is measured in the same process, one after another on the same
prompts, so ratios between rows are meaningful on a noisy machine.
"""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

from rollout.engine import EmbeddedEngine, EngineConfig
from specrl.presets import get_preset
from specrl.train_rl import build_task_and_policy, encode_prompts, rollout_params
from target_training.sft import default_cache_dir


def machine_info() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}


def timed_generate(engine, prompts, params, repeats: int = 2) -> dict:
    """Best-of-repeats tokens/s after one warm-up call (same prompts each time)."""
    engine.generate(prompts[: min(len(prompts), 2)], params)
    best = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        trajs = engine.generate(prompts, params)
        wall = time.perf_counter() - t0
        n = sum(len(t.token_ids) for t in trajs)
        if best is None or n / wall > best["tokens_per_s"]:
            best = {"tokens_per_s": n / wall, "tokens": n, "wall_s": wall, "trajectories": trajs}
    return best


def bench_generate(task_name: str, preset_name: str, out_dir, batches: list[int], *, seed: int = 0,
                   cache_dir=None, prompts_per_batch: int = 2) -> dict:
    preset = get_preset(preset_name)
    tokenizer, task, policy, _ = build_task_and_policy(task_name, preset, cache_dir or default_cache_dir())
    params = rollout_params(preset, tokenizer, seed, greedy=True)
    rows = []
    for b in batches:
        examples = task.examples("heldout", b * prompts_per_batch, seed)
        engine = EmbeddedEngine(policy, EngineConfig(max_batch=b))
        r = timed_generate(engine, encode_prompts(tokenizer, examples), params)
        rows.append({"batch": b, "mode": "plain", "tokens_per_s": round(r["tokens_per_s"], 2), "tokens": r["tokens"],
                     "wall_s": round(r["wall_s"], 4)})
        print(f"batch {b:>3}: {r['tokens_per_s']:8.1f} tokens/s ({r['tokens']} tokens in {r['wall_s']:.2f}s)")
    summary = {"benchmark": "generate", "task": task_name, "preset": preset_name, "rows": rows, "machine": machine_info()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
