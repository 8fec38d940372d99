"""Kill a `specrl train-rl --spec online` run at random moments, resume it each time, and check
that it ends exactly where an uninterrupted run ends.

Two kinds of kill, alternating, each at a random moment:
- "timer": SIGKILL after a random delay (anywhere: start-up, rollout, update, draft training,
  metrics write, checkpoint save);
- "rename": under strace, SIGKILL injected at the N-th rename(2) the process makes (N random),
  i.e. inside a checkpoint swap, the run.json write or the metrics truncation on resume. These
  are the instants where a non-atomic save would lose the run.

After every kill the run is resumed (`--resume` once it holds anything). At the end the killed
run and a reference run of the same command are compared: policy weights, the whole saved
co-training state (engine draft, trained draft, its optimizer, the feature buffer's records,
counters) and every metrics row, leaving out only wall-clock measurements (the keys in
TIMING_KEYS and those starting with perf/ or sched/), which differ between any two runs.

    python -m experiments.kill_resume --out runs/kill --kills 20 --steps 8

Prints one line per kill and a JSON summary (also saved as OUT/kill_resume.json).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

TIMING_KEYS = {"tokens_per_s", "rollout_s", "step_s", "wall_s", "sft_cached", "seconds", "step_seconds",
               "step_ema_s"}


def _cmd(out: Path, args, resume: bool) -> list[str]:
    cmd = [sys.executable, "-m", "specrl.cli", "train-rl", "--preset", args.preset, "--spec", "online",
           "--steps", str(args.steps), "--seed", str(args.seed), "--no-progress", "--out", str(out),
           "--cache-dir", str(args.cache_dir)]
    return cmd + (["--resume"] if resume else [])


def _holds_run(out: Path) -> bool:
    return any((out / n).exists() or (out / n).is_symlink() for n in ("run.json", "metrics.jsonl", "ckpt"))


def _strip(obj):
    """Drop wall-clock measurements from nested metrics and state."""
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items()
                if k not in TIMING_KEYS and not str(k).startswith(("perf/", "sched/"))}
    if isinstance(obj, (list, tuple)):
        return [_strip(v) for v in obj]
    return obj


def _diff(a, b, path="") -> list[str]:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
              and a.dtype == b.dtype and torch.equal(a, b))
        return [] if ok else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}/{k} (only one side)" for k in set(a) ^ set(b)]
        for k in sorted(set(a) & set(b), key=str):
            out += _diff(a[k], b[k], f"{path}/{k}")
        return out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path} (length {len(a)} vs {len(b)})"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [path]


def compare(ref: Path, run: Path) -> dict:
    """Differences between two finished runs, by part."""
    w_ref = load_file(str(ref / "ckpt" / "model.safetensors"))
    w_run = load_file(str(run / "ckpt" / "model.safetensors"))
    s_ref = torch.load(ref / "ckpt" / "state.pt", weights_only=False)
    s_run = torch.load(run / "ckpt" / "state.pt", weights_only=False)
    rows_ref = [json.loads(x) for x in (ref / "metrics.jsonl").read_text().splitlines()]
    rows_run = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    sum_ref = json.loads((ref / "summary.json").read_text())
    sum_run = json.loads((run / "summary.json").read_text())
    return {"policy": _diff(w_ref, w_run),
            "cotrain_state": _diff(_strip(s_ref["cotrain"]), _strip(s_run["cotrain"])),
            "trainer_state": _diff(s_ref["trainer"], s_run["trainer"]),
            "metrics_rows": _diff(_strip(rows_ref), _strip(rows_run)),
            "summary": _diff(_strip(sum_ref), _strip(sum_run)),
            "n_rows": len(rows_run),
            "draft_version": s_run["cotrain"]["draft_trainer"]["version"],
            "engine_draft_version": s_run["cotrain"]["engine_draft_version"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--preset", default="ci")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rng", type=int, default=1234, help="seed of the kill moments")
    ap.add_argument("--cache-dir", type=Path, default=None)
    ap.add_argument("--reference", type=Path, default=None, help="reuse this finished reference run")
    ap.add_argument("--reference-seconds", type=float, default=None, help="its wall time")
    args = ap.parse_args(argv)
    args.cache_dir = args.cache_dir or args.out / "cache"
    if args.out.exists() and args.out != args.reference:
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    rng = random.Random(args.rng)
    strace = shutil.which("strace")

    if not any(args.cache_dir.glob("draft-*")):  # cache the SFT start and offline draft first
        warm = _cmd(args.out / "warm-up", args, False)
        warm[warm.index("--steps") + 1] = "1"
        subprocess.run(warm, env=env, check=True, capture_output=True)
    if args.reference is not None:  # a finished reference run of the same command and code
        ref, t_ref = args.reference, args.reference_seconds
    else:
        ref = args.out / "reference"
        t0 = time.perf_counter()
        subprocess.run(_cmd(ref, args, False), env=env, check=True, capture_output=True)
        t_ref = time.perf_counter() - t0
    step_s = [json.loads(x)["step_s"] for x in (ref / "metrics.jsonl").read_text().splitlines()]
    t_step = sorted(step_s)[len(step_s) // 2]
    t_start = max(1.0, (t_ref - sum(step_s)) / 2)  # start-up (+ first evaluation); the end evaluation is alike
    print(f"reference run: {t_ref:.1f}s for {args.steps} steps (caches warm); step {t_step:.1f}s, "
          f"start-up about {t_start:.1f}s", flush=True)

    run = args.out / "killed"
    kills, attempts, log = 0, 0, []
    while kills < args.kills:
        attempts += 1
        resume = _holds_run(run)
        kind = "rename" if (kills % 2 == 1 and strace) else "timer"
        cmd = _cmd(run, args, resume)
        if kind == "rename":
            n = rng.randint(1, 3)  # on resume: the metrics truncation, then the first save's two renames
            cmd = [strace, "-f", "-qq", "-o", "/dev/null", "-e", "trace=rename,renameat,renameat2",
                   "-e", f"inject=rename,renameat,renameat2:signal=KILL:when={n}"] + cmd
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            out, err = proc.communicate()
            where = f"at rename #{n}"
        else:
            # start-up included; at most about half a step of progress per kill, so that 20 kills fit in the run
            delay = rng.uniform(0.5, t_start + 0.5 * t_step)
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            try:
                out, err = proc.communicate(timeout=delay)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
                out, err = proc.communicate()
            where = f"after {delay:.1f}s"
        rows = len((run / "metrics.jsonl").read_text().splitlines()) if (run / "metrics.jsonl").exists() else 0
        killed = proc.returncode in (-9, 137) or b"Killed" in err
        if proc.returncode not in (0, -9, 137) and not killed:
            print(err.decode()[-2000:], file=sys.stderr)
            raise SystemExit(f"run failed with exit {proc.returncode} on attempt {attempts}")
        line = (f"attempt {attempts}: {'resume' if resume else 'start'}, {kind} kill {where}: "
                f"{'killed' if killed else 'finished first'} (exit {proc.returncode}); metrics rows on disk {rows}")
        print(line, flush=True)
        log.append(line)
        if killed:
            kills += 1
        elif proc.returncode == 0:
            break  # the run completed before this kill landed: no further kills possible
    final = subprocess.run(_cmd(run, args, _holds_run(run)), env=env, capture_output=True, text=True)
    if final.returncode != 0:
        print(final.stderr[-2000:], file=sys.stderr)
        raise SystemExit(f"final resume failed with exit {final.returncode}")
    diffs = compare(ref, run)
    identical = not any(diffs[k] for k in ("policy", "cotrain_state", "trainer_state", "metrics_rows", "summary"))
    leftovers = sorted(p.name for p in run.iterdir() if p.name.startswith("."))
    summary = {"kills": kills, "attempts": attempts, "steps": args.steps, "preset": args.preset,
               "identical": identical, "differences": {k: v[:5] if isinstance(v, list) else v for k, v in diffs.items()},
               "hidden_entries_left": leftovers, "reference_s": t_ref, "log": log}
    (args.out / "kill_resume.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "log"}, indent=1))
    return 0 if identical and kills == args.kills else 1


if __name__ == "__main__":
    sys.exit(main())
