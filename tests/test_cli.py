"""CLI contract: bad input is one line on stderr and exit code 2; runs resume; nothing saved is clobbered."""
import json
import subprocess
import sys

import pytest

from specrl.cli import main


@pytest.fixture
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("sft-cache")


def _err_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specrl: error:")
    return err[0]


@pytest.mark.parametrize("argv, match", [
    (["--task", "nope"], "unknown task"),
    (["--preset", "huge"], "unknown preset"),
    (["--steps", "0"], "--steps must be positive"),
])
def test_bad_input_exit_2(tmp_path, cache, capsys, argv, match):
    code = main(["train-rl", "--out", str(tmp_path / "r"), "--cache-dir", str(cache), "--no-progress", *argv])
    assert code == 2
    assert match in _err_line(capsys)


def test_bench_bad_batches(tmp_path, capsys):
    assert main(["bench", "generate", "--out", str(tmp_path), "--batches", "1,-4"]) == 2
    assert "--batches" in _err_line(capsys)


def test_run_refuses_to_overwrite_and_resumes(tmp_path, cache, capsys):
    out = tmp_path / "run"
    base = ["train-rl", "--preset", "ci", "--out", str(out), "--cache-dir", str(cache), "--no-progress"]
    assert main(base + ["--steps", "1"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0]
    for key in ("reward", "logprob_mismatch", "entropy", "response_len", "tokens_per_s", "step_s", "router_balance"):
        assert key in rows[0]
    summary = json.loads((out / "summary.json").read_text())
    assert {"reward_start", "reward_end", "wall_s"} <= set(summary)
    before = (out / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert main(base + ["--steps", "2"]) == 2  # no --resume: refuse, leave the run alone
    assert "already holds a run" in _err_line(capsys)
    assert (out / "metrics.jsonl").read_bytes() == before
    assert main(base + ["--steps", "2", "--resume"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert json.loads((out / "summary.json").read_text())["sft_cached"] is True


def test_resume_from_corrupted_checkpoint(tmp_path, cache, capsys):
    out = tmp_path / "run"
    base = ["train-rl", "--preset", "ci", "--out", str(out), "--cache-dir", str(cache), "--no-progress"]
    assert main(base + ["--steps", "1"]) == 0
    w = out / "ckpt" / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-10])
    capsys.readouterr()
    assert main(base + ["--steps", "2", "--resume"]) == 2
    assert "truncated" in _err_line(capsys)


def test_console_entry_point_help():
    r = subprocess.run([sys.executable, "-m", "specrl", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "train-rl" in r.stdout


def test_train_draft_exports_sglang_layout(tmp_path, cache):
    from safetensors import safe_open

    argv = ["train-draft", "--preset", "ci", "--out", str(tmp_path), "--cache-dir", str(cache)]
    assert main(argv) == 0
    cfg = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    with safe_open(str(tmp_path / "draft" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
    assert not any("embed" in n for n in names)
    assert main(argv) == 2  # never overwrites an exported draft


def test_bench_speed_bad_temperature(tmp_path, cache, capsys):
    assert main(["bench", "speed", "--preset", "ci", "--out", str(tmp_path), "--cache-dir", str(cache),
                 "--temperature", "-1", "--batches", "1"]) == 2
    assert "temperature" in _err_line(capsys)


def test_engine_vllm_without_vllm_is_one_line(tmp_path, cache, capsys, monkeypatch):
    """Where vLLM is not importable (the base lane), --engine vllm names the fix and exits 2."""
    import builtins

    real_import = builtins.__import__

    def no_vllm(name, *args, **kwargs):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("No module named 'vllm'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    code = main(["train-rl", "--engine", "vllm", "--out", str(tmp_path / "r"), "--cache-dir", str(cache),
                 "--no-progress"])
    assert code == 2
    line = _err_line(capsys)
    assert "vLLM is not installed" in line and "tests/lanes/vllm.sh" in line
    assert not (tmp_path / "r").exists()  # refused before any work
