"""Exact weight conversion between specrl's `MoETransformer` and Megatron-core's `GPTModel`.

Why: the policy is trained by Megatron at scale while the embedded engine, the reference model and
the tests use specrl's names; a permutation and concatenation (no arithmetic) maps one onto the
other, with expert-parallel slicing. HF names are `target_training.hf_adapter`'s
(`to_hf_state_dict` / `to_specrl_state_dict`, the one HF <-> specrl converter).
"""
from __future__ import annotations


import torch

from target_training.config import MoEConfig
from target_training.megatron_config import MegatronBackendError, _is_dense_layer, _is_moe_layer, _qk_norm  # noqa: F401

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
