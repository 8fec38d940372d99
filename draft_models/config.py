"""Typed configuration of an EAGLE-3 draft head, and its SGLang `config.json` form.

The draft is one Llama decoder layer (q/k/v read 2H: the normed token embedding next to the
normed hidden stream) behind `fc` (3 * H_target -> H), with its own `norm` and a `lm_head` over
a reduced draft vocabulary. `to_sglang_config` writes exactly what SGLang's
`LlamaForCausalLMEagle3` reads; `from_sglang_config` reads it back.
"""
from __future__ import annotations

from dataclasses import dataclass, field

_SGLANG_KEYS = {
    "hidden_size": "hidden_size",
    "target_hidden_size": "target_hidden_size",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "intermediate_size": "intermediate_size",
    "vocab_size": "vocab_size",
    "draft_vocab_size": "draft_vocab_size",
    "max_seq_len": "max_position_embeddings",
    "rope_theta": "rope_theta",
    "rms_eps": "rms_norm_eps",
}


class Eagle3ConfigError(ValueError):
    """A draft configuration value is out of range or inconsistent (one-line message)."""


@dataclass
class Eagle3Config:
    hidden_size: int
    target_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    max_seq_len: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    aux_layer_ids: tuple[int, int, int] = field(default_factory=lambda: (0, 0, 0))
    ttt_steps: int = 7
    ttt_decay: float = 0.8

    def __post_init__(self) -> None:
        self.aux_layer_ids = tuple(int(i) for i in self.aux_layer_ids)  # type: ignore[assignment]
        self.validate()

    def validate(self) -> None:
        positive = ["hidden_size", "target_hidden_size", "num_heads", "num_kv_heads", "head_dim",
                    "intermediate_size", "vocab_size", "draft_vocab_size", "max_seq_len", "ttt_steps"]
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise Eagle3ConfigError(f"Eagle3Config.{name} must be a positive integer, got {value!r}")
        for name in ("rope_theta", "rms_eps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise Eagle3ConfigError(f"Eagle3Config.{name} must be positive, got {value!r}")
        if not 0.0 < float(self.ttt_decay) <= 1.0:
            raise Eagle3ConfigError(f"Eagle3Config.ttt_decay must lie in (0, 1], got {self.ttt_decay!r}")
        if self.num_heads % self.num_kv_heads:
            raise Eagle3ConfigError(f"Eagle3Config.num_heads ({self.num_heads}) must be a multiple of "
                                    f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise Eagle3ConfigError(f"Eagle3Config.head_dim must be even for RoPE, got {self.head_dim}")
        if self.draft_vocab_size > self.vocab_size:
            raise Eagle3ConfigError(f"Eagle3Config.draft_vocab_size ({self.draft_vocab_size}) exceeds "
                                    f"vocab_size ({self.vocab_size})")
        if len(self.aux_layer_ids) != 3 or any(i < 0 for i in self.aux_layer_ids):
            raise Eagle3ConfigError(f"Eagle3Config.aux_layer_ids must be 3 non-negative layer ids, "
                                    f"got {self.aux_layer_ids}")

    # ------------------------------------------------------------------ SGLang config.json
    def to_sglang_config(self, torch_dtype: str = "float32") -> dict:
        """The `config.json` of an SGLang EAGLE-3 draft (LlamaForCausalLMEagle3)."""
        d: dict = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": torch_dtype,
        }
        for ours, theirs in _SGLANG_KEYS.items():
            d[theirs] = getattr(self, ours)
        # The two engines read the tap ids differently: SGLang reads `eagle_config.<key>` as
        # "the output of layer i" (it adds 1 internally), vLLM reads the top-level key first, as
        # "the hidden state after i layers" (0 = the embedding). Writing each engine's own key in
        # its own convention makes both feed the draft the same three hidden states, ours.
        d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids)}
        d["eagle_aux_hidden_state_layer_ids"] = list(self.vllm_aux_layer_ids)
        # Not read by SGLang; kept so that our training settings survive a round trip.
        d["specrl"] = {"ttt_steps": self.ttt_steps, "ttt_decay": self.ttt_decay}
        return d

    @classmethod
    def from_sglang_config(cls, d: dict, default_aux_layer_ids=None) -> "Eagle3Config":
        """Parse an SGLang EAGLE-3 config.json dict; raises Eagle3ConfigError on bad content."""
        if not isinstance(d, dict):
            raise Eagle3ConfigError(f"draft config must be a JSON object, got {type(d).__name__}")
        arch = d.get("architectures") or []
        if arch and "LlamaForCausalLMEagle3" not in arch:
            raise Eagle3ConfigError(f"draft config architectures {arch} is not LlamaForCausalLMEagle3")
        if int(d.get("num_hidden_layers", 1)) != 1:
            raise Eagle3ConfigError(f"draft config num_hidden_layers={d['num_hidden_layers']}, only 1 is supported")
        if d.get("tie_word_embeddings", False):
            raise Eagle3ConfigError("draft config tie_word_embeddings=true is not supported")
        required = ["hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"]
        missing = [k for k in required if k not in d]
        if missing:
            raise Eagle3ConfigError(f"draft config lacks {missing}")
        kw: dict = {}
        for ours, theirs in _SGLANG_KEYS.items():
            if theirs in d and d[theirs] is not None:
                kw[ours] = d[theirs]
        kw.setdefault("target_hidden_size", kw["hidden_size"])
        kw.setdefault("num_kv_heads", kw["num_heads"])
        kw.setdefault("draft_vocab_size", kw["vocab_size"])
        kw.setdefault("max_seq_len", 2048)
        if "head_dim" not in kw:
            if kw["hidden_size"] % kw["num_heads"]:
                raise Eagle3ConfigError("draft config lacks head_dim and hidden_size is not a multiple of heads")
            kw["head_dim"] = kw["hidden_size"] // kw["num_heads"]
        for k in ("rope_theta", "rms_eps"):
            if k in kw:
                kw[k] = float(kw[k])
        aux = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        after = d.get("eagle_aux_hidden_state_layer_ids")  # vLLM's "after i layers" convention
        if after is not None:
            if not isinstance(after, list) or not all(isinstance(i, int) for i in after):
                raise Eagle3ConfigError(f"draft config eagle_aux_hidden_state_layer_ids must be a list of "
                                        f"integers, got {after!r}")
            from_after = [i - 1 for i in after]
            if aux is not None and list(aux) != from_after:
                raise Eagle3ConfigError(f"draft config names two different tap layers: eagle_config ids {list(aux)} "
                                        f"(output of layer i) vs top-level {after} (after i layers)")
            aux = from_after
        if aux is None:
            aux = default_aux_layer_ids
        if aux is None:
            raise Eagle3ConfigError("draft config lacks eagle_config.eagle_aux_hidden_state_layer_ids")
        if len(aux) != 3:
            raise Eagle3ConfigError(f"draft config eagle_aux_hidden_state_layer_ids must name 3 layers, got {aux}")
        kw["aux_layer_ids"] = tuple(int(i) for i in aux)
        extra = d.get("specrl") or {}
        if "ttt_steps" in extra:
            kw["ttt_steps"] = int(extra["ttt_steps"])
        if "ttt_decay" in extra:
            kw["ttt_decay"] = float(extra["ttt_decay"])
        try:
            return cls(**kw)
        except TypeError as e:  # a value of the wrong JSON type
            raise Eagle3ConfigError(f"draft config has a bad value: {e}") from None

    @property
    def vllm_aux_layer_ids(self) -> tuple[int, ...]:
        """The tap ids in vLLM's convention: hidden state after i layers = output of layer i - 1."""
        return tuple(i + 1 for i in self.aux_layer_ids)

    def engine_tap_problem(self) -> str | None:
        """Why vLLM and SGLang cannot feed this draft its three features, or None.

        Both engines keep the tap layers as a sorted set, so three distinct increasing ids are
        needed for them to concatenate the same (low, mid, high) features as specrl does."""
        ids = list(self.aux_layer_ids)
        if not ids[0] < ids[1] < ids[2]:
            return (f"aux_layer_ids {tuple(ids)} must be 3 distinct increasing layers for vLLM/SGLang "
                    f"(they capture a sorted set of layers)")
        return None

    # ------------------------------------------------------------------ construction
    @classmethod
    def for_target(cls, moe_config, draft_vocab_size: int, **overrides) -> "Eagle3Config":
        """A draft sized like the target: same hidden size and attention heads, a dense SwiGLU
        as wide as the target's dense layer, taps at the target's feature layers."""
        kw = dict(
            hidden_size=moe_config.hidden_size,
            target_hidden_size=moe_config.hidden_size,
            num_heads=moe_config.num_heads,
            num_kv_heads=moe_config.num_kv_heads,
            head_dim=moe_config.head_dim,
            intermediate_size=moe_config.dense_intermediate_size,
            vocab_size=moe_config.vocab_size,
            draft_vocab_size=draft_vocab_size,
            max_seq_len=moe_config.max_seq_len,
            rope_theta=moe_config.rope_theta,
            rms_eps=moe_config.rms_eps,
            aux_layer_ids=tuple(moe_config.feature_layer_ids),
        )
        unknown = sorted(set(overrides) - set(kw) - {"ttt_steps", "ttt_decay"})
        if unknown:
            raise Eagle3ConfigError(f"unknown Eagle3Config keys: {unknown}")
        kw.update(overrides)
        return cls(**kw)

    def build(self, target_embedding):
        """An Eagle3Draft that reads tokens through `target_embedding` (held by reference)."""
        from draft_models.eagle3 import Eagle3Draft

        return Eagle3Draft(self, target_embedding)
