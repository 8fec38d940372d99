"""`specrl train-rl`: SFT warm start (cached), then GRPO steps on a verifiable task.

`train_rl` is the whole RL algorithm at a glance: per step, rollout (speculative with
--spec frozen|online), reward, policy update, draft co-training, log, checkpoint. What the run
is built from (task, policy, engine, prompts, rewards, evaluation) is in specrl/rl_setup.py; the
run folder (run.json, metrics.jsonl, summary.json, the resumable checkpoint) in
specrl/run_dir.py.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specrl.config import CoTrainConfig
from specrl.cotrain import SpecCoTrainer
from specrl.drafts import starting_draft
from specrl.machine_load import BUSY_CORES, STEP_KEY, shared_steps
from specrl.presets import RunPreset, get_preset, reproducible as fixed_decisions
from specrl.run_choice import choice_history
from specrl.run_dir import (METRICS_FILE, append_row, check_writable, open_run_dir, read_metrics, restore_state,
                            run_identity, save_state, write_summary)
from specrl.rl_setup import (ENGINES, build_engine, build_task_and_policy, check_seed, encode_prompts, evaluate,
                          generate_step, resolve_device, rollout_params, score, step_examples, sync_policy)
from specrl.step_clock import StepClock, step_parts
from target_training.grpo import GRPOTrainer
from target_training.sft import default_cache_dir


def train_rl(task_name: str, preset_name: str | RunPreset, out_dir: str | Path, *, seed: int = 0,
             resume: bool = False, steps: int | None = None, cache_dir: Path | None = None, progress: bool = True,
             spec: str = "off", engine: str = "embedded", drafter: str | None = None, reproducible: bool = False,
             device: str = "auto", callbacks: tuple[RLCallback, ...] = (), log=print) -> dict:
    """One RL run into `out_dir` (or its continuation, with `resume`); returns the summary.
    `reproducible`: the preset's co-training with every decision fixed at the start
    (specrl.presets.reproducible)."""
    t_start = time.perf_counter()
    run, start_step, eval_start = start_run(task_name, preset_name, out_dir, seed=seed, resume=resume, steps=steps,
                                            cache_dir=cache_dir, progress=progress, spec=spec, engine=engine,
                                            drafter=drafter, reproducible=reproducible, device=device, log=log)
    preset, task, tokenizer = run.preset, run.task, run.tokenizer
    policy, rollout, trainer, cotrain = run.policy, run.engine, run.trainer, run.cotrain
    for cb in callbacks:
        cb.on_start(run)

    bar = step_bar(start_step, preset.rl_steps, progress)
    for step in bar:
        row = rl_step(run, step)
        bar.set_postfix(reward=f"{row['reward']:.2f}", len=f"{row['response_len']:.0f}")
        if (step + 1) % preset.checkpoint_every == 0 or step + 1 == preset.rl_steps:
            save_state(run.out, policy, trainer, cotrain, eval_start)
        for cb in callbacks:
            cb.on_step_end(run, step, row)

    eval_end = evaluate(rollout, task, tokenizer, run.heldout, preset, seed)
    rows = read_metrics(run.out / METRICS_FILE)
    choice = choice_history(rows) if cotrain.run_choice is not None else None
    summary = {"task": task_name, "preset": run.preset_name, "seed": seed, "spec": spec, "engine": engine,
               "device": str(run.device), "rl_steps": preset.rl_steps,
               "reward_start": eval_start["reward"], "reward_end": eval_end["reward"],
               "greedy_accuracy_start": eval_start["greedy_accuracy"], "greedy_accuracy_end": eval_end["greedy_accuracy"],
               "eval_prompts": len(run.heldout), "eval_samples_per_prompt": preset.eval_samples,
               "sft_cached": run.sft_info.get("cached", False), "wall_s": time.perf_counter() - t_start,
               # steps timed while other processes kept the machine busy (specrl.machine_load)
               "rl_steps_shared": shared_steps(rows)}
    if choice is not None:  # speculation on or off per rollout, from measured rollouts (specrl.run_choice)
        summary["run_choice"] = choice
    write_summary(run.out, summary)
    for cb in callbacks:
        cb.on_end(run, summary)
    log(f"[rl] held-out reward: start {summary['reward_start']:.3f} -> end {summary['reward_end']:.3f} "
        f"({summary['wall_s']:.0f}s)")
    if summary["rl_steps_shared"]:
        log(f"[rl] {summary['rl_steps_shared']} of {len(rows)} steps ran while other processes kept more than "
            f"{BUSY_CORES} cores busy: their times, and the decisions made from them, are not this run's alone")
    return summary


def step_bar(start_step: int, total: int, progress) -> tqdm:
    """The RL steps' progress bar. Its time left is the mean time per step so far: a step whose
    callbacks also evaluate (the drift experiment's points) would throw an estimate from the last
    steps (tqdm's default smoothing) far off for the steps after it."""
    return tqdm(range(start_step, total), desc="grpo", disable=not progress, initial=start_step, total=total,
                smoothing=0)


def rl_step(run: RLRun, step: int) -> dict:
    """One GRPO step of `run`: rollout, reward, policy update, policy sync, the co-trainer's step
    boundary (draft co-training); appends the step's row to metrics.jsonl and returns it. The
    row splits the step's wall time (`step_s`) into its parts (specrl.step_clock.step_parts).
    """
    preset, tokenizer, rollout, cotrain = run.preset, run.tokenizer, run.engine, run.cotrain
    clock = StepClock()
    cotrain.begin_step(steps_left=preset.rl_steps - step)
    examples = step_examples(run.task, run.pool, preset, run.seed, step)
    ids = [step * len(examples) + i for i in range(len(examples))]
    trajs = generate_step(rollout, encode_prompts(tokenizer, examples), rollout_params(preset, tokenizer, run.seed),
                          ids, preset.group_size, capture_features=cotrain.capture_engine_features)
    cotrain.on_rollout(trajs)
    clock.lap("rollout")
    rewards = score(run.task, tokenizer, examples, trajs)
    score_s = clock.lap("score")
    metrics = run.trainer.step(trajs, rewards, preset.group_size)
    update_s = clock.lap("update")
    sync_s = sync_policy(rollout, run.policy)
    gen = trajs.stats
    row = {"step": step, **metrics, "tokens_per_s": gen.tokens_per_s, **cotrain.end_step(), "step_s": clock.elapsed(),
           STEP_KEY: clock.others_busy_cores()}
    row.update(step_parts(row, gen, score_s, update_s, sync_s))
    row["rollout/response_lens"] = [len(t.token_ids) for t in trajs]
    if gen.spec_steps is not None:
        row["rollout/engine_steps"], row["rollout/spec_steps"] = gen.engine_steps, gen.spec_steps
    append_row(run.out / METRICS_FILE, row)
    return row


@dataclass
class RLRun:
    """What a `train_rl` callback sees: the live objects of the run."""
    preset: RunPreset
    seed: int
    out: Path
    cache_dir: Path
    tokenizer: object
    task: object
    policy: torch.nn.Module
    engine: object  # EmbeddedEngine or rollout.vllm_engine.VLLMEngine
    trainer: GRPOTrainer
    cotrain: SpecCoTrainer
    preset_name: str = "custom"
    device: torch.device = torch.device("cpu")  # where the policy, its trainer, the draft and the embedded engine run
    heldout: list = dataclasses.field(default_factory=list)  # evaluation prompts
    pool: list = dataclasses.field(default_factory=list)  # training prompts each step samples from
    sft_info: dict = dataclasses.field(default_factory=dict)


class RLCallback:
    """Extension points of `train_rl`; override what you need. Time spent here is outside the
    RL step's measured wall time (`step_s`)."""

    def on_start(self, run: RLRun) -> None:  # after the start evaluation, before step 0
        pass

    def on_step_end(self, run: RLRun, step: int, row: dict) -> None:  # after the step is logged
        pass

    def on_end(self, run: RLRun, summary: dict) -> None:  # after summary.json is written
        pass


def start_run(task_name: str, preset_name: str | RunPreset, out_dir: str | Path, *, seed: int, resume: bool,
              steps: int | None, cache_dir: Path | None, progress: bool, spec: str, engine: str,
              drafter: str | None = None, reproducible: bool = False, device: str = "auto", log=print,
              evaluate_start: bool = True) -> tuple[RLRun, int, dict | None]:
    """Check the settings, open the run folder, build task, policy, engine, trainer and
    co-trainer, resume from the checkpoint where asked, and evaluate the starting policy
    (unless the checkpoint holds that evaluation, or `evaluate_start` is off: then None):
    (run, first step, start evaluation)."""
    if isinstance(preset_name, RunPreset):  # experiments pass a tuned preset directly
        preset, preset_name = preset_name, "custom"
    else:
        preset = get_preset(preset_name)
    preset = preset.with_overrides(rl_steps=steps)
    if reproducible:  # every decision fixed at the start (specrl.presets.reproducible)
        preset = dataclasses.replace(preset, cotrain=fixed_decisions(preset.cotrain))
    if spec != "off" and drafter not in (None, preset.cotrain.drafter):  # who drafts (rollout.drafters.history)
        preset = dataclasses.replace(preset, cotrain=dataclasses.replace(preset.cotrain, mode=spec, drafter=drafter))
    check_seed(seed)
    out = Path(out_dir)
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose from {ENGINES}")
    if engine == "vllm":
        from rollout.vllm_engine import require_vllm

        require_vllm()  # before any work: one line naming the fix
    dev = resolve_device(device, engine)
    open_run_dir(out, run_identity(task_name, preset, preset_name, seed, spec), resume, log)
    torch.manual_seed(seed)
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    check_writable(cache_dir)
    tokenizer, task, policy, sft_info = build_task_and_policy(task_name, preset, cache_dir, log, progress, device=dev)
    rollout = build_engine(engine, policy, preset, out)
    # the reference is the policy as built, before any checkpoint is restored: the start, also on resume
    reference = copy.deepcopy(policy) if preset.kl_from_start or preset.grpo.kl_coef > 0 else None
    trainer = GRPOTrainer(policy, preset.grpo, ref_model=reference)
    cotrain = build_cotrainer(spec, policy, tokenizer, task, preset, seed, cache_dir, log,
                              progress=progress).attach(rollout, trainer)
    heldout = task.examples("heldout", preset.eval_prompts, seed)
    pool = task.examples("train", preset.prompt_pool or max(512, preset.prompts_per_step * 8), seed + 1)
    start_step, eval_start = 0, None
    if resume:
        start_step, eval_start = restore_state(out, policy, trainer, cotrain,
                                               on_policy_loaded=lambda: sync_policy(rollout, policy), log=log)
    if eval_start is None and evaluate_start:
        eval_start = evaluate(rollout, task, tokenizer, heldout, preset, seed)
    if eval_start is not None:
        log(f"[rl] held-out reward at start: {eval_start['reward']:.3f} "
            f"(greedy accuracy {eval_start['greedy_accuracy']:.3f})")
    run = RLRun(preset, seed, out, cache_dir, tokenizer, task, policy, rollout, trainer, cotrain,
                preset_name=preset_name, device=dev, heldout=heldout, pool=pool, sft_info=sft_info)
    return run, start_step, eval_start


def build_cotrainer(mode: str, policy, tokenizer, task, preset: RunPreset, seed: int, cache_dir: Path, log=print,
                    progress: bool | None = None):
    """The co-training plug-in for --spec off|frozen|online (off: a no-op object)."""
    if mode == "off":
        return SpecCoTrainer(None, CoTrainConfig(mode="off"))
    if preset.cotrain.drafter == "history":  # no model drafts: no EAGLE-3 head to build
        return SpecCoTrainer(None, dataclasses.replace(preset.cotrain, mode=mode, seed=seed))
    draft, _ = starting_draft(policy, tokenizer, task, preset, seed, cache_dir, log=log, progress=progress)
    return SpecCoTrainer(draft, dataclasses.replace(preset.cotrain, mode=mode, seed=seed))


__all__ = ["train_rl", "rl_step", "RLRun", "RLCallback"]
