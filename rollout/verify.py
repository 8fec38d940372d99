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

import copy
from dataclasses import dataclass
from typing import Callable

import torch

from rollout import acceptance as acc
from rollout.profile import tick
from rollout.proposer import ChainProposal, SpecStep, TreeProposal
from rollout.protocol import SamplingParams
from rollout.sampling import coupled_noise, policy_logprobs, process_logits
from rollout.tree import accepted_kv_positions, gather_path, node_depths, tree_attention_mask

Target = Callable[..., object]  # target(ids, positions=None, attn_mask=None, key_len=...) -> ModelOutput


@dataclass
class Verdict:
    """What one verify step leaves for the engine to commit, per row b of B; W is the widest run
    a row can emit (a chain's g + 1, a tree's drafted depth + 1). Entries past counts[b] are padding."""

    emitted: torch.Tensor  # (B, W) tokens to emit: the accepted drafts, then the target's own token
    counts: torch.Tensor  # (B,) tokens emitted = accepted drafts + 1
    logprobs: torch.Tensor  # (B, W) the target's log-prob of each emitted token
    features: torch.Tensor | None  # (B, W, 3H) the target's features along the accepted path, root
    #                                first (the draft's next input); None when none were tapped
    drafted_depths: torch.Tensor | int  # (B,) deepest drafted node along which acceptance was
    #                                     tested (a tree); a chain's g for every row
    kv_positions: torch.Tensor | None  # (B, W) cache positions of the accepted path's KV entries, to
    #                                    move to L.. (trees); None: already contiguous after L (chains)


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


class SpecSampling:
    """The sampling rule of one speculative step, applied identically to draft and target.

    mode: "greedy" (temperature 0), "coupled" (counter-based Gumbel noise keyed by request and
    token index; drafts use the target's noise) or "rejection" (the engine's "rng" sampling:
    standard speculative sampling with `generator`). The engine builds it: the random generator
    and the target's vocabulary size are its own; request ids and the index of each request's
    next token x_{L+1} (B,) are on the device (the coupled noise's keys)."""

    def __init__(self, params: SamplingParams, depth: int, request_ids: torch.Tensor, first_steps: torch.Tensor, *,
                 sampling_mode: str, generator: torch.Generator, vocab_size: int):
        self.params, self.depth = params, depth
        self.generator = generator
        if params.greedy:
            self.mode = "greedy"
        else:
            self.mode = "coupled" if sampling_mode == "coupled" else "rejection"
        if self.mode == "coupled":  # the noise of tokens x_{L+1} .. x_{L+1+depth}: (B, depth + 1, V)
            self.noise = coupled_noise(params.seed, request_ids, first_steps, depth + 1, vocab_size)

    def rows(self, idx: torch.Tensor) -> "SpecSampling":
        """The same rule for a subset of the step's rows (idx (b,) on the device): a proposer that
        drafts only some rows draws them with those rows' own noise."""
        sub = copy.copy(self)
        if self.mode == "coupled":
            sub.noise = self.noise[idx]
        return sub

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """Log-probs to draw from. Greedy keeps the full draft distribution (not one-hot) so trees
        can rank several children; greedy verification looks at the target's argmax only."""
        p = self.params
        if self.mode == "greedy":
            return logits.float().log_softmax(-1)
        return process_logits(logits, p.temperature, p.top_k, p.top_p)

    def propose(self, q: torch.Tensor, depth: int) -> torch.Tensor:
        if self.mode == "greedy":
            return q.argmax(-1)
        if self.mode == "coupled":
            return acc.propose_coupled(q, self.noise[:, depth])
        return torch.multinomial(q.exp(), 1, generator=self.generator)[:, 0]

    def children(self, q: torch.Tensor, k: int, depth: int):
        if self.mode == "greedy":
            top = q.topk(min(k, q.shape[-1]), dim=-1)
            return top.indices, torch.isfinite(top.values)
        if self.mode == "coupled":  # q may hold several parents per sequence: (B * P, V)
            per_row = q.shape[0] // self.noise.shape[0]
            return acc.propose_coupled_topk(q, k, self.noise[:, depth].repeat_interleave(per_row, 0))
        return acc.sample_children_without_replacement(q, k, self.generator)

    def verify_chain(self, draft_tokens, draft_logp, target_logits):
        """-> (accepted drafts (B,), the target's next token (B,)). Greedy reads the raw logits;
        the sampled modes the processed distribution."""
        if self.mode == "greedy":
            return acc.verify_chain_greedy(draft_tokens, target_logits)
        if self.mode == "coupled":
            return acc.verify_chain_coupled(draft_tokens, self.process(target_logits), self.noise)
        target_logp = self.process(target_logits)
        if draft_logp is None:  # a deterministic proposal: the point mass on each drafted token
            draft_logp = target_logp.new_full((*draft_tokens.shape, target_logp.shape[-1]), float("-inf"))
            draft_logp.scatter_(2, draft_tokens[..., None], 0.0)
        return acc.verify_chain_rejection(draft_tokens, draft_logp, target_logp, self.generator)

    def verify_tree(self, parents, tokens, *, valid, verified, draft_logp, target_logits, max_children: int):
        """-> (accepted path (B, D+1), accepted drafts (B,), the target's next token (B,)).
        The drafted depth and `max_children` (the tree's top-k) bound the walk: no read of the tree."""
        if self.mode == "greedy":  # the drafted depth bounds the path: no read of the tree's depth
            return acc.verify_tree_greedy(parents, tokens, verified, target_logits, self.depth)
        if self.mode == "coupled":
            return acc.verify_tree_coupled(parents, tokens, verified, self.process(target_logits), self.noise,
                                           self.depth)
        return acc.verify_tree_rejection(parents, tokens, valid, draft_logp, self.process(target_logits),
                                         self.generator, verified=verified, max_depth=self.depth,
                                         max_children=max_children)
