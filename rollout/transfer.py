"""Host-device traffic of an engine step: what goes up, what comes back, and when it waits.

On an accelerator, a copy from pageable host memory or a read of a device value into Python
waits for every queued kernel: a stream synchronisation in the middle of a step. The embedded
engine keeps its steps free of them but for the one hand-back of results per step:

- `upload`: a step's host integers (slot ids, last tokens, lengths, request ids) packed into one
  pinned host buffer and copied without blocking the host (one copy per call, queued behind the
  step's kernels like any other op).
- `download`: a step's captured features copied into pinned host memory without blocking;
  nothing reads them until `settle` (once, when the rollout's trajectories are built).
- `hand_back`: the step's results read into Python in one transfer, the step's one wait.

On the CPU the same calls are plain tensor builds and copies (no pinning, no stream).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch


def upload(*values: Sequence, device) -> tuple[torch.Tensor, ...]:
    """One int64 tensor on `device` per argument, shaped like it (a list (n,) or a rectangular
    list of lists (n, m)), all sent in one non-blocking copy from one pinned host buffer. The
    results are disjoint views of that copy."""
    device = torch.device(device)
    flat: list[int] = []
    shapes = []
    for v in values:
        if len(v) and isinstance(v[0], (list, tuple)):
            shapes.append((len(v), len(v[0])))
            for row in v:
                flat.extend(row)
        else:
            shapes.append((len(v),))
            flat.extend(v)
    on_host = device.type == "cpu"
    buf = torch.tensor(flat, dtype=torch.long, pin_memory=not on_host and torch.cuda.is_available())
    if not on_host:
        buf = buf.to(device, non_blocking=True)
    out, start = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(buf[start:start + n].view(shape))
        start += n
    return tuple(out)


def download(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`x` (cast to `dtype`) in host memory, copied without blocking the host (into pinned
    memory) from an accelerator: read it only after `settle`. On the CPU it is `x` itself when
    no cast is needed: treat the result as read-only."""
    return x.to(device="cpu", dtype=dtype or x.dtype, non_blocking=x.device.type != "cpu")


def settle(device) -> None:
    """Wait for every queued copy to `device`'s host memory (`download`) to land."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hand_back(*columns: torch.Tensor) -> list[list[float]]:
    """A step's results, columns (B,) or (B, k) side by side, read to the host in one transfer:
    the step's hand-back, a sync on an accelerator. float64 holds every token id and count
    exactly (integers below 2**53) next to the log-probs."""
    return torch.cat([c.reshape(c.shape[0], -1).double() for c in columns], 1).tolist()
