"""DeepSpeed ZeRO draft trainer: two gloo ranks on halves of a global batch == one process on all.

The single-process reference is `OnlineDraftTrainer.train_step` itself (torch AdamW, clipping
at max_grad_norm) on the whole batch. Both ranks run as subprocesses (RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT, DS_ACCELERATOR=cpu, gloo) of this file, for ZeRO stages 1 and 2.
Tolerances (fp32): per-step loss relative difference <= 1e-5; parameters max |diff| <= 1e-5
after 4 steps (observed differences come from the order of the gradient all-reduce sum).
"""
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

STAGES = (1, 2)
STEPS = 4
GLOBAL_BATCH = 8


def _draft():
    from specrl.config import DraftTrainConfig
    from specrl.drafts import new_draft
    from target_training.config import model_config_for

    torch.manual_seed(0)
    policy = model_config_for("tiny", 64).build()
    seqs = torch.randint(3, 64, (16, 16), generator=torch.Generator().manual_seed(0)).tolist()
    return new_draft(policy, seqs, DraftTrainConfig(draft_vocab_size=48, ttt_steps=2))


def _records(step: int, draft) -> list[dict]:
    """A global batch: equal lengths and masks, so every share has as many loss tokens."""
    g = torch.Generator().manual_seed(100 + step)
    T, H3, Vd = 16, draft.fc.weight.shape[1], draft.cfg.draft_vocab_size
    mask = torch.ones(T, dtype=torch.bool)
    mask[:4] = False  # 4 prompt tokens
    return [{"input_ids": torch.randint(3, 64, (T,), generator=g),
             "features": torch.randn(T, H3, generator=g),
             "target_logp": torch.log_softmax(2 * torch.randn(T, Vd, generator=g), -1),
             "loss_mask": mask} for _ in range(GLOBAL_BATCH)]


def _config(batch_size: int):
    from specrl.config import OnlineDraftConfig

    # warmup_steps: both trainers share the step's lr schedule (DeepSpeed once ignored it)
    return OnlineDraftConfig(lr=3e-3, batch_size=batch_size, ttt_steps=2, max_grad_norm=0.5, warmup_steps=3)


def _worker(out_dir: str) -> None:
    """One rank: train each ZeRO stage on this rank's half of every global batch."""
    from specrl.deepspeed_backend import DeepSpeedDraftTrainer, ZeroConfig, init_distributed, shard

    torch.set_num_threads(1)
    init_distributed("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    result = {}
    for stage in STAGES:
        draft = _draft()
        trainer = DeepSpeedDraftTrainer(draft, _config(GLOBAL_BATCH // world), ZeroConfig(stage=stage))
        losses = [trainer.train_step(shard(_records(step, draft), rank, world))["global_loss"]
                  for step in range(STEPS)]
        result[stage] = {"losses": losses, "state": {k: v.detach().clone() for k, v in draft.state_dict().items()},
                         "version": trainer.version}
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


class _FixedBuffer:
    def __init__(self, records):
        self.records = records

    def sample(self, n, generator, **kw):
        return self.records


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_zero_config_validation():
    pytest.importorskip("deepspeed")
    from specrl.deepspeed_backend import DeepSpeedBackendError, ZeroConfig, shard

    for kw in (dict(stage=3), dict(dtype="fp8"), dict(reduce_bucket_size=0)):
        with pytest.raises(DeepSpeedBackendError) as e:
            ZeroConfig(**kw)
        assert "\n" not in str(e.value)
    d = ZeroConfig(stage=1).build(_config(4), world_size=2)
    assert d["train_batch_size"] == 8 and d["zero_optimization"]["stage"] == 1 and d["gradient_clipping"] == 0.5
    with pytest.raises(DeepSpeedBackendError, match="split"):
        shard(list(range(5)), 0, 2)


def test_two_ranks_equal_one_process(tmp_path, one_thread):
    pytest.importorskip("deepspeed")
    from specrl.online_trainer import OnlineDraftTrainer

    port = str(_free_port())
    env_base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2",
                "DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": "0", "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, __file__, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env={**env_base, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(2)]
    # meanwhile: the single-process reference on the whole batch
    ref = {}
    for stage in STAGES:
        draft = _draft()
        trainer = OnlineDraftTrainer(draft, _config(GLOBAL_BATCH))
        losses = [trainer.train_step(_FixedBuffer(_records(step, draft)), None)["draft_loss"] for step in range(STEPS)]
        ref[stage] = {"losses": losses, "state": draft.state_dict()}
    for p in procs:
        out, _ = p.communicate(timeout=180)
        assert p.returncode == 0, out.decode()[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for stage in STAGES:
        want = ref[stage]
        for got in (r[stage] for r in ranks):
            assert got["version"] == STEPS
            for a, b in zip(got["losses"], want["losses"]):
                assert abs(a - b) <= 1e-5 * abs(b), (stage, got["losses"], want["losses"])
            assert got["state"].keys() == want["state"].keys()
            for k, v in want["state"].items():
                assert (got["state"][k].float() - v.float()).abs().max().item() <= 1e-5, (stage, k)
        # the update moved the weights (so equality is not vacuous)
        assert not torch.equal(want["state"]["fc.weight"], _draft().state_dict()["fc.weight"])


if __name__ == "__main__":
    _worker(sys.argv[1])
