"""The run folder of `specrl train-rl`: what identifies the run, its metrics rows, its checkpoint.

Files: run.json (task, seed, preset, spec mode, model config: what must stay the same for a
resume), metrics.jsonl (one row per step; non-finite numbers are written as null so every line
is valid JSON), summary.json, and ckpt (the latest resumable state; a symlink swapped
atomically, see target_training.checkpoint).

A run killed at any instant resumes to the same end state as an uninterrupted one: the
checkpoint holds everything the next steps read (policy, optimizer, RNG, the co-training state
with its feature buffer), metrics rows after the checkpoint are dropped, and a run killed before
its first checkpoint restarts from step 0.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from pathlib import Path

import torch

from specrl.presets import RunPreset
from target_training.checkpoint import load_checkpoint, recover_dir, save_checkpoint
from target_training.config import model_config_for
from target_training.real_models import is_real_model
from target_training.tokenizer import CharTokenizer

RUN_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
CKPT = "ckpt"


class RunDirError(ValueError):
    pass


# ---------------------------------------------------------------------- the folder and its identity
def open_run_dir(out: Path, identity: dict, resume: bool, log=print) -> None:
    """Make `out` ready: finish an interrupted save, refuse a folder that holds a run that
    started unless resuming (and one that holds none when resuming), check it is writable, then
    check a resumed run's identity (before anything is trained) or write a new run's, and read a
    resumed run's metrics so a damaged line is named now, not after the SFT warm start.

    A run that never started (it failed before its first step was logged: a bad task file, an
    interrupted warm start) left only its run.json: a new run takes the folder over without
    --resume, and --resume starts it from step 0."""
    if out.exists() and not out.is_dir():
        raise RunDirError(f"--out {out} exists and is not a folder")
    if out.is_dir():
        recover_dir(out / CKPT, log=log)  # a save that a crash interrupted
    started = run_started(out)
    if started and not resume:
        raise RunDirError(f"output folder {out} already holds a run; pass --resume to continue it or choose another --out")
    if resume and not started and not (out / RUN_FILE).exists():
        raise RunDirError(f"--resume given but {out} holds no run")
    out.mkdir(parents=True, exist_ok=True)
    check_writable(out)
    if resume and (out / RUN_FILE).exists():
        check_identity(out, identity)
    else:
        if (out / RUN_FILE).exists():
            log(f"[rl] {out} holds a run that never started (no metrics row, no checkpoint); starting a new one")
        write_identity(out, identity)
    if resume and (out / METRICS_FILE).exists():
        read_metrics(out / METRICS_FILE)


def run_started(out: Path) -> bool:
    """Whether `out` holds a run that got as far as logging a step: a checkpoint (or a link to
    one), a metrics line (even a damaged one) or a summary. run.json alone is written before any
    work, so a run that failed before its first step leaves nothing else."""
    if os.path.lexists(out / CKPT) or (out / SUMMARY_FILE).exists():
        return True
    metrics = out / METRICS_FILE
    if not metrics.exists():
        return False
    with open(metrics, "rb") as f:  # a resume before the first checkpoint empties it (truncate_metrics)
        return f.read(4096).strip() != b""


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
            "model": ({"real_model": preset.model, "context": preset.context} if is_real_model(preset.model)
                      else model_config_for(preset.model, tokenizer.vocab_size).to_dict()),
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


# ---------------------------------------------------------------------- metrics rows and summary
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


def write_summary(out: Path, summary: dict) -> None:
    (out / SUMMARY_FILE).write_text(json.dumps(json_safe(summary), indent=1))


# ---------------------------------------------------------------------- checkpoint and resume
def save_state(out: Path, policy, trainer, cotrain, eval_start: dict) -> None:
    """The resumable state after a step: policy, trainer, torch RNG, co-training, start evaluation."""
    save_checkpoint(out / CKPT, policy, policy.cfg, optimizer=None,
                    state={"trainer": trainer.state_dict(), "torch_rng": torch.get_rng_state(),
                           "eval_start": eval_start, "cotrain": cotrain.state_dict()})


def restore_state(out: Path, policy, trainer, cotrain, *, on_policy_loaded, log=print) -> tuple[int, dict | None]:
    """Resume from the run's checkpoint: (first step to run, start evaluation or None). A run
    killed before its first checkpoint starts again from step 0. `on_policy_loaded()` runs right
    after the policy weights are restored (the engine's policy sync)."""
    if not (out / CKPT).exists():
        truncate_metrics(out / METRICS_FILE, -1)
        log(f"[rl] {out} has no checkpoint yet; starting it again from step 0")
        return 0, None
    ckpt_model, _, _, state = load_checkpoint(out / CKPT, policy.cfg)
    policy.load_state_dict(ckpt_model.state_dict())
    on_policy_loaded()
    trainer.load_state_dict(state["trainer"])
    torch.set_rng_state(state["torch_rng"])
    cotrain.load_state_dict(state["cotrain"])
    start_step, eval_start = state["trainer"]["step"], state["eval_start"]
    truncate_metrics(out / METRICS_FILE, start_step - 1)
    log(f"[rl] resumed from {out / CKPT} at step {start_step}")
    return start_step, eval_start
