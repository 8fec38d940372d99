"""What the engine's speed options are worth, plain and speculative: the read-free MoE dispatch
(EngineConfig.moe_dispatch="dense") and compiled forwards (EngineConfig.compile_forwards).

Every option decodes the same prompts plain and with chains (the preset's length): six engines
taking turns within each repeat (`timed_generate_interleaved`), after one untimed run of every
engine on the full prompts (which compiles every shape the compiled engines meet, so no compile
lands in a timed call). An option's figure is the median over repeats of the per-repeat tokens/s
ratio to the default engine ("exact": bitwise the training dispatch, eager). Greedy: every engine
must decode the default plain engine's tokens (the options differ from it by rounding only).
Writes summary.json.

    python -m experiments.engine_options --out DIR [--preset quick] [--batches 1,4,16]
"""
from __future__ import annotations

import statistics
import time

from experiments import batch_sweep_main
from experiments.bench.common import (preset_chain_length, repeat_ratios, save_summary, speed_setup,
                                      timed_generate_interleaved)
from rollout.engine import EmbeddedEngine, EngineConfig
from rollout.protocol import same_tokens
from rollout.drafters import DrafterSpec, SpecConfig

OPTIONS = {"exact": {}, "dense": {"moe_dispatch": "dense"}, "compiled": {"compile_forwards": True}}


def run(out_dir, preset: str = "quick", batches=(1, 4, 16), repeats: int = 5, prompts_per_batch: int = 3,
        cache_dir=None, log=print) -> dict:
    policy, draft, params, prompts_for = speed_setup("arith", preset, 0, cache_dir, 0.0)
    spec_cfg = SpecConfig(mode="chain", gamma=preset_chain_length(preset))
    rows = []
    for b in batches:
        prompts = prompts_for(prompts_per_batch * b)
        engines, warm_s = {}, {}
        for option, settings in OPTIONS.items():
            config = EngineConfig(max_batch=b, **settings)
            engines[f"plain {option}"] = EmbeddedEngine(policy, config)
            engines[f"chain {option}"] = EmbeddedEngine(policy, config, drafter=DrafterSpec(draft=draft, spec=spec_cfg))
        for name, engine in engines.items():  # untimed: compiles every shape the timed calls meet
            t0 = time.perf_counter()
            engine.generate(prompts, params)
            warm_s[name] = time.perf_counter() - t0
        timed = timed_generate_interleaved(engines, prompts, params, repeats)
        reference = timed["plain exact"]["trajectories"]

        def ratio(a: str, b: str) -> float:  # median over repeats of the per-repeat tokens/s ratio a / b
            return statistics.median(repeat_ratios(timed[a], timed[b]))

        for mode in ("plain", "chain"):
            row = {"batch": b, "mode": mode, "gamma": spec_cfg.gamma if mode == "chain" else None}
            for option in OPTIONS:
                name = f"{mode} {option}"
                row[f"tokens_per_s_{option}"] = timed[name]["tokens_per_s"]
                row[f"{option}_over_exact_repeats"] = repeat_ratios(timed[name], timed[f"{mode} exact"])
                row[f"{option}_over_exact_median"] = statistics.median(row[f"{option}_over_exact_repeats"])
                row[f"first_run_s_{option}"] = warm_s[name]
                if mode == "chain":  # speculation's speed-up under the option, and over default plain decoding
                    row[f"chain_over_plain_median_{option}"] = ratio(name, f"plain {option}")
                    row[f"chain_over_plain_exact_median_{option}"] = ratio(name, "plain exact")
            row["identical_to_plain_exact"] = all(same_tokens(timed[f"{mode} {o}"]["trajectories"], reference)
                                                  for o in OPTIONS)
            row["compiled_failures"] = len(engines[f"{mode} compiled"].compiled.failures)
            rows.append(row)
            log(f"batch {b:>3} {mode}: " + "  ".join(f"{o} x{row[f'{o}_over_exact_median']:.2f}" for o in OPTIONS)
                + ("  chain/plain " + " ".join(f"{o} x{row[f'chain_over_plain_median_{o}']:.2f}" for o in OPTIONS)
                   if mode == "chain" else "")
                + f"  identical {row['identical_to_plain_exact']}  first compiled run {row['first_run_s_compiled']:.1f}s")
    return save_summary(out_dir, {"experiment": "engine_options", "preset": preset, "gamma": spec_cfg.gamma,
                                  "repeats": repeats, "prompts_per_batch": prompts_per_batch,
                                  "options": OPTIONS, "rows": rows})


def main(argv=None) -> int:
    return batch_sweep_main(__doc__, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
