"""Offline EAGLE-3 draft training: capture the target's features once, then train with TTT.

`capture_features` runs one full target forward per batch (tapping the EAGLE-3 feature layers)
and keeps, per sequence, the fused features (bf16/fp16) and the target's log-probs at the draft
vocabulary (fp16, not renormalised). `train_offline` trains the draft's own parameters on those
records with AdamW and `ttt_loss`. Both are generic: callers choose data, sizes and logging.

`draft_update_step` is the one draft update (loss -> backward -> clip -> step), shared by
`train_offline`, the online trainer (specrl/online_trainer.py) and its data-parallel DeepSpeed
variant (specrl/deepspeed_backend.py); what differs between them, how the loss is run and the
gradients applied, is a `GradientBackend`.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from tqdm import tqdm

from draft_models.ttt import ttt_loss
from draft_models.vocab import restrict_to_draft

_LOGP_FLOOR = -1e4  # log-probs stored in fp16 are clamped here (fp16 has no -inf-safe range)


def progress_bar(progress: bool | None, **kw) -> tqdm:
    """A tqdm bar on stderr with the time left: shown when `progress` is True, hidden when False,
    on a terminal only when None (so a log file or a captured test gets none)."""
    return tqdm(disable=None if progress is None else not progress, **kw)


@torch.no_grad()
def capture_features(target_model, sequences: Sequence[Sequence[int]], loss_masks: Sequence | None,
                     batch_size: int, *, d2t: torch.Tensor, feature_dtype: torch.dtype = torch.bfloat16,
                     device=None, progress: bool | None = False) -> list[dict]:
    """One target forward per batch -> one record per sequence:
    {"input_ids": (T,) int64, "features": (T, 3H) feature_dtype, "target_logp": (T, Vd) fp16,
     "loss_mask": (T,) bool}, all on CPU. target_logp[t] is the target's log-prob of each draft
    token at position t (its prediction of token t+1); loss_mask marks the tokens to predict
    (None: every token). `progress`: a bar over the sequences (see `progress_bar`)."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if loss_masks is not None and len(loss_masks) != len(sequences):
        raise ValueError(f"{len(loss_masks)} loss masks for {len(sequences)} sequences")
    cfg = target_model.cfg
    layers = tuple(cfg.feature_layer_ids)
    device = device if device is not None else next(target_model.parameters()).device
    d2t = d2t.to(device)
    was_training = target_model.training
    target_model.eval()
    records: list[dict] = []
    bar = progress_bar(progress, total=len(sequences), desc="draft features", unit="seq")
    try:
        for start in range(0, len(sequences), batch_size):
            chunk = [list(map(int, s)) for s in sequences[start: start + batch_size]]
            lens = [len(s) for s in chunk]
            if min(lens) == 0:
                raise ValueError(f"empty sequence at index {start + lens.index(0)}")
            T = max(lens)
            ids = torch.zeros(len(chunk), T, dtype=torch.long)
            for i, s in enumerate(chunk):
                ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
            out = target_model(ids.to(device), tap_layers=layers)  # right padding: causal, harmless
            feats = out.features(layers).to(feature_dtype)
            logp = restrict_to_draft(torch.log_softmax(out.logits.float(), -1), d2t)
            logp = logp.clamp_min(_LOGP_FLOOR).to(torch.float16)
            for i, s in enumerate(chunk):
                n = len(s)
                if loss_masks is None:
                    mask = torch.ones(n, dtype=torch.bool)
                else:
                    mask = torch.as_tensor(loss_masks[start + i]).to(torch.bool).reshape(-1)
                    if mask.numel() != n:
                        raise ValueError(f"loss mask {start + i} has {mask.numel()} entries for {n} tokens")
                records.append({"input_ids": ids[i, :n].clone(), "features": feats[i, :n].cpu().clone(),
                                "target_logp": logp[i, :n].cpu().clone(), "loss_mask": mask})
            bar.update(len(chunk))
    finally:
        bar.close()
        target_model.train(was_training)
    return records


def collate(records: Sequence[dict], device=None, dtype: torch.dtype = torch.float32, *, soft: bool = True) -> dict:
    """Right-pad records to a batch: input_ids 0, features 0, target_logp 0, loss_mask False.
    target_logp is None (hard labels) when `soft` is False or the first record has none."""
    T = max(int(r["input_ids"].shape[0]) for r in records)
    B = len(records)
    f0, l0 = records[0]["features"], records[0].get("target_logp") if soft else None
    ids = torch.zeros(B, T, dtype=torch.long)
    feats = torch.zeros(B, T, f0.shape[-1], dtype=dtype)
    mask = torch.zeros(B, T, dtype=torch.bool)
    logp = None if l0 is None else torch.zeros(B, T, l0.shape[-1], dtype=torch.float32)
    for i, r in enumerate(records):
        n = int(r["input_ids"].shape[0])
        ids[i, :n] = r["input_ids"]
        feats[i, :n] = r["features"].to(dtype)
        mask[i, :n] = r["loss_mask"].to(torch.bool)
        if logp is not None:
            logp[i, :n] = r["target_logp"].float()
    out = {"input_ids": ids, "features": feats, "loss_mask": mask, "target_logp": logp}
    return {k: (v.to(device) if v is not None and device is not None else v) for k, v in out.items()}


# ---------------------------------------------------------------------- one draft update
def warmup_lr(lr: float, warmup: int, updates_done: int) -> float:
    """Learning rate of the next update: linear warm-up over `warmup` updates, then flat."""
    return lr * min(1.0, (updates_done + 1) / warmup) if warmup > 0 else lr


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


