#!/usr/bin/env bash
# areal lane: specrl as an inference engine inside AReaL's asynchronous rollout (areal 1.0.4), on CPU.
#
# Why `--no-deps` and a venv of its own: areal 1.0.4 requires torch<2.11 and transformers<=5.3
# and lists GPU-only packages (sglang, vllm, flash-attn, megatron). `import areal` imports all of
# areal.infra, so the lane installs that import closure, each pinned and without dependencies,
# plus the three heavier packages areal imports at module level, with their own dependencies:
# transformers 5.3.0 (tokenizer types), ray 2.60.0 (name resolution, remote tensors; never started
# here) and numba 0.68.1 (one njit helper in areal.utils.seqpack). What runs is listed in
# tests/test_upstream_areal.py.
# Idempotent: a venv installed by this version of the script (stamp file) whose areal imports is
# reused. SPECRL_LANE_INSTALL_ONLY=1 stops after the install.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=.venv-areal
t0=$(date +%s)
STAMP="$VENV/.specrl-lane-2"  # bump when the install list below changes
if [ ! -f "$STAMP" ] || ! "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('areal') == '1.0.4'; import pytest" >/dev/null 2>&1; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q -c constraints-cpu.txt torch==2.13.0 pytest safetensors tqdm \
        transformers==5.3.0 ray==2.60.0 numba==0.68.1
    "$VENV/bin/pip" install -q -c constraints-cpu.txt --no-deps areal==1.0.4 \
        aiohttp==3.14.5 multidict==7.2.1 attrs==26.1.0 yarl==1.25.1 idna==3.20 propcache==0.5.4 \
        aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 httpx==0.28.1 colorlog==6.12.0 \
        tenacity==9.2.1 flask==3.1.3 werkzeug==3.1.9 click==8.5.1 blinker==1.9.0 itsdangerous==2.2.0 \
        torchdata==0.11.0 lark==1.3.1 uvloop==0.23.0 pyyaml==6.0.4 hydra-core==1.4.0.dev1 \
        omegaconf==2.4.0.dev2 pillow==13.0.0 orjson==3.13.0 pydantic==2.14.4 pydantic-core==2.50.5 \
        typing-inspection==0.4.5 annotated-types==0.8.0 einops==0.8.2 requests==2.34.2 urllib3==2.8.0 \
        certifi==2026.10.19.post1 aiofiles==25.1.0 openai==3.57.0 httpx2==2.16.2 sniffio==1.3.1 \
        anyio==4.16.0 jiter==0.19.0 psutil==7.2.2
    "$VENV/bin/pip" install -q --no-deps -e .  # `.venv-areal/bin/specrl drift --async-staleness ...`
    touch "$STAMP"
fi
t1=$(date +%s)
echo "areal lane: install/check took $((t1 - t0)) s"
[ "${SPECRL_LANE_INSTALL_ONLY:-0}" = "1" ] && exit 0
SPECRL_LANE=areal PYTHONPATH="$PWD" "$VENV/bin/python" -m pytest -q -p no:cacheprovider -W ignore -m areal tests/test_upstream_areal.py
echo "areal lane: tests took $(( $(date +%s) - t1 )) s"
