"""The contract between the engine and a drafter: what a proposer sees of a speculative step,
what it proposes, and what the engine tells it.

Terms. A step speculates for B active cache slots. Row b's target cache holds L_b tokens;
its last emitted token x_L (the root) is not yet fed to the target. A proposer guesses the
tokens after the root, either as a chain (g tokens in a row) or as a tree (N nodes, each with a
parent), together with the distributions they were drawn from when the sampling rule needs them
(rollout.verify). The engine verifies the guess with one target forward, emits the accepted
tokens and tells the proposer what was accepted.

The flow is one way: the engine calls the proposer, never the reverse. A proposer reads the
step's rows (host token histories, device slot ids) and the sampling context, and writes only
its own state (a draft model's cache, pending features). A deterministic drafter (history or
suffix matching, no model, no features) proposes a chain with `draft_logp=None`: a point mass,
which greedy and coupled verification accept token for token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

import torch

if TYPE_CHECKING:
    from rollout.profile import StepProfiler
    from rollout.spec_sampling import SpecSampling


class RequestView(Protocol):
    """One row's request as a proposer may read it (the engine's `SlotState`)."""

    request_id: int
    prompt: list[int]
    tokens: list[int]  # emitted so far; the last one is the root x_L

    @property
    def n_cached(self) -> int:
        """L: tokens of this request in the target cache (prompt + emitted - 1)."""


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


@dataclass
class SpecStep:
    """One speculative step as the proposer and the verifier see it, for B active slots."""

    active: list[int]  # (B) cache slots, on the host
    slots: torch.Tensor  # (B,) the same slots on the device
    lengths: torch.Tensor  # (B,) L: the target cache's lengths on the device
    roots: torch.Tensor  # (B,) x_L: each row's last emitted token, on the device
    states: Sequence[RequestView]  # (B) the rows' requests, on the host
    key_len: int  # max L over the rows, from the host (KVCache.begin_block's key length)
    depth: int  # tokens to draft along a path this step (a chain's g, a tree's depth)
    sampling: SpecSampling  # the step's sampling rule, random generator and device (rollout.spec_sampling)
    profiler: StepProfiler | None = None  # per-phase timing, when one is attached (rollout.profile)


@dataclass
class ChainProposal:
    """g draft tokens per row, verified as one causal block [x_L, tokens...]."""

    tokens: torch.Tensor  # (B, g) drafted tokens
    draft_logp: torch.Tensor | None  # (B, g, V) row i: the log-probs token i was drawn from; None
    #                                  when verification never reads them (greedy, coupled, a point mass)
    health: torch.Tensor | None = None  # () NaN or +inf flags a broken draft (checked at the hand-back)


@dataclass
class TreeProposal:
    """N draft nodes per row, verified as one block [x_L, nodes...] under a tree mask
    (rollout.tree: node n sits at block position n + 1, the root at 0)."""

    tokens: torch.Tensor  # (B, N) drafted nodes' tokens
    parents: torch.Tensor  # (B, N) each node's parent as a block position (0: the root)
    valid: torch.Tensor  # (B, N) bool: False on padding
    verified: torch.Tensor  # (B, N) bool: nodes the target scores (rejection keeps unverified siblings)
    draft_logp: torch.Tensor  # (B, N + 1, V) block position n -> the log-probs its children were drawn from
    max_children: int  # a bound on any node's children (the tree's top-k)
    health: torch.Tensor | None = None  # () as for chains


@runtime_checkable
class Proposer(Protocol):
    """The drafter of one generate() call (a speculator's `begin` makes it)."""

    uses_features: bool  # whether the engine taps the target's EAGLE-3 feature layers for it

    def prefilled(self, slots: list[int], feats: torch.Tensor | None, lens: list[int]) -> None:
        """Newly admitted prompts in these cache slots, of these lengths; feats (B, T, 3H) the
        target's features over them (None when the proposer uses none)."""

    def decoded(self, slots: list[int], out) -> None:
        """A plain decode step fed these slots' roots to the target (out: its ModelOutput)."""

    def propose(self, step: SpecStep) -> ChainProposal | TreeProposal:
        """The draft for `step`'s rows."""

    def accepted(self, active: list[int], verdict: Verdict, counts: list[int]) -> None:
        """The verify step of `active` emitted counts[b] tokens in row b."""
