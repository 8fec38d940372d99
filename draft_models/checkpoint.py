"""Save and load EAGLE-3 drafts in the folder layout SGLang loads.

  out_dir/config.json          Eagle3Config.to_sglang_config()
  out_dir/model.safetensors    fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t, t2d
                               (no embedding: the draft reads the target's; no d2t/t2d when
                               the draft vocabulary is the whole target vocabulary)

The same folder loads in SGLang and in vLLM and feeds the draft the same target hidden states
in both (see Eagle3Config.to_sglang_config for the two tap-id conventions).

  out_dir/manifest.json        SHA-256 and size of both files (an extra file the engines ignore;
                               drafts from other trainers without one still load)

`save_draft` writes a sibling temporary folder and swaps it in with renames, so an existing
checkpoint is never half-overwritten. `load_draft` verifies the manifest when there is one, so
a flipped byte in the weights is refused rather than loaded. `load_draft` checks the draft against the target it
will run with and raises DraftCheckpointError with a one-line message naming what is wrong.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draft_models.config import Eagle3Config, Eagle3ConfigError
from draft_models.eagle3 import Eagle3Draft
from draft_models.vocab import check_vocab
from target_training.checkpoint import MANIFEST, CheckpointError, verify_dir, write_manifest

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
# Keys some trainers (SpecForge) also save; the draft always reads the target's embedding instead.
_EMBEDDING_KEYS = ("embed_tokens.weight", "model.embed_tokens.weight")


class DraftCheckpointError(ValueError):
    """A draft checkpoint is unreadable or does not fit the target (one-line message)."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def draft_state_dict_for_sglang(draft: Eagle3Draft) -> dict[str, torch.Tensor]:
    """The draft's tensors under SGLang's EAGLE-3 names (detached, contiguous, on their device).

    Used for files and for runtime weight pushes (SGLang's update_weights_from_tensor maps
    q/k/v and gate/up into its fused projections and d2t into its hot-token map by these names).
    """
    sd = draft.state_dict()
    return {name: t.detach().contiguous() for name, t in sd.items() if name not in _EMBEDDING_KEYS}


def has_identity_vocab(draft: Eagle3Draft) -> bool:
    """True when the draft predicts over the whole target vocabulary in the target's order."""
    return draft.cfg.draft_vocab_size == draft.cfg.vocab_size and not bool(draft.d2t.any())


def draft_tensors_for_export(draft: Eagle3Draft) -> dict[str, torch.Tensor]:
    """What the folder holds: the SGLang-named tensors, without `d2t`/`t2d` when the vocabulary
    is the identity. vLLM creates its `draft_id_to_target_id` only when the draft vocabulary is
    smaller than the target's and refuses a `d2t` it has no place for; SGLang treats a missing
    `d2t` as the full vocabulary, and `load_draft` fills the identity back in."""
    tensors = draft_state_dict_for_sglang(draft)
    if has_identity_vocab(draft):
        tensors.pop("d2t")
        tensors.pop("t2d")
    return tensors


def check_draft_weights(weights: dict, reference: dict) -> str | None:
    """What makes `weights` unfit to replace `reference` (a state dict of the same draft), as one
    line, or None: a missing name, a shape that differs (a broadcastable one too), a non-finite value."""
    missing = sorted(set(reference) - set(weights))
    if missing:
        return f"missing tensors {missing[:3]}"
    for name, ref in reference.items():
        w = weights[name]
        if not isinstance(w, torch.Tensor) or tuple(w.shape) != tuple(ref.shape):
            return f"{name} has shape {tuple(getattr(w, 'shape', ()))}, expected {tuple(ref.shape)}"
        if w.is_floating_point() and not bool(torch.isfinite(w).all()):
            return f"{name} has non-finite values"
    return None


@torch.no_grad()
def copy_draft_weights(draft: Eagle3Draft, weights: dict[str, torch.Tensor]) -> None:
    """Copy fresh weights (SGLang names, no embedding) into `draft` in place, so whoever holds the
    module (an engine mid-rollout) sees them at its next step. All or nothing: the weights are
    checked first (check_draft_weights) and refused with a ValueError before anything is copied."""
    state = draft.state_dict()
    problem = check_draft_weights(weights, state)
    if problem is not None:
        raise ValueError(f"draft weights refused: {problem}")
    for name, t in state.items():
        t.copy_(weights[name].to(t.device, t.dtype))


def _write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file(tensors, str(path), metadata={"format": "pt"})


