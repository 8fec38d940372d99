"""Run a local HuggingFace causal LM as specrl's target: config and state-dict adapter.

Why an adapter and not a wrapper: the embedded engine (rollout/engine.py, rollout/speculative.py)
needs things an HF model does not expose cheaply: hidden-state taps at the EAGLE-3 feature
layers, a static per-slot KV cache that rolls back and compacts after tree verification, and
explicit tree masks. `MoETransformer` has all of them, so, as torchtitan does with its state-dict
adapters, we translate the HF config into a `MoEConfig` and the HF tensors into specrl's names
once, and the engine runs the model natively with every feature. `to_hf_state_dict` /
`to_hf_model` go back (export, or checking a round trip).

Supported `model_type`s: llama, qwen2, qwen3 (dense), mixtral, qwen2_moe, qwen3_moe, with the
default RoPE, SiLU MLPs and full attention. What each family needs is an option of `MoEConfig`
(QK-norm, q/k/v and o biases, dense layers placed by `mlp_only_layers`/`decoder_sparse_step`,
the sigmoid-gated shared expert, `norm_topk_prob`, tied embeddings). Anything else (RoPE
scaling, sliding windows, other activations, MLP biases, unknown tensors) is refused with a
one-line `HFAdapterError`, never silently approximated.

Tensor names: HF in-memory names (transformers 5: fused `mlp.experts.gate_up_proj` (E, 2I, H)
and `mlp.experts.down_proj` (E, H, I)) and the on-disk per-expert names (`experts.{e}.gate_proj`,
Mixtral's `block_sparse_moe.experts.{e}.w1/w2/w3`) are both read; export writes the in-memory
names, which `PreTrainedModel.load_state_dict` takes and `save_pretrained` converts back.
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch

from target_training.config import ConfigError, MoEConfig
from target_training.model import MoETransformer

DENSE_FAMILIES = ("llama", "qwen2", "qwen3")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
FAMILIES = DENSE_FAMILIES + MOE_FAMILIES


class HFAdapterError(ValueError):
    """An HF model, config or checkpoint that the adapter cannot convert (one-line message)."""


# ------------------------------------------------------------------------------ config
def _get(c, name: str, default=None):
    value = getattr(c, name, default)
    return default if value is None else value


def _rope_theta(c) -> float:
    params = _get(c, "rope_parameters") or {}
    scaling = _get(c, "rope_scaling") or {}
    rope_type = (params.get("rope_type") or params.get("type") or scaling.get("rope_type") or scaling.get("type")
                 or "default")
    if rope_type != "default":
        raise HFAdapterError(f"{c.model_type}: rope_type {rope_type!r} is not supported (only the default RoPE)")
    theta = params.get("rope_theta", _get(c, "rope_theta"))
    if theta is None:
        raise HFAdapterError(f"{c.model_type}: config has no rope_theta")
    return float(theta)


def _check_attention_and_mlp(c, max_seq_len: int) -> None:
    mt = c.model_type
    act = _get(c, "hidden_act", "silu")
    if act != "silu":
        raise HFAdapterError(f"{mt}: hidden_act {act!r} is not supported (only silu)")
    if _get(c, "mlp_bias", False):
        raise HFAdapterError(f"{mt}: mlp_bias=True is not supported")
    if _get(c, "use_sliding_window", False):
        raise HFAdapterError(f"{mt}: use_sliding_window=True is not supported (full attention only)")
    window = _get(c, "sliding_window")
    if mt == "mixtral" and window and window < max_seq_len:
        raise HFAdapterError(f"{mt}: sliding_window={window} < max_seq_len={max_seq_len} is not supported; "
                             f"pass max_seq_len <= {window}")
    kinds = set(_get(c, "layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        raise HFAdapterError(f"{mt}: layer_types {sorted(kinds)} are not supported (full_attention only)")


def moe_config_from_hf(hf_config, *, max_seq_len: int | None = None) -> MoEConfig:
    """The `MoEConfig` that computes what the HF model of `hf_config` computes.

    max_seq_len defaults to the HF `max_position_embeddings`; the engine's KV cache length is
    set separately (EngineConfig.max_len)."""
    c = hf_config
    mt = getattr(c, "model_type", None)
    if mt not in FAMILIES:
        raise HFAdapterError(f"model_type {mt!r} is not supported; supported: {', '.join(FAMILIES)}")
    L = int(c.num_hidden_layers)
    max_seq_len = int(max_seq_len or c.max_position_embeddings)
    _check_attention_and_mlp(c, max_seq_len)
    heads = int(c.num_attention_heads)
    kw: dict = dict(
        vocab_size=int(c.vocab_size), hidden_size=int(c.hidden_size), num_layers=L, num_heads=heads,
        num_kv_heads=int(_get(c, "num_key_value_heads", heads)),
        head_dim=int(_get(c, "head_dim", c.hidden_size // heads)),
        max_seq_len=max_seq_len, rope_theta=_rope_theta(c), rms_eps=float(c.rms_norm_eps),
        tie_embeddings=bool(_get(c, "tie_word_embeddings", False)), dense_first_layer=False,
        qk_norm=mt in ("qwen3", "qwen3_moe"),
        dense_intermediate_size=int(c.intermediate_size),
    )
    if mt in ("llama", "qwen3", "qwen3_moe"):
        kw["attention_bias"] = kw["attention_out_bias"] = bool(_get(c, "attention_bias", False))
    elif mt == "qwen2":
        kw["attention_bias"] = True  # Qwen2 always has q/k/v biases, never an o_proj bias
    elif mt == "qwen2_moe":
        kw["attention_bias"] = bool(_get(c, "qkv_bias", True))
    if mt in DENSE_FAMILIES:
        # every layer dense; the MoE fields are placeholders that build nothing
        kw.update(dense_layers=tuple(range(L)), num_experts=1, top_k=1,
                  expert_intermediate_size=int(c.intermediate_size))
    elif mt == "mixtral":
        kw.update(num_experts=int(c.num_local_experts), top_k=int(c.num_experts_per_tok),
                  expert_intermediate_size=int(c.intermediate_size), norm_topk_prob=True)
    else:  # qwen2_moe, qwen3_moe
        E, step = int(c.num_experts), int(_get(c, "decoder_sparse_step", 1))
        only = set(_get(c, "mlp_only_layers", []))
        dense = tuple(i for i in range(L) if i in only or not (E > 0 and (i + 1) % step == 0))
        kw.update(num_experts=max(E, 1), top_k=int(c.num_experts_per_tok), dense_layers=dense,
                  expert_intermediate_size=int(c.moe_intermediate_size),
                  norm_topk_prob=bool(_get(c, "norm_topk_prob", False)))
        if mt == "qwen2_moe":
            kw["shared_expert_intermediate_size"] = int(c.shared_expert_intermediate_size)
    if _get(c, "router_aux_loss_coef") is not None:
        kw["router_aux_loss_coef"] = float(c.router_aux_loss_coef)
    try:
        return MoEConfig(**kw)
    except ConfigError as e:
        raise HFAdapterError(f"{mt}: {e}") from None


# ------------------------------------------------------------------------------ tensors
_LEGACY_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.weight$")
_LEGACY_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj",
                "gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}


def _strip(name: str) -> str:
    name = name.removeprefix("model.")
    return name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's on-disk module name


def to_specrl_state_dict(hf_state_dict: dict[str, torch.Tensor], cfg: MoEConfig) -> dict[str, torch.Tensor]:
    """HF tensors (in-memory fused or on-disk per-expert names) -> MoETransformer names.

    Unknown names pass through renamed, so a strict load reports them. Fused expert tensors
    become views (no copy); per-expert ones are stacked."""
    out: dict[str, torch.Tensor] = {}
    per_expert: dict[str, dict[str, dict[int, torch.Tensor]]] = {}  # layer prefix -> proj -> expert -> W
    I = cfg.expert_intermediate_size
    for name, t in hf_state_dict.items():
        name = _strip(name)
        if name.endswith("rotary_emb.inv_freq"):  # a buffer some old checkpoints saved; recomputed here
            continue
        m = _LEGACY_EXPERT.match(name)
        if m and m.group(3) in _LEGACY_PROJ:
            per_expert.setdefault(m.group(1), {}).setdefault(_LEGACY_PROJ[m.group(3)], {})[int(m.group(2))] = t
        elif name.endswith(".mlp.experts.gate_up_proj"):  # (E, 2I, H): gate rows first
            prefix = name.removesuffix(".experts.gate_up_proj")
            out[f"{prefix}.w_gate"], out[f"{prefix}.w_up"] = t[:, :I], t[:, I:]
        elif name.endswith(".mlp.experts.down_proj"):  # (E, H, I)
            out[name.removesuffix(".experts.down_proj") + ".w_down"] = t
        else:
            out[name] = t
    for prefix, projs in per_expert.items():
        mlp = prefix.removesuffix(".experts")
        for proj, ours in (("gate_proj", "w_gate"), ("up_proj", "w_up"), ("down_proj", "w_down")):
            experts = projs.get(proj, {})
            if sorted(experts) != list(range(cfg.num_experts)):
                raise HFAdapterError(f"{prefix}: {proj} found for experts {sorted(experts)}, "
                                     f"expected 0..{cfg.num_experts - 1}")
            out[f"{mlp}.{ours}"] = torch.stack([experts[e] for e in range(cfg.num_experts)])
    if cfg.tie_embeddings and "embed_tokens.weight" in out:
        out["lm_head.weight"] = out["embed_tokens.weight"]  # one tensor under both names, like the module
    return out


def to_hf_state_dict(model_or_state_dict, cfg: MoEConfig | None = None, *,
                     per_expert: bool = False) -> dict[str, torch.Tensor]:
    """MoETransformer tensors -> HF names: the in-memory fused expert tensors (what
    `hf_model.state_dict()` holds) or, with `per_expert`, one tensor per expert as Qwen3-MoE
    checkpoints store them on disk (`model.layers.i.mlp.experts.e.{gate,up,down}_proj.weight`, views).
    `to_specrl_state_dict` reads both back."""
    if isinstance(model_or_state_dict, MoETransformer):
        cfg = model_or_state_dict.cfg
        sd = model_or_state_dict.state_dict()
    else:
        sd = model_or_state_dict
    if cfg is None:
        raise TypeError("to_hf_state_dict needs cfg when given a state dict")
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        stacked = name.endswith((".mlp.w_gate", ".mlp.w_up", ".mlp.w_down"))
        if stacked and per_expert:
            prefix, kind = name.rsplit(".w_", 1)
            for e in range(t.shape[0]):  # (E, ...) -> E tensors
                out[f"model.{prefix}.experts.{e}.{kind}_proj.weight"] = t[e]
        elif name.endswith(".mlp.w_gate"):
            prefix = name.removesuffix(".w_gate")
            out[f"model.{prefix}.experts.gate_up_proj"] = torch.cat([t, sd[f"{prefix}.w_up"]], dim=1)
        elif name.endswith(".mlp.w_down"):
            out[f"model.{name.removesuffix('.w_down')}.experts.down_proj"] = t
        elif name.endswith(".mlp.w_up"):
            continue  # fused with w_gate above
        elif name == "lm_head.weight":
            out[name] = t
        else:
            out[f"model.{name}"] = t
    return out


def to_hf_disk_state_dict(model_or_state_dict, cfg: MoEConfig | None = None) -> dict[str, torch.Tensor]:
    """MoETransformer tensors -> HF on-disk names (per-expert `experts.{e}.gate_proj.weight`, ...),
    what `save_pretrained` writes and what serving engines (vLLM, SGLang) load. Views, no copy."""
    out: dict[str, torch.Tensor] = {}
    for name, t in to_hf_state_dict(model_or_state_dict, cfg).items():
        if name.endswith(".experts.gate_up_proj"):  # (E, 2I, H)
            prefix, half = name.removesuffix(".gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = t[e, :half]
                out[f"{prefix}.{e}.up_proj.weight"] = t[e, half:]
        elif name.endswith(".experts.down_proj"):  # (E, H, I)
            prefix = name.removesuffix(".down_proj")
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def hf_config_from_moe(cfg: MoEConfig, *, dtype: str = "float32"):
    """The HF config that computes what a MoETransformer of `cfg` computes, so the policy can be
    served by an engine that loads HF folders (no download, nothing approximated).

    A model with QK-norm exports as Qwen3-MoE, specrl's own design (QK-norm, top-k router with
    renormalisation, dense layers by `mlp_only_layers`); a model without QK-norm whose layers are
    all dense (one converted from Llama, e.g. the real SmolLM2 target) as Llama. Options neither
    expresses (shared experts, experts without QK-norm, an o_proj bias without q/k/v biases or
    the reverse) are refused with HFAdapterError."""
    from transformers import LlamaConfig, Qwen3MoeConfig

    dense = sorted(i for i in range(cfg.num_layers) if cfg.is_dense_layer(i))
    if not cfg.qk_norm and len(dense) < cfg.num_layers:
        raise HFAdapterError("only models with QK-norm export with MoE layers, as Qwen3-MoE (qk_norm=False); "
                             "a model without QK-norm exports as Llama when every layer is dense")
    if cfg.attention_bias != cfg.attention_out_bias:
        raise HFAdapterError("Qwen3-MoE and Llama have one attention_bias for q/k/v and o_proj; the model differs")
    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.dense_intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.rms_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_embeddings, attention_bias=cfg.attention_bias, dtype=dtype)
    if cfg.qk_norm:
        if cfg.shared_expert_intermediate_size:
            raise HFAdapterError("a shared expert does not export as Qwen3-MoE")
        hf = Qwen3MoeConfig(
            **common, num_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k,
            moe_intermediate_size=cfg.expert_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
            mlp_only_layers=dense, decoder_sparse_step=1, router_aux_loss_coef=cfg.router_aux_loss_coef,
            architectures=["Qwen3MoeForCausalLM"])
    else:
        hf = LlamaConfig(**common, hidden_act="silu", mlp_bias=False, architectures=["LlamaForCausalLM"])
    back = moe_config_from_hf(hf, max_seq_len=cfg.max_seq_len)
    if _canonical(back) != _canonical(cfg):
        raise HFAdapterError(f"the model does not round-trip through a {hf.model_type} config")
    return hf


def _canonical(cfg: MoEConfig) -> dict:
    """Config fields that change what the model computes (the dense-layer placement normalised;
    a model whose layers are all dense builds no router or expert, so their fields are left out)."""
    d = dataclasses.asdict(cfg)
    d["dense_layers"] = sorted(i for i in range(cfg.num_layers) if cfg.is_dense_layer(i))
    for k in ("dense_first_layer", "aux_layer_ids", "router_aux_loss_coef"):
        d.pop(k)
    if len(d["dense_layers"]) == cfg.num_layers:
        for k in ("num_experts", "top_k", "expert_intermediate_size", "norm_topk_prob",
                  "shared_expert_intermediate_size"):
            d.pop(k)
    return d


def hf_disk_tensors(model: MoETransformer, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors of the HF folder (on-disk names, CPU, `dtype`, contiguous): what a serving
    engine loads, at start-up from the folder or in place (a policy sync). A tied lm_head is
    left out, as HF checkpoints with tie_word_embeddings do."""
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in to_hf_disk_state_dict(model).items()}
    if model.cfg.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    return tensors


