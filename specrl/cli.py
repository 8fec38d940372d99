"""The `specrl` command. Bad input ends with one line on stderr and exit code 2.

One error path for all of it: a flag out of its bounds (checked by the flag's argparse type, so
the message names the flag as typed), ValueError (config, input and checkpoint errors), every
OSError (a file where a folder should be, a read-only or full disk, ...; named with its path),
and the few OS failures libraries report as other types (torch reports a full disk while saving
as a RuntimeError). Checks that need no work run first, so nothing is trained before a bad
argument is refused; saves are atomic (target_training.checkpoint), so a failure leaves what was
saved. Ctrl-C ends with one line saying how to go on, and exit code 130. A finished command
prints its headline figures and where its files are.

The flags of each command are the fields of its dataclass in specrl.commands, which also holds
the rules between them. Experiments and benchmarks live in experiments/; the CLI reaches them only
by name (COMMANDS, and the drift presets in specrl.commands), imported when they are needed.
"""
from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from pathlib import Path

from specrl.commands import BENCH_HELP, COMMAND_LINE, command_class, command_help, flag_options, from_flags, resolve

# The function each command runs, as "module:function", imported when the command runs. A
# module's `headline(result)` (where it has one) gives the figures the command ends with.
COMMANDS = {
    "train-rl": "specrl.train_rl:train_rl",
    "train-draft": "specrl.drafts:train_draft_command",
    "drift": "experiments.drift:run_drift",
    "drift --async-staleness": "experiments.async_drift:run_async_drift",
    "bench generate": "experiments.bench.generate:bench_generate",
    "bench speed": "experiments.bench.speed:bench_speed",
    "bench profile": "experiments.bench.profile:bench_profile",
    "bench overlap": "experiments.bench.overlap:bench_overlap",
    "bench overlap --phases": "experiments.bench.overlap:bench_overlap_phases",
    "bench rl": "experiments.bench.rl:bench_rl",
    "bench rl --report-unfinished": "experiments.bench.rl:report_unfinished",
    "bench rl --report-again": "experiments.bench.rl:report_again",
    "bench real": "experiments.bench.real:bench_real",
    "bench precision": "experiments.bench.precision:bench_precision",
    "bench update": "experiments.bench.update:bench_update",
}


class UsageError(ValueError):
    """A command line argparse refused (unknown flag, bad choice, a value out of its bounds)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        # "argument --steps: must be ..." reads as "--steps must be ..."
        head, sep, rest = message.partition(": ")
        if head.startswith("argument ") and rest.startswith("must "):
            message = f"{head[len('argument '):]} {rest}"
        raise UsageError(message)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's bounds (its type's `bounds`) and its default where it has one (not for
    switches and unset options)."""

    def _get_help_string(self, action):
        text = action.help or ""
        bounds = getattr(action.type, "bounds", None)
        if bounds:
            text += f" [{bounds}]"
        if action.required or any(action.default is v for v in (None, False, argparse.SUPPRESS)):
            return text
        return text + " (default: %(default)s)"


def _add_command(sub, name: str, classes: tuple) -> None:
    """A subcommand whose flags are the fields of its command class (specrl.commands)."""
    p = sub.add_parser(name, help=command_help(classes[0]), formatter_class=_HelpFormatter)
    for flag, options in flag_options(classes[0]):
        p.add_argument(flag, **options)
    p.set_defaults(command_classes=classes)


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import version

    kw = {"formatter_class": _HelpFormatter}
    parser = _Parser(prog="specrl", description="online speculative-decoding co-training for LLM RL", **kw)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('specrl')}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    for name, entry in COMMAND_LINE.items():
        if isinstance(entry, dict):  # a group: `specrl bench` alone lists its benchmarks
            p = sub.add_parser(name, help=BENCH_HELP, **kw)
            group = p.add_subparsers(dest=name, metavar="BENCHMARK", parser_class=_Parser)
            for bench, classes in entry.items():
                _add_command(group, bench, classes)
            parser.bench_parser = p
        else:
            _add_command(sub, name, entry)
    return parser


def command_key(args: argparse.Namespace) -> str:
    """The COMMANDS key of a parsed command line."""
    return command_class(args.command_classes, vars(args)).KEY


