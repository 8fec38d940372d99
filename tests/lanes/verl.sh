#!/usr/bin/env bash
# verl lane: specrl's veRL adapter against the real verl 0.9.1, on CPU.
#
# Why its own venv: verl 0.9.1 needs transformers<5.11 while sglang 0.5.23 pins 5.19.0 (the sglang
# lane). verl installs with its dependencies (CPU torch pinned by constraints-cpu.txt); its agent
# loop also imports cachetools, fastapi, uvicorn, pyzmq and msgspec, which verl does not list.
# Idempotent: a venv installed by this version of the script (stamp file) whose verl imports is reused. SPECRL_LANE_INSTALL_ONLY=1 stops after
# the install.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=.venv-verl
t0=$(date +%s)
STAMP="$VENV/.specrl-lane-2"  # bump when the install list below changes
if [ ! -f "$STAMP" ] || ! "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('verl') == '0.9.1'; import pytest" >/dev/null 2>&1; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q -c constraints-cpu.txt torch==2.13.0 pytest verl==0.9.1 cachetools fastapi uvicorn \
        pyzmq msgspec
    touch "$STAMP"
fi
t1=$(date +%s)
echo "verl lane: install/check took $((t1 - t0)) s"
[ "${SPECRL_LANE_INSTALL_ONLY:-0}" = "1" ] && exit 0
SPECRL_LANE=verl PYTHONPATH="$PWD" "$VENV/bin/python" -m pytest -q -p no:cacheprovider -W ignore -m verl tests/test_upstream_verl.py
echo "verl lane: tests took $(( $(date +%s) - t1 )) s"
