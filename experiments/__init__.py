"""Experiments that write JSON and PNG: the drift experiment (`drift.py`, `specrl drift`), speed
sweeps (`speed.py`, `specrl speed`) and the plots both draw (`plots.py`). Timing code lives in
specrl.bench, so the experiments and `specrl bench` share one implementation."""


def batch_sweep_main(doc: str, run, argv=None) -> int:
    """The command line of a measurement over batch sizes (`python -m experiments.X`): --out,
    --preset, --batches (checked as `specrl`'s own flag: one line naming it, exit code 2) and
    --cache-dir, passed to run(out, preset, batches, cache_dir=...)."""
    import argparse

    from rollout.engine import MAX_BATCH
    from specrl.cli import _positive_ints

    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--preset", default="quick")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--cache-dir", default=None)
    args = p.parse_args(argv)
    try:
        batches = tuple(_positive_ints(args.batches, "--batches", MAX_BATCH))
    except ValueError as e:
        p.error(str(e))
    run(args.out, args.preset, batches, cache_dir=args.cache_dir)
    return 0
