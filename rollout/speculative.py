"""The speculation policy of the embedded engine: what one engine step does with its drafter.

`Speculator` holds what `install_draft` was given (rollout.drafters.DrafterSpec: the engine's
own copy of the draft, the proposal's shape, the method) and the step policy, if any
(rollout.protocol.StepPolicy); `begin` makes a generate() call's `SpecSession`, which asks the
policy, step by step, whether to speculate and how deep, feeds it what each step did, estimates
the time speculation saved, and absorbs draft faults. The drafters themselves live in
rollout.drafters; the engine drives a step (rollout.engine) and this module never calls it.
"""
from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Sequence

import torch

from draft_models.checkpoint import check_draft_against_target, copy_draft_weights
from rollout.drafters import DrafterSpec, SpecConfig
from rollout.proposer import Proposer
from rollout.protocol import StepPolicy, StepStats


class Speculator:
    """The installed drafter and step policy; `begin` makes the per-generate session."""

    def __init__(self, drafter: DrafterSpec, policy: StepPolicy | None = None):
        self.drafter = drafter
        self.draft = drafter.draft.eval() if drafter.draft is not None else None
        self.config: SpecConfig = drafter.spec
        self.policy = policy
        self.branches = drafter.branches  # chains verified side by side as branches of one tree
        self.faults: list[str] = []  # one line per draft-side failure, newest last
        self.version = 0  # version of the draft weights in use (hot swap)

    def check_target(self, target) -> None:
        """Fail with a one-line error if the draft was not built for this target."""
        if self.draft is not None:
            check_draft_against_target(self.draft.cfg, target.cfg)

    @torch.no_grad()
    def load_draft_weights(self, weights: dict, version: int) -> None:
        """Hot swap: copy fresh weights (SGLang names, no embedding) into the engine's draft in
        place, so even a rollout in flight picks them up at its next step. Speculation stays
        lossless whatever the draft; only acceptance changes."""
        copy_draft_weights(self.draft, weights)
        self.version = version

    def max_depth(self) -> int:
        return max(self.config.gamma, self.policy.max_depth() if self.policy is not None else 0)

    def block_slack(self) -> int:
        """Most cache positions one verify block can write past the last kept token."""
        c, depth = self.config, self.max_depth()
        if c.mode == "chain":
            return self.branches * depth + 1
        return 1 + c.tree_topk + (depth - 1) * c.tree_topk ** 2  # every drafted candidate, at worst

    def verify_width(self, gamma: int | None = None) -> int:
        """Tokens per row in a verify block of the configured shape (a chain of `gamma` where
        given): a chain's root and gamma drafts (per branch), a tree's root and up to
        `tree_budget` nodes."""
        c = self.config
        return 1 + (self.branches * (gamma or c.gamma) if c.mode == "chain" else c.tree_budget)

    def proposer(self, n_slots: int, max_len: int) -> Proposer:
        """The drafter of one generate() call over `n_slots` cache slots of `max_len` positions."""
        method, d = self.drafter.method, self.drafter
        if method == "custom":
            return d.proposer(n_slots, max_len)
        if method == "history":
            from rollout.drafters.history import HistoryProposer

            return HistoryProposer(d.history)
        from rollout.drafters.eagle3 import Eagle3Proposer

        eagle = Eagle3Proposer(self.draft, self.config, n_slots, max_len)
        if method == "eagle3":
            return eagle
        from rollout.drafters.hybrid import HybridProposer

        policy = self.policy
        return HybridProposer(eagle, d.history,
                              plain_seconds=policy.plain_seconds if policy is not None else lambda n_active: None)

    def begin(self, n_slots: int, max_len: int) -> "SpecSession":
        """The session of one generate() call over `n_slots` cache slots of `max_len` tokens."""
        return SpecSession(self, self.proposer(n_slots, max_len + self.block_slack()))


