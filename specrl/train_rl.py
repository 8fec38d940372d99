"""`specrl train-rl`: SFT warm start (cached), then GRPO steps on a verifiable task.

The loop in `train_rl` is the whole RL algorithm at a glance: rollout, reward, update,
log, checkpoint. Outputs in the run folder: run.json (what identifies the run: task, seed,
preset, spec mode, model config), metrics.jsonl (one row per step; non-finite numbers are
written as null so every line is valid JSON), summary.json, and ckpt (the latest resumable
state; a symlink swapped atomically, see target_training.checkpoint).

A run killed at any instant resumes with --resume to the same end state as an uninterrupted
one: the checkpoint holds everything the next steps read (policy, optimizer, RNG, the
co-training state with its feature buffer), metrics rows after the checkpoint are dropped, and
a run killed before its first checkpoint restarts from step 0.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from rollout.engine import EmbeddedEngine, EngineConfig
from rollout.protocol import SamplingParams
from specrl.cotrain import CoTrainConfig, SpecCoTrainer
from specrl.drafts import cached_offline_draft
from specrl.presets import RunPreset, get_preset
from target_training.checkpoint import CheckpointError, load_checkpoint, recover_dir, save_checkpoint
from target_training.config import model_config_for
from target_training.grpo import GRPOTrainer
from target_training.sft import default_cache_dir, warm_start
from target_training.tasks import get_task
from target_training.tokenizer import CharTokenizer


class RunDirError(ValueError):
    pass


EVAL_REQUEST_OFFSET = 1 << 40  # request ids of evaluation samples, disjoint from training rollouts
SEED_MAX = 2**32 - 1  # sampling noise keys on the seed's low 32 bits (rollout.sampling)
RUN_FILE = "run.json"


def build_task_and_policy(task_name: str, preset: RunPreset, cache_dir: Path | None, log=print, progress=False):
    tokenizer = CharTokenizer()
    task = get_task(task_name, **preset.task_kwargs)
    model_cfg = model_config_for(preset.model, tokenizer.vocab_size)
    task_spec = {"name": task_name, **preset.task_kwargs}
    policy, sft_info = warm_start(task, task_spec, tokenizer, model_cfg, preset.sft, cache_dir, log=log,
                                  progress=progress)
    return tokenizer, task, policy, sft_info


def encode_prompts(tokenizer, examples) -> list[list[int]]:
    return [[tokenizer.bos_id] + tokenizer.encode(ex.prompt) for ex in examples]


def rollout_params(preset: RunPreset, tokenizer, seed: int, greedy: bool = False) -> SamplingParams:
    return SamplingParams(temperature=0.0 if greedy else preset.temperature, max_new_tokens=preset.max_new_tokens,
                          stop_token_ids=(tokenizer.eos_id,), seed=seed)


def score(task, tokenizer, examples, trajectories) -> list[float]:
    return [task.reward(ex, tokenizer.decode(t.token_ids)) for ex, t in zip(examples, trajectories)]


def evaluate(engine, task, tokenizer, examples, preset: RunPreset, seed: int) -> dict:
    """Held-out reward under the rollout's own sampling (the quantity GRPO maximises), averaged
    over `eval_samples` samples per prompt with fixed request ids, plus greedy accuracy."""
    k = preset.eval_samples
    reps = [ex for ex in examples for _ in range(k)]
    prompts = encode_prompts(tokenizer, reps)
    ids = [EVAL_REQUEST_OFFSET + i for i in range(len(reps))]
    sampled = engine.generate(prompts, rollout_params(preset, tokenizer, seed), request_ids=ids)
    rewards = score(task, tokenizer, reps, sampled)
    greedy = engine.generate(prompts[::k], rollout_params(preset, tokenizer, seed, greedy=True))
    correct = [task.is_correct(ex, tokenizer.decode(t.token_ids)) for ex, t in zip(examples, greedy)]
    return {"reward": sum(rewards) / len(rewards), "greedy_accuracy": sum(correct) / len(correct)}


def step_examples(task, pool, preset: RunPreset, seed: int, step: int):
    """The prompts of RL step `step`, each repeated group_size times (deterministic in seed, step)."""
    rng = random.Random(seed * 100_003 + step)
    chosen = rng.sample(pool, preset.prompts_per_step)
    return [ex for ex in chosen for _ in range(preset.group_size)]


def check_seed(seed) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise ValueError(f"--seed must be an integer in [0, {SEED_MAX}], got {seed}")


def prepare_run_dir(out: Path, resume: bool, log=print) -> None:
    if out.exists() and not out.is_dir():
        raise RunDirError(f"--out {out} exists and is not a folder")
    if out.is_dir():
        recover_dir(out / "ckpt", log=log)  # a save that a crash interrupted
    has_run = any((out / name).exists() for name in ("metrics.jsonl", "ckpt", RUN_FILE))
    if has_run and not resume:
        raise RunDirError(f"output folder {out} already holds a run; pass --resume to continue it or choose another --out")
    if resume and not has_run:
        raise RunDirError(f"--resume given but {out} holds no run")
    out.mkdir(parents=True, exist_ok=True)
    check_writable(out)


def check_writable(folder: Path) -> None:
    """Fail now, with the path and the reason (read-only, permission), rather than after training."""
    probe = folder / f".write-probe-{os.getpid()}"
    probe.write_bytes(b"")
    probe.unlink()


def run_identity(task_name: str, preset: RunPreset, preset_name: str, seed: int, spec: str) -> dict:
    """What must stay the same for --resume to continue a run (not the step count, which a
    resume may raise)."""
    tokenizer = CharTokenizer()
    settings = json.dumps(dataclasses.asdict(dataclasses.replace(preset, rl_steps=1)), sort_keys=True, default=str)
    return {"task": task_name, "seed": seed, "preset": preset_name, "spec": spec,
            "model": model_config_for(preset.model, tokenizer.vocab_size).to_dict(),
            "preset_sha256": hashlib.sha256(settings.encode()).hexdigest()[:16]}


def check_identity(out: Path, identity: dict) -> None:
    """Refuse (one line) to resume a run under another task, seed, preset, spec mode or model."""
    path = out / RUN_FILE
    try:
        saved = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RunDirError(f"{path} is damaged ({e.msg} at line {e.lineno}); cannot check what run this is") from None
    names = {"model": "model config", "preset_sha256": "preset settings"}
    diffs = [f"{names.get(k, k)} {saved.get(k)!r} (this command: {identity[k]!r})" if k != "model"
             else "model config" for k in identity if saved.get(k) != identity[k]]
    if diffs:
        raise RunDirError(f"--resume: {out} is a run with a different " + "; ".join(diffs)
                          + "; resume with the run's own settings or choose another --out")


def write_identity(out: Path, identity: dict) -> None:
    tmp = out / f".{RUN_FILE}.tmp"
    tmp.write_text(json.dumps(identity, indent=1))
    os.replace(tmp, out / RUN_FILE)


def json_safe(value):
    """NaN and infinities become None (JSON null), recursively: bare NaN is not valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def append_row(path: Path, row: dict) -> None:
    """One metrics row as one write(2) on an O_APPEND file: a kill leaves the line whole or absent."""
    data = (json.dumps(json_safe(row), allow_nan=False) + "\n").encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            while data:
                data = data[os.write(fd, data):]
        finally:
            os.close(fd)
    except OSError as e:  # os.write names no file
        raise OSError(e.errno, e.strerror, str(path)) from None


