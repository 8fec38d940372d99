"""Compiled decode, verify and draft forwards for the embedded engine (`EngineConfig.compile_forwards`).

Why static graphs: on a small model every forward is hundreds of small ops, and the time goes
to dispatching them. `torch.compile` (inductor) fuses them, but only pays when the graph is
whole and fixed: a graph break or a dynamic shape gives most of the gain back (see
experiments/compile_target.py and the README). So a block is compiled only when nothing in it
is dynamic:

  - the target's MoE takes the read-free dense dispatch (no host read of group sizes, no
    break), which limits its compiled blocks to MoE.DENSE_DISPATCH_MAX_TOKENS tokens;
  - every block reads the whole cache (key_len = the cache length): keys past a row's block
    are masked, so it is the same attention over a fixed number of keys;
  - one graph per argument shape the engine meets (batch, block length, mask, positions,
    taps), compiled on first use (`dynamic=False`, `fullgraph=True`).

What runs compiled: the target's decode and verify blocks and the draft's chain and tree steps.
What stays eager: prompts (prefill, alone or riding along), the draft's catch-up over pending
features (its length varies every step), and target blocks above the dense size. If compiling
or running a shape fails, that shape runs eagerly from then on and the error is kept in
`failures`: the compiled path can make a step faster, never stop a rollout. Weights are graph
inputs, so a policy sync or a draft hot swap (in place) reaches the compiled graphs. Compiled
and eager forwards agree to rounding (the dense dispatch and inductor's fusions reorder float
sums), which the tests check on whole rollouts: same tokens, log-probs within 1e-5.
"""
from __future__ import annotations

import torch

# graphs per module: batch sizes 1..max_batch for each block length the engine meets, plus masks
RECOMPILE_LIMIT = 512


def _key(value):
    """What a graph is specialised on: a tensor's shape and dtype, any other argument itself."""
    return ("tensor", tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else value


class CompiledForwards:
    """A module's cached forward (the target's or the draft's), compiled per block shape, with
    eager fallback. `max_tokens`: blocks with more input ids run eagerly; `fixed`: keyword
    arguments every compiled call gets (the target's moe_dispatch="dense")."""

    def __init__(self, module: torch.nn.Module, max_tokens: int | None = None, **fixed):
        self.module, self.max_tokens, self.fixed = module, max_tokens, fixed
        self._compiled = torch.compile(module.forward, dynamic=False, fullgraph=True)
        self.shapes: set[tuple] = set()  # shapes run compiled at least once
        self.failures: dict[tuple, str] = {}  # shape -> the error that sent it back to eager

    def __call__(self, input_ids: torch.Tensor, *args, cache, eager, **kwargs):
        """module(input_ids, *args, cache=cache, **kwargs) on a block that reads the whole cache
        (key_len = cache.max_len); `eager()` runs the block as the caller would have, for blocks
        the compiled path does not take and after a failure."""
        shape = (_key(input_ids), *map(_key, args), *((k, _key(v)) for k, v in sorted(kwargs.items())))
        if (self.max_tokens is not None and input_ids.numel() > self.max_tokens) or shape in self.failures:
            return eager()
        lengths = cache.lengths.clone()
        try:
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                out = self._compiled(input_ids, *args, cache=cache, key_len=cache.max_len, **self.fixed, **kwargs)
        except Exception as err:  # compile or run failed: this shape is eager from now on
            self.failures[shape] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            cache.lengths.copy_(lengths)  # a block that failed part-way leaves the slots as they were
            return eager()
        self.shapes.add(shape)
        return out


def compiled_target(model) -> CompiledForwards:
    """The target's decode and verify blocks: the read-free dense MoE dispatch (no graph break),
    so at most MoE.DENSE_DISPATCH_MAX_TOKENS tokens per compiled block."""
    from target_training.model import MoE

    return CompiledForwards(model, MoE.DENSE_DISPATCH_MAX_TOKENS, moe_dispatch="dense")
