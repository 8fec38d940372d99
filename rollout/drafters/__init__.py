"""What an engine drafts with: one description, `DrafterSpec`, taken by every engine's
`install_draft` (rollout.protocol.DraftReceiver), as vLLM's `speculative_config` takes a method.

Methods:
- "eagle3": the learned EAGLE-3 head (rollout.drafters.eagle3), a chain or a dynamic tree;
- "history": no model, drafts from the GRPO group's in-flight siblings and earlier answers to the
  same prompt (rollout.drafters.history);
- "hybrid": per row and step, whichever of the two promises more (rollout.drafters.hybrid);
- "custom": a proposer factory of the caller's (rollout.proposer.Proposer), embedded engine only.

`SpecConfig` is the shape of a proposal (chain or tree, its depth and width), which the drafter
follows and the verify block is sized from.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

METHODS = ("eagle3", "history", "hybrid", "custom")

# Upper bounds, checked before any draft cache is sized from them: a draft cache holds up to
# 1 + topk + (depth - 1) * topk**2 positions per slot, so larger values only exhaust memory.
MAX_SPEC_DEPTH = 64
MAX_TREE_TOPK = 16
MAX_TREE_BUDGET = 1024


@dataclass
class SpecConfig:
    mode: str = "chain"  # "chain" or "tree"
    gamma: int = 4  # chain: draft tokens per verify; tree: depth
    tree_topk: int = 4  # children per expanded node, and nodes expanded per depth
    tree_budget: int = 12  # draft nodes verified per step (the root excluded)

    def __post_init__(self) -> None:
        if self.mode not in ("chain", "tree"):
            raise ValueError(f"SpecConfig.mode must be 'chain' or 'tree', got {self.mode!r}")
        for name, most in (("gamma", MAX_SPEC_DEPTH), ("tree_topk", MAX_TREE_TOPK), ("tree_budget", MAX_TREE_BUDGET)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= most:
                raise ValueError(f"SpecConfig.{name} must be an integer in [1, {most}], got {v!r}")


@dataclass
class DrafterSpec:
    """One engine's drafter. `draft` (an Eagle3Draft) for eagle3 and hybrid: the engine keeps its
    own copy; `history` (a rollout.drafters.history.HistoryStore) for history and hybrid: shared
    with whoever feeds it finished answers; `proposer(n_slots, max_len)` for custom."""

    method: str = "eagle3"
    draft: object = None
    spec: SpecConfig = field(default_factory=SpecConfig)
    history: object = None
    proposer: Callable | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown drafter method {self.method!r}; choose from {', '.join(METHODS)}")
        if self.method in ("eagle3", "hybrid") and self.draft is None:
            raise ValueError(f"drafter {self.method!r} needs a draft model")
        if self.method in ("history", "hybrid") and self.history is None:
            raise ValueError(f"drafter {self.method!r} needs a history store")
        if self.method == "custom" and self.proposer is None:
            raise ValueError("drafter 'custom' needs a proposer factory")
        if self.method in ("history", "hybrid") and self.spec.mode != "chain":
            raise ValueError(f"drafter {self.method!r} drafts chains; got SpecConfig.mode={self.spec.mode!r}")

    @property
    def branches(self) -> int:
        """Chains verified side by side as branches of one tree: 2 for the hybrid's "tree" form."""
        return 2 if self.method == "hybrid" and self.history.config.hybrid == "tree" else 1