def save_hf_folder(model: MoETransformer, out_dir, *, dtype: torch.dtype | None = None) -> Path:
    """Write `model` as a local HF folder (config.json + model.safetensors, on-disk names): Qwen3-MoE,
    or Llama for a dense model without QK-norm (hf_config_from_moe)."""
    from safetensors.torch import save_file

    dtype = dtype or model.embed_tokens.weight.dtype
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf = hf_config_from_moe(model.cfg, dtype=str(dtype).removeprefix("torch."))
    save_file(hf_disk_tensors(model, dtype), str(out / "model.safetensors"), metadata={"format": "pt"})
    hf.to_json_file(str(out / "config.json"))
    return out


# ------------------------------------------------------------------------------ loading
def build_target(cfg: MoEConfig, state_dict: dict[str, torch.Tensor], *, device=None,
                 dtype: torch.dtype | None = None) -> MoETransformer:
    """A MoETransformer holding exactly `state_dict` (specrl names), in eval mode.

    Built on the meta device first, so no random initialisation is spent on real-sized models."""
    first = next(iter(state_dict.values()))
    device = torch.device(device) if device is not None else first.device
    dtype = dtype or first.dtype
    with torch.device("meta"):
        model = MoETransformer(cfg)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_embeddings:  # to_empty makes new tensors: tie them again
        model.lm_head.weight = model.embed_tokens.weight
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    if missing or unexpected:
        raise HFAdapterError(f"HF weights do not fit the converted config (missing {sorted(missing)[:3]}, "
                             f"unexpected {sorted(unexpected)[:3]})")
    return model.eval()


