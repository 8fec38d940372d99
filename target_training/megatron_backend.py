"""Megatron-core backend for the MoE policy: the same model, trained by Megatron at scale.

Why: the plain-PyTorch `MoETransformer` is the reference (the engine, the tests and the CPU runs
use it); large runs train the policy with Megatron-core (tensor and expert parallelism, its
distributed optimizer), as slime/Miles and NeMo-RL do. This module keeps the two exactly
interchangeable:

- `MegatronConfig.transformer_config(moe)` translates `MoEConfig` into a Megatron
  `TransformerConfig` (RMSNorm, SwiGLU as gated_linear_unit + silu, GQA as num_query_groups,
  QK-norm, RoPE, top-k softmax router with the Switch load-balancing loss, dense first layer
  through moe_layer_freq, untied embeddings); `build(moe)` makes a `GPTModel` from the local
  (non-Transformer-Engine) layer specs.
- `specrl_to_megatron` / `megatron_to_specrl` convert weights both ways, exactly (a permutation
  and concatenation, no arithmetic), and `specrl_to_hf` / `hf_to_specrl` give the Qwen3-MoE
  checkpoint names (per-expert tensors) for free on the way.
- `MegatronPolicy` wraps the GPTModel so that it returns specrl's `ModelOutput` (logits, final
  hidden, EAGLE-3 taps captured by forward hooks on `decoder.layers`), so `grpo.GRPOTrainer` and
  the co-training feature hooks run unchanged on it; `grpo_step` is the update for Megatron's own
  (distributed) optimizer, built on the same `token_logprobs` / `grpo_loss`.

Load-balancing loss: Megatron attaches it to the router probabilities in training mode
(MoEAuxLossAutoScaler) with `moe_aux_loss_coeff`, so its gradient arrives with the policy loss's
backward; `MegatronPolicy` therefore reports aux_loss = 0 to avoid counting it twice. Megatron's
formula, coeff * E * sum_e(mean prob_e * tokens_e / (N * k)), is specrl's per layer, so the
gradients match (tests/test_megatron_backend.py).

CPU: Megatron-core 0.16 assumes CUDA in a few places even with use_cpu_initialization. On a
machine without CUDA, `initialize_parallel` and `build` install narrow shims, each for one
hard-coded line, and nothing else changes:
  1. `RotaryEmbedding.get_emb` moves `inv_freq` to `torch.cuda.current_device()`;
  2. `Router.gating` moves the router weight to CUDA, and `router_gating_linear` references the
     Transformer-Engine GEMM unguarded (NameError without TE): the shim is the same linear map;
  3. `GlobalMemoryBuffer.get_tensor` (the attention score buffer) allocates on CUDA;
  4. the RNG tracker (`CudaRNGStatesTracker.add/fork`, used for dropout) saves CUDA RNG states:
     a tracker with the same interface forks the CPU generator instead;
  5. `get_default_causal_mask` builds its mask on "cuda": `MegatronPolicy` always passes an
     explicit causal mask instead;
  6. the "alltoall" token dispatcher creates a `torch.cuda.Stream`: CPU runs use "allgather".
With these, forward, backward and torch-optimizer steps run on CPU in fp32. Megatron's own
optimizer (`get_megatron_optimizer` over its DistributedDataParallel grad buffers) targets CUDA
and is exercised only by the GPU test.
"""
from __future__ import annotations

import contextlib
import math
import re
import types
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from target_training.config import ConfigError, MoEConfig
from target_training.grpo import GRPOConfig, group_advantages, grpo_loss, pack_batch, token_logprobs
from target_training.model import ModelOutput

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DISPATCHERS = ("allgather", "alltoall")


class MegatronBackendError(ConfigError):
    """The Megatron backend cannot run with these settings (one-line message)."""


def _megatron():
    try:
        from megatron.core import parallel_state  # noqa: F401
    except ImportError as e:  # pragma: no cover - the dist extra is optional
        raise MegatronBackendError("megatron-core is not installed; pip install -e '.[dist]'") from e
    import megatron.core as mcore

    return mcore


# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------
@dataclass
class MegatronConfig:
    """Parallel layout and numerics of the Megatron policy; the architecture comes from MoEConfig."""

    tensor_parallel: int = 1
    expert_parallel: int = 1
    pipeline_parallel: int = 1  # only 1: the policy is small enough per stage in specrl's runs
    params_dtype: str = "float32"  # float32 | bfloat16 | float16
    token_dispatcher: str = "allgather"  # "alltoall" is faster with expert parallelism, CUDA only
    seed: int = 1234

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "expert_parallel", "pipeline_parallel"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise MegatronBackendError(f"MegatronConfig.{name} must be a positive integer, got {v!r}")
        if self.pipeline_parallel != 1:
            raise MegatronBackendError(f"MegatronConfig.pipeline_parallel must be 1 (pipeline stages are not "
                                       f"wired into the feature taps yet), got {self.pipeline_parallel}")
        if self.params_dtype not in _DTYPES:
            raise MegatronBackendError(f"MegatronConfig.params_dtype must be one of {sorted(_DTYPES)}, "
                                       f"got {self.params_dtype!r}")
        if self.token_dispatcher not in _DISPATCHERS:
            raise MegatronBackendError(f"MegatronConfig.token_dispatcher must be one of {list(_DISPATCHERS)}, "
                                       f"got {self.token_dispatcher!r}")

    def check(self, moe: MoEConfig) -> None:
        """Layout constraints that involve the model's sizes, and architecture options (from other
        model families) that this translation does not cover yet."""
        for name, default in (("attention_bias", False), ("attention_out_bias", False),
                              ("shared_expert_intermediate_size", 0)):
            if getattr(moe, name, default) != default:
                raise MegatronBackendError(f"MoEConfig.{name}={getattr(moe, name)!r} is not supported by the "
                                           f"Megatron backend yet")
        if moe.num_kv_heads % self.tensor_parallel:
            raise MegatronBackendError(f"MoEConfig.num_kv_heads ({moe.num_kv_heads}) must be divisible by "
                                       f"MegatronConfig.tensor_parallel ({self.tensor_parallel})")
        if moe.num_experts % self.expert_parallel:
            raise MegatronBackendError(f"MoEConfig.num_experts ({moe.num_experts}) must be divisible by "
                                       f"MegatronConfig.expert_parallel ({self.expert_parallel})")
        if moe.vocab_size % self.tensor_parallel:
            raise MegatronBackendError(f"MoEConfig.vocab_size ({moe.vocab_size}) must be divisible by "
                                       f"MegatronConfig.tensor_parallel ({self.tensor_parallel})")
        if self.token_dispatcher == "alltoall" and not torch.cuda.is_available():
            raise MegatronBackendError("MegatronConfig.token_dispatcher 'alltoall' needs CUDA "
                                       "(it creates a torch.cuda.Stream); use 'allgather' on CPU")

    def transformer_config(self, moe: MoEConfig):
        """MoEConfig -> megatron.core TransformerConfig (same architecture, this layout)."""
        self.check(moe)
        _megatron()
        from megatron.core.transformer.transformer_config import TransformerConfig

        cpu = not torch.cuda.is_available()
        moe_layer_freq = [0 if _is_dense_layer(moe, i) else 1 for i in range(moe.num_layers)]
        return TransformerConfig(
            num_layers=moe.num_layers,
            hidden_size=moe.hidden_size,
            num_attention_heads=moe.num_heads,
            num_query_groups=moe.num_kv_heads,  # GQA
            kv_channels=moe.head_dim,
            ffn_hidden_size=moe.dense_intermediate_size,  # the dense first layer
            normalization="RMSNorm",
            layernorm_epsilon=moe.rms_eps,
            qk_layernorm=_qk_norm(moe),
            gated_linear_unit=True,  # SwiGLU: silu(x W_gate) * (x W_up), fc1 = [gate; up]
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            # MoE
            num_moe_experts=moe.num_experts,
            moe_ffn_hidden_size=moe.expert_intermediate_size,
            moe_router_topk=moe.top_k,
            moe_layer_freq=moe_layer_freq,
            # norm_topk_prob: top-k over logits then softmax over the k (= renormalised top-k probs);
            # otherwise softmax over all experts, then top-k (unnormalised), Megatron's pre-softmax.
            moe_router_pre_softmax=not moe.norm_topk_prob,
            moe_router_score_function="softmax",
            moe_router_load_balancing_type="aux_loss" if moe.router_aux_loss_coef > 0 else "none",
            moe_aux_loss_coeff=moe.router_aux_loss_coef,
            moe_router_dtype="fp32",  # specrl's router softmax is fp32 too
            moe_grouped_gemm=False,
            moe_token_dispatcher_type=self.token_dispatcher,
            moe_expert_capacity_factor=None,  # dropless, like specrl
            # layout and numerics
            tensor_model_parallel_size=self.tensor_parallel,
            expert_model_parallel_size=self.expert_parallel,
            pipeline_model_parallel_size=1,
            sequence_parallel=False,
            params_dtype=_DTYPES[self.params_dtype],
            bf16=self.params_dtype == "bfloat16",
            fp16=self.params_dtype == "float16",
            use_cpu_initialization=cpu,
            # fused kernels are CUDA/Apex only
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            masked_softmax_fusion=False,
            gradient_accumulation_fusion=False,
            persist_layer_norm=False,
        )

    def build(self, moe: MoEConfig):
        """A GPTModel with the local (non-TE) layer specs; parallel state must be initialised."""
        mcore = _megatron()
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        if not mcore.parallel_state.model_parallel_is_initialized():
            raise MegatronBackendError("Megatron parallel state is not initialised; call "
                                       "megatron_backend.initialize_parallel(config) first")
        tcfg = self.transformer_config(moe)
        # Per-layer local specs (get_gpt_layer_local_spec with num_experts=None for the dense first
        # layer, num_experts=E, moe_grouped_gemm=False, qk_layernorm=True for the MoE layers).
        spec = get_gpt_decoder_block_spec(tcfg, use_transformer_engine=False, normalization="RMSNorm")
        model = GPTModel(config=tcfg, transformer_layer_spec=spec, vocab_size=moe.vocab_size,
                         max_sequence_length=moe.max_seq_len, position_embedding_type="rope",
                         rotary_percent=1.0, rotary_base=int(moe.rope_theta),
                         share_embeddings_and_output_weights=moe.tie_embeddings,
                         pre_process=True, post_process=True)
        if not torch.cuda.is_available():
            _patch_model_for_cpu(model)
        return model


