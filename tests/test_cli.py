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
    (["--preset", "huge"], "--preset: invalid choice: 'huge'"),
    (["--steps", "0"], "--steps must be in [1, 1000000], got 0"),
    (["--model", "gpt-5"], "unknown real model 'gpt-5'; choose from smollm2-135m"),
    (["--model", "smollm2-135m", "--preset", "quick"],
     "--model smollm2-135m runs with a preset of that model (real); --preset quick is the toy model 'quick'"),
])
def test_bad_input_exit_2(tmp_path, cache, capsys, argv, match):
    code = main(["train-rl", "--out", str(tmp_path / "r"), "--cache-dir", str(cache), "--no-progress", *argv])
    assert code == 2
    assert match in _err_line(capsys)


def test_bench_bad_batches(tmp_path, capsys):
    assert main(["bench", "generate", "--out", str(tmp_path), "--batches", "1,-4"]) == 2
    assert "--batches" in _err_line(capsys)


def test_run_refuses_to_overwrite_and_resumes(tmp_path, cache, capsys, monkeypatch):
    import specrl.train_rl

    out = tmp_path / "run"
    base = ["train-rl", "--preset", "ci", "--out", str(out), "--cache-dir", str(cache), "--no-progress"]

    def disk_full(*a, **k):
        raise OSError(28, "No space left on device", str(cache))

    # a run that fails in its warm start, before any step, does not block the same command's retry
    monkeypatch.setattr(specrl.train_rl, "build_task_and_policy", disk_full)
    assert main(base + ["--steps", "1"]) == 2
    assert "No space left on device" in _err_line(capsys)
    assert sorted(p.name for p in out.iterdir()) == ["run.json"]
    monkeypatch.undo()
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


# ---------------------------------------------------------------- bad input, each refused up front
@pytest.mark.parametrize("argv, match", [
    (["train-rl", "--seed", str(10**30)], r"--seed must be an integer in \[0, 4294967295\], got 1000000000000000000000000000000"),
    (["train-rl", "--seed", "-1"], r"--seed must be an integer in \[0, 4294967295\]"),
    (["train-rl", "--steps", str(10**12)], r"--steps must be in \[1, 1000000\], got 1000000000000"),
    (["bench", "generate", "--batches", "1000000000"], "--batches must be at most 4096, got 1000000000"),
    (["bench", "speed", "--temperature", "nan"], "--temperature must be a finite number >= 0, got nan"),
    (["bench", "speed", "--temperature", "inf"], "--temperature must be a finite number >= 0, got inf"),
    (["bench", "speed", "--gammas", "100000"], "--gammas must be at most 64"),
    (["bench", "speed", "--tree-budgets", "1000000"], "--tree-budgets must be at most 1024"),
    (["bench", "overlap", "--timed-steps", "0"], r"--timed-steps must be in \[1, 1000000\], got 0"),
    (["drift", "--steps", "0"], r"--steps must be in \[1, 1000000\], got 0"),
])
def test_out_of_range_values_exit_2_before_any_work(tmp_path, capsys, argv, match):
    import re

    cache = tmp_path / "cache"
    assert main([*argv, "--out", str(tmp_path / "r"), "--cache-dir", str(cache)]) == 2
    assert re.search(match, _err_line(capsys))
    assert not cache.exists()  # nothing was trained or cached


def test_folder_arguments_that_are_files(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("keep me")
    assert main(["train-rl", "--out", str(f), "--cache-dir", str(tmp_path / "c")]) == 2
    assert _err_line(capsys) == f"specrl: error: --out {f} is not a folder"
    assert main(["train-rl", "--out", str(f / "sub"), "--cache-dir", str(tmp_path / "c")]) == 2
    assert _err_line(capsys) == f"specrl: error: --out {f / 'sub'} is not a folder ({f} is a file)"
    assert main(["train-rl", "--out", str(tmp_path / "r"), "--cache-dir", str(f)]) == 2
    assert _err_line(capsys) == f"specrl: error: --cache-dir {f} is not a folder"
    assert f.read_text() == "keep me" and not (tmp_path / "r").exists() and not (tmp_path / "c").exists()


@pytest.mark.parametrize("error, match", [
    (OSError(30, "Read-only file system", "/ro/run/metrics.jsonl"), "^specrl: error: /ro/run/metrics.jsonl: Read-only file system$"),
    (OSError(28, "No space left on device", "/full/run/ckpt"), "^specrl: error: /full/run/ckpt: No space left on device$"),
    (FileExistsError(17, "File exists", "/x/out"), "^specrl: error: /x/out: File exists$"),
    (NotADirectoryError(20, "Not a directory", "/x/f/out"), "^specrl: error: /x/f/out: Not a directory$"),
    (PermissionError(13, "Permission denied", "/root/x"), "^specrl: error: /root/x: Permission denied$"),
    (RuntimeError("basic_ios::clear: iostream error"), "^specrl: error: cannot write .basic_ios::clear: iostream error.; is the disk full or read-only.$"),
])
def test_every_os_error_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch, error, match):
    """Real EROFS/ENOSPC runs are in experiments/bad_inputs.py (they need a tmpfs mount)."""
    import re

    import specrl.train_rl

    def fail(*a, **k):
        raise error

    monkeypatch.setattr(specrl.train_rl, "train_rl", fail)
    assert main(["train-rl", "--out", str(tmp_path / "r"), "--cache-dir", str(tmp_path / "c")]) == 2
    assert re.search(match, _err_line(capsys))