def read_metrics(path: Path) -> list[dict]:
    """The rows of metrics.jsonl; a line that is not a JSON row is named with its number."""
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise RunDirError(f"{path} line {i} is not valid JSON ({e.msg}; a torn or edited line): "
                              f"repair or delete that line, then resume") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise RunDirError(f"{path} line {i} is not a metrics row (no integer 'step')")
        rows.append(row)
    return rows


def truncate_metrics(path: Path, last_step: int) -> None:
    """On resume, drop rows logged after the checkpoint so the file has one row per step."""
    if not path.exists():
        return
    rows = [r for r in read_metrics(path) if r["step"] <= last_step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)


def build_cotrainer(mode: str, policy, tokenizer, task, preset: RunPreset, seed: int, cache_dir: Path, log=print):
    """The co-training plug-in for --spec off|frozen|online (off: a no-op object)."""
    if mode == "off":
        return SpecCoTrainer(None, CoTrainConfig(mode="off"))
    prompts = encode_prompts(tokenizer, task.examples("train", preset.draft.n_sequences, seed + 7))
    draft, _ = cached_offline_draft(policy, prompts, preset.draft, (tokenizer.eos_id,), cache_dir, log=log)
    return SpecCoTrainer(draft, dataclasses.replace(preset.cotrain, mode=mode, seed=seed))


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


