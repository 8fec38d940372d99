"""specrl.machine_load: the CPU other processes use beside a timed window.

The live tests assert on CPU seconds of known processes (a burner that spends a fixed amount of
CPU time), not on cores over wall time, so a busy machine (the other test worker) cannot fail
them: it adds to "others" only where "others" is asserted to be at least something."""
import shlex
import subprocess
import sys
import time

import pytest

from specrl.machine_load import CPUMark, _machine_busy_s, _tree_s, cpu_mark, others_busy_cores

live = pytest.mark.skipif(cpu_mark() is None, reason="needs Linux /proc")

BURN_S = 0.5  # CPU seconds a burner spends, however long the busy machine makes that take


def burner(done=None) -> list[str]:
    """A python process that spends BURN_S of its own CPU time, then touches `done`."""
    code = (f"import time, pathlib; t = time.process_time(); "
            f"[0 for _ in iter(lambda: time.process_time() - t < {BURN_S}, False)]; "
            + (f"pathlib.Path({str(done)!r}).touch()" if done else "pass"))
    return [sys.executable, "-c", code]


def _spent(since: CPUMark, until: CPUMark) -> tuple[float, float]:
    """(this tree's CPU seconds, the others') between two marks."""
    own = until.own_s - since.own_s
    return own, (until.machine_s - since.machine_s) - own


@live
def test_a_process_outside_this_tree_is_others_work(tmp_path):
    done = tmp_path / "done"
    since = cpu_mark()
    # started by a shell that exits at once: the burner is then nobody's child here
    cmd = " ".join(shlex.quote(a) for a in burner(done))
    subprocess.run(["sh", "-c", f"{cmd} >/dev/null 2>&1 &"], check=True)
    deadline = time.monotonic() + 30
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert done.exists()
    own, others = _spent(since, cpu_mark())
    assert others >= 0.8 * BURN_S
    assert own < 0.5 * BURN_S  # this process slept; the shell's instant is all it adds


@live
def test_this_process_and_its_children_are_its_own_work():
    since = cpu_mark()
    subprocess.run(burner(), check=True)  # a child this process waited for
    own_waited, _ = _spent(since, cpu_mark())
    since = cpu_mark()
    child = subprocess.Popen(burner())  # a live child at the second mark
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        own_live, _ = _spent(since, cpu_mark())
        if own_live >= 0.8 * BURN_S or child.poll() is not None:
            break
        time.sleep(0.05)
    child.wait()
    assert own_waited >= 0.8 * BURN_S
    assert own_live >= 0.8 * BURN_S


def test_the_tree_and_the_machine_are_read_from_proc(tmp_path):
    """A planted /proc: the root (pid 10), its child (11) and grandchild (12), and a stranger (20)
    whose name holds a parenthesis and spaces; the tick is the system's (100 on Linux)."""
    from specrl import machine_load

    tick = machine_load._TICK

    def proc(pid, ppid, utime, stime, cutime=0, cstime=0, name="python"):
        d = tmp_path / str(pid)
        d.mkdir()
        # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime cutime cstime ...
        (d / "stat").write_text(f"{pid} ({name}) S {ppid} 1 1 0 -1 0 0 0 0 0 {utime} {stime} {cutime} {cstime} 20 0 1 0\n")

    proc(10, 1, 100, 50, cutime=30)
    proc(11, 10, 20, 10)
    proc(12, 11, 5, 5, name="odd) name (x")
    proc(20, 1, 1000, 1000, name="other) S 10 (")
    (tmp_path / "self").mkdir()  # not a pid: skipped
    (tmp_path / "stat").write_text("cpu  400 100 300 9000 50 20 30 10 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    assert _tree_s(10, tmp_path) == pytest.approx((100 + 50 + 30 + 20 + 10 + 5 + 5) / tick)
    assert _tree_s(11, tmp_path) == pytest.approx(40 / tick)
    assert _machine_busy_s(tmp_path) == pytest.approx((400 + 100 + 300 + 20 + 30 + 10) / tick)


def test_others_cores_are_the_machines_seconds_less_this_trees_over_the_wall():
    a, b = CPUMark(100.0, 50.0, 10.0), CPUMark(102.0, 53.0, 11.0)
    assert others_busy_cores(a, b) == pytest.approx((3.0 - 1.0) / 2.0)
    assert others_busy_cores(a, CPUMark(102.0, 51.0, 11.5)) == 0.0  # the two counts tick apart: never below 0
    assert others_busy_cores(None, b) is None and others_busy_cores(a, CPUMark(100.001, 50.0, 10.0)) is None
