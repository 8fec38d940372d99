"""Compiled decode and verify forwards of the target (`EngineConfig.compile_forwards`).

Why static graphs: on a small model a forward is hundreds of small ops, and the time goes to
dispatching them. `torch.compile` (inductor) fuses them, but only pays when the graph is whole
and fixed; a graph break or a dynamic shape gives most of the gain back
(experiments/compile_target.py, docs/results.md "Compiled forwards"). So a block runs compiled only when
nothing in it is dynamic:

  - the MoE takes the read-free dense dispatch (no host read of group sizes, no graph break),
    so a compiled block holds at most MoE.DENSE_DISPATCH_MAX_TOKENS tokens;
  - every block reads the whole cache (key_len = the cache length): keys past a row's block
    are masked, so it is the same attention over a fixed number of keys;
  - one graph per argument shape the engine meets (rows, block length, mask, positions, taps),
    compiled on first use (`dynamic=False`, `fullgraph=True`).

and only where that pays on the CPU it was tuned on: blocks of at most MAX_ROWS rows (the gain
is dispatch overhead saved, which shrinks as rows grow, while the dense dispatch's extra expert
FLOPs grow; past MAX_ROWS a compiled forward is no faster than eager). Prompts (prefill, alone
or riding along) and larger blocks run eagerly. The draft stays eager: compiling its chain
steps the same way gave a small, unsteady gain at a few rows and a loss at more
(docs/results.md "Compiled forwards", experiments/compile_draft.py's `static` arm).

If compiling or running a shape fails, that shape runs eagerly from then on, the error is
kept in `failures` and a RuntimeWarning names the shape and the error (once per shape): the
compiled path can make a step faster, never stop a rollout. Weights are graph inputs, so a
policy sync (in place) reaches the graphs. Compiled and eager forwards agree
to rounding (the dense dispatch and inductor's fusions reorder float sums), which the tests
check on whole rollouts: same tokens, log-probs within 1e-5.
"""
from __future__ import annotations

import warnings

import torch

from target_training.model import MoE, ModelOutput, MoETransformer

MAX_ROWS = 4  # most rows of a compiled block: past it a compiled forward is no faster than eager
RECOMPILE_LIMIT = 512  # graphs per engine: a decode and a verify shape for every row count, plus masks


def _key(value):
    """What a graph is specialised on: a tensor's shape and dtype, any other argument itself."""
    return ("tensor", tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else value


class CompiledForwards:
    """The target's cached forward, compiled per block shape, with eager fallback."""

    def __init__(self, model: MoETransformer):
        self.model = model
        self._compiled = torch.compile(model.forward, dynamic=False, fullgraph=True)
        self.shapes: set[tuple] = set()  # shapes run compiled at least once
        self.failures: dict[tuple, str] = {}  # shape -> the error that sent it back to eager

    def takes(self, input_ids: torch.Tensor) -> bool:
        """Whether a block of these ids is one the compiled path runs (before any failure)."""
        B, T = input_ids.shape
        return B <= MAX_ROWS and B * T <= MoE.DENSE_DISPATCH_MAX_TOKENS

    def __call__(self, input_ids: torch.Tensor, *, cache, eager, **kwargs) -> ModelOutput:
        """model(input_ids, cache=cache, **kwargs) on a block that reads the whole cache
        (key_len = cache.max_len, dense dispatch); `eager()` runs the block as the caller would
        have, for blocks the compiled path does not take and after a failure."""
        if not self.takes(input_ids):
            return eager()
        shape = (_key(input_ids), *((k, _key(v)) for k, v in sorted(kwargs.items())))
        if shape in self.failures:
            return eager()
        lengths = cache.lengths.clone()
        try:
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                out = self._compiled(input_ids, cache=cache, key_len=cache.max_len, moe_dispatch="dense", **kwargs)
        except Exception as err:  # compile or run failed: this shape is eager from now on
            self.failures[shape] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            warnings.warn(f"compiled target forward failed for block shape {shape}; that shape runs eagerly "
                          f"from now on ({self.failures[shape]})", RuntimeWarning)
            cache.lengths.copy_(lengths)  # a block that failed part-way leaves the slots as they were
            return eager()
        self.shapes.add(shape)
        return out
