"""`specrl bench generate`: plain generation tokens/s of the embedded engine per batch size."""
from __future__ import annotations

from experiments.bench.common import save_summary, timed_generate
from rollout.engine import EmbeddedEngine, EngineConfig
from specrl.presets import get_preset
from specrl.rl_setup import build_task_and_policy, encode_prompts, rollout_params
from target_training.sft import default_cache_dir


def bench_generate(task_name: str, preset_name: str, out_dir, batches: list[int], *, seed: int = 0,
                   cache_dir=None, prompts_per_batch: int = 2, log=print) -> dict:
    """Best-of-2 greedy tokens/s at each batch size on `batch * prompts_per_batch` held-out
    prompts, saved as DIR/summary.json."""
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
        log(f"batch {b:>3}: {r['tokens_per_s']:8.1f} tokens/s ({r['tokens']} tokens in {r['wall_s']:.2f}s)")
    return save_summary(out_dir, {"benchmark": "generate", "task": task_name, "preset": preset_name, "rows": rows})


def headline(summary: dict) -> list[tuple[str, str]]:
    return [(f"batch {r['batch']}", f"{r['tokens_per_s']:.1f} tokens/s") for r in summary["rows"]]
