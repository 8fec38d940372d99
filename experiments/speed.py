"""Speed sweeps: speculative decoding over batch size, chain length and tree budget.

Every row is measured by `specrl.bench.measure_speculation`, the same code as
`specrl bench speed`: tokens/s against plain decoding on the same prompts, accept length,
per-token acceptance alpha, and the measured costs behind the DESIGN section 4 bound,
bound = accept_length / (verify_cost + gamma * c). The plots draw the bound beside each
measurement, so the gap (efficiency = speed-up / bound) shows what the decode loop wastes.

    specrl speed --preset quick --out runs/speed
"""
from __future__ import annotations

from rollout.speculative import SpecConfig
from specrl.bench import measure_and_save, speed_setup


def sweep_configs(gammas, tree_budgets, tree_depth: int, tree_topk: int) -> list[SpecConfig]:
    chains = [SpecConfig(mode="chain", gamma=g) for g in gammas]
    trees = [SpecConfig(mode="tree", gamma=tree_depth, tree_topk=tree_topk, tree_budget=n) for n in tree_budgets]
    return chains + trees


def run_speed(out_dir, *, preset: str = "quick", task: str = "arith", batches=(1, 4, 16, 64), gammas=(1, 2, 4, 6),
              tree_budgets=(4, 8, 16), tree_depth: int = 4, tree_topk: int = 4, temperature: float = 1.0,
              prompts_per_batch: int = 2, repeats: int = 2, seed: int = 0, cache_dir=None, plots: bool = True,
              log=print) -> dict:
    policy, draft, params, prompts_for = speed_setup(task, preset, seed, cache_dir, temperature)
    configs = sweep_configs(gammas, tree_budgets, tree_depth, tree_topk)
    summary = measure_and_save(out_dir, "speed_sweep", task, preset, temperature, policy, draft, params, prompts_for,
                               batches, configs, prompts_per_batch=prompts_per_batch, repeats=repeats, log=log)
    if plots:
        from experiments.plots import speed_plots
        speed_plots(out_dir)
    return summary
