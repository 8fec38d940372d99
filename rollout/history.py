"""Drafts from the GRPO group and from history: a prompt-keyed suffix drafter with no model.

GRPO samples every prompt n times in one rollout and meets the same prompts again in later
epochs, so an answer being decoded shares long spans with its in-flight siblings and with
earlier answers to the same prompt. `HistoryStore` keeps, per prompt (keyed by its token ids),
the finished answers of earlier steps (`add_rollout`) and the tokens the in-flight requests have
emitted so far (refreshed from the engine's host token lists at every speculative step). A
proposal continues the current answer the way the longest matching stretch of those answers
continued most often.

Terms. An answer is stored as [START] + its tokens (START = -1, so answers align at their first
token). The context of a request is its own stored answer. A *match* is an occurrence in a
stored answer of the context's last m tokens (m >= 2, at most `max_match`) with at least one
token after it; only the longest m found is kept. The draft walks forward: at each position it
takes the token most of the surviving matches continue with (ties: the newest answer), keeps
the matches that agree, and matches the extended context afresh when none is left. The *share*
of a drafted token is the fraction of matches that agree with it; the product of shares along
the draft estimates how many of its tokens the target will accept (`HistoryDraft.expected`).

Losslessness. A history draft is a point mass: greedy and coupled verification accept a token
iff it is the target's own choice, and rejection sampling reads `draft_logp=None` as the point
mass (accept x with probability p(x), else draw from p with x removed, renormalised):
rollout.verify. Nothing here changes what the policy emits, only how many tokens one verify
step can commit.

Memory is bounded: `max_answers_per_prompt` finished answers per prompt (the oldest policy
versions leave first) and `max_prompts` prompts (the least recently fed leave first).

`HybridProposer` speculates, per row and step, with whichever of the history draft and the
EAGLE-3 chain promises more accepted tokens; the EAGLE-3 head drafts only the rows it wins, and
not at all in a step where the history draft wins every row.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch

from rollout.proposer import ChainProposal, SpecStep, TreeProposal

START = -1  # stands before an answer's first token, so answers align at their start


@dataclass
class HistoryConfig:
    """The history drafter (rollout.history)."""

    max_match: int = 8
    """Longest context suffix (tokens) matched against stored answers."""
    siblings: bool = True
    """Draft from the in-flight answers of the same prompt (the GRPO group)."""
    history: bool = True
    """Draft from finished answers to the same prompt in earlier RL steps."""
    max_candidates: int = 64
    """Occurrences of the context's last two tokens examined per lookup, newest first: bounds the
    cost of a lookup however many answers a prompt has."""
    max_answers_per_prompt: int = 64
    """Finished answers kept per prompt; the oldest policy versions leave first."""
    max_prompts: int = 4096
    """Prompts kept; the least recently fed leave first."""
    hybrid: str = "rows"
    """Hybrid: "rows" picks one chain per row by expected accepted tokens for the cost; "tree"
    verifies the history chain and the EAGLE-3 chain of every row as two branches of one tree
    (the longer accepted run wins: the most accepted tokens, for a verify block twice as wide and
    the EAGLE-3 draft on every row; greedy and coupled sampling, rejection sampling uses "rows")."""
    hybrid_margin: float = 0.0
    """Hybrid: tokens per row by which the EAGLE-3 chain's estimate must beat the history draft's,
    on top of its measured cost, for the row to take it (HybridProposer)."""

    def __post_init__(self) -> None:
        for name in ("max_match", "max_candidates", "max_answers_per_prompt", "max_prompts"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"HistoryConfig.{name} must be a positive integer, got {v!r}")
        if self.max_match < 2:
            raise ValueError(f"HistoryConfig.max_match must be >= 2, got {self.max_match}")
        if self.hybrid not in ("tree", "rows"):
            raise ValueError(f"HistoryConfig.hybrid must be 'tree' or 'rows', got {self.hybrid!r}")
        if not (self.siblings or self.history):
            raise ValueError("HistoryConfig needs siblings or history (or both) switched on")
        if isinstance(self.hybrid_margin, bool) or not isinstance(self.hybrid_margin, (int, float)) \
                or not math.isfinite(self.hybrid_margin):
            raise ValueError(f"HistoryConfig.hybrid_margin must be a finite number, got {self.hybrid_margin!r}")


@dataclass
class HistoryDraft:
    tokens: list[int]  # up to `depth` drafted tokens
    expected: float  # estimated accepted tokens: sum over positions of the product of shares so far


class _PromptAnswers:
    """Every stored answer to one prompt and a pair index over them: (a, b) -> [(answer id, the
    position after b)]."""

    def __init__(self):
        self.answers: dict[object, list[int]] = {}  # id -> [START] + tokens; ("done", n) or ("live", request id)
        self.pairs: dict[tuple[int, int], list[tuple[object, int]]] = {}
        self.done: deque = deque()  # ids of finished answers, oldest first
        self.n_done = 0

    def extend(self, aid, tokens) -> None:
        seq = self.answers.setdefault(aid, [START])
        start = len(seq)
        seq.extend(tokens)
        pairs = self.pairs
        for i in range(max(start, 1), len(seq)):
            pairs.setdefault((seq[i - 1], seq[i]), []).append((aid, i + 1))

    def drop(self, ids) -> None:
        ids = set(ids)
        if not ids:
            return
        for aid in ids:
            self.answers.pop(aid, None)
        for key in list(self.pairs):
            kept = [o for o in self.pairs[key] if o[0] not in ids]
            if kept:
                self.pairs[key] = kept
            else:
                del self.pairs[key]


class HistoryStore:
    """The history drafter's state across generate() calls and RL steps (rollout.history)."""

    def __init__(self, config: HistoryConfig | None = None):
        self.config = config or HistoryConfig()
        self.prompts: OrderedDict[tuple[int, ...], _PromptAnswers] = OrderedDict()
        self._live: dict[int, tuple[tuple[int, ...], int]] = {}  # request id -> (prompt key, tokens stored)
        self.seconds = 0.0  # host time spent storing and drafting
        self.stats: dict[str, dict[str, int]] = {}  # per source: rows, drafted, accepted (this generate call)
        self._calib: dict[int, list] = {}  # bucket of a history draft's estimate -> [estimates, accepted, rows]

    # -- feeding ---------------------------------------------------------------------------
    def _entry(self, key: tuple[int, ...]) -> _PromptAnswers:
        entry = self.prompts.get(key)
        if entry is None:
            entry = self.prompts[key] = _PromptAnswers()
            while len(self.prompts) > self.config.max_prompts:
                self.prompts.popitem(last=False)
        else:
            self.prompts.move_to_end(key)
        return entry

    def begin_call(self) -> None:
        """A new generate() call: the previous call's in-flight answers are dropped (their finished
        form arrives through `add_rollout`), and the per-source statistics restart."""
        by_prompt: dict[tuple[int, ...], list] = {}
        for rid, (key, _) in self._live.items():
            by_prompt.setdefault(key, []).append(("live", rid))
        for key, ids in by_prompt.items():
            if key in self.prompts:
                self.prompts[key].drop(ids)
        self._live.clear()
        self.stats = {}
        self._calib = {}

    def add_rollout(self, trajectories) -> None:
        """Finished answers (rollout.protocol.Trajectory: prompt_ids, token_ids) of an RL step."""
        if not self.config.history:
            return
        t0 = time.perf_counter()
        for t in trajectories:
            entry = self._entry(tuple(t.prompt_ids))
            aid = ("done", entry.n_done)
            entry.n_done += 1
            entry.extend(aid, list(t.token_ids))
            entry.done.append(aid)
            if len(entry.done) > self.config.max_answers_per_prompt:
                entry.drop([entry.done.popleft()])
        self.seconds += time.perf_counter() - t0

    def observe(self, states) -> None:
        """Bring the stored in-flight answers up to the engine's host token lists (RequestView)."""
        for st in states:
            key, n = self._live.get(st.request_id) or (tuple(st.prompt), 0)
            if n < len(st.tokens):
                self._entry(key).extend(("live", st.request_id), st.tokens[n:])
            self._live[st.request_id] = (key, len(st.tokens))

    # -- drafting --------------------------------------------------------------------------
    def _usable(self, aid, own) -> bool:
        if aid[0] == "live":
            return aid[1] == own or self.config.siblings
        return True

    def _match(self, entry: _PromptAnswers, ctx: list[int], own: int) -> list[tuple[list[int], int]]:
        """The longest-suffix matches of ctx that have a continuation: [(answer, position after)]."""
        cands = entry.pairs.get((ctx[-2], ctx[-1]))
        if not cands:
            return []
        best, found, seen = 1, [], 0
        answers = entry.answers
        for aid, pos in reversed(cands):  # newest first: they win ties
            if not self._usable(aid, own):
                continue
            seen += 1
            if seen > self.config.max_candidates:
                break
            seq = answers[aid]
            if pos >= len(seq):
                continue  # nothing after it (the context itself, or an answer's end)
            m, top = 2, min(self.config.max_match, pos, len(ctx))
            while m < top and seq[pos - m - 1] == ctx[-m - 1]:
                m += 1
            if m > best:
                best, found = m, [(seq, pos)]
            elif m == best:
                found.append((seq, pos))
        return found

    def draft(self, own: int, depth: int) -> HistoryDraft:
        """Up to `depth` tokens continuing request `own`'s stored answer (`observe` it first)."""
        entry = self.prompts.get(self._live[own][0])
        if entry is None:
            return HistoryDraft([], 0.0)
        ctx = entry.answers.get(("live", own))
        if ctx is None or len(ctx) < 2:
            return HistoryDraft([], 0.0)
        out: list[int] = []
        expected, chance = 0.0, 1.0
        matches = self._match(entry, ctx, own)
        while len(out) < depth and matches:
            votes: dict[int, int] = {}
            for seq, pos in matches:
                votes[seq[pos]] = votes.get(seq[pos], 0) + 1
            tok = max(votes, key=votes.get)  # the first (newest) of the most voted
            chance *= votes[tok] / len(matches)
            expected += chance
            out.append(tok)
            matches = [(seq, pos + 1) for seq, pos in matches if seq[pos] == tok and pos + 1 < len(seq)]
            if not matches and len(out) < depth:  # the matched answers end here: match the extended context
                matches = self._match(entry, ctx[-self.config.max_match:] + out, own)
        return HistoryDraft(out, expected)

    def take_seconds(self) -> float:
        """Host seconds spent storing and drafting since the last call."""
        t, self.seconds = self.seconds, 0.0
        return t

    def record(self, source: str, depth: int, accepted: list[int], expected: list[float]) -> None:
        """A verify step's rows drafted by `source`, chains of `depth`: the drafts each row accepted
        and, for history rows, its draft's estimate (kept per whole-token bucket: `calibration`)."""
        s = self.stats.setdefault(source, {"rows": 0, "drafted": 0, "accepted": 0, "expected": 0.0})
        s["rows"] += len(accepted)
        s["drafted"] += depth * len(accepted)
        s["accepted"] += sum(accepted)
        if source != "history":
            return
        s["expected"] += sum(expected)
        for k, e in zip(accepted, expected):
            b = self._calib.setdefault(min(int(e), 8), [0.0, 0.0, 0])
            b[0] += e
            b[1] += k
            b[2] += 1

    def calibration(self, expected: float | None = None) -> float:
        """Accepted history tokens per token the history drafts expected, in this call, among
        drafts whose estimate fell in the same whole-token bucket as `expected` (from 16 rows on;
        before, over all history rows; before 32 drafted tokens, 1). The shares of a few matching
        answers overstate the target's agreement, the more so the more confident the draft."""
        if expected is not None:
            b = self._calib.get(min(int(expected), 8))
            if b is not None and b[2] >= 16 and b[0] > 0:
                return b[1] / b[0]
        s = self.stats.get("history")
        if not s or s["drafted"] < 32 or s["expected"] <= 0:
            return 1.0
        return s["accepted"] / s["expected"]

    def metrics(self) -> dict:
        """Per-source acceptance of the last generate() call: alpha (accepted / drafted) and the
        share of speculative rows each source drafted."""
        rows = sum(s["rows"] for s in self.stats.values())
        out = {}
        for source, s in self.stats.items():
            out[f"rollout/{source}_rows_share"] = s["rows"] / rows if rows else 0.0
            out[f"rollout/{source}_alpha"] = s["accepted"] / s["drafted"] if s["drafted"] else 0.0
        return out


