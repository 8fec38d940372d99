"""Typed configuration of the MoE policy.

One dataclass describes the whole model; `build()` turns it into a module.
Presets keep the sizes that the CPU experiments use in one place, so that a
checkpoint written by one command is recognised by every other one.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A configuration value is out of range or inconsistent (one-line message)."""


def require_positive(config, names, error: type[Exception] = ConfigError) -> None:
    """Raise `error` naming the first field of `config` among `names` that is not > 0."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise error(f"{type(config).__name__}.{name} must be positive, got {value!r}")


@dataclass
class MoEConfig:
    vocab_size: int = 64
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    expert_intermediate_size: int = 128  # hidden width of one expert's SwiGLU
    num_experts: int = 4
    top_k: int = 2
    dense_first_layer: bool = True  # layer 0 uses a dense SwiGLU (DeepSeek/Qwen-MoE style)
    dense_intermediate_size: int = 256
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    norm_topk_prob: bool = True  # renormalise the top-k router weights (Qwen3-MoE default)
    router_aux_loss_coef: float = 0.01
    tie_embeddings: bool = False
    # EAGLE-3 feature taps; empty means the default low/mid/high layers.
    aux_layer_ids: tuple[int, ...] = field(default_factory=tuple)
    # Architecture options of other model families (target_training.hf_adapter maps HF configs
    # onto them). The defaults are this model's own design; `to_dict` leaves them out while they
    # hold their defaults, so existing configs, checkpoints and cache keys are unchanged.
    qk_norm: bool = True  # RMSNorm on q and k per head (Qwen3); False for Llama, Mixtral, Qwen2
    attention_bias: bool = False  # bias on q/k/v (Qwen2 family, Llama's attention_bias)
    attention_out_bias: bool = False  # bias on o_proj (Llama's attention_bias)
    dense_layers: tuple[int, ...] = field(default_factory=tuple)  # more dense-SwiGLU layers (HF mlp_only_layers)
    shared_expert_intermediate_size: int = 0  # > 0: a sigmoid-gated shared expert in every MoE layer (Qwen2-MoE)

    _EXTENSIONS = ("qk_norm", "attention_bias", "attention_out_bias", "dense_layers", "shared_expert_intermediate_size")

    def __post_init__(self) -> None:
        self.aux_layer_ids = tuple(int(i) for i in self.aux_layer_ids)
        self.dense_layers = tuple(sorted({int(i) for i in self.dense_layers}))
        self.validate()

    def is_dense_layer(self, layer_id: int) -> bool:
        """True where layer `layer_id` has a dense SwiGLU instead of the MoE."""
        return (self.dense_first_layer and layer_id == 0) or layer_id in self.dense_layers

    def validate(self) -> None:
        positive = ["vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                    "expert_intermediate_size", "num_experts", "top_k", "dense_intermediate_size", "max_seq_len"]
        require_positive(self, positive)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"MoEConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.top_k > self.num_experts:
            raise ConfigError(f"MoEConfig.top_k ({self.top_k}) exceeds num_experts ({self.num_experts})")
        if self.head_dim % 2:
            raise ConfigError(f"MoEConfig.head_dim must be even for RoPE, got {self.head_dim}")
        for name in ("aux_layer_ids", "dense_layers"):
            for i in getattr(self, name):
                if not 0 <= i < self.num_layers:
                    raise ConfigError(f"MoEConfig.{name} has layer {i}, model has {self.num_layers} layers")
        if isinstance(self.shared_expert_intermediate_size, bool) or self.shared_expert_intermediate_size < 0:
            raise ConfigError(f"MoEConfig.shared_expert_intermediate_size must be >= 0, "
                              f"got {self.shared_expert_intermediate_size!r}")

    @property
    def feature_layer_ids(self) -> tuple[int, int, int]:
        """Layers whose outputs form the EAGLE-3 fused feature (low, mid, high).

        EAGLE-3's default for L layers is (1, L//2 - 1, L - 4), counted from 0;
        small models clamp into range so the three stay ordered.
        """
        if self.aux_layer_ids:
            ids = self.aux_layer_ids
            if len(ids) != 3:
                raise ConfigError(f"MoEConfig.aux_layer_ids must name 3 layers, got {ids}")
            return ids  # type: ignore[return-value]
        L = self.num_layers
        default = (1, L // 2 - 1, L - 4)
        if default[0] < default[1] < default[2] < L:
            return default
        # Too shallow for the EAGLE-3 default: spread three distinct taps up to the last layer.
        return (L // 4, L // 2, L - 1) if L >= 3 else (0, 0, L - 1)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        d["dense_layers"] = list(self.dense_layers)
        for name in self._EXTENSIONS:  # written only where they differ from the defaults
            if getattr(self, name) == getattr(_DEFAULTS, name):
                del d[name]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "MoEConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown MoEConfig keys: {unknown}")
        return cls(**d)

    def build(self):
        from target_training.model import MoETransformer

        return MoETransformer(self)


_DEFAULTS = MoEConfig()

PRESETS: dict[str, dict] = {
    # ~0.6M parameters: CI-sized, trains in seconds.
    "tiny": dict(hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
                 expert_intermediate_size=64, num_experts=4, top_k=2, dense_intermediate_size=128,
                 max_seq_len=192),
    # ~2M parameters: the quick CPU RL preset.
    "quick": dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
                  expert_intermediate_size=128, num_experts=8, top_k=2, dense_intermediate_size=256,
                  max_seq_len=192),
    # ~5M parameters, 12 layers: a target deep enough that one draft step (one layer) costs a few
    # percent of a target step, as for the 28-64 layer targets EAGLE-3 serves (docs/design.md section 4);
    # `specrl bench speed --preset speed` measures speculation at that draft/target cost ratio.
    "speed": dict(hidden_size=128, num_layers=12, num_heads=4, num_kv_heads=2, head_dim=32,
                  expert_intermediate_size=128, num_experts=8, top_k=2, dense_intermediate_size=256,
                  max_seq_len=192),
    # ~10M parameters: longer runs.
    "full": dict(hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=2, head_dim=32,
                 expert_intermediate_size=256, num_experts=8, top_k=2, dense_intermediate_size=512,
                 max_seq_len=256),
}


def model_config_for(preset: str, vocab_size: int) -> MoEConfig:
    if preset not in PRESETS:
        raise ConfigError(f"unknown model preset {preset!r}; choose from {sorted(PRESETS)}")
    return MoEConfig(vocab_size=vocab_size, **PRESETS[preset])