class RLCallback:
    """Extension points of `train_rl`; override what you need. Time spent here is outside the
    RL step's measured wall time (`step_s`)."""

    def on_start(self, run: RLRun) -> None:  # after the start evaluation, before step 0
        pass

    def on_step_end(self, run: RLRun, step: int, row: dict) -> None:  # after the step is logged
        pass

    def on_end(self, run: RLRun, summary: dict) -> None:  # after summary.json is written
        pass


ENGINES = ("embedded", "vllm")


def build_engine(name: str, policy, preset: RunPreset, out: Path):
    """The rollout engine. The embedded one runs the trainer's policy module itself; vLLM serves
    an exported copy that `sync_policy` refreshes after every update."""
    if name == "embedded":
        return EmbeddedEngine(policy, EngineConfig(max_batch=preset.max_batch))
    if name == "vllm":
        from rollout.vllm_engine import VLLMEngine, VLLMEngineConfig

        return VLLMEngine(policy, VLLMEngineConfig(max_batch=preset.max_batch, work_dir=str(out / "vllm")))
    raise ValueError(f"unknown engine {name!r}; choose from {ENGINES}")


def sync_policy(engine, policy) -> float | None:
    """Policy sync after an update (seconds); None for an engine that runs the policy module."""
    if isinstance(engine, EmbeddedEngine) and engine.model is policy:
        return None
    t0 = time.perf_counter()
    engine.load_policy_weights(policy.state_dict())
    return time.perf_counter() - t0