def install_history(engine, store: HistoryStore, drafter: str, spec=None) -> None:
    """Make `engine` draft with `store`: drafter "history" alone, or "hybrid" with the EAGLE-3 chain
    of the draft the engine holds. vLLM runs the history drafter in its worker (its own store,
    fed by the engine: rollout.vllm_history); the hybrid, and engines without a proposer, are
    refused in one line."""
    if hasattr(engine, "install_history"):  # vLLM: a custom proposer in its worker (rollout.vllm_history)
        if drafter != "history":
            raise ValueError(f"drafter={drafter!r} runs on the embedded engine: vLLM takes one speculative method, "
                             f"and its custom proposers see token ids only, not the hidden states EAGLE-3 reads")
        engine.install_history(store.config, spec)
        return
    spec = getattr(engine, "speculator", None)
    if spec is None or not hasattr(spec, "proposer"):
        raise ValueError(f"drafter={drafter!r} needs an engine that takes a proposer; {type(engine).__name__} "
                         f"drafts with its own")
    if drafter == "history":
        spec.proposer = lambda n_slots, max_len: HistoryProposer(store)
    elif drafter == "hybrid":
        from rollout.speculative import Eagle3Proposer

        def plain_seconds(n_active: int):  # the controller's measured plain step, when one drives the engine
            return spec.controller.plain_seconds(n_active) if spec.controller is not None else None

        spec.branches = 2 if store.config.hybrid == "tree" else 1  # the verify block holds both chains
        spec.proposer = lambda n_slots, max_len: HybridProposer(
            Eagle3Proposer(spec.draft, spec.config, n_slots, max_len), store, plain_seconds=plain_seconds)
    else:
        raise ValueError(f"unknown drafter {drafter!r}; choose history or hybrid")


