"""The hybrid drafter: per row and step, the history draft (rollout.drafters.history) or the
EAGLE-3 chain (rollout.drafters.eagle3), whichever promises more accepted tokens for its cost;
the EAGLE-3 head drafts only the rows it wins, and not at all in a step where the history draft
wins every row. In its "tree" form both chains are verified as two branches of one tree.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from rollout.drafters.history import HistoryDraft, HistoryStore, _chain
from rollout.proposer import ChainProposal, SpecStep, TreeProposal


class HybridProposer:
    """Per row and step, the history draft or the EAGLE-3 chain, whichever promises more accepted
    tokens for its cost (rollout.proposer.Proposer).

    Estimates, in accepted tokens per row: EAGLE-3's is what its rows accepted so far in this call
    (scaled to this step's chain; before 32 rows, sum_i alpha^i at the prior `eagle_alpha`);
    history's is the draft's `expected` times the store's calibration for drafts that confident.
    A history draft costs nothing on the device; an EAGLE-3 draft over k rows costs the seconds a
    line fitted to its measured chain drafts in this call predicts (the feed of pending features
    left out: every row owes it, and a skipped row's grows into one wider forward later), counted
    in tokens at the measured seconds per token of a plain step of this batch size
    (`plain_seconds`, the controller's; without it the cost is taken as 0). The head takes the k
    rows where it beats history by most (less `HistoryConfig.hybrid_margin` each), k maximising
    the summed gain less that cost.

    The EAGLE-3 head is fed and drafts only the rows it wins, and not at all in a step where history
    wins every row; the rows it skipped keep their pending features, which it feeds the next time
    it drafts them."""

    uses_features = True

    def __init__(self, eagle, store: HistoryStore, eagle_alpha: float = 0.6, plain_seconds=None):
        self.eagle, self.store = eagle, store
        self.eagle_alpha = eagle_alpha
        self.plain_seconds = plain_seconds  # n_active -> seconds of a plain step, or None
        self._fit = [0.0] * 5  # decayed sums (weight, rows, seconds, rows^2, rows x seconds) of its drafts
        store.begin_call()
        self._fed: list[bool] = []  # rows the EAGLE-3 head was fed (and drafted) this step
        self._source: list[str] = []
        self._expected: list[float] = []
        self._depth = 0

    def prefilled(self, slots, feats, lens) -> None:
        self.eagle.prefilled(slots, feats, lens)

    def decoded(self, slots, out) -> None:
        self.eagle.decoded(slots, out)

    def _eagle_expected(self, g: int) -> float:
        """Accepted tokens per row of an EAGLE-3 chain of g: measured on its rows in this call
        (accepted per row, scaled to g drafts), else sum_i alpha^i at the prior `eagle_alpha`."""
        s = self.store.stats.get("eagle3")
        if not s or s["rows"] < 32:
            return sum(self.eagle_alpha ** (i + 1) for i in range(g))
        return min(float(g), s["accepted"] / s["rows"] * g / (s["drafted"] / s["rows"]))

    def _eagle_seconds(self, rows: int) -> float | None:
        """Predicted seconds of an EAGLE-3 draft over `rows` rows: a line fitted to this call's
        measured drafts (decayed least squares; proportional while one row count was seen)."""
        w, sk, st, skk, skt = self._fit
        if w == 0:
            return None
        mk, mt = sk / w, st / w
        var = skk / w - mk * mk
        if var <= 1e-6 * mk * mk:
            return mt / mk * rows
        slope = max((skt / w - mk * mt) / var, 0.0)
        return max(mt - slope * mk, 0.0) + slope * rows

    def _time_eagle(self, seconds: float, rows: int) -> None:
        d = 0.9
        w, sk, st, skk, skt = (x * d for x in self._fit)
        self._fit = [w + 1, sk + rows, st + seconds, skk + rows * rows, skt + rows * seconds]

    def _eagle_rows(self, gains: list[float], n_active: int) -> list[int]:
        """The rows the EAGLE-3 head drafts: the k rows where it beats history by most, k maximising
        the summed gain less the draft's predicted time in tokens of a plain step of this batch."""
        plain = self.plain_seconds(n_active) if self.plain_seconds is not None else None
        order = sorted(range(len(gains)), key=lambda r: -gains[r])
        best_k, best, total = 0, 0.0, 0.0
        for k, r in enumerate(order, 1):
            total += gains[r] - self.store.config.hybrid_margin
            t = self._eagle_seconds(k)
            cost = t / (plain / n_active) if plain and t is not None else 0.0
            if total - cost > best:
                best_k, best = k, total - cost
        return sorted(order[:best_k])

    def propose(self, step: SpecStep) -> ChainProposal | TreeProposal:
        t0 = time.perf_counter()
        store, g = self.store, step.depth
        store.observe(step.states)
        drafts = [store.draft(st.request_id, g) for st in step.states]
        B, dev = len(drafts), step.slots.device
        self._depth, self._expected = g, [d.expected for d in drafts]
        if store.config.hybrid == "tree" and step.sampling.mode != "rejection":
            store.seconds += time.perf_counter() - t0
            return self._tree(step, drafts)
        e_eagle = self._eagle_expected(g)
        gains = [e_eagle - store.calibration(d.expected) * d.expected for d in drafts]
        eagle_rows = self._eagle_rows(gains, B)
        self._fed = [False] * B
        for r in eagle_rows:
            self._fed[r] = True
        self._source = ["eagle3" if fed else "history" for fed in self._fed]
        tokens = _chain(drafts, g, dev)  # (B, g): the EAGLE-3 rows are overwritten below
        store.seconds += time.perf_counter() - t0
        if not eagle_rows:
            return ChainProposal(tokens, None)
        if len(eagle_rows) == B:
            proposal = self.eagle.propose(step)
            self._time_eagle(time.perf_counter() - self.eagle.drafted_at, B)
            return proposal
        idx = torch.tensor(eagle_rows, device=dev)
        proposal = self.eagle.propose(_step_rows(step, eagle_rows, idx))
        self._time_eagle(time.perf_counter() - self.eagle.drafted_at, len(eagle_rows))
        tokens[idx] = proposal.tokens
        draft_logp = None
        if proposal.draft_logp is not None:  # rejection sampling: the history rows' q is the point mass
            draft_logp = torch.full((B, g, proposal.draft_logp.shape[-1]), float("-inf"), device=dev)
            draft_logp.scatter_(2, tokens[..., None], 0.0)
            draft_logp[idx] = proposal.draft_logp
        return ChainProposal(tokens, draft_logp, proposal.health)

    def _tree(self, step: SpecStep, drafts: list[HistoryDraft]) -> TreeProposal:
        """Both chains of every row as one tree: their common prefix once, then two branches.
        Block positions 1..g hold the history chain; g+1..2g the EAGLE-3 chain, whose first c nodes
        (the prefix it shares with the history chain, c per row) are padding and whose node c
        hangs from the history chain's node at depth c. Shared prefixes matter: two siblings with
        one token would let the first one's branch take the accepted path whatever the other's."""
        g, B, dev = step.depth, len(drafts), step.slots.device
        chain = self.eagle.propose(step)
        t0 = time.perf_counter()
        self._fed, self._source = [True] * B, ["tree"] * B
        hist = _chain(drafts, g, dev)  # (B, g)
        c = (hist == chain.tokens).long().cumprod(1).sum(1, keepdim=True)  # (B, 1) shared prefix
        j = torch.arange(g, device=dev)[None, :]  # (1, g) EAGLE-3 node index
        eagle_parents = torch.where(j == c, c, g + j).masked_fill(j < c, 0)  # (B, g) block positions
        parents = torch.cat([j.expand(B, -1), eagle_parents], 1)  # (B, 2g)
        valid = torch.cat([torch.ones(B, g, dtype=torch.bool, device=dev), j >= c], 1)
        self.store.seconds += time.perf_counter() - t0
        # greedy and coupled verification never read the draft distributions: none are made
        return TreeProposal(torch.cat([hist, chain.tokens], 1), parents, valid, valid, torch.empty(0, device=dev),
                            max_children=2, health=chain.health)

    def accepted(self, active, verdict, counts) -> None:
        if all(self._fed):
            self.eagle.accepted(active, verdict, counts)
        else:  # rows the head was not fed this step: their pending runs grow, as after a plain step
            self.eagle.forget_commit()
            for r, (slot, k) in enumerate(zip(active, counts)):
                run = verdict.features[r, :k]
                if self._fed[r]:
                    self.eagle.pending[slot] = [run]
                else:
                    self.eagle.pending[slot].append(run)
        for source in ("history", "eagle3", "tree"):
            rows = [(k - 1, e) for s, k, e in zip(self._source, counts, self._expected) if s == source]
            if rows:
                self.store.record(source, self._depth, [k for k, _ in rows], [e for _, e in rows])


def _step_rows(step: SpecStep, rows: list[int], idx: torch.Tensor) -> SpecStep:
    """The speculative step restricted to `rows` (idx: the same on the device)."""
    states = [step.states[r] for r in rows]
    return dataclasses.replace(step, active=[step.active[r] for r in rows], slots=step.slots[idx],
                               lengths=step.lengths[idx], roots=step.roots[idx], states=states,
                               key_len=max(st.n_cached for st in states), sampling=step.sampling.rows(idx))