def _read_folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / n for n in names]
    if files:
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            tensors.update(load_file(str(f)))
        return tensors
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if not bins:
        raise HFAdapterError(f"{folder}: no *.safetensors or pytorch_model*.bin weights")
    tensors = {}
    for f in bins:
        tensors.update(torch.load(f, map_location="cpu", weights_only=True))
    return tensors


def load_hf_target(source, *, max_seq_len: int | None = None, device=None, dtype: torch.dtype | None = None,
                   load_tokenizer: bool = True):
    """A local HF folder or an in-memory HF causal LM -> (MoETransformer, tokenizer or None).

    The returned model is an independent copy (eval mode) that the embedded engine runs. From a
    folder the tokenizer is loaded when the folder has one; nothing is ever downloaded."""
    tokenizer = None
    if hasattr(source, "config") and hasattr(source, "state_dict"):
        hf_config, hf_sd = source.config, source.state_dict()
    else:
        folder = Path(source)
        if not (folder / "config.json").is_file():
            raise HFAdapterError(f"{folder}: not a local HF model folder (no config.json)")
        from transformers import AutoConfig

        try:
            hf_config = AutoConfig.from_pretrained(folder, local_files_only=True)
        except (ValueError, KeyError, OSError) as e:
            raise HFAdapterError(f"{folder}/config.json cannot be read: {str(e).splitlines()[0]}") from None
        hf_sd = _read_folder_tensors(folder)
        if load_tokenizer and any((folder / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    cfg = moe_config_from_hf(hf_config, max_seq_len=max_seq_len)
    with torch.no_grad():
        model = build_target(cfg, to_specrl_state_dict(hf_sd, cfg), device=device, dtype=dtype)
    return model, tokenizer


def to_hf_model(model: MoETransformer, hf_config):
    """Export: a fresh HF model of `hf_config` holding `model`'s weights (then `save_pretrained`)."""
    from transformers import AutoModelForCausalLM

    mine = model.cfg.to_dict()
    theirs = moe_config_from_hf(hf_config, max_seq_len=model.cfg.max_seq_len).to_dict()
    diff = sorted(k for k in set(mine) | set(theirs) if k != "aux_layer_ids" and mine.get(k) != theirs.get(k))
    if diff:
        raise HFAdapterError(f"{hf_config.model_type}: the model's config differs from hf_config in {diff}")
    hf = AutoModelForCausalLM.from_config(hf_config)
    hf.to(model.embed_tokens.weight.dtype)
    hf.load_state_dict(to_hf_state_dict(model), strict=True)
    return hf.eval()


__all__ = ["HFAdapterError", "FAMILIES", "moe_config_from_hf", "to_specrl_state_dict", "to_hf_state_dict",
           "build_target", "load_hf_target", "to_hf_model", "to_hf_disk_state_dict", "hf_config_from_moe",
           "save_hf_folder"]