def train_rl(task_name: str, preset_name: str | RunPreset, out_dir: str | Path, *, seed: int = 0,
             resume: bool = False, steps: int | None = None, cache_dir: Path | None = None, progress: bool = True,
             spec: str = "off", engine: str = "embedded", callbacks: tuple[RLCallback, ...] = (), log=print) -> dict:
    t_start = time.perf_counter()
    if isinstance(preset_name, RunPreset):  # experiments pass a tuned preset directly
        preset, preset_name = preset_name, "custom"
    else:
        preset = get_preset(preset_name)
    preset = preset.with_overrides(rl_steps=steps)
    check_seed(seed)
    out = Path(out_dir)
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose from {ENGINES}")
    if engine == "vllm":
        from rollout.vllm_engine import require_vllm

        require_vllm()  # before any work: one line naming the fix
    prepare_run_dir(out, resume, log)
    identity = run_identity(task_name, preset, preset_name, seed, spec)
    if resume and (out / RUN_FILE).exists():
        check_identity(out, identity)  # before anything is trained or written
    else:
        write_identity(out, identity)
    if resume and (out / "metrics.jsonl").exists():
        read_metrics(out / "metrics.jsonl")  # a damaged line is named now, not after the SFT warm start
    torch.manual_seed(seed)
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    check_writable(cache_dir)
    tokenizer, task, policy, sft_info = build_task_and_policy(task_name, preset, cache_dir, log, progress)
    engine_name, engine = engine, build_engine(engine, policy, preset, out)
    trainer = GRPOTrainer(policy, preset.grpo)
    cotrain = build_cotrainer(spec, policy, tokenizer, task, preset, seed, cache_dir, log).attach(engine, trainer)
    heldout = task.examples("heldout", preset.eval_prompts, seed)
    pool = task.examples("train", max(512, preset.prompts_per_step * 8), seed + 1)

    start_step, eval_start = 0, None
    if resume and not (out / "ckpt").exists():  # killed before its first checkpoint: start again
        truncate_metrics(out / "metrics.jsonl", -1)
        log(f"[rl] {out} has no checkpoint yet; starting it again from step 0")
    elif resume:
        ckpt_model, _, _, state = load_checkpoint(out / "ckpt", policy.cfg)
        policy.load_state_dict(ckpt_model.state_dict())
        sync_policy(engine, policy)
        trainer.load_state_dict(state["trainer"])
        torch.set_rng_state(state["torch_rng"])
        cotrain.load_state_dict(state["cotrain"])
        start_step, eval_start = state["trainer"]["step"], state["eval_start"]
        truncate_metrics(out / "metrics.jsonl", start_step - 1)
        log(f"[rl] resumed from {out / 'ckpt'} at step {start_step}")
    if eval_start is None:
        eval_start = evaluate(engine, task, tokenizer, heldout, preset, seed)
    log(f"[rl] held-out reward at start: {eval_start['reward']:.3f} (greedy accuracy {eval_start['greedy_accuracy']:.3f})")
    run = RLRun(preset, seed, out, cache_dir, tokenizer, task, policy, engine, trainer, cotrain)
    for cb in callbacks:
        cb.on_start(run)

    bar = tqdm(range(start_step, preset.rl_steps), desc="grpo", disable=not progress, initial=start_step,
               total=preset.rl_steps)
    for step in bar:
        t0 = time.perf_counter()
        cotrain.begin_step()
        examples = step_examples(task, pool, preset, seed, step)
        ids = [step * len(examples) + i for i in range(len(examples))]
        trajs = engine.generate(encode_prompts(tokenizer, examples), rollout_params(preset, tokenizer, seed),
                                request_ids=ids, capture_features=cotrain.capture_engine_features)
        gen = dict(engine.last_stats)
        cotrain.on_rollout(trajs)
        rewards = score(task, tokenizer, examples, trajs)
        metrics = trainer.step(trajs, rewards, preset.group_size)
        sync_s = sync_policy(engine, policy)
        if sync_s is not None:
            metrics["perf/policy_sync_s"] = sync_s
        cotrain.on_policy_update()
        cotrain.train_draft()
        row = {"step": step, **metrics, "tokens_per_s": gen["tokens_per_s"], "rollout_s": gen["wall_s"],
               **cotrain.end_step(), "step_s": time.perf_counter() - t0}
        append_row(out / "metrics.jsonl", row)
        bar.set_postfix(reward=f"{row['reward']:.2f}", len=f"{row['response_len']:.0f}")
        if (step + 1) % preset.checkpoint_every == 0 or step + 1 == preset.rl_steps:
            save_checkpoint(out / "ckpt", policy, policy.cfg, optimizer=None,
                            state={"trainer": trainer.state_dict(), "torch_rng": torch.get_rng_state(),
                                   "eval_start": eval_start, "cotrain": cotrain.state_dict()})
        for cb in callbacks:
            cb.on_step_end(run, step, row)

    eval_end = evaluate(engine, task, tokenizer, heldout, preset, seed)
    summary = {"task": task_name, "preset": preset_name, "seed": seed, "spec": spec, "engine": engine_name,
               "rl_steps": preset.rl_steps,
               "reward_start": eval_start["reward"], "reward_end": eval_end["reward"],
               "greedy_accuracy_start": eval_start["greedy_accuracy"], "greedy_accuracy_end": eval_end["greedy_accuracy"],
               "eval_prompts": len(heldout), "eval_samples_per_prompt": preset.eval_samples,
               "sft_cached": sft_info.get("cached", False), "wall_s": time.perf_counter() - t_start}
    (out / "summary.json").write_text(json.dumps(json_safe(summary), indent=1))
    for cb in callbacks:
        cb.on_end(run, summary)
    log(f"[rl] held-out reward: start {summary['reward_start']:.3f} -> end {summary['reward_end']:.3f} "
        f"({summary['wall_s']:.0f}s)")
    return summary


__all__ = ["train_rl", "RLRun", "RLCallback", "RunDirError", "CheckpointError"]
