"""The sampling rule of one speculative step (`SpecSampling`): how a drafter draws its proposals
and how the verifier accepts them, in one of three modes, with the same noise on both sides.

Terms as in rollout.proposer and rollout.acceptance: x_L is a row's last emitted token, x_{L+1}
the first token a step may emit; a step drafts `depth` tokens along a path.
"""
from __future__ import annotations

import copy

import torch

from rollout import acceptance as acc
from rollout.protocol import SamplingParams
from rollout.sampling import coupled_noise, process_logits


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
