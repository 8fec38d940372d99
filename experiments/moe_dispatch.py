"""What the dense MoE dispatch (EngineConfig.moe_dispatch="dense") is worth, plain and speculative.

The exact dispatch reads each MoE layer's group sizes back to the host; the dense one runs every
expert on every token of a small block and reads nothing (target_training.model.MoE). Both arms
of a pair decode the same prompts, so the dense arm's tokens/s over the exact arm's, measured in
turns within each repeat (`timed_generate_interleaved`), is what the dispatch buys; the median
over repeats of the per-repeat ratio is the figure to quote. Greedy: every arm must decode
the exact plain arm's tokens (the dispatches differ by rounding only). Writes summary.json.

    python -m experiments.moe_dispatch --out DIR [--preset quick] [--batches 1,4,16]
"""
from __future__ import annotations

import statistics

from experiments import batch_sweep_main
from rollout.engine import EmbeddedEngine, EngineConfig
from rollout.protocol import same_tokens
from rollout.speculative import SpecConfig, Speculator
from specrl.bench import preset_chain_length, save_summary, speed_setup, timed_generate_interleaved


def run(out_dir, preset: str = "quick", batches=(1, 4, 16), repeats: int = 5, prompts_per_batch: int = 3,
        cache_dir=None, log=print) -> dict:
    policy, draft, params, prompts_for = speed_setup("arith", preset, 0, cache_dir, 0.0)
    spec_cfg = SpecConfig(mode="chain", gamma=preset_chain_length(preset))
    rows = []
    for b in batches:
        prompts = prompts_for(prompts_per_batch * b)
        engines = {}
        for dispatch in ("exact", "dense"):
            config = EngineConfig(max_batch=b, moe_dispatch=dispatch)
            engines[f"plain {dispatch}"] = EmbeddedEngine(policy, config)
            engines[f"chain {dispatch}"] = EmbeddedEngine(policy, config, speculator=Speculator(draft, spec_cfg))
        timed = timed_generate_interleaved(engines, prompts, params, repeats)
        reference = timed["plain exact"]["trajectories"]
        for mode in ("plain", "chain"):
            exact, dense = timed[f"{mode} exact"], timed[f"{mode} dense"]
            ratios = [d / e for d, e in zip(dense["tokens_per_s_repeats"], exact["tokens_per_s_repeats"])]
            rows.append({"batch": b, "mode": mode, "gamma": spec_cfg.gamma if mode == "chain" else None,
                         "tokens_per_s_exact": exact["tokens_per_s"], "tokens_per_s_dense": dense["tokens_per_s"],
                         "dense_over_exact_median": statistics.median(ratios), "dense_over_exact_repeats": ratios,
                         "identical_to_plain_exact": same_tokens(exact["trajectories"], reference)
                         and same_tokens(dense["trajectories"], reference)})
        def speedup(chain: str, plain: str) -> float:  # median per-repeat tokens/s ratio
            return statistics.median(c / p for c, p in zip(timed[chain]["tokens_per_s_repeats"],
                                                           timed[plain]["tokens_per_s_repeats"]))

        # speculation's speed-up under each dispatch, and the dense chain against exact plain decoding
        chain_over_plain = {d: speedup(f"chain {d}", f"plain {d}") for d in ("exact", "dense")}
        rows[-1].update(chain_over_plain_median=chain_over_plain,
                        chain_dense_over_plain_exact_median=speedup("chain dense", "plain exact"))
        log(f"batch {b:>3}: " + "  ".join(f"{r['mode']} dense/exact x{r['dense_over_exact_median']:.2f}"
                                          for r in rows if r["batch"] == b)
            + f"  chain/plain exact x{chain_over_plain['exact']:.2f} dense x{chain_over_plain['dense']:.2f}"
            + f"  identical {all(r['identical_to_plain_exact'] for r in rows if r['batch'] == b)}")
    summary = {"experiment": "moe_dispatch", "preset": preset, "gamma": spec_cfg.gamma, "repeats": repeats,
               "prompts_per_batch": prompts_per_batch, "rows": rows}
    return save_summary(out_dir, summary)


def main(argv=None) -> int:
    return batch_sweep_main(__doc__, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