# ---------------------------------------------------------------------------------------------
# parallel state and the CPU shims (see the module docstring for why each exists)
# ---------------------------------------------------------------------------------------------
def initialize_parallel(config: MegatronConfig) -> None:
    """Megatron's process groups on the current torch.distributed group, and its RNG trackers.

    torch.distributed must already be initialised (gloo on CPU, nccl on GPU); the world size
    must be a multiple of tensor_parallel and of expert_parallel. Idempotent."""
    mcore = _megatron()
    ps = mcore.parallel_state
    if not torch.distributed.is_initialized():
        raise MegatronBackendError("torch.distributed is not initialised; call "
                                   "torch.distributed.init_process_group first (gloo on CPU)")
    world = torch.distributed.get_world_size()
    for name in ("tensor_parallel", "expert_parallel"):
        if world % getattr(config, name):
            raise MegatronBackendError(f"world size {world} is not a multiple of MegatronConfig.{name} "
                                       f"({getattr(config, name)})")
    if ps.model_parallel_is_initialized():
        return
    ps.initialize_model_parallel(tensor_model_parallel_size=config.tensor_parallel,
                                 pipeline_model_parallel_size=1,
                                 expert_model_parallel_size=config.expert_parallel)
    if torch.cuda.is_available():
        mcore.tensor_parallel.model_parallel_cuda_manual_seed(config.seed)
    else:
        ps._GLOBAL_MEMORY_BUFFER = _cpu_memory_buffer()  # shim 3
        _install_cpu_rng_tracker(config.seed)  # shim 4