def run(args: argparse.Namespace) -> dict:
    """The command of a parsed command line, checked (its __post_init__, before any work), run."""
    command = from_flags(args.command_classes, vars(args))
    pos, kw = command.call()
    return resolve(COMMANDS[command.KEY])(*pos, **kw)


# -- what a command ends with ------------------------------------------------------------------
def _train_rl_headline(s: dict) -> list[tuple[str, str]]:
    from specrl.run_choice import describe

    rows = [("held-out reward", f"{s['reward_start']:.3f} -> {s['reward_end']:.3f}"),
            ("greedy accuracy", f"{s['greedy_accuracy_start']:.3f} -> {s['greedy_accuracy_end']:.3f}"),
            ("RL steps", str(s["rl_steps"])), ("wall time", f"{s['wall_s']:.0f}s")]
    if s.get("run_choice"):
        rows.append(("speculation", describe(s["run_choice"])))
    return rows


def _train_draft_headline(s: dict) -> list[tuple[str, str]]:
    return [("draft", s["draft"]), ("draft vocabulary", str(s["draft_vocab_size"]))]


HEADLINES = {"train-rl": _train_rl_headline, "train-draft": _train_draft_headline}


def headline(key: str, result: dict) -> list[tuple[str, str]]:
    """(label, figure) rows a finished command prints: its module's `headline`, else none."""
    if key in HEADLINES:
        return HEADLINES[key](result)
    fn = getattr(importlib.import_module(COMMANDS[key].split(":")[0]), "headline", None)
    return fn(result) if fn else []


def format_end(key: str, result: dict, out: Path) -> str:
    """A finished command's short table: its headline figures, then where its files and plots are."""
    rows = headline(key, result)
    files = sorted(p.name + ("/" if p.is_dir() else "") for p in Path(out).iterdir()) if Path(out).is_dir() else []
    plots = [f for f in files if f.endswith(".png")]
    rows.append(("files", f"{out}/ ({', '.join(f for f in files if f not in plots) or 'none'})"))
    if plots:
        rows.append(("plots", ", ".join(plots)))
    width = max(len(label) for label, _ in rows)
    return "\n".join([f"specrl {key}: done"] + [f"  {label:<{width}}  {value}" for label, value in rows])


def interrupted_line(key: str, argv: list[str], out: Path) -> str:
    """What Ctrl-C prints: how to go on from here."""
    if key == "train-rl":
        if Path(out).is_dir() and any(Path(out).iterdir()):
            again = [a for a in argv if a != "--resume"] + ["--resume"]
            return f"specrl: interrupted; continue with: specrl {shlex.join(again)}"
        return f"specrl: interrupted before anything was saved; run it again: specrl {shlex.join(argv)}"
    if key.startswith("drift"):
        return f"specrl: interrupted; a drift run does not resume: run it again with another --out (or remove {out})"
    return "specrl: interrupted; nothing was saved (results are written at the end): run it again"


# How OS failures look when a library reports them as something other than OSError.
_OS_FAILURE_TEXT = ("iostream error", "No space left on device", "Read-only file system", "file write failed",
                    "Disk quota exceeded", "os error", "inline_container.cc")


def error_line(e: BaseException) -> str | None:
    """The one-line message for an error the CLI reports (exit 2), or None for a bug."""
    if isinstance(e, OSError) and e.strerror:
        paths = " -> ".join(str(p) for p in (e.filename, e.filename2) if p is not None)
        return f"{paths}: {e.strerror}" if paths else e.strerror
    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    if isinstance(e, (ValueError, OSError)):
        return first
    if any(t in text for t in _OS_FAILURE_TEXT):
        return f"cannot write ({first}); is the disk full or read-only?"
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as e:
        print(f"specrl: error: {e}", file=sys.stderr)
        return 2
    if args.command == "bench" and args.bench is None:
        parser.bench_parser.print_help()
        return 0
    key = command_key(args)
    try:
        result = run(args)
    except KeyboardInterrupt:
        print(interrupted_line(key, argv, args.out), file=sys.stderr)
        return 130
    except Exception as e:
        msg = error_line(e)
        if msg is None:
            raise
        print(f"specrl: error: {msg}", file=sys.stderr)
        return 2
    if isinstance(result, dict):
        print(format_end(key, result, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
