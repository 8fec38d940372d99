#!/usr/bin/env bash
# miles lane: specrl's slime adapter against the real `Sample` of Miles (miles-rl 0.0.2), on CPU.
#
# Why Miles: slime (THUDM/slime) is not on PyPI (the PyPI `slime` is an unrelated library); Miles,
# its fork with the same hook names and Sample class, is. Why `--no-deps` and a venv of its own:
# miles-rl lists GPU-only requirements (torchft, ring_flash_attn, sglang-router) and its wheel
# carries its own `megatron` and `sglang` packages, which must not replace the other lanes'; the
# module under test (`miles.utils.types`) needs only torch and numpy.
# Idempotent: a venv installed by this version of the script (stamp file) whose miles imports is
# reused. SPECRL_LANE_INSTALL_ONLY=1 stops after the install.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=.venv-miles
t0=$(date +%s)
STAMP="$VENV/.specrl-lane-1"  # bump when the install list below changes
if [ ! -f "$STAMP" ] || ! "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('miles-rl') == '0.0.2'; import pytest" >/dev/null 2>&1; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q -c constraints-cpu.txt torch==2.13.0 numpy pytest safetensors
    "$VENV/bin/pip" install -q -c constraints-cpu.txt --no-deps miles-rl==0.0.2
    touch "$STAMP"
fi
t1=$(date +%s)
echo "miles lane: install/check took $((t1 - t0)) s"
[ "${SPECRL_LANE_INSTALL_ONLY:-0}" = "1" ] && exit 0
SPECRL_LANE=miles PYTHONPATH="$PWD" "$VENV/bin/python" -m pytest -q -p no:cacheprovider -W ignore -m miles tests/test_upstream_miles.py
echo "miles lane: tests took $(( $(date +%s) - t1 )) s"
