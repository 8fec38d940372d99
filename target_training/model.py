"""Decoder-only MoE transformer in plain PyTorch: the RL policy and the target of speculation.

Design points that later layers rely on:
- `forward` can tap the outputs of any layers (EAGLE-3 reads three of them) at no extra cost.
- The KV cache is static and per-slot: every sequence of a batch has its own length, so
  sequences advance by different amounts (speculative acceptance), roll back to any length,
  and slots are refilled independently (continuous batching).
- An explicit boolean mask over the new block lets tree verification attend along tree
  branches without the model knowing anything about trees.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from target_training.config import MoEConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype != torch.float32:  # a no-op cast still costs a dispatch, and a decode step has dozens
            x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = self.weight * x
        return x if x.dtype == dtype else x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 n_positions: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (B, T) -> cos, sin (B, T, 1, D) in the rotate-half convention.

    With `n_positions` (every position is below it, e.g. a KV cache's length) the values are
    looked up in a table of positions 0 .. n_positions - 1, built once per head_dim, theta and
    device: two index ops where the formula takes eight, which on a small model's decode step
    (overhead-bound) is worth having. The table holds the formula's own values."""
    if n_positions is not None:
        cos, sin = _rope_table(n_positions, head_dim, theta, positions.device)
        return cos[positions], sin[positions]
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.to(torch.float32)[..., None] * inv_freq  # (B, T, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)[:, :, None, :]  # (B, T, 1, D)
    return emb.cos(), emb.sin()


_ROPE_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (head_dim, theta, device) -> (P, 1, D) x 2


