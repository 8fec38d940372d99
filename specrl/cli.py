"""The `specrl` command. Bad input ends with one line on stderr and exit code 2.

One error path for all of it: ValueError (config, input and checkpoint errors), every OSError
(a file where a folder should be, a read-only or full disk, ...; named with its path), and the
few OS failures libraries report as other types (torch reports a full disk while saving as a
RuntimeError). Checks that need no work run first, so nothing is trained before a bad argument
is refused; saves are atomic (target_training.checkpoint), so a failure leaves what was saved.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="quick", help="run preset: ci, quick, speed, drift or full")
    p.add_argument("--out", required=True, type=Path, help="output folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", type=Path, default=None, help="where SFT warm starts are cached (default ~/.cache/specrl or $SPECRL_CACHE)")
    p.add_argument("--task", default="arith", help="arith, sort, or a local .jsonl/.parquet file")


def _engine_options(args) -> dict:
    """The embedded engine's speed options a bench command line sets (EngineConfig fields)."""
    return {"moe_dispatch": args.moe_dispatch, "compile_forwards": args.compile_forwards}


def build_parser() -> argparse.ArgumentParser:
    from target_training.model import MOE_DISPATCHES

    parser = argparse.ArgumentParser(prog="specrl", description="online speculative-decoding co-training for LLM RL")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train-rl", help="SFT warm start + GRPO on a verifiable task")
    _add_common(p)
    p.add_argument("--steps", type=int, default=None, help="override the preset's number of GRPO steps")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--spec", default="off", choices=["off", "frozen", "online"],
                   help="speculative rollouts: off, with the offline draft frozen, or co-trained online")
    p.add_argument("--engine", default="embedded", choices=["embedded", "vllm"],
                   help="rollout engine: specrl's embedded PyTorch engine, or vLLM (installed separately)")

    p = sub.add_parser("train-draft", help="train the starting EAGLE-3 draft offline on a policy's rollouts")
    _add_common(p)
    p.add_argument("--policy", type=Path, default=None,
                   help="policy checkpoint folder (e.g. RUN/ckpt); default: the preset's SFT warm start")

    p = sub.add_parser("bench", help="benchmarks that print and save JSON")
    bsub = p.add_subparsers(dest="bench", required=True)
    g = bsub.add_parser("generate", help="plain generation tokens/s at batch 1, 4, 16")
    _add_common(g)
    g.add_argument("--batches", default="1,4,16")
    s = bsub.add_parser("speed", help="plain vs chain vs tree speculative decoding at batch 1, 4, 16")
    _add_common(s)
    s.add_argument("--batches", default="1,4,16")
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--gamma", type=int, default=None,
                   help="chain length of the chain rows, the controller using 1..gamma (default: the preset's "
                        "chain length, 4 for quick and 6 for speed)")
    s.add_argument("--repeats", type=int, default=None, help="timed calls per arm and batch, after a warm-up (default: "
                                                            "5 embedded, 3 vllm); the best is reported, the bound's "
                                                            "parts pool all of them")
    s.add_argument("--prompts-per-batch", type=int, default=3, metavar="N",
                   help="requests per batch slot: batch B decodes B * N prompts, so the engine refills each "
                        "slot N - 1 times and ends with a partial-batch tail (default 3)")
    s.add_argument("--moe-dispatch", default="exact", choices=list(MOE_DISPATCHES),
                   help="(embedded) how the target's MoE runs decode and verify blocks: exact (bitwise the "
                        "training dispatch) or dense (every expert on every token at small blocks: no host read, "
                        "equal to exact to rounding); default exact")
    s.add_argument("--compile-forwards", action="store_true",
                   help="(embedded) compile the target's small decode/verify blocks into static graphs "
                        "(torch.compile, eager fallback; the draft stays eager); each engine decodes the "
                        "prompts once untimed first")
    s.add_argument("--engine", default="embedded", choices=["embedded", "vllm"],
                   help="embedded: plain/chain/tree/adaptive on specrl's engine; vllm: vLLM plain vs EAGLE-3 "
                        "vs the embedded engine (greedy)")
    s.add_argument("--online-draft", type=Path, default=None, metavar="DIR",
                   help="(--engine vllm) a draft folder to time beside the offline draft, e.g. a drift run's")
    f = bsub.add_parser("profile", help="where plain and chain-speculative engine steps spend their time")
    _add_common(f)
    f.add_argument("--batches", default="1,4,16")
    f.add_argument("--temperature", type=float, default=0.0)
    f.add_argument("--moe-dispatch", default="exact", choices=list(MOE_DISPATCHES), help="as for bench speed")
    f.add_argument("--compile-forwards", action="store_true", help="as for bench speed")
    o = bsub.add_parser("overlap", help="RL step time with no draft training, sequential and overlapped co-training")
    _add_common(o)
    o.add_argument("--steps", type=int, default=8, help="timed RL steps per arm (after --warmup)")
    o.add_argument("--warmup", type=int, default=2)
    o.add_argument("--block", type=int, default=4, help="consecutive RL steps per arm before the next arm's turn")
    o.add_argument("--phases", action="store_true",
                   help="instead: a rollout alone, with draft updates in line, and with them overlapped, per batch size")
    o.add_argument("--batches", default="1,4,16,64", help="(--phases) rollout batch sizes")
    o.add_argument("--updates", type=int, default=2, help="(--phases) draft updates per rollout")

    p = sub.add_parser("drift", help="the drift experiment: plain / frozen / online / reference drafts as GRPO moves the policy")
    _add_common(p)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--reference-every", type=int, default=None, metavar="N",
                   help="retrain the reference draft at every N-th evaluation point (0: at the end only; "
                        "default: the preset's, every point for full)")
    p.add_argument("--engine", default="embedded", choices=["embedded", "vllm"],
                   help="rollout and evaluation engine (vllm: installed separately; arms decode greedily)")
    p.add_argument("--steps", type=int, default=None,
                   help="shorten the preset's RL run to this many GRPO steps (a reduced run; say so when quoting it)")
    p.add_argument("--deep-target", default=None, metavar="PRESET",
                   help="after the run, the same speed-against-batch sweep on this model preset's SFT policy and "
                        "offline draft, e.g. speed (a 12-layer target); '' for none (default: the preset's, "
                        "speed for full)")
    p = sub.add_parser("speed", help="speed sweeps over batch size, chain length and tree budget, with the bound")
    _add_common(p)
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--gammas", default="1,2,4,6", help="chain lengths")
    p.add_argument("--tree-budgets", default="4,8,16", help="draft tokens per tree")
    p.add_argument("--temperature", type=float, default=1.0)
    return parser


