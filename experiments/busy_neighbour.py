"""Run a command beside a busy neighbour: a process that burns one CPU core in spells.

    python -m experiments.busy_neighbour SEED SPELLS_FILE -- specrl bench rl --preset drift ...

Decisions made from measured times (the run choice, the step controller) meet a shared machine's
slow spells; this puts the spells in on purpose. The neighbour waits a random 5-20 s, burns one
core for a random 2-10 s, and again, until the command ends; the times come from `SEED` alone,
and each spell's start (Unix seconds) and length go to SPELLS_FILE. Timings taken beside it are
not speeds of anything: what such a run measures is whether a decision still comes out right.
Exits with the command's exit status (2, with one line, on bad arguments).
"""
from __future__ import annotations

import itertools
import multiprocessing
import random
import subprocess
import sys
import time
from collections.abc import Iterator

WAIT_S = (5.0, 20.0)  # between two spells
SPELL_S = (2.0, 10.0)  # one spell's length


def _schedule(seed: int) -> Iterator[tuple[float, float]]:
    """The neighbour seeded with `seed`: (wait before, length) of each spell, in seconds, for ever."""
    rng = random.Random(seed)
    while True:
        wait = rng.uniform(*WAIT_S)
        yield wait, rng.uniform(*SPELL_S)


def spells(seed: int, n: int) -> list[tuple[float, float]]:
    """The first n (wait before, length) pairs of the neighbour seeded with `seed`, in seconds."""
    return list(itertools.islice(_schedule(seed), n))


def burn(seed: int, path: str) -> None:
    """The neighbour's loop: wait, burn, log, for ever (the parent ends it)."""
    with open(path, "a") as log:
        for wait, length in _schedule(seed):
            time.sleep(wait)
            start = time.time()
            log.write(f"{start:.1f} {length:.1f}\n")
            log.flush()
            while time.time() - start < length:
                pass


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") != 2 or len(argv) < 4:
        print("usage: python -m experiments.busy_neighbour SEED SPELLS_FILE -- COMMAND ...", file=sys.stderr)
        return 2
    try:
        seed = int(argv[0])
    except ValueError:
        print(f"busy_neighbour: SEED must be an integer, got {argv[0]!r}", file=sys.stderr)
        return 2
    neighbour = multiprocessing.Process(target=burn, args=(seed, argv[1]), daemon=True)
    neighbour.start()
    try:
        return subprocess.run(argv[3:]).returncode
    finally:
        neighbour.terminate()
        neighbour.join()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
