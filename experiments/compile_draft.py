"""Does `torch.compile` of the draft pay in the embedded engine? A measurement, not a feature.

Issue 16 asks for compiled forwards where they pay. The draft is the safe place to try: what
it proposes changes only acceptance, never the tokens (verification is exact), so a compiled
draft cannot break losslessness. This script times plain decoding, the eager chain draft and
the same draft with its forward compiled by inductor (`dynamic=True`: batch, block and key
lengths change every step), in turns on the same prompts, after compiling on a warm-up, and
writes summary.json. Until cc2e699 the draft's cache block read the longest slot length back
from the tensor to size its keys, a graph break; since then the engine passes that length from
the host (`key_len`), and the compiled draft still loses on CPU (README, "Measured figures").

    python -m experiments.compile_draft --out DIR [--preset quick] [--batches 1,4,16]
"""
from __future__ import annotations

import copy
import time

import torch

from experiments import batch_sweep_main
from rollout.engine import EmbeddedEngine, EngineConfig
from rollout.protocol import same_tokens
from rollout.speculative import SpecConfig, Speculator
from specrl.bench import save_summary, speed_setup, timed_generate_interleaved


def run(out_dir, preset: str = "quick", batches=(1, 4, 16), gamma: int = 4, repeats: int = 5,
        prompts_per_batch: int = 3, cache_dir=None, log=print) -> dict:
    policy, draft, params, prompts_for = speed_setup("arith", preset, 0, cache_dir, 0.0)
    compiled = copy.deepcopy(draft)
    compiled.forward = torch.compile(compiled.forward, dynamic=True)
    cfg = SpecConfig(mode="chain", gamma=gamma)
    rows = []
    for b in batches:
        prompts = prompts_for(prompts_per_batch * b)
        engines = {"plain": EmbeddedEngine(policy, EngineConfig(max_batch=b)),
                   "eager": EmbeddedEngine(policy, EngineConfig(max_batch=b), speculator=Speculator(draft, cfg)),
                   "compiled": EmbeddedEngine(policy, EngineConfig(max_batch=b), speculator=Speculator(compiled, cfg))}
        t0 = time.perf_counter()
        for _ in range(2):  # compile (and recompile for the dynamic shapes) outside the clock
            engines["compiled"].generate(prompts, params)
        warm_s = time.perf_counter() - t0
        timed = timed_generate_interleaved(engines, prompts, params, repeats)
        plain = timed["plain"]
        for name, r in timed.items():
            rows.append({"batch": b, "arm": name, "tokens_per_s": r["tokens_per_s"],
                         "speedup": r["tokens_per_s"] / plain["tokens_per_s"], "engine_steps": r["engine_steps"],
                         "identical_to_plain": same_tokens(r["trajectories"], plain["trajectories"]),
                         **({"compile_warmup_s": warm_s} if name == "compiled" else {})})
        log(f"batch {b:>3}: " + "  ".join(f"{r['arm']} x{r['speedup']:.2f}" for r in rows if r["batch"] == b)
            + f"  (compiled warm-up {warm_s:.1f}s)")
    summary = {"experiment": "compile_draft", "preset": preset, "gamma": gamma, "repeats": repeats,
               "rows": rows}
    return save_summary(out_dir, summary)


def main(argv=None) -> int:
    return batch_sweep_main(__doc__, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
