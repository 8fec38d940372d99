"""Which attention kernel the embedded model uses: flash-attn where it applies, else SDPA.

Why: on a GPU, flash-attn's fused causal kernel is the fastest path for the full forwards that
dominate training and log-prob recomputation (GRPO's forward, feature capture, prefill without a
cache). It covers only part of what `model.attend` must do, so the choice is per call:

  flash   when flash_attn imports, q is on CUDA, the dtype is fp16/bf16, head_dim <= 256 and the
          mask is plain causal (mask None). GQA is native (k/v keep their fewer heads).
  sdpa    everything else: CPU, fp32, explicit masks (tree verification, draft trees, and every
          KV-cache block, whose per-slot lengths live in a materialised mask).

The cached decode path could use `flash_attn_with_kvcache` (per-slot `cache_seqlens`), but the
slot lengths are known to `CacheBlock`, not to `attend`, which sees only the mask; wiring it is a
change to the cache planner and is left out here (docs/scale-out.md).

The preference is process-wide: "auto" (default), "sdpa" (never flash) or "flash" (must use
flash where the mask allows it, and fail loudly if flash_attn is missing), from
`set_attention_backend` or the SPECRL_ATTENTION environment variable.
"""
from __future__ import annotations

import functools
import os

import torch

BACKENDS = ("auto", "sdpa", "flash")
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_MAX_FLASH_HEAD_DIM = 256


class AttentionBackendError(RuntimeError):
    """The requested attention backend cannot run here (one-line message)."""


@functools.lru_cache(maxsize=1)
def flash_available() -> bool:
    """flash_attn importable (and so built for this torch/CUDA)."""
    try:
        import flash_attn  # noqa: F401
    except Exception:  # noqa: BLE001 - ImportError, or a broken build raising OSError/RuntimeError
        return False
    return True


def _check(name: str) -> str:
    if name not in BACKENDS:
        raise AttentionBackendError(f"attention backend must be one of {list(BACKENDS)}, got {name!r}")
    if name == "flash" and not flash_available():
        raise AttentionBackendError("attention backend 'flash' requested but flash_attn is not installed "
                                    "(pip install flash-attn on a CUDA machine), use 'auto' or 'sdpa'")
    return name


_preference: str | None = None  # None: read SPECRL_ATTENTION on first use


def set_attention_backend(name: str) -> None:
    global _preference
    _preference = _check(name)


def get_attention_backend() -> str:
    global _preference
    if _preference is None:
        _preference = _check(os.environ.get("SPECRL_ATTENTION", "auto"))
    return _preference


def flash_unsupported_reason(q: torch.Tensor, mask: torch.Tensor | None) -> str | None:
    """None if flash-attn can compute this call, else why not. q (B, T, H, D)."""
    if not flash_available():
        return "flash_attn is not installed"
    if q.dtype not in _FLASH_DTYPES:
        return f"dtype {q.dtype} (flash-attn needs float16 or bfloat16)"
    if q.shape[-1] > _MAX_FLASH_HEAD_DIM:
        return f"head_dim {q.shape[-1]} > {_MAX_FLASH_HEAD_DIM}"
    if mask is not None:
        return "an explicit attention mask (flash-attn runs plain causal attention only)"
    if not q.is_cuda:
        return f"q is on {q.device.type}, flash-attn needs CUDA"
    return None


def select(q: torch.Tensor, mask: torch.Tensor | None) -> str:
    """'flash' or 'sdpa' for this call under the current preference."""
    pref = get_attention_backend()
    if pref == "sdpa" or not q.is_cuda:  # CPU: no import attempt, no extra work in the hot path
        if pref == "flash" and mask is None:
            raise AttentionBackendError(f"attention backend 'flash' forced but {flash_unsupported_reason(q, mask)}")
        return "sdpa"
    reason = flash_unsupported_reason(q, mask)
    if reason is None:
        return "flash"
    if pref == "flash" and mask is None:
        raise AttentionBackendError(f"attention backend 'flash' forced but {reason}")
    return "sdpa"


def flash_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q (B, T, H, D), k/v (B, T, Hkv, D) -> (B, T, H*D), causal, softmax scale 1/sqrt(D)."""
    from flash_attn import flash_attn_func

    B, T = q.shape[:2]
    return flash_attn_func(q, k, v, causal=True).reshape(B, T, -1)
