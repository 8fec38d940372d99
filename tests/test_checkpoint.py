import json

import pytest
import torch

from target_training.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from target_training.config import model_config_for


def test_round_trip(tmp_path, tiny_model, tiny_cfg):
    opt = torch.optim.AdamW(tiny_model.parameters())
    save_checkpoint(tmp_path / "c", tiny_model, tiny_cfg, optimizer=opt, state={"step": 3})
    model, cfg, opt_state, state = load_checkpoint(tmp_path / "c", tiny_cfg)
    x = torch.randint(0, 64, (1, 8))
    assert torch.equal(model(x).logits, tiny_model(x).logits)
    assert state["step"] == 3 and "param_groups" in opt_state


def test_config_mismatch_names_the_field(tmp_path, tiny_model, tiny_cfg):
    save_checkpoint(tmp_path / "c", tiny_model, tiny_cfg)
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_checkpoint(tmp_path / "c", model_config_for("quick", 64))


def test_truncated_and_corrupted_files(tmp_path, tiny_model, tiny_cfg):
    path = save_checkpoint(tmp_path / "c", tiny_model, tiny_cfg)
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(path)
    weights.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    with pytest.raises(CheckpointError, match="corrupted"):
        load_checkpoint(path)
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest"):
        load_checkpoint(path)


def test_failed_save_keeps_previous_checkpoint(tmp_path, tiny_model, tiny_cfg):
    path = save_checkpoint(tmp_path / "c", tiny_model, tiny_cfg, state={"step": 1})

    class Boom:
        def state_dict(self):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        save_checkpoint(path, tiny_model, tiny_cfg, optimizer=Boom(), state={"step": 2})
    _, _, _, state = load_checkpoint(path, tiny_cfg)
    assert state["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["c"]  # no temp folders left behind


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")


def test_invalid_config_json(tmp_path, tiny_model, tiny_cfg):
    path = save_checkpoint(tmp_path / "c", tiny_model, tiny_cfg)
    cfg = json.loads((path / "config.json").read_text())
    cfg["hidden_size"] = -1
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError):
        load_checkpoint(path)
