"""Generation benchmarks: numbers go to stdout and to DIR/summary.json, never into unit tests.

Every figure in one summary is measured in the same process, one after another on the same
prompts, so ratios between rows are meaningful on a noisy machine.
"""
from __future__ import annotations

import dataclasses
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from rollout.engine import EmbeddedEngine, EngineConfig
from rollout.protocol import same_tokens, summarize_spec_stats
from specrl.presets import get_preset
from specrl.train_rl import build_task_and_policy, encode_prompts, rollout_params
from target_training.sft import default_cache_dir


def machine_info() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}


def turn_order(names, k: int) -> list:
    """The arms' order in round k of a timing that takes turns: rotated by k, so no arm always
    runs first or right after the same other one."""
    names = list(names)
    k %= len(names)
    return names[k:] + names[:k]


def timed_generate(engine, prompts, params, repeats: int = 2) -> dict:
    """Best-of-repeats tokens/s after one warm-up call (same prompts each time)."""
    return timed_generate_interleaved({"engine": engine}, prompts, params, repeats)["engine"]


def repeat_ratios(timed_a: dict, timed_b: dict) -> list[float]:
    """Arm a's tokens/s over arm b's in each timed repeat, in repeat order (two results of
    `timed_generate_interleaved`): the two calls of a repeat ran seconds apart, so a slow spell
    of the machine hits both, and the median of these is the least noisy comparison."""
    return [a / b for a, b in zip(timed_a["tokens_per_s_repeats"], timed_b["tokens_per_s_repeats"])]


def timed_generate_interleaved(engines: dict, prompts, params, repeats: int = 2, profile=()) -> dict[str, dict]:
    """`timed_generate` for several engines, taking turns within each repeat, so a slow spell of
    a noisy machine hits every engine alike instead of whichever ran during it. The turn order
    rotates by one engine per repeat, so no engine always runs right after the same other one
    (a call can leave the allocator or caches in a state that slows the next). An engine with a
    `ready()` method (an arm that shares a live engine with others and swaps its draft in) is
    readied before each of its calls, outside the clock. The engines named in `profile` carry
    one StepProfiler through all their timed calls (not the warm-up), returned as "profiler"."""
    from rollout.profile import StepProfiler

    for engine in engines.values():
        getattr(engine, "ready", lambda: None)()
        engine.generate(prompts[: min(len(prompts), 2)], params)
    profilers = {name: StepProfiler(engines[name].device) for name in profile}
    best: dict[str, dict] = {}
    names = list(engines)
    per_repeat: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(repeats):
        for name in turn_order(names, rep):
            engine = engines[name]
            getattr(engine, "ready", lambda: None)()
            if name in profilers:
                engine.profiler = profilers[name]
                profilers[name].call = rep  # the step records say which repeat they came from
            try:
                t0 = time.perf_counter()
                trajs = engine.generate(prompts, params)
                wall = time.perf_counter() - t0
            finally:
                if name in profilers:
                    engine.profiler = None
            n = sum(len(t.token_ids) for t in trajs)
            per_repeat[name].append(n / wall)
            if name not in best or n / wall > best[name]["tokens_per_s"]:
                # engine steps: deterministic for a given engine, prompts and draft (None where unknown)
                steps = (getattr(engine, "last_stats", None) or {}).get("engine_steps")
                best[name] = {"tokens_per_s": n / wall, "tokens": n, "wall_s": wall, "trajectories": trajs,
                              "engine_steps": steps}
    # tokens/s of every repeat, in repeat order: ratios between engines per repeat are their
    # least noisy comparison (both ran within seconds of each other)
    return {name: {**best[name], "tokens_per_s_repeats": per_repeat[name],
                   **({"profiler": profilers[name]} if name in profilers else {})} for name in names}


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
    return save_summary(out_dir, {"benchmark": "generate", "task": task_name, "preset": preset_name, "rows": rows})


