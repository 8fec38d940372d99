"""The harness every benchmark shares: timing arms in turns, the step profiler around one call,
the setup of a speed measurement, and saving a summary with the machine it ran on.

Every figure of one summary is measured in the same process, one after another on the same
prompts, so ratios between its rows are meaningful on a noisy machine.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from rollout.protocol import Rollout
from specrl.machine_load import AT_START, cpu_mark, others_busy_cores
from specrl.presets import get_preset
from specrl.rl_setup import build_task_and_policy, encode_prompts, rollout_params
from target_training.grpo import native_bf16
from target_training.sft import default_cache_dir


CODE = ("specrl", "rollout", "draft_models", "target_training", "experiments", "pyproject.toml")  # what a figure ran


def code_version() -> str:
    """The code a figure ran on: this checkout's git commit ("+changes" where the working tree's
    code differs from it; docs and tests do not count), or the installed package's version
    outside a git checkout."""
    root = Path(__file__).resolve().parents[2]

    def git(*args) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()

    try:
        changed = git("status", "--porcelain", "-uno", "--", *CODE)
        return git("rev-parse", "--short=10", "HEAD") + ("+changes" if changed else "")
    except (OSError, subprocess.SubprocessError):
        from importlib.metadata import version

        return f"specrl {version('specrl')}"


# the code this process imported, read when it started: a run that outlives a commit ran this one
CODE_AT_START = code_version()


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what `platform` knows: "x86_64" alone
    does not tell two machines whose speeds differ twofold apart."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    """The machine and the code a result ran on (the code when the process started), with the
    date (UTC): every summary.json carries it. `cpu_bf16`: whether the CPU computes bf16 natively,
    which decides what `compute_dtype="auto"` runs (the `real` preset's policy and draft updates).
    `others_busy_cores`: the cores other processes kept busy, on average, since this process
    started (specrl.machine_load; None where it cannot be read); each timed window keeps its own."""
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu": cpu_model(), "cpu_bf16": native_bf16(torch.device("cpu")), "cores": os.cpu_count(),
            "others_busy_cores": others_busy_cores(AT_START),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "code_version": CODE_AT_START}


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
    one StepProfiler through all their timed calls (not the warm-up), returned as "profiler".
    Every engine's result carries `others_busy_cores`: the cores other processes kept busy over
    the timed calls (specrl.machine_load), the same for all of them."""
    from rollout.profile import StepProfiler

    for engine in engines.values():
        getattr(engine, "ready", lambda: None)()
        engine.generate(prompts[: min(len(prompts), 2)], params, request_ids=range(min(len(prompts), 2)))
    profilers = {name: StepProfiler(engines[name].device) for name in profile}
    mark = cpu_mark()  # the timed calls' window: whether another job shared the machine meanwhile
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
                trajs = engine.generate(prompts, params, request_ids=range(len(prompts)))  # the same samples every call
                wall = time.perf_counter() - t0
            finally:
                if name in profilers:
                    engine.profiler = None
            n = sum(len(t.token_ids) for t in trajs)
            per_repeat[name].append(n / wall)
            if name not in best or n / wall > best[name]["tokens_per_s"]:
                # engine steps: deterministic for a given engine, prompts and draft (None where unknown)
                steps = trajs.stats.engine_steps if isinstance(trajs, Rollout) and trajs.stats else None
                best[name] = {"tokens_per_s": n / wall, "tokens": n, "wall_s": wall, "trajectories": trajs,
                              "engine_steps": steps}
    # tokens/s of every repeat, in repeat order: ratios between engines per repeat are their
    # least noisy comparison (both ran within seconds of each other)
    others = others_busy_cores(mark)
    return {name: {**best[name], "tokens_per_s_repeats": per_repeat[name], "others_busy_cores": others,
                   **({"profiler": profilers[name]} if name in profilers else {})} for name in names}


def profiled_run(engine, prompts, params):
    """One generate() with a StepProfiler attached; returns (trajectories, profiler)."""
    from rollout.profile import StepProfiler

    engine.profiler = StepProfiler(engine.device)
    try:
        trajs = engine.generate(prompts, params, request_ids=range(len(prompts)))
    finally:
        prof, engine.profiler = engine.profiler, None
    return trajs, prof


def preset_chain_length(preset_name: str, gamma: int | None = None) -> int:
    """`gamma` where given, else the preset's chain length (`RunPreset.cotrain.spec`)."""
    return gamma or get_preset(preset_name).cotrain.spec.gamma


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


def length_distribution(lengths, cap: int) -> dict | None:
    """Answer lengths in tokens: quantiles, mean, and the share that reached the cap (max_new_tokens)."""
    xs = sorted(int(x) for x in lengths)
    if not xs:
        return None
    q = lambda f: xs[min(len(xs) - 1, int(f * len(xs)))]  # noqa: E731
    return {"answers": len(xs), "min": xs[0], "p10": q(0.1), "p25": q(0.25), "median": q(0.5), "p75": q(0.75),
            "p90": q(0.9), "max": xs[-1], "mean": sum(xs) / len(xs), "at_cap": sum(x >= cap for x in xs) / len(xs)}


def gate_counts(rows: list[dict]) -> dict:
    """The swap gate's counts over an RL run, from its metric rows (specrl.cotrain's running totals,
    so the largest any row holds): draft_gated, the trained drafts it measured, draft_refused,
    those it kept out of the engine, and draft_floor_restores, the refusals that handed the engine
    back the starting draft (CoTrainConfig.gate_floor); None each in a run whose rows hold none."""
    def total(key):
        xs = [r[key] for r in rows if r.get(key) is not None]
        return max(xs) if xs else None
    return {"draft_gated": total("train/draft_gated_total"), "draft_refused": total("train/draft_refused_total"),
            "draft_floor_restores": total("train/draft_floor_restores_total")}


def gate_over_start(rows: list[dict]) -> list[dict]:
    """At each gate that measured the starting draft (CoTrainConfig.gate_floor), the serving
    draft's and the candidate's held-out expected accept length over the starting draft's, on the
    same held-out sequences of the RL rollouts (online over frozen where the gate looks, beside
    the evaluation prompts' figure), and whether the gate handed the engine back the starting draft."""
    out, restores = [], 0
    for r in rows:
        start, total = r.get("sched/gate_start_accept_length"), r.get("train/draft_floor_restores_total", restores)
        if start and r.get("sched/gate_serving_accept_length") is not None:
            out.append({"step": r["step"], "serving_over_start": r["sched/gate_serving_accept_length"] / start,
                        "candidate_over_start": r["sched/candidate_accept_length"] / start,
                        "floor_restored": total > restores})
        restores = total
    return out


def model_summary(policy, draft) -> dict:
    return {"target_parameters": policy.num_parameters(), "target_layers": policy.cfg.num_layers,
            "draft_parameters": draft.num_parameters()}


def significant(v: float, digits: int = 6) -> float:
    """v to `digits` significant digits: a row's step times are a few milliseconds in seconds,
    which a fixed number of decimals would round to a tenth of a millisecond (several percent
    of a draft step) and leave the saved costs unable to reproduce the saved bound."""
    return float(f"{v:.{digits}g}")


def write_summary(out_dir, summary: dict) -> dict:
    """`summary` with the machine, as DIR/summary.json (DIR made if missing)."""
    summary["machine"] = machine_info()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def save_summary(out_dir, summary: dict) -> dict:
    """`summary` with its rows' floats to 6 significant digits and the machine, as DIR/summary.json."""
    summary["rows"] = [{k: (significant(v) if isinstance(v, float) else v) for k, v in r.items()}
                       for r in summary["rows"]]
    return write_summary(out_dir, summary)


def exit_code(call) -> int:
    """Runs `call()` for a module's command line: 0 when it returns; bad input (a ValueError, which
    PresetError is, or an --out that already holds a result) is one line on stderr and 2."""
    try:
        call()
    except (ValueError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


class Grouped:
    """An engine whose generate() runs the prompts in consecutive groups of `batch`, so that no
    step decodes more than `batch` sequences whatever the engine's own limit (a live vLLM
    engine's limit is fixed when it starts)."""

    def __init__(self, engine, batch: int):
        self.engine, self.batch = engine, batch

    def generate(self, prompts, params, request_ids=None):
        ids = list(range(len(prompts)) if request_ids is None else request_ids)
        out = []
        for i in range(0, len(prompts), self.batch):
            out += self.engine.generate(prompts[i:i + self.batch], params, request_ids=ids[i:i + self.batch])
        return out
