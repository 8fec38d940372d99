"""The README's plug-in example is experiments/own_loop.py, verbatim, and it runs as pasted."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_readme_quotes_the_example_verbatim():
    example = (ROOT / "experiments" / "own_loop.py").read_text()
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert example in blocks


def test_the_example_runs_as_pasted_and_trains_the_draft():
    out = subprocess.run([sys.executable, "-m", "experiments.own_loop"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 6 and all(line.startswith(f"step {i}: reward ") for i, line in enumerate(lines))
    assert all("accept length" in line for line in lines)  # every rollout speculated
    versions = [int(m) for m in re.findall(r"draft version (\d+)", out.stdout)]
    assert versions[-1] > versions[0] > 0  # the draft trained and was swapped in, step after step
