"""Speculative decoding for the embedded engine: EAGLE-3 chain and dynamic-tree drafts.

Bookkeeping per cache slot (L = tokens in the target cache, x_L = the last emitted token,
not yet fed to the target):
- the target has produced fused features f_0 .. f_{L-1};
- the draft cache holds pairs (f_t, x_{t+1}) for t < D; after every step D is rolled back to
  the target's L, so at the next step the pending pairs t = D .. L-1 (all tokens known) are
  fed in one draft forward whose last output proposes x_{L+1}.
A verify step feeds [x_L, drafts...] to the target in one forward (causal for chains, a tree
mask for trees), accepts with a pure function of rollout.acceptance, keeps the KV entries of
the accepted path (rollback for chains, compaction for trees), and hands the accepted
positions' features to the next step. Log-probs come from the same verify logits, so the
RL loss sees exactly the numbers plain decoding would give (up to float reassociation).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch

from draft_models.checkpoint import check_draft_against_target, copy_draft_weights
from rollout import acceptance as acc
from rollout.engine import cached_len, hand_back
from rollout.profile import tick
from rollout.protocol import SamplingParams
from rollout.sampling import coupled_noise, policy_logprobs, process_logits
from rollout.tree import accepted_kv_positions, gather_path, node_depths, select_nodes, tree_attention_mask


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


class Speculator:
    """Holds the draft head and speculation settings; `begin` makes the per-generate session."""

    def __init__(self, draft, config: SpecConfig | None = None):
        self.draft = draft.eval()
        self.config = config or SpecConfig()
        self.enabled = True
        self.controller = None  # optional: picks plain or gamma per step (specrl.controller)
        self.faults: list[str] = []  # one line per draft-side failure, newest last
        self.version = 0  # version of the draft weights in use (hot swap)

    def check_target(self, target) -> None:
        """Fail with a one-line error if the draft was not built for this target."""
        check_draft_against_target(self.draft.cfg, target.cfg)

    def set_draft(self, draft) -> None:
        """Replace the draft module; the next generate() call uses it."""
        self.draft = draft.eval()

    @torch.no_grad()
    def load_draft_weights(self, weights: dict, version: int) -> None:
        """Hot swap: copy fresh weights (SGLang names, no embedding) into the engine's draft in
        place, so even a rollout in flight picks them up at its next step. Speculation stays
        lossless whatever the draft; only acceptance changes."""
        copy_draft_weights(self.draft, weights)
        self.version = version

    def max_depth(self) -> int:
        ctrl = self.controller
        return max([self.config.gamma] + (list(ctrl.config.gammas) if ctrl is not None else []))

    def block_slack(self) -> int:
        """Most cache positions one verify block can write past the last kept token."""
        c, depth = self.config, self.max_depth()
        if c.mode == "chain":
            return depth + 1
        return 1 + c.tree_topk + (depth - 1) * c.tree_topk ** 2  # every drafted candidate, at worst

    def verify_width(self) -> int:
        """Tokens per row in a verify block of the configured shape: a chain's root and gamma
        drafts, a tree's root and up to `tree_budget` nodes."""
        c = self.config
        return 1 + (c.gamma if c.mode == "chain" else c.tree_budget)

    def begin(self, n_slots: int, max_len: int) -> "SpecSession":
        return SpecSession(self, n_slots, max_len + self.block_slack())