def destroy_parallel() -> None:
    _megatron().parallel_state.destroy_model_parallel()


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
            raise MegatronBackendError("interleaved RoPE is not used by specrl")
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]  # (S, 1, 1, D) rotate-half

    def gating(self, inp):  # shim 2: Router.gating without the CUDA move and the TE GEMM
        dt = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, inp.dtype)
        return F.linear(inp.to(dt), self.weight.to(dt), None if self.bias is None else self.bias.to(dt))

    if getattr(model, "rotary_pos_emb", None) is not None:
        model.rotary_pos_emb.get_emb = types.MethodType(get_emb, model.rotary_pos_emb)
    for m in model.modules():
        if isinstance(m, Router):
            m.gating = types.MethodType(gating, m)


# ---------------------------------------------------------------------------------------------
# weight conversion
# ---------------------------------------------------------------------------------------------
def _is_dense_layer(cfg: MoEConfig, i: int) -> bool:
    if hasattr(cfg, "is_dense_layer"):  # configs that name more dense layers (HF mlp_only_layers)
        return cfg.is_dense_layer(i)
    return cfg.dense_first_layer and i == 0


def _is_moe_layer(cfg: MoEConfig, i: int) -> bool:
    return not _is_dense_layer(cfg, i)


def _qk_norm(cfg: MoEConfig) -> bool:
    return getattr(cfg, "qk_norm", True)


def _qkv_fuse(q, k, v, cfg: MoEConfig) -> torch.Tensor:
    """q (nh*D, H), k/v (ng*D, H) -> Megatron linear_qkv (ng*(nh/ng + 2)*D, H), per query group
    [its nh/ng query heads, its key head, its value head] (head h belongs to group h // (nh/ng))."""
    ng, D, H = cfg.num_kv_heads, cfg.head_dim, q.shape[-1]
    per = cfg.num_heads // ng
    return torch.cat([q.reshape(ng, per * D, H), k.reshape(ng, D, H), v.reshape(ng, D, H)], dim=1).reshape(-1, H)


def _qkv_split(w, cfg: MoEConfig):
    ng, D, H = cfg.num_kv_heads, cfg.head_dim, w.shape[-1]
    per = cfg.num_heads // ng
    g = w.reshape(ng, (per + 2) * D, H)
    return (g[:, : per * D].reshape(-1, H), g[:, per * D: (per + 1) * D].reshape(-1, H),
            g[:, (per + 1) * D:].reshape(-1, H))


