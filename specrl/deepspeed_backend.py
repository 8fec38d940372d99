"""DeepSpeed ZeRO backend for the online draft trainer (data parallel over several ranks).

Why: on one device `OnlineDraftTrainer` is enough (the draft is one decoder layer). When the
policy trains on N GPUs, every GPU has idle windows and its own share of the feature buffer, so
the draft should train data-parallel on all of them, with its optimizer state sharded (ZeRO 1)
and its gradients too (ZeRO 2) so the draft costs each rank a fraction of its memory budget.
This module runs the *same* update as the single-process trainer,
`draft_models.train.draft_update_step` with its warm-up (`warmup_lr`): records from a
`FeatureBuffer` (or any list of capture_features-style records), `draft_models.ttt.ttt_loss`,
AdamW with the `OnlineDraftConfig` settings (the optimizer is built by `OnlineDraftTrainer`
itself), gradient clipping at max_grad_norm over the global gradient. Only the reduction and the
application of the gradients are DeepSpeed's: `_ZeroBackend`, the update's `GradientBackend`.

Equivalence: DeepSpeed averages gradients over ranks, and `ttt_loss` is a masked mean per TTT
step; so N ranks on N shares of a global batch give the single-process update of the whole
batch exactly when every share has the same number of loss tokens per TTT step (equal-length,
equally masked shares; tests/test_deepspeed_backend.py checks 2 ranks against 1 process). With
unequal shares each rank's tokens are weighted by 1/(its count), the usual DDP mean-of-means.

CPU: `deepspeed.init_distributed(dist_backend="gloo")` with DS_ACCELERATOR=cpu. With
DS_BUILD_OPS=0 no DeepSpeed kernels are compiled, so DeepSpeedCPUAdam / FusedAdam are not
available: the client optimizer is `torch.optim.AdamW` (on ZeRO's supported list), which ZeRO
1/2 wraps with its partitioned fp32 master state.

Failure isolation (docs/design.md section 1: the RL run goes on whatever the draft does): a non-finite loss on
any rank skips the step on all ranks (the decision is all-reduced, so no rank waits in a
collective the others skipped).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from draft_models.train import collate, draft_update_step, set_lr, warmup_lr
from draft_models.ttt import ttt_loss
from specrl.config import OnlineDraftConfig
from specrl.online_trainer import OnlineDraftTrainer, step_metrics

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DeepSpeedBackendError(ValueError):
    """The DeepSpeed backend cannot run with these settings (one-line message)."""


@dataclass
class ZeroConfig:
    """The DeepSpeed settings of the draft trainer; `build()` gives DeepSpeed's config dict.

    Batch size and clipping come from OnlineDraftConfig (batch_size = records per rank and step)."""

    stage: int = 2  # 1: shard optimizer state; 2: also gradients (3 is not needed for a 1-layer draft)
    dtype: str = "float32"  # float32 | bfloat16 | float16 (mixed precision with fp32 master weights)
    reduce_bucket_size: int = 5 * 10**7
    allgather_bucket_size: int = 5 * 10**7
    overlap_comm: bool = False  # overlapping needs CUDA streams
    contiguous_gradients: bool = True

    def __post_init__(self) -> None:
        if self.stage not in (1, 2):
            raise DeepSpeedBackendError(f"ZeroConfig.stage must be 1 or 2, got {self.stage!r}")
        if self.dtype not in _DTYPES:
            raise DeepSpeedBackendError(f"ZeroConfig.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        for name in ("reduce_bucket_size", "allgather_bucket_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise DeepSpeedBackendError(f"ZeroConfig.{name} must be a positive integer, got {v!r}")

    def build(self, draft_config: OnlineDraftConfig, world_size: int) -> dict:
        return {
            "train_micro_batch_size_per_gpu": draft_config.batch_size,
            "gradient_accumulation_steps": 1,
            "train_batch_size": draft_config.batch_size * world_size,
            "gradient_clipping": draft_config.max_grad_norm,
            "zero_optimization": {"stage": self.stage, "reduce_bucket_size": self.reduce_bucket_size,
                                  "allgather_bucket_size": self.allgather_bucket_size,
                                  "overlap_comm": self.overlap_comm,
                                  "contiguous_gradients": self.contiguous_gradients},
            "bf16": {"enabled": self.dtype == "bfloat16"},
            "fp16": {"enabled": self.dtype == "float16", "initial_scale_power": 12},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }


class _TTTLoss(torch.nn.Module):
    """The draft plus its TTT loss as one module, so the step runs through the DeepSpeed
    engine's forward (what ZeRO's bookkeeping expects) and parameter names keep a fixed prefix."""

    def __init__(self, draft):
        super().__init__()
        self.draft = draft

    def forward(self, features, input_ids, target_logp, loss_mask, steps, acceptance_weight):
        return ttt_loss(self.draft, features, input_ids, target_logp, loss_mask, steps=steps,
                        acceptance_weight=acceptance_weight)


class _ZeroBackend:
    """`draft_update_step`'s GradientBackend on a DeepSpeed engine: the loss runs through the
    engine's forward; its step reduces the gradients over ranks, clips and applies them."""

    def __init__(self, engine):
        self.engine = engine

    def loss(self, features, input_ids, target_logp, loss_mask, steps, acceptance_weight):
        return self.engine(features, input_ids, target_logp, loss_mask, steps, acceptance_weight)

    def backward(self, loss: torch.Tensor) -> bool:
        self.engine.backward(loss)
        return True  # the norm is known only after the step, which clips

    def step(self, lr: float) -> None:
        set_lr(self.engine.optimizer, lr)
        self.engine.step()

    def discard(self) -> None:
        self.engine.zero_grad()

    def grad_norm(self) -> float:
        gnorm = self.engine.get_global_grad_norm()
        return float(gnorm) if gnorm is not None else float("nan")


