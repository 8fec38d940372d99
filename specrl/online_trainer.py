"""Online EAGLE-3 draft training while GRPO changes the policy.

Why: a draft trained once goes stale as RL moves the policy (docs/design.md section 1b). This trainer
takes short, budgeted bursts of TTT steps (`draft_models.ttt.ttt_loss`, the same loss as offline
training) on records from a `specrl.buffer.FeatureBuffer`, in the device's idle windows, and
hands fresh weights to the engine's draft copy (`export_weights`, SGLang parameter names).

Isolation rules, each one checked by tests/test_online_trainer.py:
- Gradients never reach the policy. The draft reads the target's token embedding by reference
  and detached (EAGLE-3: the draft shares the target's frozen embedding), and the stored
  features are detached tensors; the optimizer holds only the draft's own parameters, and the
  constructor refuses a draft whose parameters include the embedding weight.
- A policy sync never writes into the draft: the embedding is the only tensor the two share,
  by design, so loading new policy weights changes what the draft *reads* (the current
  embedding) and none of the draft's own parameters.
- A failed step costs nothing: a non-finite loss or gradient norm (e.g. NaN features) skips the
  update, leaves weights and optimizer state untouched and raises nothing; docs/design.md asks that
  the RL run goes on whatever the draft side does.
- Non-finite weights never stick: if the draft's own weights are found non-finite (after an
  update, or when a step fails and the cause is the weights rather than the batch), the trainer
  rolls weights and optimizer back to its last finite snapshot (taken every `snapshot_every`
  updates; the first is the starting draft), counts it in `counters["rollbacks"]` and warns one
  line. Without this one NaN would turn every later step into a skipped one for the whole run.
  `load_state_dict` applies the same rule to a resumed state.
"""
from __future__ import annotations

import copy
import dataclasses
import time
import warnings

import torch

from draft_models.checkpoint import check_draft_weights, draft_state_dict_for_sglang
from draft_models.train import TorchBackend, collate, draft_update_step, warmup_lr
from specrl.config import OnlineDraftConfig
from target_training.grpo import update_autocast


