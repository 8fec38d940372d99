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
    # no temp folders left behind: only `c` and the version folder it links to
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["c", path.resolve().name])


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


# ---------------------------------------------------------------- crash safety of the swap
_KILL_CHILD = r"""
import os, signal, sys
import torch
import target_training.checkpoint as ck
from target_training.config import model_config_for

out, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
cfg = model_config_for("tiny", 64)
torch.manual_seed(0)
model = cfg.build()
if sys.argv[4] == "1":
    ck.save_checkpoint(out, model, cfg, state={"step": 1})
count = [0]
def die():
    count[0] += 1
    if count[0] == n:
        os.kill(os.getpid(), signal.SIGKILL)
if mode == "hook":  # after each named step of the save
    ck.FAULT_HOOK = lambda name: die()
else:  # before each rename, replace, symlink or removal the save makes
    for name in ("rename", "replace", "symlink", "unlink", "rmdir"):
        real = getattr(os, name)
        def wrapped(*a, _real=real, **k):
            die()
            return _real(*a, **k)
        setattr(os, name, wrapped)
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)
ck.save_checkpoint(out, model, cfg, state={"step": 2})
print("finished")
"""


@pytest.mark.parametrize("first_save", [False, True])
@pytest.mark.parametrize("mode", ["hook", "syscall"])
def test_killed_at_every_step_of_a_save_leaves_a_loadable_checkpoint(tmp_path, tiny_cfg, mode, first_save):
    """SIGKILL the writer at each step of a save in turn: afterwards `ckpt` always loads (old or
    new weights, never a mix, never missing after a completed first save), recovery removes every
    orphan, and the next save works."""
    import os
    import subprocess
    import sys

    from target_training.checkpoint import recover_dir

    script = tmp_path / "child.py"
    script.write_text(_KILL_CHILD)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    seen = set()
    for n in range(1, 40):
        run_dir = tmp_path / f"{n}"
        out = run_dir / "ckpt"
        r = subprocess.run([sys.executable, str(script), str(out), mode, str(n), "0" if first_save else "1"],
                           env=env, capture_output=True, text=True, timeout=120)
        finished = "finished" in r.stdout
        assert finished or r.returncode == -9, r.stderr
        recover_dir(out)
        if out.exists():
            model, _, _, state = load_checkpoint(out, tiny_cfg)
            seen.add(state["step"])
            expect = {k: v for k, v in model.state_dict().items()}
            torch.manual_seed(0)
            ref = tiny_cfg.build().state_dict()
            shift = 1.0 if state["step"] == 2 else 0.0
            assert all(torch.equal(expect[k], ref[k] + shift) for k in ref if ref[k].is_floating_point())
        else:
            assert first_save and not finished, "a completed or previous checkpoint went missing"
        leftovers = sorted(p.name for p in run_dir.iterdir() if p.name != "ckpt")
        assert len(leftovers) == (1 if out.exists() else 0), leftovers  # just the folder ckpt names
        save_checkpoint(out, tiny_model_like(tiny_cfg), tiny_cfg, state={"step": 3})
        assert load_checkpoint(out, tiny_cfg)[3]["step"] == 3
        assert len([p for p in run_dir.iterdir() if p.name != "ckpt"]) == 1
        if finished:
            break
    else:
        pytest.fail("the save never finished")
    assert n >= 3  # the kill points were really exercised
    assert 2 in seen and (first_save or 1 in seen)


def tiny_model_like(cfg):
    torch.manual_seed(1)
    return cfg.build()


def test_recovers_an_older_two_rename_save_killed_between_renames(tmp_path, tiny_model, tiny_cfg):
    """What an older save killed between its two renames leaves: no `ckpt`, the old copy under
    `.ckpt.old-PID` and the new complete one under `.ckpt.tmp-*`; recovery picks the newer,
    complete one."""
    import os
    import time

    from target_training.checkpoint import recover_dir

    a = save_checkpoint(tmp_path / "a", tiny_model, tiny_cfg, state={"step": 1}).resolve()
    time.sleep(0.01)
    b = save_checkpoint(tmp_path / "b", tiny_model, tiny_cfg, state={"step": 2}).resolve()
    os.rename(a, tmp_path / ".ckpt.old-999999")
    os.rename(b, tmp_path / ".ckpt.tmp-abc123")
    (tmp_path / "a").unlink()
    (tmp_path / "b").unlink()
    incomplete = tmp_path / ".ckpt.tmp-zzz"
    incomplete.mkdir()
    (incomplete / "config.json").write_text("{}")
    logs = []
    recover_dir(tmp_path / "ckpt", log=logs.append)
    assert load_checkpoint(tmp_path / "ckpt", tiny_cfg)[3]["step"] == 2
    assert len(logs) == 1 and "recovered" in logs[0]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".ckpt.v-")) == ["ckpt"]


@pytest.mark.parametrize("message", ["basic_ios::clear: iostream error",
                                     "[enforce fail at inline_container.cc:672] . unexpected pos 1458944 vs 1458836"])
def test_full_disk_while_saving_is_an_oserror_and_keeps_the_previous(tmp_path, tiny_model, tiny_cfg, monkeypatch,
                                                                     message):
    """Both messages are what torch.save raised on a full tmpfs here."""
    import errno

    path = save_checkpoint(tmp_path / "c", tiny_model, tiny_cfg, state={"step": 1})

    def full(*a, **k):
        raise RuntimeError(message)

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OSError) as info:
        save_checkpoint(path, tiny_model, tiny_cfg, state={"step": 2})
    assert info.value.errno == errno.ENOSPC and str(path) in str(info.value)
    monkeypatch.undo()
    assert load_checkpoint(path, tiny_cfg)[3]["step"] == 1