# -- speculative decoding speed ------------------------------------------------------------
# How each figure of a speed row is measured; written into every speed summary.
MEASUREMENT = {
    "tokens_per_s": "generated tokens / wall seconds of one EmbeddedEngine.generate() call on the row's prompts, "
                    "best of the timed repeats after one warm-up call; engines of one batch size take turns "
                    "within each repeat, the order rotating by one per repeat (on CPU with the step profiler "
                    "attached, see target_step_s; on CUDA without)",
    "accept_length": "tokens emitted per verify step (accepted drafts + the target's own), over all sequences",
    "alpha": "accepted / drafted draft tokens",
    "target_step_s": "lower quartile (25th percentile, robust to OS preemption) of the wall time of the target's forward in the plain engine's real decode steps "
                     "(EmbeddedEngine._decode_step on the row's prompts, steps with every slot busy and no "
                     "admitted prompt riding along), rollout.profile: on CPU from the timed repeats "
                     "themselves, pooled (a profiler mark there is one clock read, so the bound's parts come "
                     "from the very calls whose speed-up is reported); on CUDA, where a mark synchronises the "
                     "device, from one extra profiled run",
    "verify_s": "lower quartile of the wall time of the target's verify forward in the speculative engine's real steps "
                "(SpecSession.step: real drafted tokens, so the experts a real block wakes), same step selection",
    "draft_step_s": "lower quartile of the draft time of a real speculative step (the forward over the pending target features, "
                    "then the chain or tree steps, with their sampling) divided by the drafted depth gamma",
    "c": "draft_step_s / target_step_s",
    "verify_cost": "verify_s / target_step_s",
    "bound": "accept_length / (verify_cost + gamma * c) (DESIGN section 4): the speed-up if the loop around "
             "the forwards cost nothing",
    "efficiency": "speedup / bound",
    "bound_median": "the bound from the medians of the same step samples instead of their lower quartiles "
                    "(target_step_s_median, verify_s_median, draft_step_s_median): how much the choice of "
                    "statistic moves the bound (a forward's spread is partly real work, which experts a block "
                    "wakes and how long its context is, and partly preemption)",
    "speedup_median": "median over the timed repeats of the per-repeat ratio of this row's tokens/s to plain's "
                      "(the two calls of a repeat run seconds apart, so a slow spell of the machine hits both)",
    "speedup_repeats": "each timed repeat's tokens/s over plain's in the same repeat, in repeat order",
    "efficiency_median": "speedup_median / bound_median: the efficiency with medians on both sides",
    "efficiency_paired": "median over the timed repeats of (that repeat's speed-up over plain) / (the bound from "
                         "the medians of that repeat's own step samples, both arms): numerator and denominator "
                         "come from the same two calls, seconds apart, so a slow spell of the machine moves both; "
                         "null where the profiler did not ride along the timed calls (CUDA)",
    "profile": "mean seconds per step of each phase (rollout.profile) over the profiled full-batch steps "
               "(the same steps as target_step_s)",
    "efficiency_factors": "efficiency as a product of three factors (specrl.bench.efficiency_factors): timed "
                          "speed-up over the speed-up the full-batch steps' mean times imply (the cost of "
                          "admissions and the partial-batch tail), that over the speed-up their forwards' mean "
                          "times imply (the loop around the forwards), that over the bound (mean vs lower "
                          "quartile)",
}


def profiled_run(engine, prompts, params):
    """One generate() with a StepProfiler attached; returns (trajectories, profiler)."""
    from rollout.profile import StepProfiler

    engine.profiler = StepProfiler(engine.device)
    try:
        trajs = engine.generate(prompts, params)
    finally:
        prof, engine.profiler = engine.profiler, None
    return trajs, prof


def engine_step_costs(plain_prof, spec_prof, batch: int, gamma: int, call: int | None = None) -> dict:
    """The bound's parts from real engine steps (see MEASUREMENT): target step, verify forward
    and draft step, each the lower quartile (rollout.profile.low_quartile) and the median over the profiled
    runs' full-batch steps without a fused prefill (of one timed call with `call`, else of all).
    Rows with no such step (a batch larger than the prompts) get None."""
    from rollout.profile import bound_costs

    plain = plain_prof.select("plain", batch, call=call)
    spec = [r for r in spec_prof.select("spec", batch, call=call) if r.gamma == gamma]
    return bound_costs([r.phases["forward"] for r in plain], [r.phases["verify_forward"] for r in spec],
                       [r.phases.get("draft", 0.0) / gamma for r in spec],
                       {"plain_steps": len(plain), "spec_steps": len(spec)})


def step_profile(prof, batch: int) -> dict:
    """Where the steps' time goes: phase breakdown of the full-batch steps of a profiled run."""
    from rollout.profile import PLAIN_PHASES, SPEC_PHASES, phase_breakdown

    out = {}
    for kind, phases in (("plain", PLAIN_PHASES), ("spec", SPEC_PHASES)):
        recs = prof.select(kind, batch)
        if recs:
            out[kind] = phase_breakdown(recs, phases)
    return out


