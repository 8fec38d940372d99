"""The EAGLE-3 drafter of the embedded engine: a chain or a dynamic tree (`SpecConfig.mode`)
drafted by the head that reads the target's fused features (draft_models.eagle3).

Bookkeeping per cache slot (L = tokens in the target cache, x_L = the last emitted token,
not yet fed to the target):
- the target has produced fused features f_0 .. f_{L-1};
- the draft cache holds pairs (f_t, x_{t+1}) for t < D; after every step D is rolled back to
  the target's L, so at the next step the pending pairs t = D .. L-1 (all tokens known) are
  fed in one draft forward whose last output proposes x_{L+1}.
After a verify step the engine hands the accepted positions' features back (`accepted`); they
are the next step's pending pairs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from rollout.drafters import SpecConfig
from rollout.profile import tick
from rollout.proposer import ChainProposal, SpecStep, TreeProposal
from rollout.spec_sampling import SpecSampling
from rollout.transfer import upload
from rollout.tree import select_nodes


class Eagle3Proposer:
    """The EAGLE-3 draft of one generate() call (rollout.proposer.Proposer), drafting a chain or
    a dynamic tree (`SpecConfig.mode`): its KV cache over the call's slots and each slot's
    pending features."""

    uses_features = True

    def __init__(self, draft, config: SpecConfig, n_slots: int, max_len: int):
        self.draft, self.cfg = draft, config
        dev = self.draft.fc.weight.device
        self.cache = self.draft.new_cache(n_slots, max_len, dev)
        self.pending: list[list[torch.Tensor]] = [[] for _ in range(n_slots)]  # features not yet fed to the draft
        self.max_len = max_len
        self._prof = None  # the step's StepProfiler during `propose`, if one is attached
        self._last_commit = _Commit([], None, None)

    def prefilled(self, slots: list[int], feats: torch.Tensor | None, lens: list[int]) -> None:
        """Newly admitted prompts (slot ids and lengths on the host): their features await the draft."""
        self.cache.reset(*upload(slots, device=self.cache.lengths.device))
        for r, (s, n) in enumerate(zip(slots, lens)):
            self.pending[s] = [feats[r, :n]]

    def decoded(self, slots: list[int], out) -> None:
        """A plain decode step of these slots: each one's new feature awaits the draft."""
        feats = out.features(self.draft.cfg.aux_layer_ids)
        for s, f in zip(slots, feats.unbind(0)):  # one call for the rows' views, not one index per row
            self.pending[s].append(f)

    def propose(self, step: SpecStep) -> ChainProposal | TreeProposal:
        """Feed the pending pairs, then draft `step.depth` tokens (a chain) or levels (a tree).
        The draft cache ends at the target's L again; the health value is the largest draft logit
        of the feed's last outputs (NaN, which amax propagates, or +inf: a broken draft; -inf marks tokens
        outside the draft's vocabulary)."""
        self._prof = step.profiler
        h_last, q_last = self._feed_pending(step.slots, step.active, step.states)  # (B, H), (B, V)
        health = q_last.amax()
        tick(self._prof, "draft_features")
        self.drafted_at = time.perf_counter()  # host time the feed ended (queued device work not waited for)
        if self.cfg.mode == "chain":
            tokens, draft_logp = self._draft_chain(step.slots, step.key_len, h_last, q_last, step.depth, step.sampling)
            self.cache.rollback(step.slots, step.lengths, check=False)
            return ChainProposal(tokens, draft_logp, health)  # (B, g), (B, g, V) or None
        tokens, parents, draft_logp, valid, verified = self._draft_tree(step.slots, step.key_len, h_last, q_last,
                                                                        step.depth, step.sampling)
        self.cache.rollback(step.slots, step.lengths, check=False)
        return TreeProposal(tokens, parents, valid, verified, draft_logp, self.cfg.tree_topk, health)

    def accepted(self, active: list[int], verdict, counts: list[int]) -> None:
        """Each slot's accepted run (the verdict's features and emitted tokens, sliced to its count)
        is its next pending run; kept whole for the next step's zero-copy block (`_Commit`)."""
        self._last_commit = _Commit(list(active), verdict.features, verdict.emitted)
        for r, (slot, k) in enumerate(zip(active, counts)):
            self.pending[slot] = [verdict.features[r, :k]]
            self._last_commit.runs.append(self.pending[slot][0])

    def forget_commit(self) -> None:
        """The pending runs were changed outside `accepted`: the next feed builds its block afresh."""
        self._last_commit = _Commit([], None, None)

    def _feed_pending(self, slots: torch.Tensor, active: list[int], states):
        """Feed pairs (f_t, x_{t+1}) for t = D .. L-1 of every slot; return the last output.

        One draft forward pads every row to the longest pending run and writes that many
        positions after each row's D, so a slot deep into its context beside a freshly admitted
        long prompt would run past the draft cache. The rows are therefore fed in as few groups
        as fit (`fit_groups`): one forward in the common case, two when continuous batching
        mixes a long new prompt with a slot near the context end. Each row's own entries and
        outputs are the same either way (padding sits after a row's last real position)."""
        feats = [p[0] if len(p) == 1 else torch.cat(p, 0) for p in (self.pending[s] for s in active)]
        counts = [f.shape[0] for f in feats]
        # the draft cache ends where the pending run starts, and the run ends at the target cache's
        # length, which the host knows: no read of the device
        D = [st.n_cached - n for st, n in zip(states, counts)]
        dtype = self.draft.fc.weight.dtype
        groups = fit_groups(D, counts, self.cache.max_len)
        h_last = q_last = None
        steady = self._last_commit.block(active, self.pending, max(counts)) if len(groups) == 1 else None
        for rows in groups:
            if steady is not None:
                hidden, ids = steady
                hidden, M = hidden.to(dtype), ids.shape[1]
            else:
                # every row padded to the group's longest run: (G, M, 3H) features, (G, M) tokens
                hidden = torch.nn.utils.rnn.pad_sequence([feats[r] for r in rows], batch_first=True).to(dtype)
                M = hidden.shape[1]
                tokens = []  # (G, M)
                for r in rows:  # x_{D+1} .. x_L: sliced from prompt and answer, not a copy of the whole sequence
                    st, lo, n = states[r], D[r] + 1, counts[r]
                    P = len(st.prompt)
                    tokens.append(st.prompt[lo:lo + n] + st.tokens[max(lo - P, 0):max(lo + n - P, 0)] + [0] * (M - n))
            # this group's host values in one copy: its rows, their lengths after the feed, their last positions
            up = upload(rows, [D[r] + counts[r] for r in rows], [counts[r] - 1 for r in rows],
                        *(() if steady is not None else (tokens,)), device=slots.device)
            sel, ends, last = None if len(groups) == 1 else up[0], up[1], up[2]  # (G,) each
            if steady is None:
                ids = up[3]  # (G, M)
            idx = slots if sel is None else slots[sel]
            tick(self._prof, "draft_features")
            # keys and values of the whole run; the layer's output at each row's last position only
            prenorm, logits = self.draft(ids, hidden, cache=self.cache, slots=idx, key_len=max(D[r] for r in rows) + M,
                                         last=last if M > 1 else None)
            # the padding's entries are dropped: each row keeps exactly its pending run
            self.cache.rollback(idx, ends, check=False)
            h_g, q_g = prenorm[:, 0], self.draft.to_target_logits(logits[:, 0])  # (G, H), (G, V): the last positions
            if sel is None:
                h_last, q_last = h_g, q_g
            else:
                if h_last is None:
                    h_last = h_g.new_empty(len(feats), *h_g.shape[1:])
                    q_last = q_g.new_empty(len(feats), *q_g.shape[1:])
                h_last[sel], q_last[sel] = h_g, q_g
            tick(self._prof, "draft")
        return h_last, q_last

    def _draft_step(self, slots, key_len: int, hidden, tokens, positions=None, mask=None):
        prenorm, logits = self.draft(tokens, hidden, cache=self.cache, slots=slots, positions=positions,
                                     attn_mask=mask, key_len=key_len)
        return prenorm, self.draft.to_target_logits(logits)

    def _draft_chain(self, slots, L_max: int, h, q_logits, depth: int, ctx: SpecSampling):
        """-> drafted tokens (B, g) and the distributions they were drawn from (B, g, V); greedy
        verification never reads those, so greedy drafting takes the argmax and returns None."""
        toks, qs = [], []
        for d in range(depth):
            if ctx.mode == "greedy":
                toks.append(q_logits.argmax(-1))  # (B,)
            else:
                q = ctx.process(q_logits)  # (B, V)
                toks.append(ctx.propose(q, d))
                qs.append(q)
            t = toks[-1]
            if d + 1 < depth:
                h, q_logits = self._draft_step(slots, L_max + d + 1, h[:, None], t[:, None])  # written at L + d
                h, q_logits = h[:, 0], q_logits[:, 0]
        return torch.stack(toks, 1), (torch.stack(qs, 1) if qs else None)

    def _draft_tree(self, slots, L_max: int, h_root, q_root_logits, depth: int, ctx: SpecSampling):
        """EAGLE-2 dynamic tree: expand the k best nodes of each depth, keep the best `budget`.

        Candidates are indexed 0..M-1 (0 = the root x_L). Expanded nodes are appended to the
        draft cache one depth at a time; a windowed mask lets each see only its ancestors among
        the tree entries. The draft cache is rolled back to L afterwards."""
        k, budget = self.cfg.tree_topk, self.cfg.tree_budget
        B, dev, H = slots.shape[0], slots.device, h_root.shape[-1]
        M = 1 + k + (depth - 1) * k * k
        rows = torch.arange(B, device=dev)[:, None]
        tok = torch.zeros(B, M, dtype=torch.long, device=dev)
        par = torch.full((B, M), -1, dtype=torch.long, device=dev)
        score = torch.zeros(B, M, device=dev)  # cumulative draft log-prob of the path
        valid = torch.zeros(B, M, dtype=torch.bool, device=dev)
        anc = torch.zeros(B, M, M, dtype=torch.bool, device=dev)  # ancestor-or-self
        valid[:, 0] = anc[:, 0, 0] = True
        q0 = ctx.process(q_root_logits)  # (B, V)
        cand_q = q0.new_full((B, M, q0.shape[-1]), float("-inf"))  # q of each node's children
        cand_q[:, 0] = q0

        def add_children(first: int, parents: torch.Tensor, q: torch.Tensor, d: int) -> torch.Tensor:
            kids, ok = ctx.children(q.reshape(-1, q.shape[-1]), k, d)  # (B*P, k)
            new = torch.arange(first, first + parents.shape[1] * k, device=dev)
            p_ids = parents.repeat_interleave(k, dim=1)  # (B, P*k)
            tok[:, new] = kids.reshape(B, -1)
            par[:, new] = p_ids
            score[:, new] = score.gather(1, p_ids) + q.reshape(B, -1, q.shape[-1]).gather(2, kids.reshape(B, -1, k)).reshape(B, -1)
            valid[:, new] = ok.reshape(B, -1) & valid.gather(1, p_ids)
            anc[:, new] = anc.gather(1, p_ids[..., None].expand(B, new.numel(), M))
            anc[:, new, new] = True
            return new

        new = add_children(1, torch.zeros(B, 1, dtype=torch.long, device=dev), q0[:, None], 0)
        frontier, frontier_h = new.expand(B, k), h_root[:, None].expand(B, k, H)
        cached: list[torch.Tensor] = []  # candidate ids of the tree entries in the draft cache
        L0 = self.cache.lengths[slots]
        first = 1 + k
        for d in range(1, depth):
            n_cached = len(cached) * k
            mask = torch.zeros(B, k, n_cached + k, dtype=torch.bool, device=dev)
            if cached:
                cids = torch.cat(cached, 1)  # (B, n_cached)
                a = anc.gather(1, frontier[..., None].expand(B, k, M))  # (B, k, M)
                mask[:, :, :n_cached] = a.gather(2, cids[:, None, :].expand(B, k, n_cached))
            mask[:, :, n_cached:] = torch.eye(k, dtype=torch.bool, device=dev)
            positions = (L0 + d - 1)[:, None].expand(B, k)
            # depth d's k entries go after the (d - 1) * k of the depths before
            h_out, q_logits = self._draft_step(slots, L_max + d * k, frontier_h, tok.gather(1, frontier), positions, mask)
            cached.append(frontier)
            q = ctx.process(q_logits)  # (B, k, V)
            cand_q[rows, frontier] = q
            new = add_children(first, frontier, q, d)
            first += k * k
            if d + 1 < depth:
                top = score[:, new].masked_fill(~valid[:, new], float("-inf")).topk(k, dim=1).indices  # (B, k)
                frontier = new[top]
                frontier_h = h_out.gather(1, (top // k)[..., None].expand(B, k, H))
        self.cache.rollback(slots, L0, check=False)
        keep, new_parents, keep_valid = select_nodes(score, par, budget + 1, valid)
        if ctx.mode == "rejection":
            # keep pruned siblings of kept nodes in the sibling sequence (unverified) to stay lossless
            keep, new_parents, keep_valid, verified = _with_pruned_siblings(keep, keep_valid, par, valid)
        else:
            verified = keep_valid
        draft_logp = cand_q[rows, keep]  # (B, N, V) node -> q for its children
        return tok[rows, keep][:, 1:], new_parents[:, 1:], draft_logp, keep_valid[:, 1:], verified[:, 1:]


def fit_groups(starts: list[int], counts: list[int], capacity: int) -> list[list[int]]:
    """Split rows into groups whose padded write fits a cache of `capacity` positions.

    Row r writes counts[r] entries from starts[r]; a group's forward pads to its largest count,
    so it needs max(starts) + max(counts) <= capacity. Every row fits on its own (the engine
    never lets a slot outgrow its cache). Greedy: take the row with the most entries, then every
    other row that fits beside it; repeat. One group whenever everything fits together."""
    if max(starts) + max(counts) <= capacity:  # the common case: everything fits together
        return [list(range(len(counts)))]
    order = sorted(range(len(counts)), key=lambda r: (-counts[r], r))
    groups: list[list[int]] = []
    while order:
        room = capacity - counts[order[0]]  # the group's padded width is its first row's count
        if starts[order[0]] > room:
            raise ValueError(f"KV cache overflow: a row needs {starts[order[0]] + counts[order[0]]} positions, "
                             f"cache holds {capacity}")
        group = [r for r in order if starts[r] <= room]
        groups.append(sorted(group))
        order = [r for r in order if starts[r] > room]
    return groups


@dataclass
class _Commit:
    """What the last step handed the draft: each active slot's pending run is row r of `feats`
    (B, W, 3H), paired with the tokens `emitted` (B, W), sliced to its emitted count."""

    active: list[int]
    feats: torch.Tensor | None
    emitted: torch.Tensor | None
    runs: list[torch.Tensor] = field(default_factory=list)  # the slices handed out, in `active` order

    def block(self, active: list[int], pending: list[list[torch.Tensor]], width: int):
        """In the steady state (the same slots, in the same order, and nothing fed to their
        pending runs since: no plain step, no admission) the next draft forward's padded block
        IS these tensors' first `width` columns, with no copy: (B, width, 3H) features, (B,
        width) tokens. The columns past a row's run hold other block nodes' values instead of
        zeros; they sit after the row's last real position, so no real output sees them. Else None."""
        if active != self.active or any(len(pending[s]) != 1 or pending[s][0] is not run
                                        for s, run in zip(active, self.runs)):
            return None
        return self.feats[:, :width], self.emitted[:, :width]


def _with_pruned_siblings(keep, keep_valid, cand_parents, cand_valid):
    """Rejection sampling over siblings needs every drafted sibling that precedes an accepted
    one in draw order; pruned siblings whose parent is kept are added back as unverified.
    Candidates keep their index order (parents before children). One read: the widest row's
    node count, which sizes the verify block."""
    B, M = cand_parents.shape
    dev = keep.device
    kept = torch.zeros(B, M, dtype=torch.bool, device=dev).scatter(1, keep, keep_valid)  # (B, M)
    parent_kept = kept.gather(1, cand_parents.clamp(min=0)) & (cand_parents >= 0)
    include = kept | (cand_valid & parent_kept)  # (B, M): kept nodes and their pruned siblings
    W = int(include.sum(1).max())
    idx = torch.arange(M, device=dev)
    nodes = torch.where(include, idx, M + idx).sort(1).values[:, :W]  # (B, W) included first, ascending
    out_valid = nodes < M
    nodes = torch.where(out_valid, nodes, 0)
    pos = include.long().cumsum(1) - 1  # (B, M) candidate -> its position among the row's nodes
    par = cand_parents.gather(1, nodes)  # (B, W)
    out_par = torch.where(out_valid & (par >= 0), pos.gather(1, par.clamp(min=0)), -1)
    return nodes, out_par, out_valid, kept.gather(1, nodes) & out_valid
