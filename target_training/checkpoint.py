"""Checkpoints that fail loudly and never clobber what was saved before.

A checkpoint is a folder: `config.json`, `model.safetensors`, optional `optimizer.pt` and
`state.pt` (step, RNG states, anything else the trainer needs), and `manifest.json` with the
SHA-256 and size of every file. Saving writes a sibling temp folder and swaps it in with
renames, so a crash mid-save leaves the previous checkpoint intact. Loading verifies sizes
and hashes first (a truncated or corrupted file is named in a one-line error) and compares
the saved model config with the expected one field by field.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from target_training.config import ConfigError, MoEConfig

MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint is missing, truncated, corrupted or does not match the expected config."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def atomic_write_dir(out_dir: str | os.PathLike, write_fn) -> Path:
    """Call write_fn(tmp_dir) and then replace out_dir by tmp_dir with renames.

    If write_fn raises, out_dir is untouched. A manifest of hashes is added automatically.
    """
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write_fn(tmp)
        files = sorted(p.name for p in tmp.iterdir() if p.is_file() and p.name != MANIFEST)
        manifest = {name: {"sha256": _sha256(tmp / name), "bytes": (tmp / name).stat().st_size} for name in files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
        tmp.rename(out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def verify_dir(path: str | os.PathLike) -> dict:
    """Check every file listed in the manifest; return the manifest."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint folder {path} does not exist")
    mpath = path / MANIFEST
    try:
        manifest = json.loads(mpath.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST} (incomplete save?)") from None
    except json.JSONDecodeError:
        raise CheckpointError(f"checkpoint manifest {mpath} is corrupted") from None
    for name, info in manifest.items():
        f = path / name
        if not f.exists():
            raise CheckpointError(f"checkpoint file {f} is missing")
        size = f.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(f"checkpoint file {f} is truncated or altered ({size} bytes, expected {info['bytes']})")
        if _sha256(f) != info["sha256"]:
            raise CheckpointError(f"checkpoint file {f} is corrupted (SHA-256 mismatch)")
    return manifest


def config_mismatch(saved: dict, expected: dict) -> str | None:
    """The differing fields, as one line of text, or None."""
    diffs = [f"{key}: checkpoint has {saved.get(key)!r}, expected {expected.get(key)!r}"
             for key in sorted(set(saved) | set(expected)) if saved.get(key) != expected.get(key)]
    return "; ".join(diffs) if diffs else None


def save_checkpoint(out_dir, model: torch.nn.Module, config: MoEConfig, *, optimizer=None,
                    state: dict | None = None, extra_json: dict | None = None) -> Path:
    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(config.to_dict(), indent=1))
        tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        save_file(tensors, str(tmp / "model.safetensors"))
        if optimizer is not None:
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        if state is not None:
            torch.save(state, tmp / "state.pt")
        if extra_json is not None:
            (tmp / "info.json").write_text(json.dumps(extra_json, indent=1))

    return atomic_write_dir(out_dir, write)


def load_config(path) -> MoEConfig:
    path = Path(path)
    verify_dir(path)
    try:
        return MoEConfig.from_dict(json.loads((path / "config.json").read_text()))
    except (json.JSONDecodeError, ConfigError, TypeError) as e:
        raise CheckpointError(f"checkpoint config {path / 'config.json'} is invalid: {e}") from None


def load_checkpoint(path, expected: MoEConfig | None = None, *, map_location="cpu"):
    """Returns (model, config, optimizer_state or None, state or None)."""
    path = Path(path)
    cfg = load_config(path)
    if expected is not None:
        diff = config_mismatch(cfg.to_dict(), expected.to_dict())
        if diff:
            raise CheckpointError(f"checkpoint {path} does not match the model config ({diff})")
    model = cfg.build()
    try:
        tensors = load_file(str(path / "model.safetensors"), device=str(map_location))
        missing, unexpected = model.load_state_dict(tensors, strict=False)
    except Exception as e:  # safetensors raises several types for bad headers
        raise CheckpointError(f"checkpoint weights {path / 'model.safetensors'} cannot be read: {e}") from None
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path} weights do not fit the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    opt = torch.load(path / "optimizer.pt", map_location=map_location, weights_only=True) if (path / "optimizer.pt").exists() else None
    state = torch.load(path / "state.pt", map_location=map_location, weights_only=False) if (path / "state.pt").exists() else None
    return model, cfg, opt, state