def efficiency_factors(row: dict, plain_profile: dict) -> dict | None:
    """Efficiency (speedup / bound) as the product of three factors, from the full-batch steps'
    mean phase times (`step_profile`): the timed speed-up over the speed-up those steps imply
    (what the steps outside them cost: admissions with their prefill, the partial-batch tail),
    that over the speed-up their forwards alone imply (the loop around the forwards), and that
    over the bound (mean against lower-quartile forward times). None without the profiles."""
    spec, plain = row["profile"].get("spec"), plain_profile.get("plain")
    if spec is None or plain is None or row["bound"] is None:
        return None
    tau = row["accept_length"]
    steps = tau * plain["step_s"] / spec["step_s"]
    forwards = tau * plain["phase_s"]["forward"] / (spec["phase_s"]["verify_forward"] + spec["phase_s"]["draft"])
    return {"outside_full_batch_steps": row["speedup"] / steps, "loop_around_forwards": steps / forwards,
            "mean_over_quartile": forwards / row["bound"]}


def speedup_bound(accept_length: float, verify_cost: float, c: float, gamma: int) -> float:
    """DESIGN section 4: accept_length / (verify_cost + gamma * c), the speed-up if the loop
    around the forwards cost nothing (MEASUREMENT["bound"])."""
    return accept_length / (verify_cost + gamma * c)


def preset_chain_length(preset_name: str, gamma: int | None = None) -> int:
    """`gamma` where given, else the preset's chain length (`RunPreset.cotrain.spec`)."""
    return gamma or get_preset(preset_name).cotrain.spec.gamma


def spec_row(batch: int, spec_cfg, timed: dict, plain_timed: dict, costs: dict, profile: dict,
             per_repeat_costs: list[dict] | None = None) -> dict:
    """One speculative row: speed against plain, acceptance, the bound from measured costs
    (pooled over the repeats: `costs`; each repeat's own: `per_repeat_costs`, for the paired
    efficiency)."""
    same = same_tokens(timed["trajectories"], plain_timed["trajectories"])
    agg = summarize_spec_stats(t.spec for t in timed["trajectories"])
    ratios = repeat_ratios(timed, plain_timed)
    speedups = {"": timed["tokens_per_s"] / plain_timed["tokens_per_s"], "_median": statistics.median(ratios)}
    paired = None
    if per_repeat_costs and all(c["c_median"] is not None for c in per_repeat_costs):
        paired = statistics.median(
            r / speedup_bound(agg["accept_length"], c["verify_cost_median"], c["c_median"], spec_cfg.gamma)
            for r, c in zip(ratios, per_repeat_costs))
    bounds = {}
    for suffix, speedup in speedups.items():
        bound = eff = None
        if costs["c"] is not None:
            bound = speedup_bound(agg["accept_length"], costs[f"verify_cost{suffix}"], costs[f"c{suffix}"],
                                  spec_cfg.gamma)
            eff = speedup / bound
        bounds.update({f"bound{suffix}": bound, f"efficiency{suffix}": eff})
    speedup = speedups[""]
    return {"batch": batch, "mode": spec_cfg.mode, "gamma": spec_cfg.gamma,
            "tree_budget": spec_cfg.tree_budget if spec_cfg.mode == "tree" else None,
            "tokens_per_s": timed["tokens_per_s"], "speedup": speedup, "speedup_median": speedups["_median"],
            "speedup_repeats": ratios,
            "accept_length": agg["accept_length"],
            "alpha": agg["accept_rate"], **bounds, "efficiency_paired": paired, "identical_to_plain": same, **costs,
            "profile": profile}


def adaptive_speculator(draft, spec_cfg, gammas):
    """A chain speculator under the speculation controller (plain decoding where it does not pay)."""
    from rollout.speculative import Speculator
    from specrl.controller import ControllerConfig, SpeculationController

    spec = Speculator(draft, spec_cfg)
    spec.controller = SpeculationController(ControllerConfig(gammas=tuple(gammas)))
    return spec