class SpecSession:
    def __init__(self, spec: Speculator, n_slots: int, max_len: int):
        self.spec, self.cfg, self.draft = spec, spec.config, spec.draft
        dev = self.draft.fc.weight.device
        self.cache = self.draft.new_cache(n_slots, max_len, dev)
        self.pending: list[list[torch.Tensor]] = [[] for _ in range(n_slots)]  # features not yet fed to the draft
        self.max_len = max_len
        self.faulted = False
        self._prof = None  # the engine's StepProfiler during a step, if one is attached
        self._last_commit = _Commit([], None, None)

    # -- hooks called by the engine -------------------------------------------------------
    def should_speculate(self, n_active: int) -> bool:
        if not self.spec.enabled or self.faulted:
            return False
        ctrl = self.spec.controller
        return ctrl.should_speculate(n_active) if ctrl is not None else True

    def block_width(self) -> int:
        """About how many tokens per row the next step's target forward carries (the engine's
        fusion budget, EmbeddedEngine._can_fuse): a verify block, or 1 once speculation is off.
        An estimate: the engine asks before the step's decision, and a controller may still
        choose a plain step or a shorter chain."""
        return self.spec.verify_width() if self.spec.enabled and not self.faulted else 1

    def depth(self) -> int:
        ctrl = self.spec.controller
        return ctrl.gamma_for_step() if ctrl is not None else self.cfg.gamma

    def observe(self, n_active: int, seconds: float, result: dict | None) -> None:
        """Feed the step's measured time and acceptance to the controller, if any."""
        ctrl = self.spec.controller
        if ctrl is None:
            return
        if result is None:
            ctrl.observe_plain(n_active, seconds)
        else:
            ctrl.observe_spec(n_active, result["gamma"], seconds, result["tokens_per_seq"], result["accepted"],
                              result["drafted"])

    def on_fault(self, err: Exception) -> None:
        """A draft-side failure: plain decoding for the rest of this generate() call; the next
        call tries speculation again."""
        msg = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        self.spec.faults.append(msg)
        self.faulted = True
        warnings.warn(f"speculation disabled for this rollout after a draft failure ({msg})", RuntimeWarning)

    def on_prefill(self, slots: list[int], feats: torch.Tensor, lens: list[int]) -> None:
        """Newly admitted prompts (slot ids and lengths on the host): their features await the draft."""
        self.cache.reset(torch.tensor(slots, device=self.cache.lengths.device))
        for r, (s, n) in enumerate(zip(slots, lens)):
            self.pending[s] = [feats[r, :n]]

    def on_plain_step(self, slots: list[int], out) -> None:
        """A plain decode step of these slots: each one's new feature awaits the draft."""
        feats = out.features(self.draft.cfg.aux_layer_ids)
        for r, s in enumerate(slots):
            self.pending[s].append(feats[r])

    # -- one speculative step ------------------------------------------------------------
    def step(self, engine, cache, active: list[int], states, params: SamplingParams, capture: bool,
             prefill=None) -> dict:
        """Draft, verify and accept for the active slots; `prefill` (newly admitted prompts) rides
        along in the verify forward (EmbeddedEngine.forward).

        Chains and trees differ in drafting, the verify block and the acceptance rule
        (`_chain_block`, `_tree_block`); what follows acceptance is shared and batched
        (`_commit`). From the verify forward on, nothing is read back from the device until
        `_commit` hands the emitted tokens back in one transfer; the draft's health check
        (NaN or +inf logits) travels with it, and a bad draft is reported as a fault before any
        slot state changes (the engine then rolls the target cache back and decodes plainly)."""
        slots = torch.tensor(active, device=cache.lengths.device)
        L = cache.lengths[slots]  # (B,)
        depth = self.depth()  # the caches carry `block_slack` spare positions for the verify block
        prof = self._prof = engine.profiler
        if prof is not None:
            prof.set_gamma(depth)
        L_max = cached_len(states)  # every block's key length from the host (KVCache.begin_block)
        h_last, q_last = self._feed_pending(slots, active, states)  # (B, H), (B, V)
        draft_max = q_last.amax()  # NaN (amax propagates it) or +inf: a bad draft; -inf marks non-draft tokens
        ctx = _Sampling(params, engine, states, depth)
        roots = torch.tensor([s.last_token for s in states], device=slots.device)  # x_L
        tick(prof, "draft_features")
        block = self._chain_block if self.cfg.mode == "chain" else self._tree_block
        v = block(engine, cache, slots, L, L_max, roots, h_last, q_last, depth, ctx, params, capture, prefill)
        tick(prof, "accept")
        return self._commit(engine, active, states, params, capture, depth, v, draft_max)

    def _chain_block(self, engine, cache, slots, L, L_max: int, roots, h_last, q_last, depth: int, ctx, params,
                     capture, prefill) -> "_Verified":
        tokens, draft_logp = self._draft_chain(slots, L_max, h_last, q_last, depth, ctx)  # (B, g), (B, g, V)
        self.cache.rollback(slots, L, check=False)
        block_tokens = torch.cat([roots[:, None], tokens], 1)  # (B, g+1): causal, at positions L ..
        tick(self._prof, "draft")
        out = engine.forward(cache, slots, block_tokens, params, capture, self, prefill, key_len=L_max + depth + 1)
        tick(self._prof, "verify_forward")
        n_acc, next_tok = ctx.verify_chain(tokens, draft_logp, out.logits)
        cache.rollback(slots, L + n_acc + 1, check=False)  # the accepted prefix is already contiguous
        return _Verified(block_tokens, out, None, n_acc, next_tok, depth)

    def _tree_block(self, engine, cache, slots, L, L_max: int, roots, h_last, q_last, depth: int, ctx, params,
                    capture, prefill) -> "_Verified":
        tokens, parents, draft_logp, valid, verified = self._draft_tree(slots, L_max, h_last, q_last, depth, ctx)
        self.cache.rollback(slots, L, check=False)
        block_tokens = torch.cat([roots[:, None], tokens], 1)  # (B, N): root, then the drafted nodes
        block_parents = torch.cat([torch.full_like(roots[:, None], -1), parents], 1)
        block_valid = torch.cat([torch.ones_like(valid[:, :1]), valid], 1)
        block_verified = torch.cat([torch.ones_like(valid[:, :1]), verified], 1)
        depths = node_depths(block_parents)  # (B, N)
        mask = tree_attention_mask(block_parents, block_verified)
        tick(self._prof, "draft")
        out = engine.forward(cache, slots, block_tokens, params, capture, self, prefill,
                             positions=L[:, None] + depths, attn_mask=mask, key_len=L_max + block_tokens.shape[1])
        tick(self._prof, "verify_forward")
        path, n_acc, next_tok = ctx.verify_tree(block_parents, block_tokens, block_valid, block_verified,
                                                draft_logp, out.logits, self.cfg.tree_topk)
        # keep the accepted path's KV entries contiguous after position L
        src, n_keep = accepted_kv_positions(path, L)
        cache.compact(slots, src, L)
        cache.rollback(slots, L + n_keep, check=False)
        return _Verified(block_tokens, out, path, n_acc, next_tok, depths.masked_fill(~block_valid, 0).max(1).values)

    def _commit(self, engine, active, states, params: SamplingParams, capture: bool, depth: int,
                v: "_Verified", draft_max: torch.Tensor) -> dict:
        """Accepted features to the draft, emitted tokens and log-probs to the slot states.

        Each slot emits its accepted drafts, then the target's own token; each token's log-prob
        comes from the verify logits at the node before it (the policy's exact distribution
        there). The hand-back is one transfer of (tokens, counts) plus the log-probs; stop tokens
        and length budgets are then applied on the host by the engine's own token-by-token rule
        (`append_token`), on at most gamma + 1 tokens per row."""
        taps = engine.model.cfg.feature_layer_ids
        n_acc, next_tok = v.n_acc, v.next_tok
        B, W = v.block_tokens.shape if v.path is None else v.path.shape
        n_keep = n_acc + 1  # (B,) root + accepted drafts = tokens emitted

        def along_path(x):  # (B, N, ...) -> (B, W, ...): the accepted nodes first; later entries are never read
            return x if v.path is None else gather_path(v.path, x, fill=0)

        feats = along_path(v.out.features(taps))  # (B, W, 3H)
        emitted = torch.cat([along_path(v.block_tokens)[:, 1:], next_tok[:, None]], 1)  # (B, W)
        emitted.scatter_(1, n_acc[:, None], next_tok[:, None])
        path_logits = along_path(v.out.logits)  # (B, W, V): the node before each token
        emitted_lp = policy_logprobs(path_logits, params.temperature).gather(2, emitted[..., None])[..., 0]  # (B, W)
        tick(self._prof, "cache_features")
        per_row_depths = isinstance(v.drafted_depths, torch.Tensor)
        columns = (emitted, n_keep, draft_max.expand(B), emitted_lp) + ((v.drafted_depths,) if per_row_depths else ())
        rows = hand_back(*columns)  # (B, 2W + 2), plus a last column for a tree's drafted depths
        if not rows[0][W + 1] < math.inf:  # NaN or +inf
            raise FloatingPointError("draft produced NaN or infinite logits")
        emitted_total = drafted_total = 0
        self._last_commit = _Commit(list(active), feats, emitted)
        for r, (slot, st, row) in enumerate(zip(active, states, rows)):
            k, lp_row = int(row[W]), row[W + 2:2 * W + 2]
            drafted_depth = int(row[-1]) if per_row_depths else v.drafted_depths
            self.pending[slot] = [feats[r, :k]]
            self._last_commit.runs.append(self.pending[slot][0])
            if capture:
                st.features.append(feats[r, :k].to(torch.float16).cpu())
            if st.spec is not None:
                st.spec.record(drafted_depth, k - 1)
            emitted_total += k
            drafted_total += drafted_depth
            for token, logprob in zip(map(int, row[:k]), lp_row[:k]):
                if not engine.append_token(st, token, logprob, params):
                    break  # a stop token or the length budget: the rest is dropped
        tick(self._prof, "emit")
        return {"gamma": depth, "tokens_per_seq": emitted_total / B, "accepted": emitted_total - B,
                "drafted": drafted_total}

    # -- drafting ------------------------------------------------------------------------
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
                tokens = []
                for r in rows:  # x_{D+1} .. x_L: sliced from prompt and answer, not a copy of the whole sequence
                    st, lo, n = states[r], D[r] + 1, counts[r]
                    P = len(st.prompt)
                    tokens.append(st.prompt[lo:lo + n] + st.tokens[max(lo - P, 0):max(lo + n - P, 0)] + [0] * (M - n))
                ids = torch.tensor(tokens, device=slots.device)
            sel = None if len(groups) == 1 else torch.tensor(rows, device=slots.device)  # (G,) rows of this group
            idx = slots if sel is None else slots[sel]
            tick(self._prof, "draft_features")
            prenorm, logits = self.draft(ids, hidden, cache=self.cache, slots=idx, key_len=max(D[r] for r in rows) + M)
            # the padding's entries are dropped: each row keeps exactly its pending run
            self.cache.rollback(idx, torch.tensor([D[r] + counts[r] for r in rows], device=slots.device), check=False)
            ar = torch.arange(len(rows), device=slots.device)
            last = torch.tensor([counts[r] - 1 for r in rows], device=slots.device)
            h_g, q_g = prenorm[ar, last], self.draft.to_target_logits(logits[ar, last])  # (G, H), (G, V)
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

    def _draft_chain(self, slots, L_max: int, h, q_logits, depth: int, ctx: "_Sampling"):
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

    def _draft_tree(self, slots, L_max: int, h_root, q_root_logits, depth: int, ctx: "_Sampling"):
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


