"""Megatron-core backend for the MoE policy: the same model, trained by Megatron at scale.

Why: the plain-PyTorch `MoETransformer` is the reference (the engine, the tests and the CPU runs
use it); large runs train the policy with Megatron-core (tensor and expert parallelism, its
distributed optimizer), as slime/Miles and NeMo-RL do. This module keeps the two exactly
interchangeable:

- `MegatronConfig.transformer_config(moe)` (`target_training.megatron_config`) translates `MoEConfig` into a Megatron
  `TransformerConfig` (RMSNorm, SwiGLU as gated_linear_unit + silu, GQA as num_query_groups,
  QK-norm, RoPE, top-k softmax router with the Switch load-balancing loss, dense first layer
  through moe_layer_freq, untied embeddings); `build(moe)` makes a `GPTModel` from the local
  (non-Transformer-Engine) layer specs.
- `specrl_to_megatron` / `megatron_to_specrl` (`target_training.megatron_convert`) convert weights
  both ways, exactly (a permutation and concatenation, no arithmetic); HF checkpoint names are
  `target_training.hf_adapter`'s, the one HF <-> specrl converter.
- `MegatronPolicy` wraps the GPTModel so that it returns specrl's `ModelOutput` (logits, final
  hidden, EAGLE-3 taps captured by forward hooks on `decoder.layers`), so `grpo.GRPOTrainer` and
  the co-training feature hooks run unchanged on it; `grpo_step` is the same update (`grpo.grpo_update`)
  for Megatron's own (distributed) optimizer.

Load-balancing loss: Megatron attaches it to the router probabilities in training mode
(MoEAuxLossAutoScaler) with `moe_aux_loss_coeff`, so its gradient arrives with the policy loss's
backward; `MegatronPolicy` therefore reports aux_loss = 0 to avoid counting it twice. Megatron's
formula, coeff * E * sum_e(mean prob_e * tokens_e / (N * k)), is specrl's per layer, so the
gradients match (tests/test_megatron_backend.py).

This module keeps the policy wrapper, its feature taps and the GRPO step; the configuration, the
CPU shims and the converters live in `megatron_config`, `megatron_cpu` and `megatron_convert`,
and their public names are re-exported here.

CPU: Megatron-core 0.16 assumes CUDA in a few places even with use_cpu_initialization. For a
policy built for CPU (`MegatronConfig.device == "cpu"`, whether or not the machine has CUDA),
`initialize_parallel` and `build` install narrow shims, each for one hard-coded line, and
nothing else changes (a "cuda" config installs none of them):
  1. `RotaryEmbedding.get_emb` moves `inv_freq` to `torch.cuda.current_device()`;
  2. `Router.gating` moves the router weight to CUDA, and `router_gating_linear` references the
     Transformer-Engine GEMM unguarded (NameError without TE): the shim is the same linear map;
  3. `GlobalMemoryBuffer.get_tensor` (the attention score buffer) allocates on CUDA;
  4. the RNG tracker (`CudaRNGStatesTracker.add/fork`, used for dropout) saves CUDA RNG states:
     a tracker with the same interface forks the CPU generator instead;
  5. `get_default_causal_mask` builds its mask on "cuda": `MegatronPolicy` always passes an
     explicit causal mask instead;
  6. the "alltoall" token dispatcher creates a `torch.cuda.Stream`: CPU configs use "allgather".
With these, forward, backward and torch-optimizer steps run on CPU in fp32. Megatron's own
optimizer (`get_megatron_optimizer` over its DistributedDataParallel grad buffers) targets CUDA
and is exercised only by the GPU test.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from target_training.config import MoEConfig
from target_training.grpo import GRPOConfig, grpo_update
from target_training.megatron_config import (MegatronBackendError, MegatronConfig, _megatron,  # noqa: F401
                                             destroy_parallel, initialize_parallel)
from target_training.megatron_convert import (load_megatron_weights, megatron_to_specrl,  # noqa: F401
                                              specrl_to_megatron)
from target_training.model import ModelOutput


class FeatureTaps:
    """Forward hooks on the tapped `model.decoder.layers` that keep each tapped layer's output:
    the one Megatron feature tap (MegatronPolicy's ModelOutput.taps, slime's log-prob capture).

    Layers are found by Megatron's 1-based `layer_number` (global, so a pipeline stage holding
    layers 8..15 is tapped by the same ids), falling back to the position in `decoder.layers`.
    Megatron's TransformerLayer returns (hidden (T, B, H), context); with `seq_first` the hook
    stores (B, T, H), the tensor specrl's `ModelOutput.taps[i]` holds (the residual stream after
    layer i). `when()` false (e.g. a disarmed capture) skips the store; nothing else is done."""

    def __init__(self, model, layer_ids: Sequence[int], *, seq_first: bool = True, when=None):
        self.layer_ids = tuple(int(i) for i in layer_ids)
        self.seq_first, self.when = seq_first, when
        self.taps: dict[int, torch.Tensor] = {}
        layers = model.decoder.layers
        by_id = {int(getattr(layer, "layer_number", i + 1)) - 1: layer for i, layer in enumerate(layers)}
        missing = [i for i in self.layer_ids if i not in by_id]
        if missing:
            raise MegatronBackendError(f"tap layers {missing} are not on this rank (have {sorted(by_id)}); "
                                       f"pipeline parallelism must keep the taps on one stage")
        self._handles = [by_id[i].register_forward_hook(self._hook(i)) for i in sorted(set(self.layer_ids))]

    def _hook(self, i: int):
        def hook(module, args, output):
            if self.when is not None and not self.when():
                return
            hidden = output[0] if isinstance(output, tuple) else output
            self.taps[i] = hidden.transpose(0, 1) if self.seq_first else hidden  # (T, B, H) -> (B, T, H)
        return hook

    def features(self) -> torch.Tensor:
        """EAGLE-3 fused feature (B, T, 3H) of the last forward."""
        return torch.cat([self.taps[i] for i in self.layer_ids], dim=-1)

    def clear(self) -> None:
        self.taps = {}

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class MegatronPolicy(torch.nn.Module):
    """A GPTModel behind specrl's policy interface: `forward(input_ids, tap_layers=())` ->
    `ModelOutput`, so `GRPOTrainer`, its log-prob hooks and `capture_features` take it as is.
    Full causal forwards only (training and log-prob recomputation): the KV cache and tree masks
    stay with the embedded engine, which receives weights through `megatron_to_specrl`."""

    def __init__(self, model, cfg: MoEConfig):
        super().__init__()
        self.model = model
        self.cfg = cfg
        self._final = {}
        model.decoder.final_layernorm.register_forward_hook(lambda m, a, o: self._final.__setitem__("h", o))

    def forward(self, input_ids: torch.Tensor, *, tap_layers=(), cache=None, slots=None, positions=None,
                attn_mask=None, logits_at: torch.Tensor | None = None) -> ModelOutput:
        """MoETransformer.forward's contract for full causal forwards; with `logits_at` the logits are
        the (N, V) rows at those positions, picked from Megatron's output layer's (B, T, V)."""
        if cache is not None or slots is not None or attn_mask is not None:
            raise MegatronBackendError("MegatronPolicy runs full causal forwards only (no cache, no explicit mask)")
        B, T = input_ids.shape
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {T} tokens exceeds max_seq_len {self.cfg.max_seq_len}")
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        # Megatron's mask is True where attention is *blocked*; explicit so no CUDA default is built.
        causal = torch.ones(T, T, dtype=torch.bool, device=input_ids.device).triu(1)[None, None]  # (1, 1, T, T)
        taps = FeatureTaps(self.model, tap_layers) if tap_layers else None
        try:
            logits = self.model(input_ids, positions, causal)  # (B, T, V)
        finally:
            if taps is not None:
                taps.remove()
        hidden = self._final.pop("h").transpose(0, 1)  # (B, T, H)
        # The load-balancing loss is already attached to the router's autograd graph (see the
        # module docstring): report 0 so GRPOTrainer does not add it a second time.
        if logits_at is not None:
            logits = logits[logits_at]
        return ModelOutput(logits=logits, hidden=hidden, taps=taps.taps if taps else {},
                           aux_loss=logits.new_zeros((), dtype=torch.float32), expert_counts=None)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def grpo_step(policy: MegatronPolicy, optimizer, trajectories, rewards, group_size: int, config: GRPOConfig,
              *, before_backward=None) -> dict:
    """One on-policy GRPO update (ppo_epochs 1, whole batch; `grpo.grpo_update`) with any
    optimizer exposing zero_grad() and step(): Megatron's distributed optimizer (whose step()
    clips with its own clip_grad and returns (ok, grad_norm, zeros)) or a torch optimizer.
    No router-loss term is added: Megatron attaches it to the router's graph itself.
    `before_backward` lets the caller zero Megatron's DDP grad buffers."""
    def apply_gradients(loss: torch.Tensor) -> float | None:
        optimizer.zero_grad()
        if before_backward is not None:
            before_backward()
        loss.backward()
        result = optimizer.step()
        if isinstance(result, tuple) and len(result) >= 2 and result[1] is not None:
            return float(result[1])
        return None

    cfg = dataclasses.replace(config, ppo_epochs=1, minibatch_size=0, old_logprobs="trainer")
    return grpo_update(policy, trajectories, rewards, group_size, cfg, apply_gradients)