def measure_batch(policy, draft, prompts, params, batch: int, spec_cfgs, *, repeats: int = 3,
                  adaptive_gammas=None, warm_prompts=None, engine_options: dict | None = None) -> list[dict]:
    """Plain decoding and every speculative configuration at one batch size, on the same
    prompts: timed in turns (`timed_generate_interleaved`), the bound's parts measured on the
    timed calls' own steps (on CUDA, where a profiler mark synchronises, on one extra profiled
    run each). With `adaptive_gammas`, also the chain draft under the controller,
    whose statistics are warmed on `warm_prompts` (other prompts) before any timing. Every engine
    gets `engine_options` (EngineConfig fields: moe_dispatch, compile_forwards); with compiled
    forwards, each engine first decodes the prompts once untimed, compiling every shape it meets."""
    from rollout.speculative import Speculator

    config = EngineConfig(max_batch=batch, **(engine_options or {}))
    engines = {"plain": EmbeddedEngine(policy, config)}
    for i, scfg in enumerate(spec_cfgs):
        engines[i] = EmbeddedEngine(policy, config, speculator=Speculator(draft, scfg))
    if adaptive_gammas:
        engines["adaptive"] = EmbeddedEngine(policy, config,
                                             speculator=adaptive_speculator(draft, spec_cfgs[0], adaptive_gammas))
    if config.compile_forwards:  # compile every shape the timed calls (and the controller's warm-up) meet
        for name, engine in engines.items():
            for batch_prompts in ([prompts, warm_prompts] if name == "adaptive" else [prompts]):
                engine.generate(batch_prompts, params)
        if adaptive_gammas:  # a fresh controller: steps that compiled would have misled it
            engines["adaptive"].speculator = adaptive_speculator(draft, spec_cfgs[0], adaptive_gammas)
    if adaptive_gammas:
        for _ in range(2):
            engines["adaptive"].generate(warm_prompts, params)
    profiled = [name for name in engines if name != "adaptive"]
    in_timed = engines["plain"].device.type == "cpu"  # a CUDA mark synchronises the device: profile apart there
    timed = timed_generate_interleaved(engines, prompts, params, repeats, profile=profiled if in_timed else ())
    profs = {name: timed[name]["profiler"] if in_timed else profiled_run(engines[name], prompts, params)[1]
             for name in profiled}
    plain = timed["plain"]
    rows = [{"batch": batch, "mode": "plain", "tokens_per_s": plain["tokens_per_s"], "speedup": 1.0,
             "profile": step_profile(profs["plain"], batch)}]
    for i, scfg in enumerate(spec_cfgs):
        costs = engine_step_costs(profs["plain"], profs[i], batch, scfg.gamma)
        per_repeat = ([engine_step_costs(profs["plain"], profs[i], batch, scfg.gamma, call=r) for r in range(repeats)]
                      if in_timed else None)
        row = spec_row(batch, scfg, timed[i], plain, costs, step_profile(profs[i], batch), per_repeat)
        row["efficiency_factors"] = efficiency_factors(row, rows[0]["profile"])
        rows.append(row)
    if adaptive_gammas:
        r = timed["adaptive"]
        agg = summarize_spec_stats(t.spec for t in r["trajectories"])
        ctrl = engines["adaptive"].speculator.controller.summary()
        bucket = ctrl["buckets"].get(engines["adaptive"].speculator.controller.bucket_of(batch), {})
        rows.append({"batch": batch, "mode": "adaptive", "gamma": None, "gammas": list(adaptive_gammas),
                     "tokens_per_s": r["tokens_per_s"], "speedup": r["tokens_per_s"] / plain["tokens_per_s"],
                     "accept_length": agg["accept_length"], "alpha": agg["accept_rate"],
                     "identical_to_plain": same_tokens(r["trajectories"], plain["trajectories"]),
                     "controller_gamma": bucket.get("gamma")})
    return rows


def measure_speculation(policy, draft, prompts, params, batch: int, spec_cfg, plain: dict | None = None,
                        repeats: int = 3) -> dict:
    """One speculative configuration at one batch size against plain decoding on the same
    prompts (timed in turns with it): tokens/s, speed-up, accept length, alpha, the measured
    costs and the DESIGN section 4 bound. `plain` is accepted for callers of the older
    signature and ignored: plain is re-timed beside the speculative engine."""
    return measure_batch(policy, draft, prompts, params, batch, [spec_cfg], repeats=repeats)[1]


def _fmt(v, spec: str = ".2f") -> str:
    return "" if v is None else (str(v) if isinstance(v, (bool, str)) else format(v, spec))