def _positive_ints(text: str, what: str, most: int) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be a comma-separated list of integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise ValueError(f"{what} must be positive integers, got {text!r}")
    if max(values) > most:
        raise ValueError(f"{what} must be at most {most}, got {max(values)}")
    return values


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


def _check_common(args: argparse.Namespace) -> None:
    from rollout.engine import MAX_BATCH
    from rollout.protocol import SamplingParams
    from specrl.train_rl import check_seed

    check_seed(args.seed)
    _check_folder("--out", args.out)
    _check_folder("--cache-dir", args.cache_dir)
    if getattr(args, "temperature", None) is not None:
        try:
            SamplingParams(temperature=args.temperature)
        except ValueError as e:
            raise ValueError(f"--{e}") from None
    args.batch_list = (_positive_ints(args.batches, "--batches", MAX_BATCH)
                       if getattr(args, "batches", None) is not None else None)


def run(args: argparse.Namespace) -> dict:
    _check_common(args)
    if args.command == "train-rl":
        from specrl.presets import MAX_RL_STEPS
        from specrl.train_rl import train_rl

        if args.steps is not None and not 0 < args.steps <= MAX_RL_STEPS:
            raise ValueError(f"--steps must be in [1, {MAX_RL_STEPS}], got {args.steps}")
        return train_rl(args.task, args.preset, args.out, seed=args.seed, resume=args.resume, steps=args.steps,
                        cache_dir=args.cache_dir, progress=not args.no_progress, spec=args.spec,
                        engine=args.engine)
    if args.command == "train-draft":
        from specrl.drafts import train_draft_command

        return train_draft_command(args.task, args.preset, args.out, policy_path=args.policy, seed=args.seed,
                                   cache_dir=args.cache_dir)
    if args.command == "bench" and args.bench == "generate":
        from specrl.bench import bench_generate

        return bench_generate(args.task, args.preset, args.out, args.batch_list,
                              seed=args.seed, cache_dir=args.cache_dir)
    if args.command == "bench" and args.bench == "speed":
        from rollout.speculative import MAX_SPEC_DEPTH
        from specrl.bench import bench_speed

        if args.gamma is not None and not 0 < args.gamma <= MAX_SPEC_DEPTH:
            raise ValueError(f"--gamma must be in [1, {MAX_SPEC_DEPTH}], got {args.gamma}")
        if args.repeats is not None and not 0 < args.repeats <= 100:
            raise ValueError(f"--repeats must be in [1, 100], got {args.repeats}")
        if not 0 < args.prompts_per_batch <= 64:
            raise ValueError(f"--prompts-per-batch must be in [1, 64], got {args.prompts_per_batch}")
        # unset --repeats / --gamma: each engine's default (the embedded one takes the preset's chain length)
        options = {"prompts_per_batch": args.prompts_per_batch, **({} if args.repeats is None else {"repeats": args.repeats})}
        if args.engine == "vllm":
            from specrl.bench_vllm import bench_speed_vllm

            if args.moe_dispatch != "exact" or args.compile_forwards:
                raise ValueError("--moe-dispatch and --compile-forwards are options of the embedded engine; "
                                 "drop them with --engine vllm")
            if args.temperature != 0.0:
                raise ValueError("--engine vllm benchmarks greedy decoding only (its rows check token identity, "
                                 "which sampled speculation on vLLM keeps in law only); drop --temperature")
            return bench_speed_vllm(args.task, args.preset, args.out, args.batch_list, seed=args.seed,
                                    cache_dir=args.cache_dir, online_draft_dir=args.online_draft,
                                    **({} if args.gamma is None else {"gamma": args.gamma}), **options)
        if args.online_draft is not None:
            raise ValueError("--online-draft needs --engine vllm")
        return bench_speed(args.task, args.preset, args.out, args.batch_list,
                           seed=args.seed, cache_dir=args.cache_dir, temperature=args.temperature,
                           chain_gamma=args.gamma, engine_options=_engine_options(args), **options)
    if args.command == "bench" and args.bench == "profile":
        from specrl.bench import bench_profile

        return bench_profile(args.task, args.preset, args.out, args.batch_list,
                             seed=args.seed, cache_dir=args.cache_dir, temperature=args.temperature,
                             engine_options=_engine_options(args))
    if args.command == "bench" and args.bench == "overlap":
        from specrl.bench_overlap import bench_overlap, bench_overlap_phases

        if args.phases:
            return bench_overlap_phases(args.task, args.preset, args.out, batches=args.batch_list,
                                        updates=args.updates, seed=args.seed, cache_dir=args.cache_dir)
        return bench_overlap(args.task, args.preset, args.out, steps=args.steps, warmup=args.warmup, block=args.block, seed=args.seed,
                             cache_dir=args.cache_dir)
    if args.command == "drift":
        from experiments.drift import run_drift

        return run_drift(args.preset, args.out, seed=args.seed, task=args.task, cache_dir=args.cache_dir,
                         progress=not args.no_progress, reference_every=args.reference_every,
                         engine=args.engine, rl_steps=args.steps, deep_target=args.deep_target)
    if args.command == "speed":
        from experiments.speed import run_speed
        from rollout.speculative import MAX_SPEC_DEPTH, MAX_TREE_BUDGET

        return run_speed(args.out, preset=args.preset, task=args.task, batches=args.batch_list,
                         gammas=_positive_ints(args.gammas, "--gammas", MAX_SPEC_DEPTH),
                         tree_budgets=_positive_ints(args.tree_budgets, "--tree-budgets", MAX_TREE_BUDGET),
                         temperature=args.temperature, seed=args.seed, cache_dir=args.cache_dir)
    raise ValueError(f"unknown command {args.command!r}")


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
    args = build_parser().parse_args(argv)
    try:
        result = run(args)
    except Exception as e:
        msg = error_line(e)
        if msg is None:
            raise
        print(f"specrl: error: {msg}", file=sys.stderr)
        return 2
    if isinstance(result, dict):
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
