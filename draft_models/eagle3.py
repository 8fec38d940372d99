"""EAGLE-3 draft head with SGLang/SpecForge parameter names.

Parameters (exactly the names SGLang's LlamaForCausalLMEagle3 loads):
  fc.weight                                  (H, 3 * H_target)
  midlayer.input_layernorm.weight            (H,)    norms the token embedding
  midlayer.hidden_norm.weight                (H,)    norms the hidden stream
  midlayer.self_attn.{q,k,v}_proj.weight     (heads * D, 2H)
  midlayer.self_attn.o_proj.weight           (H, heads * D)
  midlayer.post_attention_layernorm.weight   (H,)
  midlayer.mlp.{gate,up,down}_proj.weight    SwiGLU
  norm.weight, lm_head.weight                (Vd, H)
  buffers d2t (Vd,) int64, t2d (V,) bool
The token embedding is the target's `nn.Embedding`, held by reference outside the module tree:
it is in neither `parameters()` nor `state_dict()`, and no gradient reaches it (read detached),
so the policy keeps training its embedding and the draft always reads the current one.

One draft layer step (as SGLang computes it):
  h        = fc(features) if the input is a fused target feature, else the previous pre-norm output
  x        = cat([input_layernorm(embed(token)), hidden_norm(h)])      (2H)
  r        = h + o_proj(attention(q_proj(x), k_proj(x), v_proj(x)))     (RoPE on q, k)
  prenorm  = r + mlp(post_attention_layernorm(r))
  logits   = lm_head(norm(prenorm))                                     (draft vocab)
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from draft_models.config import Eagle3Config, Eagle3ConfigError
from draft_models.vocab import check_vocab, draft_logits_to_target, identity_vocab
from target_training.model import KVCache, RMSNorm, SwiGLU, apply_rope, attend, plan_attention, rope_cos_sin


class _Ref:
    """Holds the target embedding without registering it; deepcopy keeps the reference."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __deepcopy__(self, memo):
        return self


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.n_heads * self.hd, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.n_kv * self.hd, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.n_kv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.hd, cfg.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.hd)
        k = self.k_proj(x).view(B, T, self.n_kv, self.hd)
        v = self.v_proj(x).view(B, T, self.n_kv, self.hd)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def qkv(self, emb, h, cos, sin):
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], dim=-1)
        return self.self_attn.qkv(x, cos, sin)

    def finish(self, attn_out: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        r = h + self.self_attn.o_proj(attn_out)
        return r + self.mlp(self.post_attention_layernorm(r))


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: Eagle3Config, target_embedding: nn.Embedding):
        super().__init__()
        cfg.validate()
        if not isinstance(target_embedding, nn.Embedding):
            raise TypeError(f"target_embedding must be an nn.Embedding, got {type(target_embedding).__name__}")
        if target_embedding.num_embeddings != cfg.vocab_size:
            raise Eagle3ConfigError(f"vocab_size {cfg.vocab_size} != target embedding rows "
                                    f"{target_embedding.num_embeddings}")
        if target_embedding.embedding_dim != cfg.hidden_size:
            raise Eagle3ConfigError(f"hidden_size {cfg.hidden_size} != target embedding width "
                                    f"{target_embedding.embedding_dim} (the draft reads the target's embedding)")
        self.cfg = cfg
        self._embed_ref = _Ref(target_embedding)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        d2t, t2d = identity_vocab(cfg.vocab_size, cfg.draft_vocab_size)
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    # ------------------------------------------------------------------ embedding and vocab
    @property
    def embed_tokens(self) -> nn.Embedding:
        """The target's embedding (a reference; not a parameter of the draft)."""
        return self._embed_ref.obj

    def set_target_embedding(self, embedding: nn.Embedding) -> None:
        if tuple(embedding.weight.shape) != (self.cfg.vocab_size, self.cfg.hidden_size):
            raise Eagle3ConfigError(f"target embedding shape {tuple(embedding.weight.shape)} != "
                                    f"({self.cfg.vocab_size}, {self.cfg.hidden_size})")
        self._embed_ref = _Ref(embedding)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        w, own = self.embed_tokens.weight.detach(), self.fc.weight
        x = F.embedding(input_ids if input_ids.device == w.device else input_ids.to(w.device), w)
        return x if (x.device, x.dtype) == (own.device, own.dtype) else x.to(device=own.device, dtype=own.dtype)

    @torch.no_grad()
    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        problem = check_vocab(d2t, t2d, self.cfg.vocab_size, self.cfg.draft_vocab_size)
        if problem:
            raise ValueError(problem)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def to_target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """(..., Vd) -> (..., V) with -inf outside the draft vocabulary."""
        return draft_logits_to_target(draft_logits, self.d2t, self.cfg.vocab_size)

    # ------------------------------------------------------------------ the layer, in two halves
    def project(self, hidden: torch.Tensor, project: bool | None = None) -> torch.Tensor:
        """Fused target features (.., 3 * H_target) go through `fc`; own outputs (.., H) pass."""
        width = hidden.shape[-1]
        if project is None:
            if width == 3 * self.cfg.target_hidden_size:
                project = True
            elif width == self.cfg.hidden_size:
                project = False
            else:
                raise ValueError(f"hidden has width {width}; expected 3 * target_hidden_size = "
                                 f"{3 * self.cfg.target_hidden_size} or hidden_size = {self.cfg.hidden_size}")
        if hidden.dtype != self.fc.weight.dtype:
            hidden = hidden.to(self.fc.weight.dtype)
        return self.fc(hidden) if project else hidden

    def prepare(self, input_ids, hidden, positions, project: bool | None = None, n_positions: int | None = None):
        """-> (h, q, k, v): the residual stream and the RoPE'd queries/keys at `positions` (B, T),
        all below `n_positions` where given (rope_cos_sin)."""
        h = self.project(hidden, project)
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, n_positions)
        q, k, v = self.midlayer.qkv(self.embed(input_ids), h, cos, sin)
        return h, q, k, v

    def finish(self, h, q, k, v, mask: torch.Tensor | None):
        """Attention over keys k/v (B, S, Hkv, D) under mask (B|1, 1, T, S) (None = causal, S == T)
        and the rest of the layer -> (prenorm (B, T, H), logits (B, T, Vd))."""
        prenorm = self.midlayer.finish(attend(q, k, v, mask), h)
        return prenorm, self.lm_head(self.norm(prenorm))

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, *, cache: KVCache | None = None,
                slots: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None, project: bool | None = None, key_len: int | None = None,
                last: torch.Tensor | None = None):
        """One draft step over T positions per row -> (prenorm_hidden (B, T, H), logits (B, T, Vd)).

        Row i pairs input_ids[:, i] with hidden[:, i]; the caller aligns them: at draft position t
        the target feature of position t goes with the token at t + 1, and the output is the
        draft's distribution for the token at t + 2. `hidden` is the fused target feature
        (B, T, 3 * H_target) or the draft's own previous pre-norm output (B, T, H).
        Without a cache: causal attention (or attn_mask (B, T, T)), RoPE positions 0..T-1 unless
        given. With a cache: exactly like MoETransformer.forward: the T entries go to slot
        slots[b] after its current length, attend to its prefix and, among themselves, causally
        or per attn_mask (tree); the slot lengths advance by T (roll back what you drop).
        key_len: see KVCache.begin_block.
        last (B,), with a cache: every position's keys and values are written, but the layer's
        output is computed at position last[b] of row b only -> ((B, 1, H), (B, 1, Vd)). Feeding a
        long run of target features (the catch-up after plain decoding steps) costs the keys and
        values of the run, not its attention, MLP and head: only the last output drafts.
        """
        B, T = input_ids.shape
        if hidden.shape[:2] != (B, T):
            raise ValueError(f"hidden must have shape ({B}, {T}, ...), got {tuple(hidden.shape)}")
        if last is not None and (cache is None or last.shape != (B,)):
            raise ValueError(f"last needs a cache and shape ({B},), got {tuple(last.shape)}")
        block, mask, positions = plan_attention(input_ids, cache, slots, positions, attn_mask, self.cfg.max_seq_len,
                                                key_len)
        h, q, k, v = self.prepare(input_ids, hidden, positions, project, cache.max_len if cache is not None else None)
        if block is not None:
            k, v = block.write_and_read(0, k, v)
        if last is not None:  # the queries, residuals and mask rows at each row's last position
            rows = torch.arange(B, device=last.device)
            h, q = h[rows, last][:, None], q[rows, last][:, None]
            mask = mask.expand(B, *mask.shape[1:])[rows, :, last][:, :, None]  # (B, 1, 1, S)
        out = self.finish(h, q, k, v, mask)
        if block is not None:
            block.commit()
        return out

    def new_cache(self, batch_size: int, max_len: int | None = None, device=None, dtype=None) -> KVCache:
        """A 1-layer KVCache for this draft (defaults: max_seq_len, the draft's device and dtype)."""
        return KVCache(1, batch_size, max_len or self.cfg.max_seq_len, self.cfg.num_kv_heads, self.cfg.head_dim,
                       device if device is not None else self.fc.weight.device,
                       dtype if dtype is not None else self.fc.weight.dtype)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


from draft_models.ttt import ttt_loss, ttt_unroll  # noqa: E402  (re-export; ttt.py does not import this module)

__all__ = ["Eagle3Draft", "ttt_loss", "ttt_unroll"]
