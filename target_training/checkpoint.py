"""Checkpoints that fail loudly and never clobber what was saved before.

A checkpoint is a folder: `config.json`, `model.safetensors`, optional `optimizer.pt` and
`state.pt` (step, RNG states, anything else the trainer needs), and `manifest.json` with the
SHA-256 and size of every file. Loading verifies sizes and hashes first (a truncated or
corrupted file is named in a one-line error) and compares the saved model config with the
expected one field by field.

Crash safety. `ckpt` is a relative symlink to a hidden sibling version folder
`.ckpt.v-<id>`; a save writes `.ckpt.tmp-<id>`, renames it to a fresh `.ckpt.v-<id>` once
complete (only complete folders carry a `.v-` name), then replaces the symlink with one
rename(2) of a new link over it, which POSIX makes atomic. At every instant `ckpt` therefore
names either the previous or the new complete checkpoint. A crash leaves at worst orphan
siblings; `recover_dir` (run at start-up and before every save) removes them, and it also
repairs the one state an older two-rename save (or a crash while an old real `ckpt/` folder
is moved aside) could leave: no `ckpt` at all, with complete copies under hidden names; the
newest complete copy becomes `ckpt` again.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Callable

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


# Test seam: called with the name of each step of a save ("written", "completed", "linked",
# "moved_legacy", "swapped", "cleaned"), so a test can kill the writer at every one of them.
FAULT_HOOK: Callable[[str], None] | None = None


def _step(name: str) -> None:
    if FAULT_HOOK is not None:
        FAULT_HOOK(name)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for f in path.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(path)


def _siblings(out: Path, kind: str) -> list[Path]:
    """Hidden siblings of `out` of one kind: "v" (complete versions), "tmp", "old", "link"."""
    prefix = f".{out.name}.{kind}-"
    if not out.parent.is_dir():
        return []
    return sorted(p for p in out.parent.iterdir() if p.name.startswith(prefix))


def _complete(path: Path) -> bool:
    if path.is_symlink() or not path.is_dir():
        return False
    try:
        verify_dir(path)
    except CheckpointError:
        return False
    return True


def _disk_nearly_full(path: Path) -> bool:
    """Under 1 MiB free where `path` lives: a writer's own error then means a full disk."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < (1 << 20)


def _new_version_name(out: Path) -> Path:
    return out.parent / f".{out.name}.v-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _owner_gone(p: Path) -> bool:
    """Whether the process that named a sibling `.NAME.KIND-PID-...` is this one or no longer runs
    (another live writer's unfinished folder is left alone)."""
    pid = p.name.rsplit(".", 1)[-1].split("-")[1] if "-" in p.name else ""
    if not pid.isdigit() or int(pid) == os.getpid():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _point(out: Path, target: Path) -> None:
    """Make `out` a symlink to the sibling `target` with one atomic rename."""
    link = out.parent / f".{out.name}.link-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    os.symlink(target.name, link)
    _step("linked")
    if out.is_dir() and not out.is_symlink():  # a real folder (older layout): move it aside first
        os.rename(out, _new_version_name(out))
        _step("moved_legacy")
    os.replace(link, out)
    _fsync_dir(out.parent)


def recover_dir(out_dir: str | os.PathLike, log: Callable[[str], None] | None = None) -> Path | None:
    """Finish or undo a save that a crash interrupted; returns the folder `out_dir` names, or None.

    If `out_dir` is missing (or a dangling link) but complete copies exist under hidden sibling
    names (new `.v-`, or an older save's `.old-`/`.tmp-` with a verifying manifest), the newest
    one (by manifest time) becomes `out_dir` again. Then every sibling that `out_dir` does not
    name is removed: unfinished temp folders, stale versions, leftover links."""
    out = Path(out_dir)
    current: Path | None = None
    if out.is_symlink() and out.exists():
        current = out.parent / os.readlink(out)
    elif out.is_dir():
        current = out
    else:
        cands = [p for kind in ("v", "old", "tmp") for p in _siblings(out, kind) if _complete(p)]
        if cands:
            best = max(cands, key=lambda p: (p / MANIFEST).stat().st_mtime_ns)
            if not best.name.startswith(f".{out.name}.v-"):
                target = _new_version_name(out)
                os.rename(best, target)
                best = target
            if out.is_symlink():  # dangling
                out.unlink()
            _point(out, best)
            current = best
            if log is not None:
                log(f"[ckpt] recovered {out} from an interrupted save ({best.name})")
    if current is None:
        for p in _siblings(out, "link") + _siblings(out, "tmp"):
            if _owner_gone(p):
                _remove(p)
        return None
    for kind in ("v", "old", "tmp", "link"):
        for p in _siblings(out, kind):
            if (p.is_symlink() or p.resolve() != current.resolve()) and _owner_gone(p):
                _remove(p)
    return current


def _remove(p: Path) -> None:
    if p.is_symlink() or p.is_file():
        p.unlink(missing_ok=True)
    else:
        shutil.rmtree(p, ignore_errors=True)


def atomic_write_dir(out_dir: str | os.PathLike, write_fn) -> Path:
    """Call write_fn(tmp_dir) and then make out_dir name the result with one atomic rename.

    If write_fn raises, out_dir is untouched. A manifest of hashes is added automatically.
    Returns out_dir (a symlink to the complete version folder).
    """
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    recover_dir(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    try:
        try:
            write_fn(tmp)
        except OSError:
            raise
        except Exception as e:  # torch.save and safetensors report a full disk as their own errors
            text = str(e)
            if any(t in text for t in ("iostream error", "write failed", "PytorchStreamWriter", "No space left",
                                       "os error 28", "inline_container.cc")) or _disk_nearly_full(tmp):
                raise OSError(errno.ENOSPC, f"cannot write the checkpoint (disk full?): "
                                            f"{text.splitlines()[0]}", str(out)) from None
            raise
        write_manifest(tmp)
        _fsync_tree(tmp)
        _step("written")
        version = _new_version_name(out)
        os.rename(tmp, version)
        _step("completed")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        _point(out, version)
    except BaseException:
        if not (out.is_symlink() and out.exists() and os.readlink(out) == version.name):
            shutil.rmtree(version, ignore_errors=True)
        raise
    _step("swapped")
    recover_dir(out)  # the previous version and any orphans
    _step("cleaned")
    return out


def write_manifest(path: Path) -> None:
    """manifest.json: SHA-256 and size of every other file in the folder (policy and draft checkpoints)."""
    files = sorted(p.name for p in path.iterdir() if p.is_file() and p.name != MANIFEST)
    manifest = {name: {"sha256": _sha256(path / name), "bytes": (path / name).stat().st_size} for name in files}
    (path / MANIFEST).write_text(json.dumps(manifest, indent=1))


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


TIED_HEAD = "lm_head.weight"  # the output matrix, the embedding's own when cfg.tie_embeddings


def save_checkpoint(out_dir, model: torch.nn.Module, config: MoEConfig, *, optimizer=None,
                    state: dict | None = None, extra_json: dict | None = None) -> Path:
    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(config.to_dict(), indent=1))
        tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()
                   if not (config.tie_embeddings and k == TIED_HEAD)}  # one copy of a tied matrix (safetensors)
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
    if cfg.tie_embeddings:
        missing = [k for k in missing if k != TIED_HEAD]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path} weights do not fit the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    opt = torch.load(path / "optimizer.pt", map_location=map_location, weights_only=True) if (path / "optimizer.pt").exists() else None
    state = torch.load(path / "state.pt", map_location=map_location, weights_only=False) if (path / "state.pt").exists() else None
    return model, cfg, opt, state
