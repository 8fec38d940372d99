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

from dataclasses import dataclass

import torch

from rollout import acceptance as acc
from rollout.protocol import SamplingParams
from rollout.sampling import policy_logprobs, process_logits
from rollout.tree import accepted_kv_positions, gather_path, node_depths, select_nodes, tree_attention_mask


@dataclass
class SpecConfig:
    mode: str = "chain"  # "chain" or "tree"
    gamma: int = 4  # chain: draft tokens per verify; tree: depth
    tree_topk: int = 4  # children per expanded node, and nodes expanded per depth
    tree_budget: int = 12  # draft nodes verified per step (the root excluded)

    def __post_init__(self) -> None:
        if self.mode not in ("chain", "tree"):
            raise ValueError(f"SpecConfig.mode must be 'chain' or 'tree', got {self.mode!r}")
        for name in ("gamma", "tree_topk", "tree_budget"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SpecConfig.{name} must be positive, got {getattr(self, name)}")


class Speculator:
    """Holds the draft head and speculation settings; `begin` makes the per-generate session."""

    def __init__(self, draft, config: SpecConfig | None = None):
        self.draft = draft.eval()
        self.config = config or SpecConfig()
        self.enabled = True
        self.controller = None  # optional: decides per step whether to speculate (specrl.controller)

    def set_draft(self, draft) -> None:
        """Hot swap: the next generate() call (or the next step, between calls) uses this draft."""
        self.draft = draft.eval()

    def block_slack(self) -> int:
        """Most cache positions one verify block can write past the last kept token."""
        c = self.config
        if c.mode == "chain":
            return c.gamma + 1
        return 1 + c.tree_topk + (c.gamma - 1) * c.tree_topk ** 2  # every drafted candidate, at worst

    def begin(self, n_slots: int, max_len: int) -> "SpecSession":
        return SpecSession(self, n_slots, max_len + self.block_slack())


class SpecSession:
    def __init__(self, spec: Speculator, n_slots: int, max_len: int):
        self.spec, self.cfg, self.draft = spec, spec.config, spec.draft
        dev = self.draft.fc.weight.device
        self.cache = self.draft.new_cache(n_slots, max_len, dev)
        self.pending: list[list[torch.Tensor]] = [[] for _ in range(n_slots)]  # features not yet fed to the draft
        self.max_len = max_len

    # -- hooks called by the engine -------------------------------------------------------
    def should_speculate(self, n_active: int) -> bool:
        if not self.spec.enabled:
            return False
        ctrl = self.spec.controller
        return ctrl.should_speculate(n_active) if ctrl is not None else True

    def on_prefill(self, slot_ids: torch.Tensor, ids: torch.Tensor, feats: torch.Tensor, lens: torch.Tensor) -> None:
        self.cache.reset(slot_ids)
        for r, s in enumerate(slot_ids.tolist()):
            self.pending[s] = [feats[r, : int(lens[r])]]

    def on_plain_step(self, slot_ids: torch.Tensor, ids: torch.Tensor, out) -> None:
        feats = out.features(self.draft.cfg.aux_layer_ids)
        for r, s in enumerate(slot_ids.tolist()):
            self.pending[s].append(feats[r])

    # -- one speculative step ------------------------------------------------------------
    def step(self, engine, cache, active: list[int], states, params: SamplingParams, capture: bool) -> None:
        slots = torch.tensor(active, device=cache.lengths.device)
        L = cache.lengths[slots]  # (B,)
        depth = self.cfg.gamma  # the caches carry `block_slack` spare positions for the verify block
        h_last, q_last = self._feed_pending(slots, states)  # (B, H), (B, Vd)
        ctx = _Sampling(params, engine, states)
        if self.cfg.mode == "chain":
            tokens, parents, draft_logp, valid, verified = self._draft_chain(slots, h_last, q_last, depth, ctx)
        else:
            tokens, parents, draft_logp, valid, verified = self._draft_tree(slots, h_last, q_last, depth, ctx)
        self.cache.rollback(slots, L)
        # verify: block = [x_L, drafts...]; positions = L + depth in the tree
        roots = torch.tensor([s.last_token for s in states], device=slots.device)
        block_tokens = torch.cat([roots[:, None], tokens], 1)  # (B, N)
        block_parents = torch.cat([torch.full_like(roots[:, None], -1), parents], 1)
        block_valid = torch.cat([torch.ones_like(valid[:, :1]), valid], 1)
        block_verified = torch.cat([torch.ones_like(valid[:, :1]), verified], 1)
        mask = tree_attention_mask(block_parents, block_verified)
        positions = L[:, None] + node_depths(block_parents)
        out = engine.model(block_tokens, cache=cache, slots=slots, positions=positions, attn_mask=mask,
                           tap_layers=engine.model.cfg.feature_layer_ids)
        target_logp = ctx.process(out.logits)  # (B, N, V)
        path, n_acc, next_tok = ctx.verify(block_parents, block_tokens, block_valid, block_verified,
                                           draft_logp, target_logp, out.logits)
        # keep the accepted path's KV entries contiguous after position L
        src, n_keep = accepted_kv_positions(path, L)
        for r in range(len(active)):
            k = int(n_keep[r])
            cache.compact(slots[r : r + 1], src[r : r + 1, :k], L[r : r + 1])
        feats = gather_path(path, out.features(engine.model.cfg.feature_layer_ids), fill=0)  # (B, W, 3H)
        lp_all = policy_logprobs(out.logits, params.temperature)  # (B, N, V)
        path_lp = gather_path(path, lp_all, fill=0)  # (B, W, V)
        for r, (slot, st) in enumerate(zip(active, states)):
            k = int(n_keep[r])  # root + accepted drafts
            self.pending[slot] = [feats[r, :k]]
            if capture:
                st.features.append(feats[r, :k].to(torch.float16).cpu())
            emitted = [int(t) for t in block_tokens[r, path[r, 1:k]]] + [int(next_tok[r])]
            drafted_depth = int(node_depths(block_parents[r : r + 1]).masked_fill(~block_valid[r : r + 1], 0).max())
            if st.spec is not None:
                st.spec.record(drafted_depth, k - 1)
            for i, t in enumerate(emitted):
                if not engine.append_token(st, t, float(path_lp[r, i, t]), params):
                    break

    # -- drafting ------------------------------------------------------------------------
    def _feed_pending(self, slots: torch.Tensor, states):
        """Feed pairs (f_t, x_{t+1}) for t = D .. L-1 of every slot; return the last output."""
        feats = [torch.cat(self.pending[s], 0) for s in slots.tolist()]
        n = torch.tensor([f.shape[0] for f in feats], device=slots.device)
        M = int(n.max())
        D = self.cache.lengths[slots]
        B = len(feats)
        dtype = self.draft.fc.weight.dtype
        hidden = torch.zeros(B, M, feats[0].shape[-1], dtype=dtype, device=slots.device)
        ids = torch.zeros(B, M, dtype=torch.long, device=slots.device)
        for r, (f, st) in enumerate(zip(feats, states)):
            full = st.prompt + st.tokens
            d = int(D[r])
            hidden[r, : f.shape[0]] = f.to(dtype)
            ids[r, : f.shape[0]] = torch.tensor(full[d + 1 : d + 1 + f.shape[0]])
        prenorm, logits = self.draft(ids, hidden, cache=self.cache, slots=slots)
        self.cache.rollback(slots, D + n)
        rows = torch.arange(B, device=slots.device)
        return prenorm[rows, n - 1], self.draft.to_target_logits(logits[rows, n - 1])

    def _draft_step(self, slots, hidden, tokens, positions=None, mask=None):
        prenorm, logits = self.draft(tokens, hidden, cache=self.cache, slots=slots, positions=positions,
                                     attn_mask=mask)
        return prenorm, self.draft.to_target_logits(logits)

    def _draft_chain(self, slots, h, q_logits, depth: int, ctx: "_Sampling"):
        B = slots.shape[0]
        toks, qs = [], []
        for d in range(depth):
            q = ctx.process(q_logits)  # (B, V)
            t = ctx.propose(q, d)  # (B,)
            toks.append(t)
            qs.append(q)
            if d + 1 < depth:
                h, q_logits = self._draft_step(slots, h[:, None], t[:, None])
                h, q_logits = h[:, 0], q_logits[:, 0]
        tokens = torch.stack(toks, 1)  # (B, g)
        parents = torch.arange(depth, device=slots.device).expand(B, depth)  # block node i+1's parent is node i
        # draft_logp indexed by block node: node i proposes its child with q_i
        V = qs[0].shape[-1]
        draft_logp = torch.stack(qs + [qs[-1].new_full((B, V), float("-inf"))], 1)  # (B, g+1, V)
        valid = torch.ones(B, depth, dtype=torch.bool, device=slots.device)
        return tokens, parents, draft_logp, valid, valid

    def _draft_tree(self, slots, h_root, q_root_logits, depth: int, ctx: "_Sampling"):
        """EAGLE-2 dynamic tree: expand the top-k nodes per depth, then keep the best `budget`.

        Candidates are indexed 1..M (0 = root). The draft re-runs the expanded part of the tree
        in one block with a tree mask at each depth (it is one layer, so this is cheap) and
        rolls its cache back afterwards."""
        k, budget = self.cfg.tree_topk, self.cfg.tree_budget
        B, dev = slots.shape[0], slots.device
        L0 = self.cache.lengths[slots]
        tokens = [torch.zeros(B, dtype=torch.long, device=dev)]  # candidate 0 = root placeholder
        parents = [torch.full((B,), -1, dtype=torch.long, device=dev)]
        scores = [torch.zeros(B, device=dev)]
        valid = [torch.ones(B, dtype=torch.bool, device=dev)]
        qlist = [ctx.process(q_root_logits)]  # q of each candidate (for its children)
        hidden_of = {0: h_root}  # candidate -> draft pre-norm output after consuming it
        frontier = torch.zeros(B, 1, dtype=torch.long, device=dev)  # candidates to expand
        for d in range(depth):
            new_nodes = []
            for j in range(frontier.shape[1]):
                par = frontier[:, j]  # (B,)
                pick = list(enumerate(par.tolist()))
                q = torch.stack([qlist[p][b] for b, p in pick])  # (B, V)
                kids, kid_ok = ctx.children(q, k, d)  # (B, k)
                par_ok = torch.stack([valid[p][b] for b, p in pick])
                par_score = torch.stack([scores[p][b] for b, p in pick])
                for c in range(kids.shape[1]):
                    tokens.append(kids[:, c])
                    parents.append(par)
                    scores.append(par_score + q.gather(1, kids[:, c : c + 1])[:, 0])
                    valid.append(kid_ok[:, c] & par_ok)
                    qlist.append(None)
                    new_nodes.append(len(tokens) - 1)
            if d + 1 == depth:
                break
            # choose the k best new candidates per row to expand next
            new_idx = torch.tensor(new_nodes, device=dev)
            new_scores = torch.stack([scores[i].masked_fill(~valid[i], float("-inf")) for i in new_nodes], 1)
            top = new_scores.topk(min(k, len(new_nodes)), dim=1).indices  # (B, k')
            frontier = new_idx[top]  # (B, k') candidate ids, differ per row
            # run the draft on the expanded tree (all ancestors of the frontier) in one block
            out_h, out_q = self._run_tree_block(slots, L0, frontier, tokens, parents, hidden_of)
            for j in range(frontier.shape[1]):
                for b in range(B):
                    cid = int(frontier[b, j])
                    if qlist[cid] is None:
                        qlist[cid] = torch.full_like(qlist[0], float("-inf"))
                        hidden_of[cid] = torch.zeros_like(h_root)
                    qlist[cid][b] = ctx.process(out_q[b, j][None])[0]
                    hidden_of[cid][b] = out_h[b, j]
        cand_tokens = torch.stack(tokens, 1)  # (B, M+1)
        cand_parents = torch.stack(parents, 1)
        cand_valid = torch.stack(valid, 1)
        cand_scores = torch.stack(scores, 1)
        keep, new_parents, keep_valid = select_nodes(cand_scores, cand_parents, budget + 1, cand_valid)
        V = qlist[0].shape[-1]
        neg = torch.full((B, V), float("-inf"), device=dev)
        cand_q = torch.stack([q if q is not None else neg for q in qlist], 1)  # (B, M+1, V)
        if ctx.mode == "rejection":
            # keep pruned siblings of kept nodes in the sibling sequence (unverified) to stay lossless
            keep, new_parents, keep_valid, verified = _with_pruned_siblings(keep, new_parents, keep_valid,
                                                                           cand_parents, cand_valid)
        else:
            verified = keep_valid
        rows = torch.arange(B, device=dev)[:, None]
        tokens_k = cand_tokens[rows, keep][:, 1:]
        draft_logp = cand_q[rows, keep]  # (B, N, V) node -> q for its children
        return tokens_k, new_parents[:, 1:], draft_logp, keep_valid[:, 1:], verified[:, 1:]

    def _run_tree_block(self, slots, L0, frontier, tokens, parents, hidden_of):
        """Draft outputs at the frontier candidates: the block holds the frontier and all their
        non-root ancestors, with a tree mask; returns (h (B, k, H), q_logits (B, k, V))."""
        B, dev = slots.shape[0], slots.device
        outs_h, outs_q = [], []
        # per row: ordered node list (ancestors first); rows may differ, pad to the same size
        rows_nodes, rows_par = [], []
        for b in range(B):
            nodes = set()
            for j in range(frontier.shape[1]):
                c = int(frontier[b, j])
                while c > 0:
                    nodes.add(c)
                    c = int(parents[c][b])
            order = sorted(nodes)
            rows_nodes.append(order)
        T = max(len(o) for o in rows_nodes)
        ids = torch.zeros(B, T, dtype=torch.long, device=dev)
        hid = torch.zeros(B, T, hidden_of[0].shape[-1], dtype=hidden_of[0].dtype, device=dev)
        par = torch.full((B, T), -1, dtype=torch.long, device=dev)
        ok = torch.zeros(B, T, dtype=torch.bool, device=dev)
        for b, order in enumerate(rows_nodes):
            pos_of = {c: i for i, c in enumerate(order)}
            for i, c in enumerate(order):
                p = int(parents[c][b])
                ids[b, i] = tokens[c][b]
                hid[b, i] = hidden_of[p][b]
                par[b, i] = pos_of.get(p, -1)
                ok[b, i] = True
        mask = tree_attention_mask(par, ok)
        positions = L0[:, None] + node_depths(par)
        h, q = self._draft_step(slots, hid, ids, positions=positions, mask=mask)
        self.cache.rollback(slots, L0)
        for b, order in enumerate(rows_nodes):
            pos_of = {c: i for i, c in enumerate(order)}
            sel = [pos_of[int(c)] for c in frontier[b].tolist()]
            outs_h.append(h[b, sel])
            outs_q.append(q[b, sel])
        return torch.stack(outs_h), torch.stack(outs_q)


def _with_pruned_siblings(keep, new_parents, keep_valid, cand_parents, cand_valid):
    """Rejection sampling over siblings needs every drafted sibling that precedes an accepted
    one in draw order; pruned siblings whose parent is kept are added back as unverified."""
    B = keep.shape[0]
    rows_keep, rows_par, rows_valid, rows_ver = [], [], [], []
    for b in range(B):
        kept = [int(c) for c, v in zip(keep[b].tolist(), keep_valid[b].tolist()) if v]
        kept_set = set(kept)
        extra = [c for c in range(cand_parents.shape[1]) if c not in kept_set and bool(cand_valid[b, c])
                 and int(cand_parents[b, c]) in kept_set]
        nodes = sorted(kept + extra)
        pos = {c: i for i, c in enumerate(nodes)}
        rows_keep.append(nodes)
        rows_par.append([pos[int(cand_parents[b, c])] if c != 0 else -1 for c in nodes])
        rows_ver.append([c in kept_set for c in nodes])
    W = max(len(n) for n in rows_keep)
    dev = keep.device
    out_keep = torch.zeros(B, W, dtype=torch.long, device=dev)
    out_par = torch.full((B, W), -1, dtype=torch.long, device=dev)
    out_valid = torch.zeros(B, W, dtype=torch.bool, device=dev)
    out_ver = torch.zeros(B, W, dtype=torch.bool, device=dev)
    for b in range(B):
        n = len(rows_keep[b])
        out_keep[b, :n] = torch.tensor(rows_keep[b])
        out_par[b, :n] = torch.tensor(rows_par[b])
        out_valid[b, :n] = True
        out_ver[b, :n] = torch.tensor(rows_ver[b])
    return out_keep, out_par, out_valid, out_ver


class _Sampling:
    """The sampling rule of one generate() call, applied identically to draft and target."""

    def __init__(self, params: SamplingParams, engine, states):
        self.params = params
        self.generator = engine.generator
        if params.greedy:
            self.mode = "greedy"
        else:
            self.mode = "coupled" if engine.config.sampling_mode == "coupled" else "rejection"
        dev = engine.device
        self.rids = torch.tensor([s.request_id for s in states], device=dev)
        self.first_step = torch.tensor([len(s.tokens) for s in states], device=dev)  # index of x_{L+1}

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        return process_logits(logits, p.temperature, p.top_k, p.top_p)

    def propose(self, q: torch.Tensor, depth: int) -> torch.Tensor:
        if self.mode == "greedy":
            return q.argmax(-1)
        if self.mode == "coupled":
            return acc.propose_coupled(q, self.params.seed, self.rids, self.first_step + depth)
        return torch.multinomial(q.exp(), 1, generator=self.generator)[:, 0]

    def children(self, q: torch.Tensor, k: int, depth: int):
        if self.mode == "greedy":
            top = q.topk(min(k, q.shape[-1]), dim=-1)
            return top.indices, torch.isfinite(top.values)
        if self.mode == "coupled":
            return acc.propose_coupled_topk(q, k, self.params.seed, self.rids, self.first_step + depth)
        return acc.sample_children_without_replacement(q, k, self.generator)

    def verify(self, parents, tokens, valid, verified, draft_logp, target_logp, target_logits):
        if self.mode == "greedy":
            return acc.verify_tree_greedy(parents, tokens, verified, target_logits)
        if self.mode == "coupled":
            return acc.verify_tree_coupled(parents, tokens, verified, target_logp, self.params.seed, self.rids,
                                           self.first_step)
        return acc.verify_tree_rejection(parents, tokens, valid, draft_logp, target_logp, self.generator,
                                         verified=verified)