def test_a_bug_still_shows_its_traceback(tmp_path, monkeypatch):
    import specrl.train_rl

    monkeypatch.setattr(specrl.train_rl, "train_rl", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        main(["train-rl", "--out", str(tmp_path / "r")])


@pytest.mark.parametrize("text, match", [
    ('{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2", "answer": \n', r"line 2 is not valid JSON"),
    ('{"prompt": "1+1", "answer": "2"}\n[1, 2]\n', r"line 2 is not a JSON object"),
    ("", r"is empty"),
    ("\n  \n", r"is empty"),
])
def test_bad_task_files_name_the_file_and_line(tmp_path, text, match):
    """In a subprocess: the `datasets` reader used to add a second stderr line of its own."""
    import re

    f = tmp_path / "tasks.jsonl"
    f.write_text(text)
    r = subprocess.run([sys.executable, "-m", "specrl.cli", "train-rl", "--task", str(f), "--out", str(tmp_path / "r"),
                        "--cache-dir", str(tmp_path / "c"), "--no-progress"], capture_output=True, text=True)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert str(f) in lines[0] and re.search(match, lines[0])


def test_a_run_refused_for_its_task_file_does_not_block_its_retry(tmp_path, capsys):
    """A bad task file is refused after the run folder is opened: run.json is left there, and the
    retry, with or without --resume, meets the task file's error again, not the folder's."""
    f = tmp_path / "tasks.jsonl"
    f.write_text('{"prompt": "1+1", "answer": \n')
    out = tmp_path / "r"
    argv = ["train-rl", "--task", str(f), "--out", str(out), "--cache-dir", str(tmp_path / "c"), "--no-progress"]
    for extra in ([], [], ["--resume"]):
        capsys.readouterr()
        assert main(argv + extra) == 2
        err = capsys.readouterr().err
        assert "line 1 is not valid JSON" in err and "already holds a run" not in err, err
        assert sorted(p.name for p in out.iterdir()) == ["run.json"]


# ---------------------------------------------------------------- resume: identity, damage, early kill
@pytest.fixture(scope="module")
def online_run(tmp_path_factory):
    """A finished 1-step `--spec online` CI run (copied by each test before it is changed)."""
    cache = tmp_path_factory.mktemp("cache")
    out = tmp_path_factory.mktemp("run") / "run"
    assert main(["train-rl", "--preset", "ci", "--spec", "online", "--steps", "1", "--out", str(out),
                 "--cache-dir", str(cache), "--no-progress"]) == 0
    return out, cache


def _copy_run(src, tmp_path):
    import shutil

    dst = tmp_path / "run"
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _resume(out, cache, *extra):
    return main(["train-rl", "--preset", "ci", "--spec", "online", "--steps", "2", "--out", str(out),
                 "--cache-dir", str(cache), "--no-progress", "--resume", *extra])


@pytest.mark.parametrize("extra, match", [
    (["--seed", "7"], "different seed 0 .this command: 7."),
    (["--task", "sort"], "different task 'arith' .this command: 'sort'."),
    (["--preset", "quick"], "different preset 'ci' .this command: 'quick'.; model config; preset settings"),
])
def test_resume_refuses_another_identity_before_training(online_run, tmp_path, capsys, extra, match):
    import re

    out = _copy_run(online_run[0], tmp_path)
    cache = online_run[1]
    before = sorted(p.name for p in cache.iterdir())
    metrics = (out / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert _resume(out, cache, *extra) == 2
    assert re.search(match, _err_line(capsys))
    assert sorted(p.name for p in cache.iterdir()) == before  # no SFT start trained for the other task
    assert (out / "metrics.jsonl").read_bytes() == metrics


def test_torn_last_metrics_line_is_named(online_run, tmp_path, capsys):
    out = _copy_run(online_run[0], tmp_path)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 1, "loss": 0.1')
    capsys.readouterr()
    assert _resume(out, online_run[1]) == 2
    assert _err_line(capsys) == (f"specrl: error: {out / 'metrics.jsonl'} line 2 is not valid JSON (Expecting ',' "
                                 "delimiter; a torn or edited line): repair or delete that line, then resume")


def test_resume_of_a_run_killed_before_its_first_checkpoint(online_run, tmp_path, capsys):
    """The metrics row is written before the first checkpoint: a kill between them used to leave
    a run that could be neither resumed nor restarted."""
    import shutil

    out = _copy_run(online_run[0], tmp_path)
    shutil.rmtree((out / "ckpt").resolve())
    (out / "ckpt").unlink()
    (out / "summary.json").unlink()
    assert _resume(out, online_run[1]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    ref = [json.loads(x) for x in (online_run[0] / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["loss"] == ref[0]["loss"] and rows[0]["train/draft_version"] == ref[0]["train/draft_version"]


def test_damaged_cached_offline_draft_does_not_block_resume(online_run, tmp_path, capsys):
    import shutil

    out = _copy_run(online_run[0], tmp_path)
    cache = tmp_path / "cache"
    shutil.copytree(online_run[1], cache, symlinks=True)
    (draft,) = [p for p in cache.iterdir() if p.name.startswith("draft-")]
    w = draft / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-100])  # truncated
    assert _resume(out, cache) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and rows[1]["train/draft_version"] > rows[0]["train/draft_version"]
    assert "training it again" in capsys.readouterr().out


def test_non_finite_metrics_are_written_as_null(tmp_path):
    """metrics.jsonl used to carry bare NaN, which is not JSON."""
    from specrl.run_dir import append_row, read_metrics

    path = tmp_path / "metrics.jsonl"
    append_row(path, {"step": 0, "train/draft_loss": float("nan"), "x": [1.0, float("inf")], "y": {"z": -float("inf")}})

    def strict(token):
        raise ValueError(f"non-JSON constant {token}")

    line = path.read_text()
    assert json.loads(line, parse_constant=strict) == {"step": 0, "train/draft_loss": None, "x": [1.0, None],
                                                       "y": {"z": None}}
    assert read_metrics(path)[0]["train/draft_loss"] is None


@pytest.mark.parametrize("flag", ["--gammas", "--repeats", "--prompts-per-batch"])
def test_bench_speed_bad_gamma_or_repeats(tmp_path, capsys, flag):
    assert main(["bench", "speed", "--preset", "ci", "--out", str(tmp_path), flag, "0", "--batches", "1"]) == 2
    assert flag in _err_line(capsys)
    assert not (tmp_path / "summary.json").exists()


def _without_package(monkeypatch, package: str) -> None:
    """Make `package` (and its submodules) fail to import for the rest of the test."""
    import builtins

    real_import = builtins.__import__

    def blocked(name, *args, **kwargs):
        if name == package or name.startswith(package + "."):
            raise ImportError(f"No module named {package!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", blocked)


def test_engine_vllm_without_vllm_is_one_line(tmp_path, cache, capsys, monkeypatch):
    """Where vLLM is not importable (the base lane), --engine vllm names the fix and exits 2."""
    _without_package(monkeypatch, "vllm")
    code = main(["train-rl", "--engine", "vllm", "--out", str(tmp_path / "r"), "--cache-dir", str(cache),
                 "--no-progress"])
    assert code == 2
    line = _err_line(capsys)
    assert "vLLM is not installed" in line and "tests/lanes/vllm.sh" in line
    assert not (tmp_path / "r").exists()  # refused before any work


def test_async_drift_without_areal_is_one_line(tmp_path, cache, capsys, monkeypatch):
    """Where AReaL is not importable (the base lane), --async-staleness names the fix and exits 2."""
    _without_package(monkeypatch, "areal")
    code = main(["drift", "--preset", "ci", "--async-staleness", "0", "1", "--out", str(tmp_path / "d"),
                 "--cache-dir", str(cache)])
    assert code == 2
    line = _err_line(capsys)
    assert "areal 1.0.4" in line and "tests/lanes/areal.sh" in line
    assert not (tmp_path / "d").exists()  # refused before any work
    code = main(["drift", "--preset", "ci", "--async-staleness", "1", "--engine", "vllm", "--out", str(tmp_path / "d")])
    assert code == 2 and "--async-staleness runs the embedded engine" in _err_line(capsys)


# ---------------------------------------------------------------- the front door
def test_version_and_bench_listing(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"specrl {version('specrl')}"
    assert main(["bench"]) == 0  # the benchmarks listed, not a usage error
    out = capsys.readouterr().out
    assert all(name in out for name in ("generate", "speed", "profile", "overlap"))


def test_help_lists_each_commands_presets_and_defaults(capsys):
    from experiments.drift import DRIFT_PRESETS

    with pytest.raises(SystemExit):
        main(["drift", "--help"])
    text = capsys.readouterr().out
    assert "{" + ",".join(DRIFT_PRESETS) + "}" in text and "speed" not in text.split("--preset")[1].split("{")[1].split("}")[0].split(",")
    with pytest.raises(SystemExit):
        main(["bench", "speed", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 1,4,16)" in text and "(default: quick, or real with --model)" in text and "'prompt' and 'answer'" in text


def test_a_bounded_flag_names_itself_in_one_line():
    """In a subprocess: argparse's own refusal (usage line plus error) is one line too."""
    r = subprocess.run([sys.executable, "-m", "specrl", "train-rl", "--out", "x", "--steps", "0"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "specrl: error: --steps must be in [1, 1000000], got 0"]


def test_ctrl_c_is_one_line_and_says_how_to_resume(tmp_path, cache):
    import signal
    import time

    out = tmp_path / "run"
    argv = ["train-rl", "--preset", "ci", "--steps", "1000", "--out", str(out), "--cache-dir", str(cache),
            "--no-progress"]
    # a shell without job control starts background jobs with SIGINT ignored, and Python keeps an
    # ignored SIGINT ignored: restore the default so the run sees Ctrl-C however the suite was started
    proc = subprocess.Popen([sys.executable, "-m", "specrl", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 300
        while not (out / "metrics.jsonl").exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # never leave a 1000-step run behind
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == [f"specrl: interrupted; continue with: specrl {' '.join(argv)} --resume"]


def test_a_run_ends_with_its_headline_table(tmp_path, cache, capsys):
    out = tmp_path / "draft"
    assert main(["train-draft", "--preset", "ci", "--out", str(out), "--cache-dir", str(cache)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    end = lines[lines.index("specrl train-draft: done"):]
    assert len(end) < 10 and any("draft vocabulary" in x for x in end) and any(str(out) in x for x in end)


def test_only_the_cli_imports_experiments(tmp_path):
    """The core package never imports experiments/ (the CLI reaches it through COMMANDS, by
    name); shown to catch a planted import."""
    import ast
    import shutil
    from pathlib import Path

    def importers(pkg: Path) -> list[str]:
        bad = []
        for f in sorted(pkg.rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
                if any(n == "experiments" or n.startswith("experiments.") for n in names) and f.name != "cli.py":
                    bad.append(str(f.relative_to(pkg)))
        return bad

    pkg = Path(__file__).parents[1] / "specrl"
    assert importers(pkg) == []
    planted = tmp_path / "specrl"
    shutil.copytree(pkg, planted, ignore=shutil.ignore_patterns("__pycache__"))
    (planted / "buffer.py").write_text((planted / "buffer.py").read_text()
                                       + "\n\ndef _f():\n    from experiments.bench.common import machine_info\n")
    assert importers(planted) == ["buffer.py"]


def test_drafter_choices_that_cannot_run_are_refused_in_one_line(tmp_path, capsys):
    """--drafter history trains nothing (so not with --spec online), needs speculation on, and the
    hybrid needs the embedded engine; each is refused before any work, nothing written."""
    out = tmp_path / "r"
    cases = [(["--spec", "online", "--drafter", "history"], "--drafter history has no draft to train"),
             (["--drafter", "history"], "--drafter history needs --spec frozen or online"),
             (["--spec", "online", "--drafter", "hybrid", "--engine", "vllm"], "--drafter hybrid runs on the embedded")]
    for argv, msg in cases:
        assert main(["train-rl", "--preset", "ci", "--out", str(out), *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0], err
    assert not out.exists()
