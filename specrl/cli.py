"""The `specrl` command. Bad input ends with one line on stderr and exit code 2.

One error path for all of it: a flag out of its bounds (checked by the flag's argparse type, so
the message names the flag as typed), ValueError (config, input and checkpoint errors), every
OSError (a file where a folder should be, a read-only or full disk, ...; named with its path),
and the few OS failures libraries report as other types (torch reports a full disk while saving
as a RuntimeError). Checks that need no work run first, so nothing is trained before a bad
argument is refused; saves are atomic (target_training.checkpoint), so a failure leaves what was
saved. Ctrl-C ends with one line saying how to go on, and exit code 130. A finished command
prints its headline figures and where its files are.

Experiments and benchmarks live in experiments/; the CLI reaches them only through COMMANDS,
imported when their command runs.
"""
from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from pathlib import Path

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
    "bench real": "experiments.bench.real:bench_real",
    "bench precision": "experiments.bench.precision:bench_precision",
}
DRIFT_PRESETS = "experiments.drift:DRIFT_PRESETS"

REAL_PRESET = "real"  # the preset family of the real model (specrl.presets, experiments.drift)
TASK_HELP = ("a built-in task (arith, sort; word and champ: worked problems for a real model) or a local task file: .jsonl (one JSON object per line) or .parquet, "
             "with string fields 'prompt' and 'answer' (exact-match reward on the text after the last 'ans ', "
             "else the whole completion) and an optional 'split' ('train', or one of heldout/test/eval/validation/"
             "valid/val; without it a stable hash of the prompt holds out 1 prompt in 8)")


def resolve(target: str):
    """The object a "module:name" string names, importing its module."""
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


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


# -- flag types: bounds checked where the flag is parsed ----------------------------------------
def _int_in(lo: int, hi: int | None = None):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi}], got {v}" if hi is not None
                                             else f"must be >= {lo}, got {v}")
        return v
    parse.bounds = f"{lo}..{hi}" if hi is not None else f">= {lo}"
    return parse


def int_list(most: int):
    """A flag type: a comma-separated list of positive integers, each at most `most`."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a comma-separated list of integers, got {text!r}") from None
        if not values or min(values) <= 0:
            raise argparse.ArgumentTypeError(f"must be positive integers, got {text!r}")
        if max(values) > most:
            raise argparse.ArgumentTypeError(f"must be at most {most}, got {max(values)}")
        return values
    parse.bounds = f"comma-separated, each 1..{most}"
    return parse


def _temperature(text: str) -> float:
    from rollout.protocol import SamplingParams

    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    try:
        SamplingParams(temperature=v)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("temperature ")) from None
    return v


_temperature.bounds = "finite, >= 0"


def _seed(text: str) -> int:
    from specrl.rl_setup import check_seed

    try:
        v = int(text)
        check_seed(v)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--seed ") if str(e).startswith("--seed")
                                         else f"must be an integer, got {text!r}") from None
    return v


def _arm_list(text: str) -> list[str]:
    """Comma-separated names (bench rl checks each against its arms before any work)."""
    return [a.strip() for a in text.split(",") if a.strip()]


_arm_list.bounds = "comma-separated"


def _add_common(p: argparse.ArgumentParser, presets, default: str = "quick") -> None:
    p.add_argument("--preset", default=None, choices=list(presets),
                   help=f"run preset (default: {default}, or {REAL_PRESET} with --model)")
    p.add_argument("--model", default=None, metavar="NAME",
                   help=f"a real pretrained model instead of a toy MoE trained here: smollm2-135m (the .[real] extra; "
                        f"selects the preset {REAL_PRESET}, whose task is word)")
    p.add_argument("--out", required=True, type=Path, help="output folder")
    p.add_argument("--seed", type=_seed, default=0, help="random seed")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="where SFT warm starts and offline drafts are cached (default ~/.cache/specrl or $SPECRL_CACHE)")
    p.add_argument("--task", default=None, help=TASK_HELP + " (default: the preset's, arith for the toy presets)")
    p.set_defaults(default_preset=default)


def _resolve_preset(args: argparse.Namespace, key: str) -> None:
    """--preset and --task from --model where they are not given; a real model with another
    model's preset is refused."""
    from specrl.presets import get_preset
    from target_training.real_models import real_model

    if args.model is not None:
        real_model(args.model)  # an unknown name fails before anything is loaded
    args.preset = args.preset or (REAL_PRESET if args.model else args.default_preset)
    preset = resolve(DRIFT_PRESETS)[args.preset].rl if key.startswith("drift") else get_preset(args.preset)
    if args.model is not None and preset.model != args.model:
        raise ValueError(f"--model {args.model} runs with a preset of that model ({REAL_PRESET}); "
                         f"--preset {args.preset} is the toy model {preset.model!r}")
    args.task = args.task or preset.task


