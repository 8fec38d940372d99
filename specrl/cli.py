"""The `specrl` command. Bad input ends with one line on stderr and exit code 2."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="quick", help="run preset: ci, quick or full")
    p.add_argument("--out", required=True, type=Path, help="output folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", type=Path, default=None, help="where SFT warm starts are cached (default ~/.cache/specrl or $SPECRL_CACHE)")
    p.add_argument("--task", default="arith", help="arith, sort, or a local .jsonl/.parquet file")


def build_parser() -> argparse.ArgumentParser:
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

    p = sub.add_parser("drift", help="the drift experiment: plain / frozen / online / reference drafts as GRPO moves the policy")
    _add_common(p)
    p.add_argument("--no-progress", action="store_true")
    p = sub.add_parser("speed", help="speed sweeps over batch size, chain length and tree budget, with the bound")
    _add_common(p)
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--gammas", default="1,2,4,6", help="chain lengths")
    p.add_argument("--tree-budgets", default="4,8,16", help="draft tokens per tree")
    p.add_argument("--temperature", type=float, default=1.0)
    return parser


def _positive_ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be a comma-separated list of integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise ValueError(f"{what} must be positive integers, got {text!r}")
    return values


def run(args: argparse.Namespace) -> dict:
    if args.command == "train-rl":
        from specrl.train_rl import train_rl

        if args.steps is not None and args.steps <= 0:
            raise ValueError(f"--steps must be positive, got {args.steps}")
        return train_rl(args.task, args.preset, args.out, seed=args.seed, resume=args.resume, steps=args.steps,
                        cache_dir=args.cache_dir, progress=not args.no_progress, spec=args.spec,
                        engine=args.engine)
    if args.command == "train-draft":
        from specrl.drafts import train_draft_command

        return train_draft_command(args.task, args.preset, args.out, policy_path=args.policy, seed=args.seed,
                                   cache_dir=args.cache_dir)
    if args.command == "bench" and args.bench == "generate":
        from specrl.bench import bench_generate

        return bench_generate(args.task, args.preset, args.out, _positive_ints(args.batches, "--batches"),
                              seed=args.seed, cache_dir=args.cache_dir)
    if args.command == "bench" and args.bench == "speed":
        from specrl.bench import bench_speed

        return bench_speed(args.task, args.preset, args.out, _positive_ints(args.batches, "--batches"),
                           seed=args.seed, cache_dir=args.cache_dir, temperature=args.temperature)
    if args.command == "drift":
        from experiments.drift import run_drift

        return run_drift(args.preset, args.out, seed=args.seed, task=args.task, cache_dir=args.cache_dir,
                         progress=not args.no_progress)
    if args.command == "speed":
        from experiments.speed import run_speed

        return run_speed(args.out, preset=args.preset, task=args.task, batches=_positive_ints(args.batches, "--batches"),
                         gammas=_positive_ints(args.gammas, "--gammas"),
                         tree_budgets=_positive_ints(args.tree_budgets, "--tree-budgets"),
                         temperature=args.temperature, seed=args.seed, cache_dir=args.cache_dir)
    raise ValueError(f"unknown command {args.command!r}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = run(args)
    except (ValueError, FileNotFoundError) as e:  # config, input and checkpoint errors
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"specrl: error: {msg}", file=sys.stderr)
        return 2
    if isinstance(result, dict):
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
