"""Experiments that write JSON and PNG: the drift experiment (`drift.py`, `specrl drift`), the
benchmarks behind `specrl bench` (`bench/`: speed, generate, profile, overlap, on one timing
harness), one-off measurements (compile_draft, compile_target, engine_options, kill_resume,
bad_inputs) and the plots they draw (`plots.py`)."""


def batch_sweep_main(doc: str, run, argv=None) -> int:
    """The command line of a measurement over batch sizes (`python -m experiments.X`): --out,
    --preset, --batches (the type of `specrl`'s own flag) and --cache-dir, passed to
    run(out, preset, batches, cache_dir=...)."""
    import argparse

    from rollout.engine import MAX_BATCH
    from specrl.commands import int_list

    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--preset", default="quick")
    p.add_argument("--batches", type=int_list(MAX_BATCH), default="1,4,16")
    p.add_argument("--cache-dir", default=None)
    args = p.parse_args(argv)
    run(args.out, args.preset, tuple(args.batches), cache_dir=args.cache_dir)
    return 0