def _engine_options(args) -> dict:
    """The embedded engine's speed options a bench command line sets (EngineConfig fields)."""
    return {"moe_dispatch": args.moe_dispatch, "compile_forwards": args.compile_forwards}


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import version

    from rollout.engine import MAX_BATCH
    from rollout.speculative import MAX_SPEC_DEPTH, MAX_TREE_BUDGET
    from specrl.presets import MAX_RL_STEPS, RL_PRESETS
    from target_training.model import MOE_DISPATCHES

    rl = list(RL_PRESETS)
    batches = int_list(MAX_BATCH)
    steps_help = "GRPO steps (default: the preset's)"
    kw = {"formatter_class": _HelpFormatter}
    parser = _Parser(prog="specrl", description="online speculative-decoding co-training for LLM RL", **kw)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('specrl')}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("train-rl", help="SFT warm start + GRPO on a verifiable task", **kw)
    _add_common(p, rl)
    p.add_argument("--steps", type=_int_in(1, MAX_RL_STEPS), default=None, help=steps_help)
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--spec", default="off", choices=["off", "frozen", "online"],
                   help="speculative rollouts: off, with the offline draft frozen, or co-trained online")
    p.add_argument("--drafter", default="eagle3", choices=["eagle3", "history", "hybrid"],
                   help="who drafts: the EAGLE-3 head; history: the group's siblings and earlier answers to the same "
                        "prompt (no model; with --spec frozen); hybrid: per row, whichever promises more")
    p.add_argument("--engine", default="embedded", choices=["embedded", "vllm"],
                   help="rollout engine: specrl's embedded PyTorch engine, or vLLM (installed separately)")

    p = sub.add_parser("train-draft", help="train the starting EAGLE-3 draft offline on a policy's rollouts", **kw)
    _add_common(p, rl)
    p.add_argument("--policy", type=Path, default=None,
                   help="policy checkpoint folder (e.g. RUN/ckpt); default: the preset's SFT warm start")

    p = sub.add_parser("drift", help="the drift experiment: plain / frozen / online / reference drafts as GRPO "
                                     "moves the policy", **kw)
    _add_common(p, resolve(DRIFT_PRESETS))
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--reference-every", type=_int_in(0), default=None, metavar="N",
                   help="retrain the reference draft at every N-th evaluation point (0: at the end only; "
                        "default: the preset's, every point for full)")
    p.add_argument("--engine", default="embedded", choices=["embedded", "vllm"],
                   help="rollout and evaluation engine (vllm: installed separately; arms decode greedily)")
    p.add_argument("--steps", type=_int_in(1, MAX_RL_STEPS), default=None,
                   help=steps_help + "; fewer shortens the run (a reduced run: say so when quoting it)")
    p.add_argument("--async-staleness", type=_int_in(0, 64), nargs="+", default=None, metavar="ETA",
                   help="the asynchronous variant inside AReaL's loop (areal installed: tests/lanes/areal.sh), "
                        "one run per staleness bound, e.g. 0 1 4 (0: synchronous); frozen and online arms only")
    p.add_argument("--async-windows", nargs="+", choices=["wait", "between"], default=["wait"],
                   help="(--async-staleness) where the draft trains: while the trainer waits for its batch, "
                        "and/or after the policy update")
    p.add_argument("--deep-target", default=None, metavar="PRESET",
                   help="after the run, the same speed-against-batch sweep on this model preset's SFT policy and "
                        "offline draft, e.g. speed (a 12-layer target); '' for none (default: the preset's, "
                        "speed for full)")

    p = sub.add_parser("bench", help="benchmarks that print and save JSON (see `specrl bench`)", **kw)
    bsub = p.add_subparsers(dest="bench", metavar="BENCHMARK", parser_class=_Parser)
    g = bsub.add_parser("generate", help="plain generation tokens/s per batch size", **kw)
    _add_common(g, rl)
    g.add_argument("--batches", type=batches, default="1,4,16", help="batch sizes")
    s = bsub.add_parser("speed", help="plain vs chain, tree and adaptive speculative decoding per batch size, "
                                      "with the bound; sweeps with --gammas and --tree-budgets", **kw)
    _add_common(s, rl)
    s.add_argument("--batches", type=batches, default="1,4,16", help="batch sizes")
    s.add_argument("--gammas", type=int_list(MAX_SPEC_DEPTH), default=None,
                   help="chain lengths, one chain arm each; the adaptive arm picks among 1..the longest "
                        "(default: the preset's chain length, 4 for quick and 6 for speed)")
    s.add_argument("--tree-budgets", type=int_list(MAX_TREE_BUDGET), default=None,
                   help="draft tokens per tree, one tree arm each (depth 4, top-4; default 12; embedded only)")
    s.add_argument("--temperature", type=_temperature, default=0.0, help="sampling temperature (0: greedy)")
    s.add_argument("--repeats", type=_int_in(1, 100), default=None,
                   help="timed calls per arm and batch, after a warm-up (default: 5 embedded, 3 vllm); the best "
                        "is reported, the bound's parts pool all of them")
    s.add_argument("--prompts-per-batch", type=_int_in(1, 64), default=3, metavar="N",
                   help="requests per batch slot: batch B decodes B * N prompts, so the engine refills each "
                        "slot N - 1 times and ends with a partial-batch tail")
    s.add_argument("--moe-dispatch", default="exact", choices=list(MOE_DISPATCHES),
                   help="(embedded) how the target's MoE runs decode and verify blocks: exact (bitwise the "
                        "training dispatch) or dense (every expert on every token at small blocks: no host read, "
                        "equal to exact to rounding)")
    s.add_argument("--compile-forwards", action="store_true",
                   help="(embedded) compile the target's small decode/verify blocks into static graphs "
                        "(torch.compile, eager fallback; the draft stays eager); each engine decodes the "
                        "prompts once untimed first")
    s.add_argument("--engine", default="embedded", choices=["embedded", "vllm"],
                   help="embedded: plain/chain/tree/adaptive on specrl's engine; vllm: vLLM plain vs EAGLE-3 "
                        "vs the embedded engine (greedy, one chain length)")
    s.add_argument("--online-draft", type=Path, default=None, metavar="DIR",
                   help="(--engine vllm) a draft folder to time beside the offline draft, e.g. a drift run's")
    f = bsub.add_parser("profile", help="where plain and chain-speculative engine steps spend their time", **kw)
    _add_common(f, rl)
    f.add_argument("--batches", type=batches, default="1,4,16", help="batch sizes")
    f.add_argument("--temperature", type=_temperature, default=0.0, help="sampling temperature (0: greedy)")
    f.add_argument("--moe-dispatch", default="exact", choices=list(MOE_DISPATCHES), help="as for bench speed")
    f.add_argument("--compile-forwards", action="store_true", help="as for bench speed")
    o = bsub.add_parser("overlap", help="RL step time with no draft training, sequential and overlapped co-training",
                        **kw)
    _add_common(o, rl)
    o.add_argument("--timed-steps", type=_int_in(1, MAX_RL_STEPS), default=8, help="timed RL steps per arm")
    o.add_argument("--warmup", type=_int_in(0), default=2, help="untimed RL steps per arm before them")
    o.add_argument("--block", type=_int_in(1), default=4, help="consecutive RL steps per arm before the next arm's turn")
    o.add_argument("--phases", action="store_true",
                   help="instead: a rollout alone, with draft updates in line, and with them overlapped, per batch size")
    o.add_argument("--batches", type=batches, default="1,4,16,64", help="(--phases) rollout batch sizes")
    o.add_argument("--updates", type=_int_in(1), default=2, help="(--phases) draft updates per rollout")
    c = bsub.add_parser("precision", help="speculative against plain decoding, token by token, in fp32 and bf16 "
                                          "(greedy and coupled sampling)", **kw)
    _add_common(c, rl)
    c.add_argument("--prompts", type=_int_in(1, 100_000), default=256, help="held-out prompts")
    c.add_argument("--batch", type=_int_in(1, 1024), default=16, help="engine batch size")
    q = bsub.add_parser("real", help="plain decoding of a real pretrained model on the embedded engine (fp32, "
                                     "bf16) against HF generate, per batch size", **kw)
    q.add_argument("--model", default="smollm2-135m", help="a real model (target_training.real_models)")
    q.add_argument("--out", required=True, type=Path, help="output folder")
    q.add_argument("--cache-dir", type=Path, default=None,
                   help="where the converted model is cached (default ~/.cache/specrl or $SPECRL_CACHE)")
    q.add_argument("--batches", type=batches, default="1,8,32", help="batch sizes")
    q.add_argument("--max-new-tokens", type=_int_in(1, 4096), default=64, help="new tokens per sequence")
    q.add_argument("--repeats", type=_int_in(1), default=3, help="timed repeats per batch size")
    q.add_argument("--no-hf", action="store_true", help="leave out the HF generate arm")
    q.add_argument("--eagle3", action="store_true",
                   help="also EAGLE-3 chains in fp32 with the model's offline draft (trained once on its own answers, cached)")
    q.add_argument("--draft-steps", type=_int_in(1, 1_000_000), default=None, help="(--eagle3) offline draft training steps")
    q.add_argument("--gamma", type=_int_in(1, MAX_SPEC_DEPTH), default=4, help="(--eagle3) chain length")
    q.add_argument("--dtypes", type=_arm_list, default="fp32,bf16", help="embedded engine dtypes: fp32, bf16")
    q.add_argument("--engine", default="embedded", choices=["embedded", "vllm"],
                   help="vllm: also vLLM in fp32, plain and (--eagle3) EAGLE-3 with the same draft")
    r = bsub.add_parser("rl", help="the whole RL step with speculation off, frozen and online, arms taking turns "
                                   "in segments of steps; split into rollout, update, co-training and the rest", **kw)
    _add_common(r, rl)
    r.add_argument("--engine", default="embedded", choices=["embedded", "vllm"], help="rollout engine")
    r.add_argument("--arms", type=_arm_list, default="off,frozen,online",
                   help="comma-separated arms: off, frozen, online, online-unpriced (draft updates not priced by "
                        "the rollout time speculation saves), frozen-fixed and online-fixed (the preset's chain at "
                        "every step, no adaptive controller), off-b (a second off run: the noise floor), history "
                        "(drafts from the group's siblings and earlier answers, no model), history-sib / history-past "
                        "(siblings only / earlier answers only), hybrid (history or the online EAGLE-3 chain per row), "
                        "hybrid-tree (both chains as two branches of one verified tree)")
    r.add_argument("--prompt-pool", type=_int_in(1), default=None,
                   help="training prompts the steps sample from (default: the preset's); a small pool revisits "
                        "prompts sooner, as epochs do")
    r.add_argument("--steps", type=_int_in(1, MAX_RL_STEPS), default=20, help="RL steps per arm")
    r.add_argument("--segment", type=_int_in(1), default=5, help="consecutive RL steps per arm before the next arm's turn")
    r.add_argument("--warmup", type=_int_in(0), default=1, help="first steps left out of the medians")
    r.add_argument("--vllm-schedule", action="store_true",
                   help="(--engine vllm) speculate by batch size, from speed-ups measured on vLLM first "
                        "(default: the preset's chain at every step)")
    parser.bench_parser = p  # `specrl bench` alone lists its benchmarks
    return parser