def save_draft(draft: Eagle3Draft, out_dir: str | os.PathLike) -> Path:
    """Write the SGLang EAGLE-3 folder to out_dir (replaced atomically if it exists)."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.cpu() for k, v in draft_tensors_for_export(draft).items()}
    cfg = draft.cfg.to_sglang_config(torch_dtype=_dtype_name(draft.fc.weight.dtype))
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = out.parent / f".{out.name}.tmp-{tag}"
    old = out.parent / f".{out.name}.old-{tag}"
    try:
        tmp.mkdir()
        _write_safetensors(tensors, tmp / WEIGHTS_NAME)
        with open(tmp / CONFIG_NAME, "w") as f:
            json.dump(cfg, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        write_manifest(tmp)
        if out.exists():
            os.rename(out, old)  # keep the previous checkpoint until the new one is in place
        try:
            os.rename(tmp, out)
        except BaseException:
            if old.exists() and not out.exists():
                os.rename(old, out)
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return out


def read_draft_config(path: str | os.PathLike, default_aux_layer_ids=None) -> Eagle3Config:
    file = Path(path) / CONFIG_NAME
    if not file.is_file():
        raise DraftCheckpointError(f"{file}: missing draft config")
    try:
        d = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DraftCheckpointError(f"{file}: unreadable draft config ({e})") from None
    try:
        return Eagle3Config.from_sglang_config(d, default_aux_layer_ids)
    except (Eagle3ConfigError, TypeError, ValueError, AttributeError) as e:
        raise DraftCheckpointError(f"{file}: {e}") from None


def read_draft_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    file = Path(path) / WEIGHTS_NAME
    if not file.is_file():
        raise DraftCheckpointError(f"{file}: missing draft weights")
    try:
        return load_file(str(file))
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DraftCheckpointError(f"{file}: unreadable safetensors ({msg})") from None


def check_draft_against_target(cfg: Eagle3Config, tcfg, where: Path | str = "draft") -> None:
    """Raise DraftCheckpointError naming the first field where the draft does not fit the target."""
    checks = [
        ("target_hidden_size", cfg.target_hidden_size, tcfg.hidden_size, "target hidden_size"),
        ("hidden_size", cfg.hidden_size, tcfg.hidden_size, "target embedding width"),
        ("vocab_size", cfg.vocab_size, tcfg.vocab_size, "target vocab_size"),
        ("eagle_aux_hidden_state_layer_ids", list(cfg.aux_layer_ids), list(tcfg.feature_layer_ids),
         "target feature_layer_ids"),
    ]
    for name, mine, theirs, what in checks:
        if mine != theirs:
            raise DraftCheckpointError(f"{where}: draft {name}={mine} does not match {what}={theirs}")


def load_draft(path: str | os.PathLike, target_model, device=None, dtype=None) -> Eagle3Draft:
    """Load a draft folder for `target_model` (an MoETransformer: reads .cfg and .embed_tokens)."""
    root = Path(path)
    if not root.is_dir():
        raise DraftCheckpointError(f"{root}: no such draft checkpoint folder")
    if (root / MANIFEST).exists():
        try:
            verify_dir(root)
        except CheckpointError as e:
            raise DraftCheckpointError(f"draft {e}") from None
    tcfg = target_model.cfg
    cfg = read_draft_config(root, default_aux_layer_ids=tcfg.feature_layer_ids)
    check_draft_against_target(cfg, tcfg, root / CONFIG_NAME)
    tensors = read_draft_tensors(root)
    for k in _EMBEDDING_KEYS:
        tensors.pop(k, None)
    wfile = root / WEIGHTS_NAME
    fc = tensors.get("fc.weight")
    want_fc = (cfg.hidden_size, 3 * tcfg.hidden_size)
    if fc is not None and tuple(fc.shape) != want_fc:
        raise DraftCheckpointError(f"{wfile}: fc.weight shape {tuple(fc.shape)} does not match "
                                   f"(hidden_size, 3 * target hidden_size) = {want_fc}")
    draft = Eagle3Draft(cfg, target_model.embed_tokens)
    expected = draft.state_dict()
    if cfg.draft_vocab_size == cfg.vocab_size and "d2t" not in tensors and "t2d" not in tensors:
        tensors["d2t"], tensors["t2d"] = expected["d2t"].clone(), expected["t2d"].clone()  # identity (see export)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        raise DraftCheckpointError(f"{wfile}: missing tensors {missing[:5]}")
    if unexpected:
        raise DraftCheckpointError(f"{wfile}: unexpected tensors {unexpected[:5]}")
    for name, t in expected.items():
        if tuple(tensors[name].shape) != tuple(t.shape):
            raise DraftCheckpointError(f"{wfile}: {name} shape {tuple(tensors[name].shape)} != expected "
                                       f"{tuple(t.shape)} from {CONFIG_NAME}")
    problem = check_vocab(tensors["d2t"].to(torch.long), tensors["t2d"].to(torch.bool),
                          cfg.vocab_size, cfg.draft_vocab_size)
    if problem:
        raise DraftCheckpointError(f"{wfile}: {problem}")
    if not all(bool(torch.isfinite(t).all()) for n, t in tensors.items() if t.is_floating_point()):
        raise DraftCheckpointError(f"{wfile}: non-finite weights")
    tensors["d2t"] = tensors["d2t"].to(torch.long)
    tensors["t2d"] = tensors["t2d"].to(torch.bool)
    draft.load_state_dict(tensors, strict=True)
    draft.to(device=device if device is not None else target_model.embed_tokens.weight.device, dtype=dtype)
    return draft