@dataclass
class _Verified:
    """What a verify block leaves for `SpecSession._commit`."""

    block_tokens: torch.Tensor  # (B, N) root, then the drafted tokens / nodes
    out: object  # the target's ModelOutput over the block
    path: torch.Tensor | None  # (B, W) accepted nodes, root first, -1 padded; None: the block's first
    #                            n_acc + 1 nodes (chains), so nothing is gathered
    n_acc: torch.Tensor  # (B,) accepted drafts
    next_tok: torch.Tensor  # (B,) the target's own token after them
    drafted_depths: torch.Tensor | int  # (B,) deepest drafted node along which acceptance was tested (a chain: gamma)


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


class _Sampling:
    """The sampling rule of one speculative step, applied identically to draft and target."""

    def __init__(self, params: SamplingParams, engine, states, depth: int):
        self.params, self.depth = params, depth
        self.generator = engine.generator
        if params.greedy:
            self.mode = "greedy"
        else:
            self.mode = "coupled" if engine.config.sampling_mode == "coupled" else "rejection"
        if self.mode == "coupled":  # the noise of tokens x_{L+1} .. x_{L+1+depth}: (B, depth + 1, V)
            dev = engine.device
            rids = torch.tensor([s.request_id for s in states], device=dev)
            first_step = torch.tensor([len(s.tokens) for s in states], device=dev)  # index of x_{L+1}
            self.noise = coupled_noise(params.seed, rids, first_step, depth + 1, engine.model.cfg.vocab_size)

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
        return acc.verify_chain_rejection(draft_tokens, draft_logp, self.process(target_logits), self.generator)

    def verify_tree(self, parents, tokens, valid, verified, draft_logp, target_logits, max_children: int):
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
