"""A bounded feature buffer for online EAGLE-3 draft training.

Why it exists: the policy changes at every RL step, so the draft must keep learning from the
target features of the *current* policy (docs/design.md section 1). Two sources feed it at no extra
forward pass: the rollout engine, which computes the target's hidden states at every verified
position anyway (`add_trajectories`, hard labels), and the policy trainer's own log-prob forward
on the very same sequences (`add_from_trainer_forward`, soft targets from its logits).

Records have the format of `draft_models.train.capture_features`, so `draft_models.train.collate`
and `draft_models.ttt.ttt_loss` consume them unchanged:
    {"input_ids": (T,) int64, "features": (T, 3H) half, "target_logp": (T, Vd) fp16 or None,
     "loss_mask": (T,) bool}
plus the buffer's own keys "policy_version" (int) and "weight_per_pos" ((T,) float32 or None).

Memory is bounded in bytes (every stored tensor counted, and stored in storage of its own, so
the count is what the buffer keeps alive). Each entry is tagged with the policy
version that produced it; when a new entry does not fit, the stalest entries go first (lowest
version, then oldest insertion): features of an old policy describe a target that no longer
exists. Acceptance statistics double as a training signal: sequences where the draft was rejected
most are the ones it needs to learn, so `sample(prefer_rejected=...)` can replay them more often.
"""
from __future__ import annotations

import heapq
import itertools
import time
import zlib
from collections.abc import Callable, Sequence

import torch

from draft_models.train import _LOGP_FLOOR
from draft_models.vocab import restrict_to_draft
from rollout.transfer import download, settle
from target_training.grpo import answer_lengths, logit_positions


def _draft_logp(logits: torch.Tensor, d2t: torch.Tensor, at: torch.Tensor | None, shape: tuple[int, int],
                temperature: float) -> torch.Tensor:
    """The target's log-probs at `temperature` over the draft vocabulary, not renormalised, fp16,
    clamped: restrict_to_draft(logits / T) minus the full vocabulary's logsumexp of logits / T.
    logits (B, T, V), or (N, V) at the positions `at` (B, T) marks, the rest then the floor ->
    (B, T, Vd)."""
    lg = logits.detach().float()
    if temperature != 1.0:  # dividing by 1 changes no bit: skip the op
        lg = lg / temperature
    logp = restrict_to_draft(lg, d2t.to(lg.device)) - torch.logsumexp(lg, dim=-1, keepdim=True)
    logp = logp.clamp_min(_LOGP_FLOOR).to(torch.float16)
    if at is not None:  # (N, Vd) -> (B, T, Vd), the floor where nothing was computed
        logp = logp.new_full((*shape, logp.shape[-1]), _LOGP_FLOOR).index_put_((at,), logp)
    return logp


