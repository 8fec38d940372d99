"""CPU shims for Megatron-core 0.16, so the Megatron backend runs forward, backward and optimizer
steps on CPU (fp32) when the policy is built for CPU (`MegatronConfig.device == "cpu"`), whether
or not the machine has CUDA.

Why: Megatron-core assumes CUDA in a few hard-coded lines even with use_cpu_initialization. Each
shim replaces one of them and nothing else (numbers as in target_training/megatron_backend.py):
  1. `RotaryEmbedding.get_emb` moves `inv_freq` to `torch.cuda.current_device()`;
  2. `Router.gating` moves the router weight to CUDA and calls the Transformer-Engine GEMM;
  3. `GlobalMemoryBuffer.get_tensor` (the attention score buffer) allocates on CUDA;
  4. the RNG tracker (`CudaRNGStatesTracker.add/fork`) saves CUDA RNG states.
Installed by `megatron_config.MegatronConfig.build` and `megatron_config.initialize_parallel`
for a CPU config only; a CUDA config uses Megatron's own code paths.
"""
from __future__ import annotations

import contextlib
import math
import types

import torch
import torch.nn.functional as F

from target_training.config import ConfigError


def _cpu_memory_buffer():
    from megatron.core.utils import GlobalMemoryBuffer

    class CpuMemoryBuffer(GlobalMemoryBuffer):
        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
            n = math.prod(tensor_shape)
            buf = self.buffer.get((name, dtype))
            if buf is None or buf.numel() < n:
                buf = self.buffer[(name, dtype)] = torch.empty(n, dtype=dtype)
            return buf[:n].view(*tensor_shape)

    return CpuMemoryBuffer()


def _install_cpu_rng_tracker(seed: int) -> None:
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Same bookkeeping as Megatron's tracker, on the CPU default generator."""

        def add(self, name, seed):
            if seed in self.seeds_ or name in self.states_:
                raise ValueError(f"RNG state {name!r} or seed {seed} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise ValueError(f"RNG state {name!r} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    tracker = CpuRNGStatesTracker()
    # Same three streams and seeds as model_parallel_cuda_manual_seed at rank 0 of each group.
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024)
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _patch_model_for_cpu(model) -> None:
    from megatron.core.transformer.moe.router import Router

    def get_emb(self, max_seq_len, offset=0):  # shim 1: RotaryEmbedding.get_emb without .cuda()
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)  # (S, D/2)
        if self.rotary_interleaved:
            raise ConfigError("interleaved RoPE is not used by specrl")
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]  # (S, 1, 1, D) rotate-half

    def gating(self, inp):  # shim 2: Router.gating without the CUDA move and the TE GEMM
        dt = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, inp.dtype)
        return F.linear(inp.to(dt), self.weight.to(dt), None if self.bias is None else self.bias.to(dt))

    if getattr(model, "rotary_pos_emb", None) is not None:
        model.rotary_pos_emb.get_emb = types.MethodType(get_emb, model.rotary_pos_emb)
    for m in model.modules():
        if isinstance(m, Router):
            m.gating = types.MethodType(gating, m)