class GradientBackend(Protocol):
    """How a draft update runs its loss and applies its gradients."""

    def loss(self, features, input_ids, target_logp, loss_mask, steps, acceptance_weight) -> tuple[torch.Tensor, dict]:
        """`ttt_loss` of the draft on a collated batch: (scalar loss, its metrics)."""

    def backward(self, loss: torch.Tensor) -> bool:
        """Gradients of `loss`, clipped where clipping comes before the step; False when they are
        unusable (a non-finite norm) and the update must be skipped."""

    def step(self, lr: float) -> None:
        """Apply the gradients at learning rate `lr`."""

    def discard(self) -> None:
        """Drop the gradients of an update that is skipped, where the backend needs it (a
        backend that zeroes gradients before every backward may do nothing)."""

    def grad_norm(self) -> float:
        """The gradient norm of the last backward, before clipping."""


class TorchBackend:
    """Plain PyTorch: AdamW (betas 0.9, 0.95) over `params`, gradient-norm clipping at
    `max_grad_norm` (inf: measured, never clipped). Gradients are zeroed before each backward
    and left in place after a step (the owner may drop them)."""

    def __init__(self, draft, params: list[torch.nn.Parameter], *, lr: float, weight_decay: float,
                 max_grad_norm: float):
        self.draft, self.params, self.max_grad_norm = draft, params, max_grad_norm
        self.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
        self._grad_norm = float("nan")

    def loss(self, features, input_ids, target_logp, loss_mask, steps, acceptance_weight):
        return ttt_loss(self.draft, features, input_ids, target_logp, loss_mask, steps=steps,
                        acceptance_weight=acceptance_weight)

    def backward(self, loss: torch.Tensor) -> bool:
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self._grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm))
        return math.isfinite(self._grad_norm)

    def step(self, lr: float) -> None:
        set_lr(self.optimizer, lr)
        self.optimizer.step()

    def discard(self) -> None:
        pass  # backward zeroes the gradients first

    def grad_norm(self) -> float:
        return self._grad_norm


@dataclass
class DraftUpdate:
    """What one draft update did."""

    metrics: dict  # ttt_loss's: loss, ce_k, acc_k, accept_k, n_k
    grad_norm: float  # before clipping; nan when the loss was not finite (no backward ran)
    applied: bool  # False: a non-finite loss or gradient norm skipped it, the weights are untouched


def draft_update_step(backend: GradientBackend, batch: dict, *, lr: float, ttt_steps: int | None = None,
                      acceptance_weight: float = 0.0, agree: Callable[[bool], bool] | None = None) -> DraftUpdate:
    """One TTT update of the draft on a collated batch (see `collate`): loss -> backward ->
    clip -> step at `lr`. A non-finite loss skips the backward, a non-finite gradient norm the
    step. `agree` turns this process's verdict on the loss into every rank's (data parallel: an
    all-reduced AND), so that all ranks skip together."""
    loss, metrics = backend.loss(batch["features"], batch["input_ids"], batch["target_logp"], batch["loss_mask"],
                                 ttt_steps, acceptance_weight)
    ok = math.isfinite(metrics["loss"])
    if agree is not None:
        ok = agree(ok)
    backward_ran = ok
    if ok:
        ok = backend.backward(loss)
    if ok:
        backend.step(lr)
    else:
        backend.discard()
    return DraftUpdate(metrics, backend.grad_norm() if backward_ran else float("nan"), ok)


def train_offline(draft, data: Sequence[dict], steps: int, lr: float, batch_size: int, seed: int = 0, *,
                  ttt_steps: int | None = None, weight_decay: float = 0.0, grad_clip: float = 1.0,
                  warmup: int = 0, acceptance_weight: float = 0.0, soft_targets: bool = True,
                  log_fn: Callable[[dict], None] | None = None, progress: bool | None = False) -> list[dict]:
    """Train the draft's parameters on capture_features records; returns one metric dict per step
    (step, lr, grad_norm, seconds, and ttt_loss's loss / ce_k / acc_k / accept_k / n_k).
    `progress`: a bar over the steps with the loss (see `progress_bar`)."""
    if not data:
        raise ValueError("train_offline needs at least one record")
    if steps < 0 or batch_size <= 0 or not lr > 0:
        raise ValueError(f"bad training settings: steps={steps}, batch_size={batch_size}, lr={lr}")
    params = [p for p in draft.parameters() if p.requires_grad]
    backend = TorchBackend(draft, params, lr=lr, weight_decay=weight_decay,
                           max_grad_norm=grad_clip if grad_clip > 0 else float("inf"))
    gen = torch.Generator().manual_seed(seed)
    device, dtype = draft.fc.weight.device, draft.fc.weight.dtype
    order: list[int] = []
    history: list[dict] = []
    draft.train()
    bar = progress_bar(progress, total=steps, desc="draft training", unit="step")
    for step in range(steps):
        t0 = time.perf_counter()
        if len(order) < batch_size:
            order += torch.randperm(len(data), generator=gen).tolist() * max(1, math.ceil(batch_size / len(data)))
        idx, order = order[:batch_size], order[batch_size:]
        batch = collate([data[i] for i in idx], device, dtype, soft=soft_targets)
        cur_lr = warmup_lr(lr, warmup, step)
        update = draft_update_step(backend, batch, lr=cur_lr, ttt_steps=ttt_steps, acceptance_weight=acceptance_weight)
        metrics = update.metrics
        metrics.update(step=step, lr=cur_lr, grad_norm=update.grad_norm, seconds=time.perf_counter() - t0)
        history.append(metrics)
        if log_fn is not None:
            log_fn(metrics)
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", refresh=False)
    bar.close()
    draft.eval()
    return history