def format_row(row: dict) -> str:
    arm = f"{row['arm']} " if "arm" in row else ""  # rows of several engines name theirs
    if row["mode"] == "plain":
        return f"{arm}batch {row['batch']:>3} plain: {row['tokens_per_s']:8.1f} tok/s  x{row.get('speedup', 1.0):.2f}"
    tag = (f"adaptive g={row.get('controller_gamma')}" if row["mode"] == "adaptive"
           else f"{row['mode']} g={row['gamma']}" + (f" n={row['tree_budget']}" if row.get("tree_budget") else ""))
    return (f"{arm}batch {row['batch']:>3} {tag:>14}: {row['tokens_per_s']:8.1f} tok/s  x{row['speedup']:.2f}  "
            f"tau {_fmt(row.get('accept_length'))}  alpha {_fmt(row.get('alpha'))}  c {_fmt(row.get('c'), '.3f')}  "
            f"verify {_fmt(row.get('verify_cost'))}  bound {_fmt(row.get('bound'))}  eff {_fmt(row.get('efficiency'))}  "
            f"(medians: x{_fmt(row.get('speedup_median'))} bound {_fmt(row.get('bound_median'))} "
            f"eff {_fmt(row.get('efficiency_median'))}, paired eff {_fmt(row.get('efficiency_paired'))})  "
            f"identical {_fmt(row.get('identical_to_plain'))}"
            + ("  eff = " + " x ".join(f"{k} {v:.3f}" for k, v in row["efficiency_factors"].items())
               if row.get("efficiency_factors") else ""))


TABLE_COLUMNS = (("batch", "d"), ("mode", "s"), ("tokens_per_s", ".1f"), ("speedup", ".2f"), ("accept_length", ".2f"),
                 ("alpha", ".2f"), ("c", ".3f"), ("verify_cost", ".2f"), ("bound", ".2f"), ("efficiency", ".2f"),
                 ("speedup_median", ".2f"), ("bound_median", ".2f"), ("efficiency_median", ".2f"),
                 ("efficiency_paired", ".2f"), ("identical_to_plain", "s"))


