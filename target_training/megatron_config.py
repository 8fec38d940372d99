"""Megatron-core configuration for the MoE policy: `MegatronConfig` -> Megatron `TransformerConfig`
and `GPTModel`, and Megatron's parallel state.

Why its own module: the translation from specrl's `MoEConfig` (RMSNorm, SwiGLU as
gated_linear_unit + silu, GQA as num_query_groups, QK-norm, RoPE, top-k softmax router with the
Switch load-balancing loss, dense first layer through moe_layer_freq, untied embeddings) is one
concept, used by `megatron_backend` (the policy wrapper) and by anyone building a GPTModel that
must match specrl's reference model.

Device: every CPU/CUDA decision (use_cpu_initialization, the shims of `target_training.megatron_cpu`,
Megatron's memory buffer and RNG tracker, the process-group backend) follows
`MegatronConfig.device`, the device the policy is built for, never whether CUDA happens to exist:
a CPU build on a CUDA machine stays on CPU. Only the field's default looks at the machine.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from target_training.config import ConfigError, MoEConfig
from target_training.megatron_cpu import _cpu_memory_buffer, _install_cpu_rng_tracker, _patch_model_for_cpu

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DISPATCHERS = ("allgather", "alltoall")
_DEVICES = ("cpu", "cuda")
_PARALLEL = {"device": None}  # the device initialize_parallel set Megatron's parallel state up for


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _is_dense_layer(cfg: MoEConfig, i: int) -> bool:
    if hasattr(cfg, "is_dense_layer"):  # configs that name more dense layers (HF mlp_only_layers)
        return cfg.is_dense_layer(i)
    return cfg.dense_first_layer and i == 0


def _is_moe_layer(cfg: MoEConfig, i: int) -> bool:
    return not _is_dense_layer(cfg, i)


def _qk_norm(cfg: MoEConfig) -> bool:
    return getattr(cfg, "qk_norm", True)


class MegatronBackendError(ConfigError):
    """The Megatron backend cannot run with these settings (one-line message)."""


def _megatron():
    try:
        from megatron.core import parallel_state  # noqa: F401
    except ImportError as e:  # pragma: no cover - the dist extra is optional
        raise MegatronBackendError("megatron-core is not installed; pip install -e '.[dist]'") from e
    import megatron.core as mcore

    return mcore


@dataclass
class MegatronConfig:
    """Parallel layout and numerics of the Megatron policy; the architecture comes from MoEConfig."""

    tensor_parallel: int = 1
    expert_parallel: int = 1
    pipeline_parallel: int = 1  # only 1: the policy is small enough per stage in specrl's runs
    params_dtype: str = "float32"  # float32 | bfloat16 | float16
    token_dispatcher: str = "allgather"  # "alltoall" is faster with expert parallelism, CUDA only
    seed: int = 1234
    # "cpu" | "cuda" (Megatron builds on torch.cuda.current_device(); the launcher sets it per rank)
    device: str = field(default_factory=_default_device)

    def __post_init__(self) -> None:
        if self.device not in _DEVICES:
            raise MegatronBackendError(f"MegatronConfig.device must be one of {list(_DEVICES)}, got {self.device!r}")
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

    @property
    def on_cpu(self) -> bool:
        return self.device == "cpu"

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
        if self.token_dispatcher == "alltoall" and self.on_cpu:
            raise MegatronBackendError("MegatronConfig.token_dispatcher 'alltoall' needs device 'cuda' "
                                       "(it creates a torch.cuda.Stream); use 'allgather' on CPU")

    def transformer_config(self, moe: MoEConfig):
        """MoEConfig -> megatron.core TransformerConfig (same architecture, this layout)."""
        self.check(moe)
        _megatron()
        from megatron.core.transformer.transformer_config import TransformerConfig

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
            use_cpu_initialization=self.on_cpu,
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
        _check_cuda(self)
        if _PARALLEL["device"] not in (None, self.device):
            raise MegatronBackendError(f"Megatron parallel state was initialised for device "
                                       f"{_PARALLEL['device']!r}, this build is for {self.device!r}; call "
                                       f"destroy_parallel() and initialize_parallel(config) first")
        tcfg = self.transformer_config(moe)
        # Per-layer local specs (get_gpt_layer_local_spec with num_experts=None for the dense first
        # layer, num_experts=E, moe_grouped_gemm=False, qk_layernorm=True for the MoE layers).
        spec = get_gpt_decoder_block_spec(tcfg, use_transformer_engine=False, normalization="RMSNorm")
        model = GPTModel(config=tcfg, transformer_layer_spec=spec, vocab_size=moe.vocab_size,
                         max_sequence_length=moe.max_seq_len, position_embedding_type="rope",
                         rotary_percent=1.0, rotary_base=int(moe.rope_theta),
                         share_embeddings_and_output_weights=moe.tie_embeddings,
                         pre_process=True, post_process=True)
        if self.on_cpu:
            _patch_model_for_cpu(model)
        return model


def _check_cuda(config: MegatronConfig) -> None:
    if not config.on_cpu and not torch.cuda.is_available():
        raise MegatronBackendError("MegatronConfig.device is 'cuda' but CUDA is not available")


def initialize_parallel(config: MegatronConfig) -> None:
    """Megatron's process groups on the current torch.distributed group, and its RNG trackers,
    for `config.device`.

    torch.distributed must already be initialised with a backend for that device (gloo for
    "cpu", nccl for "cuda"; a mixed "cpu:gloo,cuda:nccl" serves both); the world size must be a
    multiple of tensor_parallel and of expert_parallel. Idempotent for the same device."""
    mcore = _megatron()
    ps = mcore.parallel_state
    _check_cuda(config)
    if not torch.distributed.is_initialized():
        raise MegatronBackendError("torch.distributed is not initialised; call torch.distributed."
                                   "init_process_group first (gloo for device 'cpu', nccl for 'cuda')")
    backend = str(torch.distributed.get_backend())
    need = "gloo" if config.on_cpu else "nccl"
    if need not in backend:
        raise MegatronBackendError(f"MegatronConfig.device {config.device!r} needs a {need} process group, "
                                   f"torch.distributed was initialised with {backend!r}")
    world = torch.distributed.get_world_size()
    for name in ("tensor_parallel", "expert_parallel"):
        if world % getattr(config, name):
            raise MegatronBackendError(f"world size {world} is not a multiple of MegatronConfig.{name} "
                                       f"({getattr(config, name)})")
    if ps.model_parallel_is_initialized():
        if _PARALLEL["device"] not in (None, config.device):
            raise MegatronBackendError(f"Megatron parallel state is already initialised for device "
                                       f"{_PARALLEL['device']!r}, not {config.device!r}; call destroy_parallel() first")
        return
    ps.initialize_model_parallel(tensor_model_parallel_size=config.tensor_parallel,
                                 pipeline_model_parallel_size=1,
                                 expert_model_parallel_size=config.expert_parallel)
    if config.on_cpu:
        ps._GLOBAL_MEMORY_BUFFER = _cpu_memory_buffer()  # shim 3
        _install_cpu_rng_tracker(config.seed)  # shim 4
    else:
        mcore.tensor_parallel.model_parallel_cuda_manual_seed(config.seed)
    _PARALLEL["device"] = config.device


def destroy_parallel() -> None:
    _megatron().parallel_state.destroy_model_parallel()
    _PARALLEL["device"] = None