def shard(records: Sequence[dict], rank: int, world_size: int) -> list[dict]:
    """The contiguous share of a global batch that `rank` trains on (equal shares)."""
    if len(records) % world_size:
        raise DeepSpeedBackendError(f"a global batch of {len(records)} records does not split over "
                                    f"{world_size} ranks")
    n = len(records) // world_size
    return list(records[rank * n: (rank + 1) * n])


class DeepSpeedDraftTrainer:
    """Data-parallel EAGLE-3 draft training under ZeRO; one instance per rank.

    torch.distributed must be initialised (`init_distributed`). `version` counts updates."""

    def __init__(self, draft, config: OnlineDraftConfig | None = None, zero: ZeroConfig | None = None):
        import deepspeed

        if not dist.is_initialized():
            raise DeepSpeedBackendError("torch.distributed is not initialised; call "
                                        "specrl.deepspeed_backend.init_distributed() first")
        # The single-process trainer validates the draft and builds the AdamW (its parameter
        # selection, betas and weight decay); ZeRO wraps that optimizer.
        base = OnlineDraftTrainer(draft, config)
        self.config, self.zero = base.config, zero if zero is not None else ZeroConfig()
        self.draft = draft
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=_TTTLoss(draft), optimizer=base.optimizer, model_parameters=base._params,
            config=self.zero.build(self.config, self.world_size))
        self.backend = _ZeroBackend(self.engine)
        self.version = 0
        self.counters = {"steps": 0, "updates": 0, "skipped_nonfinite": 0}

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def train_step(self, records: Sequence[dict]) -> dict:
        """One ZeRO step on this rank's records (every rank calls it, with its own share).

        Soft targets when every record of every rank carries target_logp, else hard labels."""
        cfg = self.config
        t0 = time.perf_counter()
        self.counters["steps"] += 1
        soft = self._all(all(r.get("target_logp") is not None for r in records))
        batch = collate(records, self.device, next(self.draft.parameters()).dtype, soft=soft)
        self.engine.train()
        update = draft_update_step(self.backend, batch, lr=warmup_lr(cfg.lr, cfg.warmup_steps, self.counters["updates"]),
                                   ttt_steps=cfg.ttt_steps, acceptance_weight=cfg.acceptance_weight, agree=self._all)
        if update.applied:
            self.version += 1
            self.counters["updates"] += 1
        else:
            self.counters["skipped_nonfinite"] += 1
        metrics = step_metrics(update.metrics, records, grad_norm=update.grad_norm, soft=soft, ok=update.applied,
                               version=self.version, t0=t0)
        metrics["global_loss"] = self._mean(metrics["draft_loss"])
        return metrics

    def train_step_from_buffer(self, buffer, generator: torch.Generator | None, *,
                               min_version: int | None = None) -> dict:
        """Sample this rank's batch from its own FeatureBuffer (as OnlineDraftTrainer does)."""
        records = buffer.sample(self.config.batch_size, generator, prefer_rejected=self.config.prefer_rejected,
                                min_version=min_version)
        if not self._all(bool(records)):
            return {"draft_loss": float("nan"), "skipped_empty": True, "version": self.version}
        return self.train_step(records)

    def _all(self, flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def _mean(self, x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item()) / self.world_size


def init_distributed(backend: str | None = None, *, shm_comm: bool = False) -> None:
    """deepspeed.init_distributed from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT;
    gloo without CUDA, nccl with it.

    On the CPU accelerator DeepSpeed's comm backend JIT-compiles a shared-memory all-reduce
    (C++ op `deepspeed_shm_comm`, minutes on a small machine, and a compiler at run time) even
    with DS_BUILD_OPS=0. Only DeepSpeed's inference all-reduce uses it; ZeRO training reduces
    through torch.distributed (gloo), so by default the op is marked unavailable and never built."""
    import deepspeed

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not shm_comm:
        from deepspeed.accelerator import get_accelerator

        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if builder is not None:
            deepspeed.ops.__compatible_ops__[builder.NAME] = False
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