def _renamed(cfg: MoEConfig) -> list[tuple[str, str]]:
    """(specrl name, Megatron name) of every tensor that only changes its name; the fused QKV
    and MLP input projections and the stacked experts are converted by hand in each direction."""
    pairs = [("embed_tokens.weight", "embedding.word_embeddings.weight"), ("norm.weight", "decoder.final_layernorm.weight")]
    if not cfg.tie_embeddings:
        pairs.append(("lm_head.weight", "output_layer.weight"))
    for i in range(cfg.num_layers):
        s, m = f"layers.{i}.", f"decoder.layers.{i}."
        layer = [("input_layernorm.weight", "input_layernorm.weight"),
                 ("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
                 ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight")]
        if _qk_norm(cfg):
            layer += [("self_attn.q_norm.weight", "self_attention.q_layernorm.weight"),
                      ("self_attn.k_norm.weight", "self_attention.k_layernorm.weight")]
        layer.append(("mlp.gate.weight", "mlp.router.weight") if _is_moe_layer(cfg, i)
                     else ("mlp.down_proj.weight", "mlp.linear_fc2.weight"))
        pairs += [(s + a, m + b) for a, b in layer]
    return pairs


def specrl_to_megatron(sd: dict[str, torch.Tensor], cfg: MoEConfig, *, ep_rank: int = 0,
                       ep_size: int = 1) -> dict[str, torch.Tensor]:
    """specrl MoETransformer state dict -> GPTModel state dict (tensor_parallel 1).

    With expert parallelism, rank ep_rank holds global experts [ep_rank * E/ep, (ep_rank+1) * E/ep)
    as local_experts.0 .. E/ep - 1."""
    if cfg.num_experts % ep_size or not 0 <= ep_rank < ep_size:
        raise MegatronBackendError(f"bad expert-parallel slice: rank {ep_rank} of {ep_size} for "
                                   f"{cfg.num_experts} experts")
    e_local = cfg.num_experts // ep_size
    out = {m: sd[k] for k, m in _renamed(cfg)}
    for i in range(cfg.num_layers):
        s, m = f"layers.{i}.", f"decoder.layers.{i}."
        out[m + "self_attention.linear_qkv.weight"] = _qkv_fuse(
            sd[s + "self_attn.q_proj.weight"], sd[s + "self_attn.k_proj.weight"], sd[s + "self_attn.v_proj.weight"], cfg)
        if _is_moe_layer(cfg, i):
            wg, wu, wd = sd[s + "mlp.w_gate"], sd[s + "mlp.w_up"], sd[s + "mlp.w_down"]  # (E, I, H), (E, H, I)
            for j in range(e_local):
                e = ep_rank * e_local + j
                x = f"{m}mlp.experts.local_experts.{j}."
                out[x + "linear_fc1.weight"] = torch.cat([wg[e], wu[e]], 0)  # (2I, H)
                out[x + "linear_fc2.weight"] = wd[e]
        else:
            out[m + "mlp.linear_fc1.weight"] = torch.cat([sd[s + "mlp.gate_proj.weight"], sd[s + "mlp.up_proj.weight"]], 0)
    return out


def megatron_to_specrl(sd: dict[str, torch.Tensor], cfg: MoEConfig) -> dict[str, torch.Tensor]:
    """GPTModel state dict (tensor_parallel 1, all experts local) -> specrl state dict."""
    sd = {k: v for k, v in sd.items() if not k.endswith("_extra_state")}
    out = {k: sd[m] for k, m in _renamed(cfg)}
    if cfg.tie_embeddings:
        out["lm_head.weight"] = sd["embedding.word_embeddings.weight"]
    I = cfg.expert_intermediate_size
    for i in range(cfg.num_layers):
        s, m = f"layers.{i}.", f"decoder.layers.{i}."
        q, k, v = _qkv_split(sd[m + "self_attention.linear_qkv.weight"], cfg)
        out[s + "self_attn.q_proj.weight"], out[s + "self_attn.k_proj.weight"], out[s + "self_attn.v_proj.weight"] = q, k, v
        if _is_moe_layer(cfg, i):
            fc1 = [sd[f"{m}mlp.experts.local_experts.{e}.linear_fc1.weight"] for e in range(cfg.num_experts)]
            out[s + "mlp.w_gate"] = torch.stack([w[:I] for w in fc1])
            out[s + "mlp.w_up"] = torch.stack([w[I:] for w in fc1])
            out[s + "mlp.w_down"] = torch.stack([sd[f"{m}mlp.experts.local_experts.{e}.linear_fc2.weight"]
                                                 for e in range(cfg.num_experts)])
        else:
            fc1 = sd[m + "mlp.linear_fc1.weight"]
            half = fc1.shape[0] // 2
            out[s + "mlp.gate_proj.weight"], out[s + "mlp.up_proj.weight"] = fc1[:half], fc1[half:]
    return out


def load_megatron_weights(model, sd: dict[str, torch.Tensor]) -> None:
    """Load a converted state dict; every parameter must be covered (`_extra_state` aside)."""
    result = model.load_state_dict(sd, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise MegatronBackendError(f"state dict does not match the Megatron model: missing {missing[:4]}, "
                                   f"unexpected {list(result.unexpected_keys)[:4]}")


_HF_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.w_(gate|up|down)$")


def specrl_to_hf(sd: dict[str, torch.Tensor], cfg: MoEConfig) -> dict[str, torch.Tensor]:
    """specrl -> Qwen3-MoE checkpoint names (per-expert tensors, as stored on disk): specrl already
    uses HF names except for its stacked experts and the `model.` prefix."""
    out = {}
    for k, v in sd.items():
        hit = _HF_EXPERT.match(k)
        if hit:
            layer, kind = hit.groups()
            for e in range(v.shape[0]):
                out[f"model.layers.{layer}.mlp.experts.{e}.{kind}_proj.weight"] = v[e]
        elif k == "lm_head.weight":
            if not cfg.tie_embeddings:
                out[k] = v
        else:
            out["model." + k] = v
    return out


def hf_to_specrl(sd: dict[str, torch.Tensor], cfg: MoEConfig) -> dict[str, torch.Tensor]:
    out = {k[len("model."):]: v for k, v in sd.items() if k.startswith("model.") and ".mlp.experts." not in k}
    out["lm_head.weight"] = sd["model.embed_tokens.weight"] if cfg.tie_embeddings else sd["lm_head.weight"]
    for i in range(cfg.num_layers):
        if _is_moe_layer(cfg, i):
            for kind in ("gate", "up", "down"):
                out[f"layers.{i}.mlp.w_{kind}"] = torch.stack(
                    [sd[f"model.layers.{i}.mlp.experts.{e}.{kind}_proj.weight"] for e in range(cfg.num_experts)])
    return out


# ---------------------------------------------------------------------------------------------
# the policy wrapper, feature taps, GRPO
# ---------------------------------------------------------------------------------------------
class FeatureTaps:
    """Forward hooks on `model.decoder.layers[i]` that keep each tapped layer's output.

    Megatron's TransformerLayer returns (hidden (T, B, H), context); the hook stores (B, T, H),
    the same tensor specrl's `ModelOutput.taps[i]` holds (the residual stream after layer i)."""

    def __init__(self, model, layer_ids: Sequence[int]):
        self.layer_ids = tuple(int(i) for i in layer_ids)
        self.taps: dict[int, torch.Tensor] = {}
        layers = model.decoder.layers
        for i in self.layer_ids:
            if not 0 <= i < len(layers):
                raise MegatronBackendError(f"tap layer {i} is out of range for {len(layers)} layers")
        self._handles = [layers[i].register_forward_hook(self._hook(i)) for i in sorted(set(self.layer_ids))]

    def _hook(self, i: int):
        def hook(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            self.taps[i] = hidden.transpose(0, 1)  # (T, B, H) -> (B, T, H)
        return hook

    def features(self) -> torch.Tensor:
        """EAGLE-3 fused feature (B, T, 3H) of the last forward."""
        return torch.cat([self.taps[i] for i in self.layer_ids], dim=-1)

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
                attn_mask=None) -> ModelOutput:
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
        return ModelOutput(logits=logits, hidden=hidden, taps=taps.taps if taps else {},
                           aux_loss=logits.new_zeros((), dtype=torch.float32), expert_counts=None)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def grpo_step(policy: MegatronPolicy, optimizer, trajectories, rewards, group_size: int, config: GRPOConfig,
              *, before_backward=None) -> dict:
    """One on-policy GRPO update (ppo_epochs 1, whole batch) with any optimizer exposing
    zero_grad() and step(): Megatron's distributed optimizer (whose step() clips with its own
    clip_grad and returns (ok, grad_norm, zeros)) or a torch optimizer. Uses grpo.py's
    pack_batch / group_advantages / token_logprobs / grpo_loss; `before_backward` lets the caller
    zero Megatron's DDP grad buffers."""
    dev = next(policy.parameters()).device
    batch = {k: v.to(dev) for k, v in pack_batch(trajectories).items()}
    adv = group_advantages(torch.as_tensor(rewards, dtype=torch.float32), group_size, config.adv_eps).to(dev)
    policy.train()
    out = policy(batch["input_ids"])
    logp, ent = token_logprobs(out.logits, batch["input_ids"], config.temperature)
    loss, metrics = grpo_loss(logp, logp.detach(), adv, batch["response_mask"], config.clip_eps)
    optimizer.zero_grad()
    if before_backward is not None:
        before_backward()
    loss.backward()
    result = optimizer.step()
    policy.eval()
    mf = batch["response_mask"].float()
    metrics.update(loss=loss.item(), entropy=((ent * mf).sum() / mf.sum().clamp(min=1)).item(),
                   reward=float(torch.as_tensor(rewards, dtype=torch.float32).mean()))
    if isinstance(result, tuple) and len(result) >= 2 and result[1] is not None:
        metrics["grad_norm"] = float(result[1])
    return metrics
