"""`specrl bench profile`: where a plain and a chain-speculative engine step spend their time
(rollout.profile phases), one warm-up and one profiled run per engine and batch size."""
from __future__ import annotations

from experiments.bench.common import model_summary, preset_chain_length, profiled_run, save_summary, speed_setup
from experiments.bench.speed import MEASUREMENT, engine_step_costs, step_profile
from rollout.engine import EmbeddedEngine, EngineConfig


def bench_profile(task_name: str, preset_name: str, out_dir, batches: list[int], *, seed: int = 0, cache_dir=None,
                  chain_gamma: int | None = None, prompts_per_batch: int = 3, temperature: float = 0.0,
                  engine_options: dict | None = None, log=print) -> dict:
    """The phase profile and the bound's parts at each batch size, saved as DIR/summary.json;
    chains of the preset's length unless given."""
    from rollout.drafters import DrafterSpec, SpecConfig

    EngineConfig(**(engine_options or {}))  # a bad value fails before the expensive setup
    chain_gamma = preset_chain_length(preset_name, chain_gamma)
    policy, draft, params, prompts_for = speed_setup(task_name, preset_name, seed, cache_dir, temperature)
    scfg = SpecConfig(mode="chain", gamma=chain_gamma)
    rows = []
    for b in batches:
        prompts = prompts_for(b * prompts_per_batch)
        config = EngineConfig(max_batch=b, **(engine_options or {}))
        engines = {"plain": EmbeddedEngine(policy, config),
                   "chain": EmbeddedEngine(policy, config, drafter=DrafterSpec(draft=draft, spec=scfg))}
        profs = {}
        for name, e in engines.items():
            e.generate(prompts if config.compile_forwards else prompts[:2], params)  # warm-up (compiles every shape)
            profs[name] = profiled_run(e, prompts, params)[1]
        costs = engine_step_costs(profs["plain"], profs["chain"], b, chain_gamma)
        row = {"batch": b, "gamma": chain_gamma, **costs,
               "plain": step_profile(profs["plain"], b).get("plain"), "chain": step_profile(profs["chain"], b).get("spec")}
        rows.append(row)
        log(format_profile(row))
    return save_summary(out_dir, {"benchmark": "profile", "task": task_name, "preset": preset_name,
                                  "temperature": temperature, "model": model_summary(policy, draft),
                                  "measurement": MEASUREMENT, "engine_options": engine_options or {}, "rows": rows})


def format_profile(row: dict) -> str:
    lines = [f"batch {row['batch']:>3}:"]
    for kind in ("plain", "chain"):
        p = row.get(kind)
        if not p or not p.get("steps"):
            continue
        parts = "  ".join(f"{k} {v * 1e3:.2f}ms ({p['phase_fraction'][k]:.0%})" for k, v in p["phase_s"].items())
        lines.append(f"  {kind:>5} step {p['step_s'] * 1e3:.2f}ms over {p['steps']} steps: {parts}")
    return "\n".join(lines)


def headline(summary: dict) -> list[tuple[str, str]]:
    def ms(v):
        return "n/a" if v is None else f"{v * 1e3:.2f}ms"

    return [(f"batch {r['batch']}", f"target step {ms(r.get('target_step_s'))}, c {r['c']:.3f}, verify cost "
             f"{r['verify_cost']:.2f}" if r.get("c") is not None else f"target step {ms(r.get('target_step_s'))}")
            for r in summary["rows"]]