def _rows_logits(logits: torch.Tensor, at: torch.Tensor | None, rows: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits, at) of some rows of a batch: logits (B, T, V) -> (R, T, V); or compact (N, V) at
    the positions `at` (B, T) marks (row-major, as logit_positions lays them out) -> those of the
    rows, with `at` (R, T). rows: (R,) row indices, increasing."""
    if at is None:
        return logits[rows], None
    B, T = at.shape
    keep = torch.zeros(B, dtype=torch.bool, device=at.device)
    keep[rows.to(at.device)] = True
    return logits[keep[:, None].expand(B, T)[at]], at[rows.to(at.device)]


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _own(t, dtype: torch.dtype) -> torch.Tensor:
    """`t` on the CPU as `dtype`, in storage of its own of exactly its size.

    `.to()` returns its input unchanged when device and dtype already match, and a row sliced
    from a batch tensor is a view that keeps the whole batch alive; the byte count would then
    understate what the buffer holds (several times over for rows sliced from batches). Copy
    whenever the result shares storage with the input or its storage is larger than the tensor
    itself."""
    src = torch.as_tensor(t).detach()
    out = src.to("cpu", dtype)
    shares = out.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()
    if shares or not out.is_contiguous() or out.untyped_storage().nbytes() != _nbytes(out):
        out = out.clone(memory_format=torch.contiguous_format)
    return out


class FeatureBuffer:
    """Version-tagged, byte-bounded store of draft training records (see the module docstring)."""

    def __init__(self, budget_bytes: int, feature_dtype: torch.dtype = torch.float16, seed: int = 0,
                 heldout_every: int = 0, heldout_records: int = 16, heldout_per_prompt: int = 2):
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise ValueError(f"FeatureBuffer budget_bytes must be a positive integer, got {budget_bytes!r}")
        if not feature_dtype.is_floating_point:
            raise ValueError(f"FeatureBuffer feature_dtype must be a floating dtype, got {feature_dtype}")
        self.budget_bytes = budget_bytes
        self.feature_dtype = feature_dtype
        self.seed = int(seed)
        self._gen = torch.Generator().manual_seed(self.seed)
        self._entries: dict[int, dict] = {}  # insertion id -> entry, in insertion order
        self._heap: list[tuple[int, int]] = []  # (policy_version, insertion id); lazy deletion
        self._ids = itertools.count()
        self._bytes = 0
        self.capture_seconds = 0.0  # time spent storing features from the trainer's forward (hook)
        self.counters = {"added": 0, "evicted": 0, "rejected_oversized": 0, "skipped_empty": 0,
                         "skipped_heldout": 0}  # answers to held-out prompts not stored (see heldout_prompt)
        # held-out sequences (they measure drafts; never sampled): the answers to one prompt in
        # `heldout_every` (heldout_prompt), never trained on from either source; of each such prompt
        # at most `heldout_per_prompt` answers per policy version are kept (the others are dropped:
        # a sibling answer in training would leak the prompt), the newest `heldout_records` in all
        self.heldout_every, self.heldout_records = int(heldout_every), int(heldout_records)
        self.heldout_per_prompt = int(heldout_per_prompt)
        self.heldout: list[dict] = []
        self._held_now: tuple[int, dict] = (-1, {})  # (policy version, answers kept per held prompt)
        self.heldout_only = False  # store the held-out rows only (a frozen draft is measured, not trained)
        # the rollouts' sampling temperature (0: greedy), set by the co-trainer from each rollout: the
        # held-out rows' soft targets are the target's log-probs at it, so a draft is measured under
        # the acceptance the engine sees (training rows keep the target's own distribution, T = 1)
        self.heldout_temperature = 1.0
        self.soft_targets = False  # the trainer's forward gave logits: held-out answers can be kept
        self._rows = 0  # rows offered by the trainer's forward so far

    # ------------------------------------------------------------------ core
    def __len__(self) -> int:
        return len(self._entries)

    def count(self, min_version: int | None = None) -> int:
        """Records `sample(..., min_version=min_version)` draws from (all of them: None)."""
        return sum(1 for e in self._entries.values() if min_version is None or e["policy_version"] >= min_version)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def add(self, record: dict, policy_version: int, weight_per_pos: torch.Tensor | None = None) -> bool:
        """Store one record (tensors moved to CPU, features cast to feature_dtype); evict the stalest
        entries until it fits. Returns False (and counts it) when the record alone exceeds the budget
        or has no token to predict."""
        ids = _own(record["input_ids"], torch.long).reshape(-1)
        T = ids.numel()
        feats = _own(record["features"], self.feature_dtype)
        mask = _own(record["loss_mask"], torch.bool).reshape(-1)
        logp = record.get("target_logp")
        logp = None if logp is None else _own(logp, torch.float16)
        if feats.dim() != 2 or feats.shape[0] != T or mask.numel() != T or (logp is not None and logp.shape[0] != T):
            lshape = None if logp is None else tuple(logp.shape)
            raise ValueError(f"record shapes disagree: input_ids ({T},), features {tuple(feats.shape)}, "
                             f"loss_mask {tuple(mask.shape)}, target_logp {lshape}")
        if not bool(mask.any()):
            self.counters["skipped_empty"] += 1
            return False
        w = None
        rejection = None
        if weight_per_pos is not None:
            w = _own(weight_per_pos, torch.float32).reshape(-1)
            if w.numel() != T:
                raise ValueError(f"weight_per_pos has {w.numel()} entries for {T} tokens")
            rejection = float(w[mask].mean())  # the sampling weight of the whole sequence
        entry = {"input_ids": ids, "features": feats, "target_logp": logp, "loss_mask": mask,
                 "weight_per_pos": w, "policy_version": int(policy_version), "rejection": rejection}
        size = sum(_nbytes(entry[k]) for k in ("input_ids", "features", "target_logp", "loss_mask", "weight_per_pos"))
        if size > self.budget_bytes:
            self.counters["rejected_oversized"] += 1
            return False
        while self._bytes + size > self.budget_bytes:
            self._evict_stalest()
        entry["nbytes"] = size
        key = next(self._ids)
        self._entries[key] = entry
        heapq.heappush(self._heap, (entry["policy_version"], key))
        self._bytes += size
        self.counters["added"] += 1
        return True

    def _evict_stalest(self) -> None:
        while True:
            _, key = heapq.heappop(self._heap)
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._bytes -= entry["nbytes"]
                self.counters["evicted"] += 1
                return

    def clear(self) -> None:
        self._entries.clear()
        self._heap.clear()
        self._bytes = 0

    # ------------------------------------------------------------------ sources
    @torch.no_grad()
    def add_from_trainer_forward(self, input_ids: torch.Tensor, features: torch.Tensor, logits: torch.Tensor | None,
                                 response_mask: torch.Tensor, d2t: torch.Tensor, policy_version: int) -> int:
        """Hook-side source: one record per row of the policy trainer's log-prob forward.

        logits: (B, T, V) at every position, or (N, V) at the answer positions only
        (`target_training.grpo.logit_positions(response_mask)`, what GRPOTrainer's forward computes),
        or None (hard labels). Soft targets are the target's log-probs at the draft vocabulary, not
        renormalised, fp16, clamped like capture_features; where no logits were computed they hold
        the floor (ttt_loss reads a position only where the next token is an answer token). They
        are computed as restrict_to_draft(logits) minus the full-vocabulary logsumexp, which equals
        restrict_to_draft(log_softmax(logits)) without materialising a second fp32 tensor over the
        full vocabulary. Right padding is trimmed: a row's length is its last response position + 1;
        rows without a response token are skipped. Returns the number of records stored."""
        B, T = input_ids.shape
        if features.shape[:2] != (B, T) or response_mask.shape != (B, T):
            raise ValueError(f"features {tuple(features.shape)} and response_mask {tuple(response_mask.shape)} "
                             f"must match input_ids {(B, T)}")
        mask = response_mask.detach().to(torch.bool)
        lengths = answer_lengths(mask).tolist()
        # per row: "train", "held" (a held-out prompt's answer, kept to measure drafts: soft targets
        # needed) or "skip" (a held-out prompt's answer beyond heldout_per_prompt, or no answer)
        state = ["skip" if n <= 0 else "train" for n in lengths]
        self._rows += sum(n > 0 for n in lengths)
        self.soft_targets |= logits is not None
        if self.heldout_every > 0 and logits is not None:  # hard labels (no logits) measure nothing: all train
            ids_host, firsts = input_ids.detach().cpu(), mask.to(torch.int8).argmax(1).tolist()
            for b, n in enumerate(lengths):
                key = self._prompt_key(ids_host[b, :firsts[b]]) if n > 0 else None
                if key is not None and self._held_key(key):
                    state[b] = "held" if self._keep_held(key, policy_version) else "skip"
                    self.counters["skipped_heldout"] += state[b] == "skip"
        held = [st == "held" for st in state]
        at = None  # (B, T) bool: where compact (N, V) logits were computed
        if logits is not None and logits.dim() == 2:
            at = logit_positions(mask)
            if logits.shape[0] != int(at.sum()):
                raise ValueError(f"logits {tuple(logits.shape)} match neither (B, T, V) nor the {int(at.sum())} "
                                 f"answer positions of response_mask")
        elif logits is not None and logits.shape[:2] != (B, T):
            raise ValueError(f"logits {tuple(logits.shape)} must match input_ids {(B, T)}")
        if self.heldout_only:  # only the held-out rows are stored: compute nothing for the others
            rows = [b for b in range(B) if held[b]]
            if not rows:
                return 0
            state = ["held"] * len(rows)
            if len(rows) < B:
                idx = torch.tensor(rows, device=input_ids.device)
                if logits is not None:
                    logits, at = _rows_logits(logits, at, idx)
                input_ids, features, mask = input_ids[idx], features[idx], mask[idx]
                lengths, held = [lengths[b] for b in rows], [True] * len(rows)
                B = len(rows)
        temp = self.heldout_temperature
        hot = logits is not None and any(held) and temp not in (0.0, 1.0)  # held-out rows at another temperature
        logp = None if logits is None or (hot and all(held)) else _draft_logp(logits, d2t, at, (B, T), 1.0)
        if hot:  # the held-out rows' log-probs at the rollouts' temperature (the others' are not used)
            rows = torch.tensor([b for b in range(B) if held[b]], device=logits.device)
            sub, sub_at = _rows_logits(logits, at, rows)
            hot_logp = _draft_logp(sub, d2t, sub_at, (len(rows), T), temp)
            logp = hot_logp.new_full((B, T, hot_logp.shape[-1]), _LOGP_FLOOR) if logp is None else logp
            logp[rows] = hot_logp
        if input_ids.device.type != "cpu":  # the batch to the host in one copy per tensor, not one per row
            input_ids, features, mask = download(input_ids), download(features.detach(), self.feature_dtype), download(mask)
            logp = None if logp is None else download(logp)
            settle(response_mask.device)
        stored = 0
        for b, n in enumerate(lengths):
            if n <= 0:
                self.counters["skipped_empty"] += 1
            if state[b] == "skip":
                continue
            rec = {"input_ids": input_ids[b, :n], "features": features[b, :n].detach(),
                   "target_logp": None if logp is None else logp[b, :n], "loss_mask": mask[b, :n]}
            if state[b] == "held":
                self._hold_out(rec, policy_version)
            else:
                stored += self.add(rec, policy_version)
        return stored

    def heldout_prompt(self, prompt_ids) -> bool:
        """Whether the answers to this prompt are held out: one prompt in `heldout_every`, by a hash
        of its token ids (and the buffer's seed), so the trainer's forward and the engine's
        trajectories agree, a prompt sampled again in a later epoch is held out again, and no
        draft ever trains on an answer to it (nor on its sibling answers in a GRPO group, which
        would make the held-out value read the draft's memory of the prompt). The prompt is the
        row's tokens before its first answer token: rows must be right-padded (prompt first)."""
        return self._held_key(self._prompt_key(prompt_ids))

    @staticmethod
    def _prompt_key(prompt_ids) -> bytes:
        """A prompt's identity: its token ids as int64 bytes."""
        return torch.as_tensor(prompt_ids, dtype=torch.int64).cpu().numpy().tobytes()

    def _held_key(self, key: bytes) -> bool:
        return self.heldout_every > 0 and zlib.crc32(key, self.seed & 0xFFFFFFFF) % self.heldout_every == 0

    def _keep_held(self, key: bytes, policy_version: int) -> bool:
        """Count one more answer to a held-out prompt (`_prompt_key`) at this policy version; True
        while at most heldout_per_prompt of them are kept."""
        version, kept = self._held_now
        if version != policy_version:
            self._held_now = version, kept = policy_version, {}
        kept[key] = kept.get(key, 0) + 1
        return kept[key] <= self.heldout_per_prompt

    def _hold_out(self, record: dict, policy_version: int) -> None:
        """Keep `record` among the held-out sequences (own storage), the oldest dropped past
        `heldout_records`, with the temperature its soft targets are at (heldout_temperature; 0:
        greedy, the targets then at T = 1, whose argmax is the same)."""
        rec = {"input_ids": _own(record["input_ids"], torch.long).reshape(-1),
               "features": _own(record["features"], self.feature_dtype),
               "target_logp": _own(record["target_logp"], torch.float16),
               "loss_mask": _own(record["loss_mask"], torch.bool).reshape(-1), "policy_version": int(policy_version),
               "temperature": float(self.heldout_temperature)}
        self.heldout = (self.heldout + [rec])[-self.heldout_records:] if self.heldout_records else []

    @property
    def rows_seen(self) -> int:
        """Rows the trainer's forward has offered so far (held-out sequences change only with it)."""
        return self._rows

    @property
    def heldout_version(self) -> int | None:
        """The newest policy version among the held-out sequences (None: none held out yet)."""
        return max((r["policy_version"] for r in self.heldout), default=None)

    def logprob_hook(self, layer_ids: Sequence[int], d2t: torch.Tensor, policy_version: Callable[[], int],
                     soft_targets: bool = True):
        """A callable for GRPOTrainer.logprob_hooks (set the trainer's tap_layers to layer_ids too);
        policy_version() is read at call time."""
        layer_ids = tuple(layer_ids)

        def hook(input_ids, out, response_mask):
            t0 = time.perf_counter()
            self.add_from_trainer_forward(input_ids, out.features(layer_ids), out.logits if soft_targets else None,
                                          response_mask, d2t, policy_version())
            self.capture_seconds += time.perf_counter() - t0

        return hook

    def add_trajectories(self, trajectories: Sequence, policy_version: int) -> int:
        """Engine-side source: trajectories with captured features (others are skipped).

        Trajectory.features covers P + n - 1 positions (none for the last token, which is never an
        input), so a zero row pads it to T = P + n; the last row is never read by ttt_loss. Hard
        labels (target_logp None); the loss is on the response tokens. With acceptance statistics,
        the per-position weight is the sequence's rejection rate 1 - accepted / drafted on its
        response tokens: SpecStats are per sequence and per draft depth, not per position, so no
        finer attribution is possible. Returns the number of records stored."""
        stored = 0
        for traj in trajectories:
            if traj.features is None:
                continue
            if self.heldout_prompt(traj.prompt_ids):  # measured on, never trained on (heldout_prompt)
                self.counters["skipped_heldout"] += 1
                continue
            P, n = len(traj.prompt_ids), len(traj.token_ids)
            T = P + n
            feats = traj.features.detach()
            if feats.dim() != 2 or feats.shape[0] != T - 1:
                raise ValueError(f"trajectory {traj.request_id}: features {tuple(feats.shape)} for {T} tokens "
                                 f"(expected {T - 1} rows)")
            feats = feats.to("cpu", self.feature_dtype)
            feats = torch.cat([feats, feats.new_zeros(1, feats.shape[1])], 0)
            mask = torch.zeros(T, dtype=torch.bool)
            mask[P:] = True
            w = None
            spec = getattr(traj, "spec", None)
            if spec is not None and spec.drafted > 0:
                w = mask.float() * (1.0 - spec.accepted / spec.drafted)
            rec = {"input_ids": torch.tensor(traj.full_ids, dtype=torch.long), "features": feats,
                   "target_logp": None, "loss_mask": mask}
            stored += self.add(rec, policy_version, w)
        return stored

    # ------------------------------------------------------------------ sampling
    def sample(self, n: int, generator: torch.Generator | None, prefer_rejected: float = 0.0,
               min_version: int | None = None) -> list[dict]:
        """n records drawn with weights (1 - prefer_rejected) * uniform + prefer_rejected * rejection
        weight (normalised; entries without acceptance statistics get the mean known weight, so
        neither source is starved; with none known the mix is uniform). min_version restricts the
        draw to entries of that policy version or newer (recency). Without replacement when enough
        entries have positive weight, else with replacement. Returned dicts share the stored
        tensors: read them, do not modify them in place. generator None uses the buffer's own."""
        if n < 0 or not 0.0 <= prefer_rejected <= 1.0:
            raise ValueError(f"sample needs n >= 0 and prefer_rejected in [0, 1], got {n}, {prefer_rejected}")
        entries = [e for e in self._entries.values() if min_version is None or e["policy_version"] >= min_version]
        if n == 0 or not entries:
            return []
        uniform = torch.full((len(entries),), 1.0 / len(entries), dtype=torch.float64)
        weights = uniform
        known = [e["rejection"] for e in entries if e["rejection"] is not None]
        if prefer_rejected > 0 and known and sum(known) > 0:
            fill = sum(known) / len(known)
            rej = torch.tensor([fill if e["rejection"] is None else e["rejection"] for e in entries],
                               dtype=torch.float64).clamp_min(0.0)
            weights = (1.0 - prefer_rejected) * uniform + prefer_rejected * rej / rej.sum()
        replacement = n > int((weights > 0).sum())
        idx = torch.multinomial(weights, n, replacement=replacement,
                                generator=generator if generator is not None else self._gen).tolist()
        keys = ("input_ids", "features", "target_logp", "loss_mask", "weight_per_pos", "policy_version")
        return [{k: entries[i][k] for k in keys} for i in idx]

    # ------------------------------------------------------------------ reporting and checkpoints
    def stats(self) -> dict:
        versions = [e["policy_version"] for e in self._entries.values()]
        return {"entries": len(self._entries), "bytes": self._bytes, "budget": self.budget_bytes,
                "version_min": min(versions) if versions else None,
                "version_max": max(versions) if versions else None,
                "with_soft_targets": sum(e["target_logp"] is not None for e in self._entries.values()),
                "with_spec_weight": sum(e["rejection"] is not None for e in self._entries.values()),
                "tokens_to_predict": sum(int(e["loss_mask"].sum()) for e in self._entries.values()),
                **self.counters}

    def state_dict(self, include_tensors: bool = False) -> dict:
        """Metadata (budget, seed, counters, the version of each entry, the sampling RNG); with
        include_tensors also the entries themselves. Features are cheap to regenerate from the next
        rollouts, so checkpoints normally leave them out."""
        sd = {"budget_bytes": self.budget_bytes, "seed": self.seed, "feature_dtype": str(self.feature_dtype),
              "counters": dict(self.counters), "rng": self._gen.get_state(),
              "versions": [e["policy_version"] for e in self._entries.values()], "rows": self._rows}
        if include_tensors:
            sd["heldout"] = [dict(r) for r in self.heldout]
            sd["entries"] = [{k: v for k, v in e.items() if k not in ("nbytes", "rejection")}
                             for e in self._entries.values()]
        return sd

    def load_state_dict(self, sd: dict) -> None:
        """Restore metadata; the entries too when the state dict has them, else the buffer is empty
        (it refills from the next rollouts). Entries keep their insertion order and versions."""
        budget = sd["budget_bytes"]
        if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
            raise ValueError(f"FeatureBuffer budget_bytes must be a positive integer, got {budget!r}")
        self.budget_bytes = budget
        self.seed = int(sd["seed"])
        self._gen = torch.Generator().manual_seed(self.seed)
        if "rng" in sd:
            self._gen.set_state(sd["rng"])
        self.clear()
        for e in sd.get("entries", []):
            self.add(e, e["policy_version"], e.get("weight_per_pos"))
        self.counters = {**{k: 0 for k in self.counters}, **sd["counters"]}  # after the re-adds, which would count again
        self._rows = int(sd.get("rows", 0))
        self.heldout = [dict(r) for r in sd.get("heldout", [])][-self.heldout_records:] if self.heldout_records else []
