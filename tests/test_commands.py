"""The command dataclasses behind the `specrl` flags: every field is a flag with its help, the
rules between flags live in __post_init__, and each command's call fits its function."""
import dataclasses
import inspect

import pytest
import torch

from specrl import commands
from specrl.cli import COMMANDS, build_parser, command_key, main
from specrl.commands import AsyncDrift, BenchReal, BenchRL, BenchSpeed, Drift, TrainRL


def _subcommands():
    """(argv prefix, classes) of every command line."""
    for name, entry in commands.COMMAND_LINE.items():
        if isinstance(entry, dict):
            yield from (([name, bench], classes) for bench, classes in entry.items())
        else:
            yield [name], entry


def _subparser(parser, names):
    for name in names:
        (sub,) = [a for a in parser._actions if a.dest in ("command", "bench")]
        parser = sub.choices[name]
    return parser


@pytest.mark.parametrize("names, classes", list(_subcommands()), ids=[" ".join(n) for n, _ in _subcommands()])
def test_every_field_is_a_flag_with_its_help(names, classes, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100000")  # one line per flag: no help text broken at a hyphen
    parser = _subparser(build_parser(), names)
    actions = {a.dest: a for a in parser._actions if a.dest != "help"}
    fields = dataclasses.fields(classes[0])
    assert sorted(actions) == sorted(f.name for f in fields)  # no flag outside the dataclass
    for variant in classes[1:]:  # a variant runs on the same command line
        assert issubclass(variant, classes[0]) and dataclasses.fields(variant) == fields
    with pytest.raises(SystemExit):
        main([*names, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for f in fields:
        action = actions[f.name]
        assert action.option_strings == ["--" + f.name.replace("_", "-")]
        assert action.help == f.metadata["help"] and action.help
        assert " ".join(f.metadata["help"].split()) in text
        assert action.required == (f.default is dataclasses.MISSING)


def test_every_command_key_has_one_class():
    keys = [cls.KEY for _, classes in _subcommands() for cls in classes]
    assert sorted(keys) == sorted(COMMANDS)


@pytest.mark.parametrize("argv, key", [
    (["drift"], "drift"),
    (["drift", "--async-staleness", "0", "1"], "drift --async-staleness"),
    (["bench", "overlap"], "bench overlap"),
    (["bench", "overlap", "--phases"], "bench overlap --phases"),
])
def test_a_switch_selects_its_variant(argv, key):
    assert command_key(build_parser().parse_args([*argv, "--out", "x"])) == key


def test_cross_field_rules_fire_in_post_init(tmp_path):
    """Made directly, with no parser: the rules are the dataclass's own."""
    out = tmp_path / "r"
    with pytest.raises(ValueError, match="^--drafter history needs --spec frozen or online$"):
        TrainRL(out=out, drafter="history")
    with pytest.raises(ValueError, match="^--drafter hybrid runs on the embedded engine"):
        TrainRL(out=out, spec="online", drafter="hybrid", engine="vllm")
    with pytest.raises(ValueError, match="^--engine vllm benchmarks greedy decoding only"):
        BenchSpeed(out=out, engine="vllm", temperature=0.5)
    with pytest.raises(ValueError, match="^--online-draft needs --engine vllm$"):
        BenchSpeed(out=out, online_draft=tmp_path / "d")
    with pytest.raises(ValueError, match="^--eagle3 speculates in fp32"):
        BenchReal(out=out, dtypes=("bf16",), eagle3=True)
    with pytest.raises(ValueError, match="^--async-staleness runs the embedded engine"):
        AsyncDrift(preset="ci", out=out, async_staleness=(1,), engine="vllm")
    Drift(preset="ci", out=out, engine="vllm")  # the synchronous experiment takes --engine vllm
    with pytest.raises(ValueError, match="^--device must be one of auto, cpu, cuda or cuda:N, got 'tpu'$"):
        BenchRL(out=out, preset="ci", device="tpu")
    with pytest.raises(ValueError, match="^--device cuda runs the embedded engine; --engine vllm serves"):
        TrainRL(out=out, device="cuda", engine="vllm")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"^--device cuda:0: this torch \(.*\) sees no CUDA device$"):
            Drift(preset="ci", out=out, device="cuda:0")
    ok = TrainRL(out=out, spec="frozen", drafter="history")
    assert (ok.preset, ok.task) == ("quick", "arith")  # defaults resolved from the preset
    assert not out.exists()  # refused and checked before any work


def test_folder_flags_are_checked_in_post_init(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(ValueError, match=f"^--cache-dir {f} is not a folder$"):
        TrainRL(out=tmp_path / "r", cache_dir=f)


@pytest.mark.parametrize("names, classes", list(_subcommands()), ids=[" ".join(n) for n, _ in _subcommands()])
def test_each_call_fits_its_function(names, classes, tmp_path):
    """A command's positional and keyword arguments bind to its function's signature."""
    from specrl.commands import resolve

    for cls in classes:
        values = {"out": tmp_path / "r"}
        if "preset" in {f.name for f in dataclasses.fields(cls)}:
            values["preset"] = "ci"
        if cls.SWITCH == "async_staleness":
            values["async_staleness"] = (0, 1)
        elif cls.SWITCH is not None:
            values[cls.SWITCH] = True
        pos, kw = cls(**values).call()
        inspect.signature(resolve(COMMANDS[cls.KEY])).bind(*pos, **kw)
