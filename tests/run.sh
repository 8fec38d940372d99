#!/usr/bin/env bash
# The whole test suite, set up from nothing: the base lane (embedded default, CPU torch pinned),
# then one lane per real upstream package (tests/lanes/*.sh, each in its own venv).
# Slow tests (marked `slow`) are left out; run them with `pytest -m slow`.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
DS_BUILD_OPS=0 .venv/bin/pip install -q -c constraints-cpu.txt -e ".[test,hf,dist]"
.venv/bin/python -m pytest -q -m "not slow and not vllm and not sglang and not verl"
for lane in tests/lanes/*.sh; do
    [ -e "$lane" ] || continue
    echo "== lane $(basename "$lane" .sh)"
    bash "$lane"
done