def _chain(drafts: list[HistoryDraft], depth: int, device) -> torch.Tensor:
    """(B, depth) token ids: each row's draft, padded by repeating its last token (or 0)."""
    rows = []
    for d in drafts:
        t = d.tokens[:depth]
        rows.append(t + [t[-1] if t else 0] * (depth - len(t)))
    return torch.tensor(rows, dtype=torch.long, device=device)


class HistoryProposer:
    """History drafts alone (rollout.proposer.Proposer): no model, no features, chains."""

    uses_features = False

    def __init__(self, store: HistoryStore):
        self.store = store
        store.begin_call()

    def prefilled(self, slots, feats, lens) -> None:
        pass

    def decoded(self, slots, out) -> None:
        pass

    def propose(self, step: SpecStep) -> ChainProposal:
        t0 = time.perf_counter()
        store = self.store
        store.observe(step.states)
        drafts = [store.draft(st.request_id, step.depth) for st in step.states]
        self._depth, self._expected = step.depth, [d.expected for d in drafts]
        tokens = _chain(drafts, step.depth, step.slots.device)
        store.seconds += time.perf_counter() - t0
        return ChainProposal(tokens, None)

    def accepted(self, active, verdict, counts) -> None:
        self.store.record("history", self._depth, [k - 1 for k in counts], self._expected)


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
