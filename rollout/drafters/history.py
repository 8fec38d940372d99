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
"""
from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch

from rollout.proposer import ChainProposal, SpecStep

START = -1  # stands before an answer's first token, so answers align at their start


@dataclass
class HistoryConfig:
    """The history drafter (rollout.drafters.history)."""

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
    """The history drafter's state across generate() calls and RL steps (rollout.drafters.history)."""

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