class SpecSession:
    """One generate() call's speculation: whether and how deep each step speculates, the step
    policy's measurements, draft faults, and the call's `proposer`."""

    def __init__(self, spec: Speculator, proposer: Proposer):
        self.spec, self.cfg, self.proposer = spec, spec.config, proposer
        self.faulted = False
        self.target_error: Exception | None = None  # set by the engine when the target's verify forward fails
        # estimated seconds speculation saved in this call (step policy only; `settle` prices it at the end)
        self.saved_s: float | None = 0.0 if spec.policy is not None else None

    def should_speculate(self, n_active: int) -> bool:
        if self.faulted:
            return False
        policy = self.spec.policy
        return policy.should_speculate(n_active) if policy is not None else True

    def block_width(self, n_active: int) -> int:
        """About how many tokens per row the next step's target forward over n_active rows
        carries (the engine's fusion budget, EmbeddedEngine._can_fuse): 1 once speculation is
        off or where the policy decodes this batch size plainly, else a verify block of the
        chain it plays there (the configured one while it explores). An estimate: the engine asks
        before the step's decision. Planned as a verify block, a step the policy then decodes
        plainly pads every row to the prompts' width, which costs more than the two forwards."""
        if self.faulted:
            return 1
        policy = self.spec.policy
        gamma = policy.exploited(n_active) if policy is not None and n_active > 0 else None
        return 1 if gamma == 0 else self.spec.verify_width(gamma)

    def depth(self) -> int:
        policy = self.spec.policy
        return policy.gamma_for_step() if policy is not None else self.cfg.gamma

    def observe(self, step: StepStats) -> None:
        """Feed a step's figures to the policy, if any."""
        if self.spec.policy is not None:
            self.spec.policy.observe(step)

    def settle(self, lengths: Sequence[int], width: int, decode_s: float, spec_steps: int) -> None:
        """Price the call (step policy only): `saved_s` = the seconds plain decoding would take to
        emit the same tokens, less `decode_s`, the measured seconds of the call's engine steps.
        Plain decoding's steps are counted as the call ran them (`plain_batch_sizes`: `lengths`,
        the tokens of each row in admission order, at most `width` rows a step), each at the
        policy's measured plain-step seconds for its batch size. No cost model enters: where a
        step's cost grows with its rows (a CPU) the tail's small steps are cheap, where every step
        costs the same (a launch-bound GPU) they are not, and the batch waits for its longest row
        either way. Prefill fused into a step counts in `decode_s` only, so the saving is
        understated by it. 0 when no step speculated; None when a batch size has no measured
        plain step yet."""
        policy = self.spec.policy
        if policy is None:
            return
        if spec_steps == 0:
            self.saved_s = 0.0
            return
        seconds: dict[int, float | None] = {}
        plain = 0.0
        for n in plain_batch_sizes(lengths, width):
            if n not in seconds:
                seconds[n] = policy.plain_seconds(n)
            if seconds[n] is None:
                self.saved_s = None
                return
            plain += seconds[n]
        self.saved_s = plain - decode_s

    def on_fault(self, err: Exception) -> None:
        """A draft-side failure: plain decoding for the rest of this generate() call; the next
        call tries speculation again. A failure of the target's own verify forward
        (`target_error`) is no draft fault and plain decoding would not avoid it: raised again."""
        if err is self.target_error:
            raise err
        msg = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        self.spec.faults.append(msg)
        self.faulted = True
        warnings.warn(f"speculation disabled for this rollout after a draft failure ({msg})", RuntimeWarning)


def plain_batch_sizes(lengths: Sequence[int], width: int) -> list[int]:
    """The batch size of each engine step that plain decoding takes to emit `lengths[i]` tokens
    for row i: rows join in order as rows finish, at most `width` decoding at once, and each row's
    first token comes with its prompt's prefill (so a row of L tokens decodes in L - 1 steps).
    One entry per step. The embedded engine schedules so where enough prompts are prefilled
    ahead; with fewer, a step after more rows end at once than were prefilled runs a row short."""
    queue = deque(n - 1 for n in lengths if n > 1)
    active: list[int] = []
    sizes: list[int] = []
    while queue or active:
        while queue and len(active) < width:
            active.append(queue.popleft())
        sizes.append(len(active))
        active = [r - 1 for r in active if r > 1]
    return sizes
