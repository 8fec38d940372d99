#!/usr/bin/env bash
# The whole test suite, set up from nothing: the base lane (embedded default, CPU torch pinned),
# then one lane per real upstream package (tests/lanes/*.sh, each in its own venv `.venv-<lane>`).
# The lanes' installs (mostly download and unpack) run in the background while the base lane
# tests; their tests run afterwards, one lane at a time. Slow tests (marked `slow`) are left out.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .lane-logs
lanes=()
pids=()
for lane in tests/lanes/*.sh; do
    [ -e "$lane" ] || continue
    name=$(basename "$lane" .sh)
    lanes+=("$lane")
    SPECRL_LANE_INSTALL_ONLY=1 bash "$lane" > ".lane-logs/$name.install.log" 2>&1 &
    pids+=($!)
done
python3 -m venv .venv
DS_BUILD_OPS=0 .venv/bin/pip install -q -c constraints-cpu.txt -e ".[test,hf,dist]"
.venv/bin/python -m pytest -q -m "not slow and not vllm and not sglang and not verl"
for i in "${!lanes[@]}"; do
    name=$(basename "${lanes[$i]}" .sh)
    if ! wait "${pids[$i]}"; then
        echo "lane $name: install failed" >&2
        cat ".lane-logs/$name.install.log" >&2
        exit 1
    fi
    cat ".lane-logs/$name.install.log"
done
for lane in "${lanes[@]}"; do
    echo "== lane $(basename "$lane" .sh)"
    bash "$lane"
done
