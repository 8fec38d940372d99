#!/usr/bin/env bash
# sglang lane: specrl's SGLang client against the real sglang 0.5.23 code, on CPU.
#
# Why its own venv: sglang 0.5.23 pins transformers==5.19.0, verl 0.9.1 needs transformers<5.11, so
# the two upstream lanes cannot share one. Why `--no-deps`: sglang lists CUDA-only wheels (kernels,
# flashinfer, torch 2.14.1); the modules the tests import (io_struct, server_args, the
# scheduler's weight-update manager, the EAGLE-3 model) need only the light packages below.
# torchvision: the PyPI wheel is a CUDA build whose C++ ops do not load on CPU torch; sglang imports
# it only for multimodal configs, and tests/upstream.py declares the two op schemas it needs.
# Idempotent: a venv installed by this version of the script (stamp file) whose sglang imports is reused. SPECRL_LANE_INSTALL_ONLY=1 stops after
# the install.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=.venv-sglang
t0=$(date +%s)
STAMP="$VENV/.specrl-lane-2"  # bump when the install list below changes
if [ ! -f "$STAMP" ] || ! "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('sglang') == '0.5.23'; import pytest" >/dev/null 2>&1; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q -c constraints-cpu.txt torch==2.13.0 pytest transformers==5.19.0 numpy safetensors \
        tqdm msgspec pyzmq pydantic fastapi pybase64 orjson setproctitle psutil requests pillow packaging IPython \
        aiohttp dill apache-tvm-ffi==0.1.11 sentencepiece compressed-tensors gguf openai partial_json_parser \
        uvloop uvicorn einops
    "$VENV/bin/pip" install -q -c constraints-cpu.txt --no-deps sglang==0.5.23 triton torchvision==0.28.0
    touch "$STAMP"
fi
t1=$(date +%s)
echo "sglang lane: install/check took $((t1 - t0)) s"
[ "${SPECRL_LANE_INSTALL_ONLY:-0}" = "1" ] && exit 0
SPECRL_LANE=sglang PYTHONPATH="$PWD" "$VENV/bin/python" -m pytest -q -p no:cacheprovider -W ignore -m sglang tests/test_upstream_sglang.py
echo "sglang lane: tests took $(( $(date +%s) - t1 )) s"
