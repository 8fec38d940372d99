"""Run every bad input the CLI and the configs must refuse in one line (bad flags and values, paths
that are files, damaged task files and run folders, a read-only or full disk, configs that would
allocate gigabytes, a damaged draft) and print a table: input -> exit code -> stderr.

Each CLI row is a real `specrl` subprocess; the read-only and full-disk rows run it inside a
private mount namespace (`unshare -m`, needs root or user namespaces) on a tmpfs that is
remounted read-only or sized too small for the second checkpoint, so the errors are the
kernel's own EROFS and ENOSPC. Rows that act on a run folder check afterwards that nothing
saved was lost (the hashes of its files before and after). API rows (configs that would
allocate gigabytes) call the constructor in a subprocess and print the exception's one line.

    python -m experiments.bad_inputs --out runs/bad-inputs [--cache-dir DIR]

Prints the table as Markdown and saves it as OUT/bad_inputs.json.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def _specrl(*args) -> list[str]:
    return [PY, "-m", "specrl.cli", *map(str, args)]


def _fingerprint(folder: Path) -> dict:
    """Hash of every file under a run folder (through the ckpt symlink)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            out[str(p.relative_to(folder))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _run(cmd, env, shell=False) -> tuple[int, str, str]:
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, shell=shell, timeout=1200)
    return r.returncode, r.stderr.strip(), r.stdout.strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cache-dir", type=Path, default=None)
    ap.add_argument("--only", default=None, help="run only the rows whose label contains one of these comma-separated texts")
    args = ap.parse_args(argv)
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    w = args.out.resolve()
    cache = (args.cache_dir or w / "cache").resolve()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    common = ["--preset", "ci", "--cache-dir", cache, "--no-progress"]

    # a finished 1-step online run to resume from, and its checkpoint size (for the full-disk row)
    base = w / "base"
    code, err, _ = _run(_specrl("train-rl", *common, "--spec", "online", "--steps", 1, "--out", base), env)
    assert code == 0, err
    ckpt_bytes = sum(p.stat().st_size for p in (base / "ckpt").resolve().iterdir())

    def copy_run(name: str) -> Path:
        dst = w / name
        shutil.copytree(base, dst, symlinks=True)
        return dst

    rows = []

    def row(label: str, cmd, folder: Path | None = None, shell=False):
        if args.only and not any(o in label for o in args.only.split(",")):
            return
        before = _fingerprint(folder) if folder is not None and folder.exists() else None
        code, err, out = _run(cmd, env, shell=shell)
        intact = None
        if before is not None:
            after = _fingerprint(folder)
            intact = all(after.get(k) == v for k, v in before.items())
        lines = err.splitlines()
        rows.append({"input": label, "exit": code, "stderr_lines": len(lines),
                     "stderr": lines[-1] if lines else "", "saved_intact": intact,
                     "stdout_tail": next((x for x in out.splitlines() if "damaged" in x or "kept checkpoint" in x), "")})
        print(f"{label}: exit {code}: {lines[-1] if lines else ''}", flush=True)

    f = w / "a-file"
    f.write_text("not a folder\n")
    row("--out is a regular file", _specrl("train-rl", *common, "--out", f))
    row("--out below a regular file", _specrl("train-rl", *common, "--out", f / "run"))
    row("--cache-dir is a regular file", _specrl("train-rl", "--preset", "ci", "--cache-dir", f, "--out", w / "r1"))
    row("--steps 1000000000000", _specrl("train-rl", *common, "--steps", 10**12, "--out", w / "r2"))
    row("--seed 10**30", _specrl("train-rl", *common, "--seed", 10**30, "--out", w / "r3"))
    row("bench generate --batches 1000000000",
        _specrl("bench", "generate", *common[:-1], "--batches", 10**9, "--out", w / "r4"))
    row("bench speed --temperature nan", _specrl("bench", "speed", *common[:-1], "--temperature", "nan", "--out", w / "r5"))
    row("bench speed --temperature inf", _specrl("bench", "speed", *common[:-1], "--temperature", "inf", "--out", w / "r6"))
    bad = w / "bad.jsonl"
    bad.write_text('{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2", "answer": \n')
    row("malformed JSONL task file (line 2)", _specrl("train-rl", *common, "--task", bad, "--out", w / "r7"))
    empty = w / "empty.jsonl"
    empty.write_text("")
    row("empty JSONL task file", _specrl("train-rl", *common, "--task", empty, "--out", w / "r8"))

    resume = ["--spec", "online", "--steps", 2, "--resume"]
    r = copy_run("seed")
    row("--resume --seed 7 on a seed-0 run", _specrl("train-rl", *common, *resume, "--seed", 7, "--out", r), r)
    r = copy_run("task")
    row("--resume --task sort on an arith run", _specrl("train-rl", *common, *resume, "--task", "sort", "--out", r), r)
    r = copy_run("torn")
    with open(r / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 1, "loss": 0.1')
    row("torn last line of metrics.jsonl, --resume", _specrl("train-rl", *common, *resume, "--out", r), r)
    r = copy_run("draftcache")
    dcache = w / "cache-copy"
    shutil.copytree(cache, dcache, symlinks=True)
    (d,) = [p for p in dcache.iterdir() if p.name.startswith("draft-")]
    (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:-100])
    row("damaged cached offline draft, --resume (should succeed)",
        _specrl("train-rl", "--preset", "ci", "--cache-dir", dcache, "--no-progress", *resume, "--out", r))

    # real EROFS and ENOSPC on a private tmpfs (scripts in files: no nested shell quoting)
    if shutil.which("unshare"):
        mnt = w / "mnt"
        mnt.mkdir()
        verify = w / "verify.py"
        verify.write_text("import sys\nfrom target_training.checkpoint import load_checkpoint\n"
                          "print('kept checkpoint at step', load_checkpoint(sys.argv[1])[3]['trainer']['step'])\n")
        r = copy_run("ro-src")
        cmd = " ".join(_specrl("train-rl", *common, *resume, "--out", mnt / "run"))
        script = w / "erofs.sh"
        script.write_text(f"mount -t tmpfs -o size=64m tmpfs {mnt} && cp -a {r} {mnt}/run && "
                          f"mount -o remount,ro {mnt} || exit 99\n{cmd}\ncode=$?\n"
                          f"{PY} {verify} {mnt}/run/ckpt\nexit $code\n")
        row("--out on a read-only filesystem (EROFS), --resume", ["unshare", "-m", "sh", str(script)])
        size = int(ckpt_bytes * 1.6)
        cmd = " ".join(_specrl("train-rl", *common, "--spec", "online", "--steps", 3, "--out", mnt / "run"))
        script = w / "enospc.sh"
        script.write_text(f"mount -t tmpfs -o size={size} tmpfs {mnt} || exit 99\n{cmd}\ncode=$?\n"
                          f"{PY} {verify} {mnt}/run/ckpt\nexit $code\n")
        row(f"full disk during the 2nd checkpoint save (tmpfs {size // 1024} KiB)", ["unshare", "-m", "sh", str(script)])

    api = [
        ("SpecConfig(gamma=10**7)", "from rollout.drafters import SpecConfig as C; C(gamma=10**7)"),
        ("SpecConfig(mode='tree', tree_budget=10**7)", "from rollout.drafters import SpecConfig as C; C(mode='tree', tree_budget=10**7)"),
        ("OnlineDraftConfig(batch_size=10**9)", "from specrl.config import OnlineDraftConfig as C; C(batch_size=10**9)"),
        ("SamplingParams(temperature=float('nan'))", "from rollout.protocol import SamplingParams as S; S(temperature=float('nan'))"),
        ("EngineConfig(max_batch=10**9)", "from rollout.engine import EngineConfig as E; E(max_batch=10**9)"),
    ]
    for label, code in api:
        wrapped = (f"import sys\ntry:\n    {code}\nexcept ValueError as e:\n"
                   f"    print(type(e).__name__ + ': ' + str(e), file=sys.stderr); sys.exit(2)")
        row(f"API: {label}", [PY, "-c", wrapped])
    flip = (
        "import sys, torch\n"
        "from draft_models.checkpoint import save_draft, load_draft, DraftCheckpointError\n"
        "from specrl.config import DraftTrainConfig\n"
        "from specrl.drafts import new_draft\n"
        "from target_training.config import model_config_for\n"
        "p = model_config_for('tiny', 64).build(); d = new_draft(p, [[3, 4, 5, 6]], DraftTrainConfig(draft_vocab_size=16))\n"
        f"out = save_draft(d, '{w}/draft'); f = out / 'model.safetensors'; b = bytearray(f.read_bytes())\n"
        "b[len(b) // 2] ^= 1; f.write_bytes(bytes(b))\n"
        "try:\n    load_draft(out, p)\nexcept DraftCheckpointError as e:\n    print(e, file=sys.stderr); sys.exit(2)\n")
    row("API: load_draft of a draft with one flipped byte in model.safetensors", [PY, "-c", flip])

    (w / "bad_inputs.json").write_text(json.dumps(rows, indent=1))
    print()
    print("| input | exit | stderr lines | stderr (last line) | saved files intact | stdout (last line) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        intact = "" if r["saved_intact"] is None else ("yes" if r["saved_intact"] else "NO")
        msg = r["stderr"].replace("|", "\\|")
        print(f"| {r['input']} | {r['exit']} | {r['stderr_lines']} | {msg} | {intact} | {r['stdout_tail'][:160]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
