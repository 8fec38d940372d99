"""Verification of a proposal: one target forward over the drafted block, the acceptance rule of
rollout.acceptance, and the verdict the engine commits.

Terms (as in rollout.proposer). The verify block of row b is [x_L, drafted tokens...]: causal
for a chain, under the tree's ancestor mask for a tree (node at RoPE position L + depth). The
target's logits at a block position give the distribution of the token after it, so one
forward scores every draft and yields the target's own next token after the accepted run (the
correction at the first rejection, or the bonus token). A row emits its accepted drafts and
then that token: counts[b] = accepted + 1 tokens, each with the log-prob the target gives it at
the position before it (exactly what plain decoding would record, up to float reassociation).

The target is given as a function, target(ids (B, T), positions=None, attn_mask=None,
key_len=...) -> ModelOutput, that owns the cache, the slots and anything riding along in the
forward; the verifier never sees the engine.
"""
from __future__ import annotations

from typing import Callable

import torch

from rollout.profile import tick
from rollout.proposer import ChainProposal, SpecStep, TreeProposal, Verdict
from rollout.sampling import policy_logprobs
from rollout.tree import accepted_kv_positions, gather_path, node_depths, tree_attention_mask

Target = Callable[..., object]  # target(ids, positions=None, attn_mask=None, key_len=...) -> ModelOutput


def verify(step: SpecStep, proposal: ChainProposal | TreeProposal, target: Target,
           feature_layers: tuple[int, ...] = ()) -> Verdict:
    """Score `proposal` with one target forward and accept by `step.sampling`'s rule. The target
    cache keeps the whole block; the engine trims it to the accepted run (`Verdict.counts`,
    `Verdict.kv_positions`). Nothing is read back from the device."""
    if isinstance(proposal, ChainProposal):
        return _verify_chain(step, proposal, target, feature_layers)
    return _verify_tree(step, proposal, target, feature_layers)


def _verify_chain(step: SpecStep, p: ChainProposal, target: Target, feature_layers) -> Verdict:
    block_tokens = torch.cat([step.roots[:, None], p.tokens], 1)  # (B, g+1): causal, at positions L ..
    tick(step.profiler, "draft")
    out = target(block_tokens, key_len=step.key_len + block_tokens.shape[1])
    tick(step.profiler, "verify_forward")
    n_acc, next_tok = step.sampling.verify_chain(p.tokens, p.draft_logp, out.logits)
    tick(step.profiler, "accept")
    return _verdict(step, out, feature_layers, block_tokens=block_tokens, path=None, n_acc=n_acc, next_tok=next_tok,
                    drafted_depths=p.tokens.shape[1], kv_positions=None)


def _verify_tree(step: SpecStep, p: TreeProposal, target: Target, feature_layers) -> Verdict:
    roots = step.roots
    block_tokens = torch.cat([roots[:, None], p.tokens], 1)  # (B, N): root, then the drafted nodes
    block_parents = torch.cat([torch.full_like(roots[:, None], -1), p.parents], 1)
    block_valid = torch.cat([torch.ones_like(p.valid[:, :1]), p.valid], 1)
    block_verified = torch.cat([torch.ones_like(p.valid[:, :1]), p.verified], 1)
    depths = node_depths(block_parents)  # (B, N)
    mask = tree_attention_mask(block_parents, block_verified)
    tick(step.profiler, "draft")
    out = target(block_tokens, positions=step.lengths[:, None] + depths, attn_mask=mask,
                 key_len=step.key_len + block_tokens.shape[1])
    tick(step.profiler, "verify_forward")
    path, n_acc, next_tok = step.sampling.verify_tree(block_parents, block_tokens, valid=block_valid,
                                                      verified=block_verified, draft_logp=p.draft_logp,
                                                      target_logits=out.logits, max_children=p.max_children)
    kv_positions, _ = accepted_kv_positions(path, step.lengths)  # the accepted path's entries, to move after L
    tick(step.profiler, "accept")
    drafted = depths.masked_fill(~block_valid, 0).max(1).values
    return _verdict(step, out, feature_layers, block_tokens=block_tokens, path=path, n_acc=n_acc, next_tok=next_tok,
                    drafted_depths=drafted, kv_positions=kv_positions)


def _verdict(step: SpecStep, out, feature_layers, *, block_tokens, path, n_acc, next_tok, drafted_depths,
             kv_positions) -> Verdict:
    """The emitted run of every row, its log-probs and features, gathered along the accepted path
    (path (B, W) accepted nodes root first, -1 padded; None: a chain's first n_acc + 1 nodes)."""

    def along_path(x):  # (B, N, ...) -> (B, W, ...): the accepted nodes first; later entries are never read
        return x if path is None else gather_path(path, x, fill=0)

    feats = along_path(out.features(feature_layers)) if feature_layers else None  # (B, W, 3H)
    emitted = torch.cat([along_path(block_tokens)[:, 1:], next_tok[:, None]], 1)  # (B, W)
    emitted.scatter_(1, n_acc[:, None], next_tok[:, None])
    path_logits = along_path(out.logits)  # (B, W, V): the node before each token
    emitted_lp = policy_logprobs(path_logits, step.sampling.params.temperature).gather(2, emitted[..., None])[..., 0]
    tick(step.profiler, "cache_features")
    return Verdict(emitted=emitted, counts=n_acc + 1, logprobs=emitted_lp, features=feats,
                   drafted_depths=drafted_depths, kv_positions=kv_positions)
