"""Names used but never bound, across the project's Python files.

A module that only an upstream lane imports (specrl/async_rl.py runs under the AReaL lane) can
carry an undefined name past the base lane's tests; pyflakes reads every file without importing it.
"""
from __future__ import annotations

from pathlib import Path

import pytest

pyflakes_api = pytest.importorskip("pyflakes.api")
from pyflakes import messages  # noqa: E402
from pyflakes.reporter import Reporter  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("specrl", "rollout", "draft_models", "target_training", "experiments", "tests")


class _Collect(Reporter):
    def __init__(self):
        self.found: list[str] = []

    def unexpectedError(self, filename, msg):
        self.found.append(f"{filename}: {msg}")

    def syntaxError(self, filename, msg, lineno, offset, text):
        self.found.append(f"{filename}:{lineno}: {msg}")

    def flake(self, message):
        if isinstance(message, (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)):
            self.found.append(str(message))


def undefined_names(paths) -> list[str]:
    reporter = _Collect()
    for path in paths:
        pyflakes_api.checkPath(str(path), reporter)
    return reporter.found


def test_no_module_uses_a_name_it_never_binds():
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    assert len(files) > 50
    assert undefined_names(files) == []


def test_the_check_finds_a_planted_undefined_name(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("from math import pi\n\ndef f():\n    return {STEP_KEY: pi}\n")
    found = undefined_names([planted])
    assert len(found) == 1 and "STEP_KEY" in found[0]