def format_table(rows: list[dict]) -> str:
    """The rows as a Markdown table (the README's form)."""
    head = ["batch", "mode", "tokens/s", "speedup", "tau", "alpha", "c", "verify", "bound", "eff", "speedup (median)",
            "bound (median)", "eff (median)", "eff (paired)", "identical"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = []
        for key, spec in TABLE_COLUMNS:
            v = r.get(key)
            if key == "mode" and r["mode"] == "adaptive":
                v = f"adaptive (g={r.get('controller_gamma')})"
            elif key == "mode" and r["mode"] != "plain":
                v = f"{r['mode']} g={r['gamma']}" + (f" n={r['tree_budget']}" if r.get("tree_budget") else "")
            if key == "mode" and "arm" in r:
                v = f"{r['arm']} ({v})"
            cells.append(_fmt(v, spec) if not isinstance(v, str) else v)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def speed_setup(task_name: str, preset_name: str, seed: int, cache_dir, temperature: float):
    """The policy, its cached offline draft, sampling params and a prompt maker for speed runs."""
    from rollout.protocol import SamplingParams
    from specrl.drafts import cached_offline_draft

    SamplingParams(temperature=temperature)  # a bad --temperature fails before the expensive setup
    preset = get_preset(preset_name)
    cache_dir = cache_dir or default_cache_dir()
    tokenizer, task, policy, _ = build_task_and_policy(task_name, preset, cache_dir)
    draft_prompts = encode_prompts(tokenizer, task.examples("train", 1024, seed + 7))
    draft_cfg = dataclasses.replace(preset.draft, max_new_tokens=preset.max_new_tokens)  # the preset's recipe
    draft, _ = cached_offline_draft(policy, draft_prompts, draft_cfg, (tokenizer.eos_id,), cache_dir)
    # replace() re-runs SamplingParams validation, so a bad --temperature is refused
    params = dataclasses.replace(rollout_params(preset, tokenizer, seed), temperature=temperature)

    def prompts_for(n: int):
        return encode_prompts(tokenizer, task.examples("heldout", n, seed))

    return policy, draft, params, prompts_for


def significant(v: float, digits: int = 6) -> float:
    """v to `digits` significant digits: a row's step times are a few milliseconds in seconds,
    which a fixed number of decimals would round to a tenth of a millisecond (several percent
    of a draft step) and leave the saved costs unable to reproduce the saved bound."""
    return float(f"{v:.{digits}g}")


def save_summary(out_dir, summary: dict) -> dict:
    summary["rows"] = [{k: (significant(v) if isinstance(v, float) else v) for k, v in r.items()}
                       for r in summary["rows"]]
    summary["machine"] = machine_info()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def bench_speed(task_name: str, preset_name: str, out_dir, batches: list[int], *, seed: int = 0, cache_dir=None,
                chain_gamma: int | None = None, tree_depth: int = 4, tree_topk: int = 4, tree_budget: int = 12,
                prompts_per_batch: int = 3, temperature: float = 0.0, repeats: int = 5,
                engine_options: dict | None = None, log=print) -> dict:
    """Plain, chain, tree and adaptive (chain under the controller) decoding at each batch size,
    timed in turns on the same prompts, with the bound's parts measured on the engine's own
    steps (MEASUREMENT) and where each step's time goes (`profile` of every row). The chain
    length defaults to the preset's (`RunPreset.cotrain.spec`)."""
    from rollout.speculative import SpecConfig

    EngineConfig(**(engine_options or {}))  # a bad value fails before the expensive setup
    chain_gamma = preset_chain_length(preset_name, chain_gamma)
    policy, draft, params, prompts_for = speed_setup(task_name, preset_name, seed, cache_dir, temperature)
    modes = [SpecConfig(mode="chain", gamma=chain_gamma),
             SpecConfig(mode="tree", gamma=tree_depth, tree_topk=tree_topk, tree_budget=tree_budget)]
    return measure_and_save(out_dir, "speed", task_name, preset_name, temperature, policy, draft, params,
                            prompts_for, batches, modes, prompts_per_batch=prompts_per_batch, repeats=repeats,
                            adaptive_gammas=tuple(range(1, chain_gamma + 1)), engine_options=engine_options, log=log)


def measure_and_save(out_dir, benchmark: str, task_name: str, preset_name: str, temperature: float, policy, draft,
                     params, prompts_for, batches, spec_cfgs, *, prompts_per_batch: int, repeats: int,
                     adaptive_gammas=None, engine_options: dict | None = None, log=print) -> dict:
    """`measure_batch` at every batch size (each row logged as it comes), saved as summary.json
    and printed as a table. The adaptive arm's controller is warmed on prompts the timed runs
    do not use."""
    rows = []
    for b in batches:
        n = b * prompts_per_batch
        prompts = prompts_for(n)
        warm = prompts_for(2 * n)[n:] if adaptive_gammas else None
        new = measure_batch(policy, draft, prompts, params, b, spec_cfgs, repeats=repeats,
                            adaptive_gammas=adaptive_gammas, warm_prompts=warm, engine_options=engine_options)
        rows.extend(new)
        for row in new:
            log(format_row(row))
    summary = save_summary(out_dir, {"benchmark": benchmark, "task": task_name, "preset": preset_name,
                                     "temperature": temperature, "model": model_summary(policy, draft),
                                     "measurement": MEASUREMENT, "repeats": repeats,
                                     "prompts_per_batch": prompts_per_batch, "engine_options": engine_options or {},
                                     "rows": rows})
    log(format_table(summary["rows"]))
    return summary


def model_summary(policy, draft) -> dict:
    return {"target_parameters": policy.num_parameters(), "target_layers": policy.cfg.num_layers,
            "draft_parameters": draft.num_parameters()}


def bench_profile(task_name: str, preset_name: str, out_dir, batches: list[int], *, seed: int = 0, cache_dir=None,
                  chain_gamma: int | None = None, prompts_per_batch: int = 3, temperature: float = 0.0,
                  engine_options: dict | None = None, log=print) -> dict:
    """`specrl bench profile`: where a plain and a chain-speculative step spend their time
    (rollout.profile phases), one warm-up and one profiled run per engine and batch size; chains
    of the preset's length unless given."""
    from rollout.speculative import SpecConfig, Speculator

    EngineConfig(**(engine_options or {}))  # a bad value fails before the expensive setup
    chain_gamma = preset_chain_length(preset_name, chain_gamma)
    policy, draft, params, prompts_for = speed_setup(task_name, preset_name, seed, cache_dir, temperature)
    scfg = SpecConfig(mode="chain", gamma=chain_gamma)
    rows = []
    for b in batches:
        prompts = prompts_for(b * prompts_per_batch)
        config = EngineConfig(max_batch=b, **(engine_options or {}))
        engines = {"plain": EmbeddedEngine(policy, config),
                   "chain": EmbeddedEngine(policy, config, speculator=Speculator(draft, scfg))}
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
