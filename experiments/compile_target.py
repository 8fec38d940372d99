"""Would `torch.compile` of the target's decode and verify forwards pay on this CPU? A measurement.

The best case for inductor is a forward with nothing dynamic in it: a fixed (batch, block) shape,
the read-free MoE dispatch (no host read, so no graph break there) and every block reading the
whole cache length (a fixed key count, masked), compiled with `dynamic=False`. This script times
one such forward per shape against the engine's eager forward (exact dispatch, keys up to the
longest row, as `EmbeddedEngine` runs it) on a 40-token cache, median of many calls, and records
what compiling each shape costs and how far the compiled logits are from eager's (same inputs,
same dispatch and key count). The engine would need one graph per batch size and block length it
meets (batch sizes shrink in the tail), so the compile cost is paid per shape. Writes summary.json.

    python -m experiments.compile_target --out DIR [--preset quick] [--batches 1,4,16]
"""
from __future__ import annotations

import statistics
import time

import torch

from experiments import batch_sweep_main
from experiments.bench.common import preset_chain_length, save_summary, speed_setup
from rollout.compiled import RECOMPILE_LIMIT
from target_training.model import KVCache, MoE


def time_forward(forward, cache: KVCache, ids, key_len: int, moe_dispatch: str, cached: int, calls: int):
    """Median seconds of forward() over `calls` calls after a few warm ones, every call on the
    same `cached`-token slots (the block is rolled back each time); and the last logits."""
    slots = torch.arange(ids.shape[0])
    times = []
    with torch.inference_mode():
        for i in range(calls + 3):
            cache.lengths[:] = cached
            t0 = time.perf_counter()
            out = forward(ids, cache=cache, slots=slots, key_len=key_len, moe_dispatch=moe_dispatch)
            if i >= 3:
                times.append(time.perf_counter() - t0)
    return (statistics.median(times) if times else None), out.logits


def run(out_dir, preset: str = "quick", batches=(1, 4, 16), cached: int = 40, calls: int = 100, cache_dir=None,
        log=print) -> dict:
    import torch._dynamo

    policy, _, _, _ = speed_setup("arith", preset, 0, cache_dir, 0.0)
    compiled = torch.compile(policy.forward, dynamic=False, fullgraph=True)
    g = torch.Generator().manual_seed(0)
    rows = []
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):  # a graph per shape, as in the engine
        for b in batches:
            rows.extend(_measure_batch(policy, compiled, b, preset, cached, calls, g, log))
    return save_summary(out_dir, {"experiment": "compile_target", "preset": preset, "cached_tokens": cached,
                                  "calls": calls, "rows": rows})


def _measure_batch(policy, compiled, b: int, preset: str, cached: int, calls: int, g, log) -> list[dict]:
    """The rows of one batch size: a decode block and a chain's verify block."""
    cfg, rows = policy.cfg, []
    for block in (1, preset_chain_length(preset) + 1):  # a decode block and a chain's verify block
        ids = torch.randint(3, cfg.vocab_size, (b, block), generator=g)
        if b * block > MoE.DENSE_DISPATCH_MAX_TOKENS:  # the exact dispatch reads the host: no whole graph
            log(f"batch {b:>3} block {block}: beyond the dense dispatch's {MoE.DENSE_DISPATCH_MAX_TOKENS} tokens")
            continue
        cache = KVCache.for_model(cfg, b, cfg.max_seq_len)
        t0 = time.perf_counter()
        time_forward(compiled, cache, ids, cfg.max_seq_len, "dense", cached, calls=0)  # compiles this shape
        compile_s = time.perf_counter() - t0
        eager_s, _ = time_forward(policy.forward, cache, ids, cached + block, "exact", cached, calls)
        eager_static_s, eager_logits = time_forward(policy.forward, cache, ids, cfg.max_seq_len, "dense", cached,
                                                    calls)
        compiled_s, compiled_logits = time_forward(compiled, cache, ids, cfg.max_seq_len, "dense", cached, calls)
        # microseconds, and the logit difference times 1e6: the summary keeps 4 decimals
        rows.append({"batch": b, "block": block, "eager_us": eager_s * 1e6,
                     "eager_static_dense_us": eager_static_s * 1e6, "compiled_us": compiled_s * 1e6,
                     "eager_over_compiled": eager_s / compiled_s, "compile_s": compile_s,
                     "max_abs_logit_diff_x1e6": (eager_logits - compiled_logits).abs().max().item() * 1e6})
        r = rows[-1]
        log(f"batch {b:>3} block {block}: eager {r['eager_us']:7.0f}us  eager static+dense "
            f"{r['eager_static_dense_us']:7.0f}us  compiled {r['compiled_us']:7.0f}us  "
            f"eager/compiled x{r['eager_over_compiled']:.2f}  compile {compile_s:.1f}s  "
            f"max|dlogit| {r['max_abs_logit_diff_x1e6']:.1f}e-6")
    return rows


def main(argv=None) -> int:
    return batch_sweep_main(__doc__, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