class _SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Counts the bytes autograd keeps for backward in a forward (each storage once; the draft's
    own parameters excluded, they are counted apart): the step's activation memory, measured on
    any device.

    Storages are told apart by identity, not address: the allocator hands a freed storage's
    address to the next one, which would then go uncounted (a figure that depends on when memory
    is freed). Every storage seen is held until the hook exits, so no identity is reused either."""

    def __init__(self, params, inputs=()):
        self.nbytes = 0
        self._held: dict[int, torch.UntypedStorage] = {}  # id -> the storage, kept alive
        for p in params:
            self._held[id(p.untyped_storage())] = p.untyped_storage()
        for t in inputs:  # the step's input batch: counted once here, whether autograd saves it or not
            if torch.is_tensor(t):
                self._count(t)

        def pack(t: torch.Tensor) -> torch.Tensor:
            self._count(t)
            return t

        super().__init__(pack, lambda t: t)

    def _count(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()  # one Python object per storage, shared by all its views
        if id(storage) not in self._held:
            self._held[id(storage)] = storage
            self.nbytes += storage.nbytes()

    def __exit__(self, *args) -> None:
        self._held.clear()  # the step is over: its storages may be freed
        super().__exit__(*args)


def _all_finite(obj) -> bool:
    """True when every floating tensor in a (nested) state is finite."""
    if isinstance(obj, torch.Tensor):
        return not obj.is_floating_point() or bool(torch.isfinite(obj).all())
    if isinstance(obj, dict):
        return all(_all_finite(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(_all_finite(v) for v in obj)
    return True


def step_metrics(metrics: dict, records: list[dict], *, grad_norm: float, soft: bool, ok: bool, version: int,
                 t0: float) -> dict:
    """The metrics of an online update on buffer records (this trainer's and the DeepSpeed
    trainer's): ttt_loss's plus draft_loss, grad_norm, staleness, ..."""
    versions = [int(r["policy_version"]) for r in records if "policy_version" in r]
    draft_loss = metrics.pop("loss")
    metrics.update(draft_loss=draft_loss, grad_norm=grad_norm, soft_targets=soft, skipped_nonfinite=not ok,
                   skipped_empty=False, version=version, batch_size=len(records),
                   staleness=(max(versions) - min(versions)) if versions else 0,
                   seconds=time.perf_counter() - t0)
    return metrics


class OnlineDraftTrainer:
    """Owns the draft being trained and its AdamW; `version` numbers its weights (+1 per update
    and per rollback, so a consumer can tell any change)."""

    def __init__(self, draft, config: OnlineDraftConfig | None = None):
        self.draft = draft
        self.config = config if config is not None else OnlineDraftConfig()
        emb = draft.embed_tokens.weight
        params = [p for p in draft.parameters() if p.requires_grad]
        if any(p is emb for p in draft.parameters()):
            raise ValueError("the draft's parameters include the target embedding; it must be held by "
                             "reference and never optimised")
        if not params:
            raise ValueError("the draft has no trainable parameters")
        self.backend = TorchBackend(draft, params, lr=self.config.lr, weight_decay=self.config.weight_decay,
                                    max_grad_norm=self.config.max_grad_norm)
        self.optimizer = self.backend.optimizer
        self._params = params
        self.version = 0
        self.step_seconds: float | None = None  # running estimate of one update, for budgeting
        self.counters = {"steps": 0, "updates": 0, "skipped_nonfinite": 0, "skipped_empty": 0, "rollbacks": 0}
        self.activation_bytes_per_record: float | None = None  # measured, largest seen (memory budget)
        self._good: dict | None = None  # the last finite weights and optimizer state (CPU copies)
        self._snapshot()

    # ------------------------------------------------------------------ rollback
    def _snapshot(self) -> None:
        draft = {k: v.detach().to("cpu", copy=True) for k, v in self.draft.state_dict().items()}
        opt = self.optimizer.state_dict()
        if _all_finite(draft) and _all_finite(opt["state"]):
            self._good = {"draft": draft, "optimizer": copy.deepcopy(opt), "updates": self.counters["updates"]}

    def weights_finite(self) -> bool:
        return _all_finite(self._params)

    def _rollback(self, why: str) -> bool:
        """Restore the last finite snapshot; False when there is none to restore."""
        if self._good is None:
            return False
        self.draft.load_state_dict(self._good["draft"])
        self.optimizer.load_state_dict(copy.deepcopy(self._good["optimizer"]))
        self.version += 1
        self.counters["rollbacks"] += 1
        warnings.warn(f"online draft: {why}; rolled back to its last finite weights (from update "
                      f"{self._good['updates']}), now version {self.version}", RuntimeWarning)
        return True

    # ------------------------------------------------------------------ one step
    def train_step(self, buffer, generator: torch.Generator | None, *, min_version: int | None = None,
                   batch_size: int | None = None) -> dict:
        """One AdamW step on a batch sampled from `buffer`.

        Soft targets when every sampled record has target_logp, else hard labels for the whole
        batch (collate needs one kind). Metrics: draft_loss, grad_norm, acc_k / ce_k / accept_k /
        n_k from ttt_loss, seconds, version, soft_targets, skipped_nonfinite, skipped_empty,
        staleness (newest minus oldest policy version in the batch), activation_bytes.
        `batch_size` overrides the config's (the memory budget shrinks it)."""
        cfg = self.config
        t0 = time.perf_counter()
        self.counters["steps"] += 1
        records = buffer.sample(batch_size or cfg.batch_size, generator, prefer_rejected=cfg.prefer_rejected,
                                min_version=min_version)
        if not records:
            self.counters["skipped_empty"] += 1
            return {"draft_loss": float("nan"), "skipped_empty": True, "skipped_nonfinite": False,
                    "version": self.version, "seconds": time.perf_counter() - t0}
        soft = all(r.get("target_logp") is not None for r in records)
        batch = collate(records, self.draft.fc.weight.device, self.draft.fc.weight.dtype, soft=soft)
        was_training = self.draft.training
        self.draft.train()
        act = _SavedBytes(self._params, batch.values())
        lr = warmup_lr(cfg.lr, cfg.warmup_steps, self.counters["updates"])
        try:
            with torch.enable_grad(), act, update_autocast(cfg.compute_dtype, self.draft.fc.weight.device):
                update = draft_update_step(self.backend, batch, lr=lr, ttt_steps=cfg.ttt_steps,
                                           acceptance_weight=cfg.acceptance_weight)
                metrics, gnorm, ok = update.metrics, update.grad_norm, update.applied
                rolled_back = False
                if ok:
                    if self.weights_finite():
                        self.version += 1
                        self.counters["updates"] += 1
                        if self.counters["updates"] % cfg.snapshot_every == 0:
                            self._snapshot()
                    else:
                        ok = False
                        rolled_back = self._rollback("an update made its weights non-finite")
                if not ok:
                    self.counters["skipped_nonfinite"] += 1
                    if not rolled_back and not self.weights_finite():  # the weights, not the batch
                        rolled_back = self._rollback("its weights are non-finite")
                self.optimizer.zero_grad(set_to_none=True)
        finally:
            self.draft.train(was_training)
        act_bytes = act.nbytes  # the step's activations: the collated batch and what autograd saved
        self.activation_bytes_per_record = max(act_bytes / len(records), self.activation_bytes_per_record or 0.0)
        metrics = step_metrics(metrics, records, grad_norm=gnorm, soft=soft, ok=ok, version=self.version, t0=t0)
        metrics.update(rolled_back=rolled_back, activation_bytes=act_bytes, lr_scale=lr / cfg.lr if cfg.lr else 1.0)
        return metrics

    # ------------------------------------------------------------------ budgeted bursts
    def train_for(self, buffer, max_steps: int, time_budget_s: float, generator: torch.Generator | None, *,
                  min_version: int | None = None, batch_size: int | None = None) -> dict:
        """Run steps until max_steps or the time budget. A step is not started when the measured
        step time (an average kept across calls) says it would overrun the budget: the RL step
        must not wait on the draft. Only the very first step, with nothing measured yet, runs on
        any positive budget. An empty buffer ends the burst.
        Returns steps, updates, full_rate_updates (the applied updates, each counted by its learning
        rate over the configured one: a warm-up update counts by its share), skipped_nonfinite,
        seconds, mean_loss (over finite losses), version, `last` (the last step's metrics), and
        `shut`: steps were wanted and the budget was positive, yet the estimate alone started none
        (only steps that run refresh it: a caller that sees this in window after window may set
        step_seconds to None to have it measured again, SpecCoTrainer does)."""
        if max_steps < 0 or not time_budget_s == time_budget_s:
            raise ValueError(f"train_for needs max_steps >= 0 and a time budget, got {max_steps}, {time_budget_s}")
        t0 = time.perf_counter()
        steps = updates = skipped = 0
        full_rate = 0.0
        losses: list[float] = []
        last: dict = {}
        shut = False
        while steps < max_steps and time_budget_s > 0:
            elapsed = time.perf_counter() - t0
            if self.step_seconds is not None and elapsed + self.step_seconds > time_budget_s:
                shut = steps == 0
                break
            t_step = time.perf_counter()
            last = self.train_step(buffer, generator, min_version=min_version, batch_size=batch_size)
            if last.get("skipped_empty"):
                break
            dt = time.perf_counter() - t_step
            self.step_seconds = dt if self.step_seconds is None else 0.7 * self.step_seconds + 0.3 * dt
            steps += 1
            if last["skipped_nonfinite"]:
                skipped += 1
            else:
                updates += 1
                full_rate += last["lr_scale"]
                losses.append(last["draft_loss"])
        return {"steps": steps, "updates": updates, "full_rate_updates": full_rate, "skipped_nonfinite": skipped,
                "seconds": time.perf_counter() - t0,
                "mean_loss": sum(losses) / len(losses) if losses else float("nan"),
                "version": self.version, "last": last, "shut": shut}

    # ------------------------------------------------------------------ memory
    def memory_bytes(self) -> dict[str, int]:
        """The draft side's resident bytes, measured on the live tensors: parameters, their
        gradients (allocated by every backward), and the optimizer's state (AdamW: two moments
        per parameter once it has stepped). Activations scale with the batch: see
        `activation_bytes_per_record`, measured by every train_step (None before the first)."""
        def size(ts) -> int:
            return sum(t.numel() * t.element_size() for t in ts if torch.is_tensor(t))

        params = size(self._params)
        opt = sum(size(st.values()) for st in self.optimizer.state.values())
        return {"params": params, "grads": params, "optimizer": opt}

    # ------------------------------------------------------------------ weights out, checkpoints
    def export_weights(self) -> dict[str, torch.Tensor]:
        """A detached CPU copy of the draft in SGLang names (no embedding), safe to hand to an
        engine's draft copy while training continues on this one."""
        return {k: v.to("cpu", copy=True) for k, v in draft_state_dict_for_sglang(self.draft).items()}

    def state_dict(self) -> dict:
        """A snapshot (copies, not views): torch's optimizer.state_dict() returns the live moment
        tensors, and an optimizer loaded from it would share and double-update them."""
        return {"draft": {k: v.detach().clone() for k, v in self.draft.state_dict().items()},
                "optimizer": copy.deepcopy(self.optimizer.state_dict()), "version": self.version,
                "counters": dict(self.counters), "config": dataclasses.asdict(self.config),
                "step_seconds": self.step_seconds,  # the budget check reads it: a resume must see it too
                # so does the memory plan: the largest activation size measured so far
                "activation_bytes_per_record": self.activation_bytes_per_record}

    def load_state_dict(self, sd: dict) -> None:
        """Restore a snapshot. Non-finite draft weights are refused: the current (starting) draft
        is kept and the refusal counted as a rollback, with one warning; non-finite optimizer
        moments alone restart AdamW from an empty state."""
        counters = dict(sd.get("counters", self.counters))
        counters.setdefault("rollbacks", 0)
        problem = check_draft_weights(sd["draft"], self.draft.state_dict())
        if problem is None:
            self.draft.load_state_dict(sd["draft"])
            if _all_finite(sd["optimizer"]["state"]):
                self.optimizer.load_state_dict(copy.deepcopy(sd["optimizer"]))
        self.version = int(sd["version"])
        self.counters = counters
        self.step_seconds = sd.get("step_seconds", self.step_seconds)
        self.activation_bytes_per_record = sd.get("activation_bytes_per_record", self.activation_bytes_per_record)
        if problem is None:
            self._snapshot()
        else:
            self.version += 1
            self.counters["rollbacks"] += 1
            warnings.warn(f"online draft: the resumed draft state is unusable ({problem}); "
                          f"training goes on from the starting draft, now version {self.version}", RuntimeWarning)
