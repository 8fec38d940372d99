"""Whether a timing had the machine to itself: the CPU that other processes used meanwhile.

A figure timed while another heavy job ran (a test suite, a second benchmark) is not the
figure of the code alone: on a 2-core machine a test run beside an RL step can cost it a
quarter of its speed, and the budget, the run choice and the step controller all act on
measured times. Every RL step and every timed window of the experiments therefore records

    others_busy_cores = (machine's busy CPU seconds - this process tree's CPU seconds) / wall seconds

over the window: the cores that processes outside this one and its children kept busy, on
average. A machine that runs nothing else reads a few hundredths (the kernel and the system's
daemons); a test suite beside the run reads about 1. The machine's figures come from
/proc/stat, the process tree's from /proc/<pid>/stat (this process and its live descendants,
with the children they have waited for: an engine's worker processes count as this run's own
work). Where /proc is absent (not Linux) nothing is measured and the figure is None. Inside a
container /proc/stat counts the host's cores, so there the figure is the host's other load.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

# Others' cores above which a timed window counts as shared: well above the idle machine's
# background (a few hundredths of a core), well below one other busy thread.
BUSY_CORES = 0.1

_PROC = Path("/proc")
try:
    _TICK = float(os.sysconf("SC_CLK_TCK"))
except (AttributeError, ValueError, OSError):  # not a POSIX system
    _TICK = 100.0


@dataclass(frozen=True)
class CPUMark:
    """A moment, with the CPU seconds spent by then: by the whole machine, and by this process's tree."""

    wall_s: float  # time.monotonic()
    machine_s: float  # busy CPU seconds of every core since boot (/proc/stat: all but idle and iowait)
    own_s: float  # CPU seconds of this process, its live descendants and the children they waited for


def _machine_busy_s(proc: Path = _PROC) -> float:
    fields = (proc / "stat").read_text().split("\n", 1)[0].split()
    assert fields[0] == "cpu", fields[0]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / _TICK  # guest time is inside user's already


def _tree_s(root: int, proc: Path = _PROC) -> float:
    """CPU seconds of process `root` and its live descendants, each with its waited-for children's."""
    parent, spent = {}, {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:  # exited while we looked
            continue
        rest = text[text.rfind(")") + 2:].split()  # after "pid (comm) ": the name may hold spaces
        pid = int(entry.name)
        parent[pid] = int(rest[1])
        spent[pid] = sum(int(x) for x in rest[11:15]) / _TICK  # utime, stime, cutime, cstime
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += spent.get(pid, 0.0)
        todo.extend(children.get(pid, ()))
    return total


def cpu_mark() -> CPUMark | None:
    """Now, with the CPU seconds spent so far; None where /proc cannot be read."""
    try:
        return CPUMark(time.monotonic(), _machine_busy_s(), _tree_s(os.getpid()))
    except (OSError, ValueError, IndexError, AssertionError):
        return None


def others_busy_cores(since: CPUMark | None, until: CPUMark | None = None) -> float | None:
    """The cores that processes outside this one's tree kept busy, on average, from `since` to
    `until` (None: now). None where either mark is missing or under 10 ms passed (the kernel
    counts CPU time in ticks of 10 ms). Never below 0: the two counts tick apart."""
    until = until or cpu_mark()
    if since is None or until is None:
        return None
    wall = until.wall_s - since.wall_s
    if wall < 0.01:
        return None
    return max(0.0, ((until.machine_s - since.machine_s) - (until.own_s - since.own_s)) / wall)


STEP_KEY = "perf/others_busy_cores"  # an RL step row's figure (specrl.train_rl.rl_step, specrl.async_rl)


def shared(cores: float | None) -> bool:
    """Whether a window whose others_busy_cores read `cores` counts as shared (None: not measured)."""
    return cores is not None and cores > BUSY_CORES


def shared_steps(rows) -> int:
    """The RL step rows that ran while others kept the machine busy."""
    return sum(shared(r.get(STEP_KEY)) for r in rows)


# when this process started its work (the harness's modules import this one early)
AT_START = cpu_mark()