def _check_folder(flag: str, path: Path | None) -> None:
    """A folder argument must be a folder or creatable as one: its nearest existing ancestor
    must be a folder (else mkdir fails later with NotADirectoryError or FileExistsError)."""
    if path is None:
        return
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    if p.exists() and not p.is_dir():
        where = "" if p == Path(path) else f" ({p} is a file)"
        raise ValueError(f"{flag} {path} is not a folder{where}")


def command_key(args: argparse.Namespace) -> str:
    """The COMMANDS key of a parsed command line."""
    if args.command == "drift" and args.async_staleness is not None:
        return "drift --async-staleness"
    if args.command != "bench":
        return args.command
    return f"bench {args.bench}" + (" --phases" if args.bench == "overlap" and args.phases else "")


def _call(args: argparse.Namespace) -> tuple[tuple, dict]:
    """The positional and keyword arguments of the command's function."""
    key = command_key(args)
    if hasattr(args, "default_preset"):
        _resolve_preset(args, key)
    if key == "bench real":
        from target_training.real_models import real_model

        real_model(args.model)  # an unknown name fails before anything is loaded
        bad = [d for d in args.dtypes if d not in ("fp32", "bf16")]
        if bad or not args.dtypes:
            raise ValueError(f"--dtypes: choose from fp32, bf16 (got {','.join(args.dtypes)})")
        if args.eagle3 and "fp32" not in args.dtypes:
            raise ValueError("--eagle3 speculates in fp32: include fp32 in --dtypes")
        return (args.model, args.out), {"batches": args.batches, "max_new_tokens": args.max_new_tokens,
                                        "repeats": args.repeats, "hf": not args.no_hf, "cache_dir": args.cache_dir,
                                        "eagle3": args.eagle3, "draft_steps": args.draft_steps, "gamma": args.gamma,
                                        "dtypes": tuple(args.dtypes), "engine": args.engine}
    common = {"seed": args.seed, "cache_dir": args.cache_dir}
    if key == "train-rl":
        if args.drafter != "eagle3" and args.spec == "off":
            raise ValueError(f"--drafter {args.drafter} needs --spec frozen or online")
        if args.drafter == "history" and args.spec == "online":
            raise ValueError("--drafter history has no draft to train: use --spec frozen (or --drafter hybrid)")
        if args.drafter == "hybrid" and args.engine != "embedded":
            raise ValueError("--drafter hybrid runs on the embedded engine (vLLM takes one speculative method)")
        return (args.task, args.preset, args.out), {**common, "resume": args.resume, "steps": args.steps,
                                                    "progress": not args.no_progress, "spec": args.spec,
                                                    "engine": args.engine, "drafter": args.drafter}
    if key == "train-draft":
        return (args.task, args.preset, args.out), {**common, "policy_path": args.policy}
    if key == "drift --async-staleness":
        if args.engine != "embedded" or args.deep_target is not None or args.reference_every is not None:
            raise ValueError("--async-staleness runs the embedded engine without reference or deep target; "
                             "drop --engine, --reference-every and --deep-target")
        return (args.preset, args.out), {**common, "task": args.task, "staleness": tuple(args.async_staleness),
                                         "rl_steps": args.steps, "draft_windows": tuple(args.async_windows)}
    if key == "drift":
        return (args.preset, args.out), {**common, "task": args.task, "progress": not args.no_progress,
                                         "reference_every": args.reference_every, "engine": args.engine,
                                         "rl_steps": args.steps, "deep_target": args.deep_target}
    pos = (args.task, args.preset, args.out)
    if key == "bench generate":
        return (*pos, args.batches), common
    if key == "bench speed":
        if args.engine == "vllm":
            if args.moe_dispatch != "exact" or args.compile_forwards:
                raise ValueError("--moe-dispatch and --compile-forwards are options of the embedded engine; "
                                 "drop them with --engine vllm")
            if args.temperature != 0.0:
                raise ValueError("--engine vllm benchmarks greedy decoding only (its rows check token identity, "
                                 "which sampled speculation on vLLM keeps in law only); drop --temperature")
            if args.tree_budgets is not None:
                raise ValueError("--tree-budgets: --engine vllm runs chains only; drop it")
            if args.gammas is not None and len(args.gammas) != 1:
                raise ValueError("--gammas: --engine vllm times one chain length; give one")
        elif args.online_draft is not None:
            raise ValueError("--online-draft needs --engine vllm")
        return (*pos, args.batches), {**common, "engine": args.engine, "gammas": args.gammas,
                                      "tree_budgets": args.tree_budgets, "temperature": args.temperature,
                                      "repeats": args.repeats, "prompts_per_batch": args.prompts_per_batch,
                                      "online_draft_dir": args.online_draft,
                                      "engine_options": _engine_options(args) if args.engine == "embedded" else None}
    if key == "bench profile":
        return (*pos, args.batches), {**common, "temperature": args.temperature, "engine_options": _engine_options(args)}
    if key == "bench overlap --phases":
        return pos, {**common, "batches": args.batches, "updates": args.updates}
    if key == "bench overlap":
        return pos, {**common, "steps": args.timed_steps, "warmup": args.warmup, "block": args.block}
    if key == "bench precision":
        return pos, {**common, "n_prompts": args.prompts, "batch": args.batch}
    if key == "bench rl":
        return pos, {**common, "engine": args.engine, "arms": args.arms, "steps": args.steps,
                     "segment": args.segment, "warmup": args.warmup, "vllm_schedule": args.vllm_schedule,
                     "prompt_pool": args.prompt_pool}
    raise ValueError(f"unknown command {key!r}")


def run(args: argparse.Namespace) -> dict:
    _check_folder("--out", args.out)
    _check_folder("--cache-dir", args.cache_dir)
    pos, kw = _call(args)
    return resolve(COMMANDS[command_key(args)])(*pos, **kw)


# -- what a command ends with ------------------------------------------------------------------
def _train_rl_headline(s: dict) -> list[tuple[str, str]]:
    return [("held-out reward", f"{s['reward_start']:.3f} -> {s['reward_end']:.3f}"),
            ("greedy accuracy", f"{s['greedy_accuracy_start']:.3f} -> {s['greedy_accuracy_end']:.3f}"),
            ("RL steps", str(s["rl_steps"])), ("wall time", f"{s['wall_s']:.0f}s")]


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
    return f"specrl: interrupted; nothing was saved (results are written at the end): run it again"


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