def _rope_table(n_positions: int, head_dim: int, theta: float, device: torch.device):
    key = (head_dim, float(theta), device)
    table = _ROPE_TABLES.get(key)
    if table is None or table[0].shape[0] < n_positions:  # grown to the largest cache seen
        cos, sin = rope_cos_sin(torch.arange(n_positions, device=device)[None], head_dim, theta)
        table = _ROPE_TABLES[key] = (cos[0], sin[0])
    return table


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    if x.dtype == torch.float32:
        return x * cos + rotated * sin
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class KVCache:
    """Static KV cache with a length per slot.

    k, v: (L, B_max, T_max, H_kv, D). Entries at positions >= lengths[slot] are garbage and
    never attended to, so rollback is just lowering a length.
    """

    def __init__(self, num_layers: int, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        if batch_size <= 0 or max_len <= 0:
            raise ValueError(f"KVCache needs positive batch_size and max_len, got {batch_size}, {max_len}")
        shape = (num_layers, batch_size, max_len, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.max_len = max_len
        self.batch_size = batch_size

    @classmethod
    def for_model(cls, cfg: MoEConfig, batch_size: int, max_len: int | None = None,
                  device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> "KVCache":
        return cls(cfg.num_layers, batch_size, max_len or cfg.max_seq_len, cfg.num_kv_heads, cfg.head_dim, device, dtype)

    def begin_block(self, slots: torch.Tensor | None, T: int, attn_mask: torch.Tensor | None = None,
                    key_len: int | None = None) -> "CacheBlock":
        """Plan the write of T new tokens per slot: where they go and what they may attend to.

        attn_mask (B, T, W), W >= T, covers the last W keys of each row (its W - T newest cached
        entries, then the block); older keys are always visible. W = T is a plain block mask
        (tree verification); W > T lets a block see only some recent entries (draft trees).
        Default: causal within the block.

        key_len: how many keys the block reads, at least every row's length + T; callers that
        know the lengths on the host pass it (an upper bound is fine: keys past a row's block
        are masked), which spares reading the lengths back from the device (a sync on an
        accelerator). Such a caller also vouches that a W > T window fits (every row holds at
        least W - T cached entries), which is otherwise checked by reading the lengths.
        Default: read them."""
        slots = self.all_slots()[: attn_mask.shape[0] if attn_mask is not None else self.batch_size] if slots is None else slots
        B = slots.shape[0]
        device = self.lengths.device
        start = self.lengths[slots]  # (B,)
        end = int(start.max()) + T if key_len is None else key_len
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: need {end} positions, cache holds {self.max_len}")
        offs = torch.arange(T, device=device)
        write_pos = start[:, None] + offs  # (B, T)
        keys = torch.arange(end, device=device)  # (S,)
        if attn_mask is None:  # causal: a token sees every key up to its own position
            mask = keys[None, None, :] <= write_pos[:, :, None]  # (B, T, S)
            return CacheBlock(self, slots, start, write_pos, end, mask[:, None])
        W = attn_mask.shape[-1]
        if W < T or (W > T and key_len is None and bool((start < W - T).any())):  # W == T fits always
            raise ValueError(f"attn_mask window of {W} keys does not fit a block of {T} after the cached entries")
        win0 = start + T - W  # (B,) first key under the mask
        prefix = keys[None, None, :] < win0[:, None, None]  # (B, 1, S)
        rel = keys[None, :] - win0[:, None]  # (B, S) position inside the window
        in_win = (rel >= 0) & (rel < W)
        gathered = torch.gather(attn_mask, 2, rel.clamp(0, W - 1)[:, None, :].expand(B, T, end))  # (B, T, S)
        mask = (prefix | (in_win[:, None, :] & gathered))[:, None]  # (B, 1, T, S)
        return CacheBlock(self, slots, start, write_pos, end, mask)

    def all_slots(self) -> torch.Tensor:
        return torch.arange(self.batch_size, device=self.lengths.device)

    def rollback(self, slots: torch.Tensor, lengths: torch.Tensor, check: bool = True) -> None:
        """Truncate each slot to the given length (must not exceed its current length).
        `check=False` skips the range check (a host sync on an accelerator) for callers whose
        lengths are right by construction (the speculative step's own rollbacks); they pass
        tensors on the cache's device, so the write is one indexed assignment."""
        if not check:
            self.lengths[slots] = lengths
            return
        slots = torch.as_tensor(slots, device=self.lengths.device)
        lengths = torch.as_tensor(lengths, device=self.lengths.device, dtype=torch.long).expand_as(slots)
        if bool((lengths > self.lengths[slots]).any()) or bool((lengths < 0).any()):
            raise ValueError("KVCache.rollback: new length must lie in [0, current length]")
        self.lengths[slots] = lengths

    def reset(self, slots: torch.Tensor) -> None:
        self.lengths[torch.as_tensor(slots, device=self.lengths.device)] = 0

    def compact(self, slots: torch.Tensor, src_positions: torch.Tensor, dst_start: torch.Tensor) -> None:
        """Copy entries at src_positions (B, n) of each slot to dst_start[b] + arange(n), then set
        lengths to dst_start + n. Used to keep an accepted tree path and drop its siblings."""
        n = src_positions.shape[1]
        dst = dst_start[:, None] + torch.arange(n, device=src_positions.device)  # (B, n)
        rows = slots[:, None].expand_as(src_positions)
        for buf in (self.k, self.v):
            moved = buf[:, rows, src_positions]  # (L, B, n, Hkv, D) (a copy)
            buf[:, rows, dst] = moved
        self.lengths[slots] = dst_start + n


class Attention(nn.Module):
    def __init__(self, cfg: MoEConfig, layer_id: int):
        super().__init__()
        self.cfg = cfg
        self.layer_id = layer_id
        self.n_heads, self.n_kv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * self.hd, cfg.hidden_size, bias=cfg.attention_out_bias)
        # Qwen3-style QK-norm keeps logits tame; other families (cfg.qk_norm False) have none
        self.q_norm = RMSNorm(self.hd, cfg.rms_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.hd, cfg.rms_eps) if cfg.qk_norm else nn.Identity()

    def forward(self, x, cos, sin, block: CacheBlock | None, mask: torch.Tensor | None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.n_heads, self.hd))
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv, self.hd))
        v = self.v_proj(x).view(B, T, self.n_kv, self.hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if block is not None:
            k, v = block.write_and_read(self.layer_id, k, v)
            mask = block.mask
        return self.o_proj(attend(q, k, v, mask))


class SwiGLU(nn.Module):
    """The dense feed-forward (policy's first layer, the draft's MLP)."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


MOE_DISPATCHES = ("exact", "dense")  # MoE.forward's `dispatch`


class MoE(nn.Module):
    """Top-k softmax router over SwiGLU experts, with the Switch-style load-balancing loss.

    Expert weights are stacked (E, out, in) so that export to HF/Megatron names is a slice.
    With cfg.shared_expert_intermediate_size > 0, a shared SwiGLU expert scaled by a sigmoid
    gate is added to every token's output (Qwen2-MoE).
    """

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate_size
        self.cfg = cfg
        self.gate = nn.Linear(H, E, bias=False)  # the router
        self.w_gate = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w_up = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w_down = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)
        if cfg.shared_expert_intermediate_size > 0:
            self.shared_expert = SwiGLU(H, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(H, 1, bias=False)

    def forward(self, x: torch.Tensor, dispatch: str = "exact"):
        """x (B, T, H) -> (out (B, T, H), (aux loss or None, expert counts (E,))). `dispatch`
        (MOE_DISPATCHES): "exact" runs each expert on its own tokens, bitwise equal at every size;
        "dense" lets a small no-grad block take `_experts_dense` instead (no host read)."""
        B, T, H = x.shape
        flat = x.reshape(-1, H)  # (N, H)
        probs = F.softmax(self.gate(flat).float(), dim=-1)  # (N, E)
        topw, topi = probs.topk(self.cfg.top_k, dim=-1)  # (N, k)
        if self.cfg.norm_topk_prob:
            topw = topw / topw.sum(-1, keepdim=True)
        E = self.cfg.num_experts
        counts = torch.bincount(topi.reshape(-1), minlength=E)  # (E,)
        N = flat.shape[0]
        if torch.is_grad_enabled() or N > self.SORTED_DISPATCH_MAX_TOKENS:
            out = self._experts_masked(flat, topi, topw, counts)
        elif dispatch == "dense" and N <= self.DENSE_DISPATCH_MAX_TOKENS:
            out = self._experts_dense(flat, topi, topw)
        else:
            out = self._experts_sorted(flat, topi, topw, counts)
        if self.cfg.shared_expert_intermediate_size > 0:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        aux = None  # the load-balancing loss only matters where gradients flow (training)
        if torch.is_grad_enabled():
            frac_tokens = counts.float() / max(1, topi.numel())  # f_e
            aux = E * (frac_tokens * probs.mean(0)).sum()
        return out.view(B, T, H), (aux, counts)


    # Decode and verify blocks (a few to a few hundred tokens, no autograd) are dominated by
    # per-expert overhead, so they take the sorted dispatch; large blocks and every forward that
    # records gradients keep the masked one. Both run the same matmuls on the same rows in the same
    # order and accumulate each token's experts in ascending expert order, so their outputs are
    # bitwise equal; their backward passes are not (the gather's gradient sums in another order, a
    # last-bit difference that a long SFT or RL run amplifies), hence training never switches.
    SORTED_DISPATCH_MAX_TOKENS = 512
    # Opt-in ("dense", EngineConfig.moe_dispatch): a block of at most this many tokens runs every
    # expert over every token in three batched matmuls. No host read (the group sizes are never
    # needed), so a decode or verify step is sync-free up to its hand-back, and small blocks,
    # dominated by per-expert overhead, run faster. It computes E/k times the expert FLOPs, so
    # large blocks run slower, and it is not bitwise equal to the exact dispatches: a token's
    # product depends on how many rows share the matmul, so tokens and log-probs match "exact"
    # only to rounding.
    DENSE_DISPATCH_MAX_TOKENS = 32

    @staticmethod
    def _swiglu(h: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(h, w_gate)) * F.linear(h, w_up), w_down)

    def _expert(self, e: int, h: torch.Tensor) -> torch.Tensor:
        return self._swiglu(h, self.w_gate[e], self.w_up[e], self.w_down[e])

    def _experts_dense(self, flat, topi, topw) -> torch.Tensor:
        """Every expert over every token, each token's output the router-weighted sum over its
        top-k experts (weight 0 elsewhere); accumulated in float32 like the exact dispatches."""
        E, (N, H) = self.cfg.num_experts, flat.shape
        x = flat.expand(E, N, H)  # (E, N, H), a view
        y = torch.bmm(F.silu(torch.bmm(x, self.w_gate.mT)) * torch.bmm(x, self.w_up.mT), self.w_down.mT)  # (E, N, H)
        w = torch.zeros(N, E, dtype=topw.dtype, device=flat.device).scatter_(1, topi, topw)  # (N, E)
        return torch.bmm(w[:, None], y.transpose(0, 1).to(w.dtype))[:, 0].to(flat.dtype)  # (N, H)

    def _experts_masked(self, flat, topi, topw, counts) -> torch.Tensor:
        """One boolean match per expert: a host sync per expert, cheap at large token counts."""
        out = torch.zeros_like(flat)
        for e in torch.nonzero(counts).flatten().tolist():
            tok, slot = torch.nonzero(topi == e, as_tuple=True)  # tokens ascending
            out.index_add_(0, tok, (self._expert(e, flat[tok]) * topw[tok, slot, None]).to(out.dtype))
        return out

    def _experts_sorted(self, flat, topi, topw, counts) -> torch.Tensor:
        """Assignments sorted by expert once; one host sync (the group sizes) for all experts."""
        k = topi.shape[1]
        order = torch.argsort(topi.reshape(-1), stable=True)  # (N*k,) grouped by expert, tokens ascending
        tok, slot = order // k, order % k
        h = flat[tok]  # (N*k, H)
        weights = zip(self.w_gate.unbind(0), self.w_up.unbind(0), self.w_down.unbind(0))  # 3 ops, not 3 per expert
        ys, start = [], 0
        for n, expert_weights in zip(counts.tolist(), weights):
            if n:
                ys.append(self._swiglu(h[start:start + n], *expert_weights))
                start += n
        y = torch.cat(ys) * topw[tok, slot, None]  # (N*k, H)
        # index_add_ on CPU adds in index order, so each token sums its experts in ascending order
        return torch.zeros_like(flat).index_add_(0, tok, y.to(flat.dtype))


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        dense = cfg.is_dense_layer(layer_id)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.dense_intermediate_size) if dense else MoE(cfg)

    def forward(self, x, cos, sin, block, mask, moe_dispatch: str = "exact"):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, block, mask)
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoE):  # MoE also returns its router stats
            y, router = self.mlp(h, moe_dispatch)
            return x + y, router
        return x + self.mlp(h), None


@dataclass
class CacheBlock:
    """T new tokens per row being written into a KVCache (see KVCache.begin_block)."""

    cache: KVCache
    slots: torch.Tensor  # (B,)
    start: torch.Tensor  # (B,) slot lengths before the block
    write_pos: torch.Tensor  # (B, T) cache positions of the new tokens (= their default RoPE positions)
    key_len: int  # S: keys 0..S-1 are read
    mask: torch.Tensor  # (B, 1, T, S) bool, True = attend

    def write_and_read(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, T, Hkv, D) of one layer and return all keys/values (B, S, Hkv, D), in k's dtype."""
        dtype = k.dtype
        c, rows = self.cache, self.slots[:, None].expand_as(self.write_pos)
        if k.dtype != c.k.dtype:  # (casts only where the dtypes differ: a no-op cast still costs a dispatch)
            k, v = k.to(c.k.dtype), v.to(c.v.dtype)
        c.k[layer, rows, self.write_pos] = k
        c.v[layer, rows, self.write_pos] = v
        keys, values = c.k[layer, self.slots, : self.key_len], c.v[layer, self.slots, : self.key_len]
        if keys.dtype != dtype:
            keys, values = keys.to(dtype), values.to(dtype)
        return keys, values

    def commit(self) -> None:
        """Advance the slot lengths past the block; callers roll back what they do not keep."""
        self.cache.lengths[self.slots] = self.start + self.write_pos.shape[1]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q (B, T, H, D), k/v (B, S, Hkv, D) -> (B, T, H*D). Causal when mask is None.
    flash-attn where it applies (CUDA, fp16/bf16, causal), else SDPA: see attention_backend."""
    from target_training import attention_backend  # local: keeps model.py importable on its own

    if q.is_cuda and attention_backend.select(q, mask) == "flash":
        return attention_backend.flash_causal(q, k, v)
    B, T = q.shape[:2]
    gqa = q.shape[2] != k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return out.transpose(1, 2).reshape(B, T, -1)


def plan_attention(input_ids: torch.Tensor, cache: KVCache | None, slots, positions, attn_mask, max_seq_len: int,
                   key_len: int | None = None):
    """Shared by every decoder here (policy and draft): validate the inputs, then either plan a
    cache block (positions default to the write positions) or a cache-free pass (causal unless
    attn_mask (B, T, T) is given). Returns (block or None, mask for attend(), positions)."""
    B, T = input_ids.shape
    if input_ids.dtype != torch.long:
        raise TypeError(f"input_ids must be int64, got {input_ids.dtype}")
    if attn_mask is not None and (attn_mask.shape[:2] != (B, T) or attn_mask.shape[2] < T
                                  or (cache is None and attn_mask.shape[2] != T)):
        raise ValueError(f"attn_mask must have shape {(B, T, T)} (or (B, T, W > T) with a cache), "
                         f"got {tuple(attn_mask.shape)}")
    if cache is None:
        if T > max_seq_len:
            raise ValueError(f"sequence of {T} tokens exceeds max_seq_len {max_seq_len}")
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        return None, (attn_mask[:, None] if attn_mask is not None else None), positions
    if slots is not None and slots.shape != (B,):
        raise ValueError(f"slots must have shape ({B},), got {tuple(slots.shape)}")
    block = cache.begin_block(slots if slots is not None else cache.all_slots()[:B], T, attn_mask, key_len)
    return block, block.mask, (block.write_pos if positions is None else positions)


@dataclass
class ModelOutput:
    logits: torch.Tensor  # (B, T, V); (N, V) at the N positions `logits_at` marks, in row-major order
    hidden: torch.Tensor  # (B, T, H) final hidden state, after the final norm
    taps: dict[int, torch.Tensor] = field(default_factory=dict)  # layer id -> (B, T, H)
    aux_loss: torch.Tensor | None = None  # load-balancing loss, summed over MoE layers (None without autograd)
    expert_counts: torch.Tensor | None = None  # (n_moe_layers, E) token assignments per expert

    def features(self, layer_ids) -> torch.Tensor:
        """EAGLE-3 fused feature: the tapped layers concatenated, (B, T, 3H)."""
        return torch.cat([self.taps[i] for i in layer_ids], dim=-1)


class MoETransformer(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([Block(cfg, i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor, *, cache: KVCache | None = None, slots: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                tap_layers=(), key_len: int | None = None, moe_dispatch: str = "exact",
                logits_at: torch.Tensor | None = None) -> ModelOutput:
        """input_ids (B, T).

        Without a cache: a full causal forward (training, log-prob recomputation); attn_mask
        (B, T, T) replaces the causal mask when given.
        With a cache: the T new tokens of each row b are written to slot slots[b] at positions
        lengths[slot] .. lengths[slot] + T - 1; they attend to the slot's cached prefix and, among
        themselves, causally or per attn_mask (B, T, T). The slot lengths advance by T; callers
        roll back whatever they do not keep. key_len: see KVCache.begin_block. moe_dispatch: see
        MoE.forward ("dense" is for inference blocks; training ignores it).
        logits_at (B, T) bool: the LM head runs at those positions only, and `logits` is (N, V) in
        row-major order of the mask (a policy update needs the answer positions alone: the head over
        a 49k vocabulary at every prompt and padding position is a large part of a small model's
        step). Logits are computed in fp32 even under autocast: they are what log-probs come from.
        """
        if moe_dispatch not in MOE_DISPATCHES:
            raise ValueError(f"moe_dispatch must be one of {MOE_DISPATCHES}, got {moe_dispatch!r}")
        block, mask, positions = plan_attention(input_ids, cache, slots, positions, attn_mask, self.cfg.max_seq_len,
                                                key_len)
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta,
                                cache.max_len if cache is not None else None)  # a cached position is below it
        x = self.embed_tokens(input_ids)
        taps: dict[int, torch.Tensor] = {}
        tap_set = set(tap_layers)
        aux_total = x.new_zeros((), dtype=torch.float32) if torch.is_grad_enabled() else None
        counts = []
        for i, layer in enumerate(self.layers):
            x, router = layer(x, cos, sin, block, mask, moe_dispatch)
            if router is not None:
                if aux_total is not None:
                    aux_total = aux_total + router[0]
                counts.append(router[1])
            if i in tap_set:
                taps[i] = x
        if block is not None:
            block.commit()
        h = self.norm(x)
        if logits_at is not None:
            with torch.autocast(h.device.type, enabled=False):
                logits = F.linear(h[logits_at].float(), self.lm_head.weight.float())
        elif torch.is_autocast_enabled(h.device.type):
            with torch.autocast(h.device.type, enabled=False):
                logits = F.linear(h.float(), self.lm_head.weight.float())
        else:
            logits = self.lm_head(h)
        return ModelOutput(logits=logits, hidden=h, taps=taps, aux_loss=aux_total,
                           expert_counts=torch.stack(counts) if counts else None)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
