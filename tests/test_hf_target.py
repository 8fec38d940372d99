"""HF target adapter: converted models compute what HF computes, names round-trip exactly, and the
embedded engine's greedy speculative decoding reproduces HF `generate` token for token."""
import dataclasses

import pytest
import torch

from draft_models.config import Eagle3Config
from draft_models.train import capture_features, train_offline
from rollout.engine import EmbeddedEngine, EngineConfig
from rollout.protocol import SamplingParams
from rollout.drafters import DrafterSpec, SpecConfig
from target_training.config import MoEConfig
from target_training.hf_adapter import (FAMILIES, HFAdapterError, build_target, load_hf_target, moe_config_from_hf,
                                        to_hf_model, to_hf_state_dict, to_specrl_state_dict)
from helpers import tiny_hf_config, tiny_hf_model, tiny_hf_tokenizer

pytest.importorskip("transformers")  # the optional "hf" extra
pytestmark = pytest.mark.usefixtures("one_thread")


def _ids(n_rows=2, T=12, vocab=96, seed=1):
    return torch.randint(3, vocab, (n_rows, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_features_match_hf(family):
    hf = tiny_hf_model(family)
    ours, tok = load_hf_target(hf)
    assert tok is None
    ids = _ids()
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        out = ours(ids, tap_layers=range(ours.cfg.num_layers - 1))
    torch.testing.assert_close(out.logits, ref.logits, atol=2e-5, rtol=1e-5)
    # EAGLE-3 taps are the HF decoder-layer outputs (hidden_states[i + 1]; the last one is normed in HF)
    for i, tap in out.taps.items():
        torch.testing.assert_close(tap, ref.hidden_states[i + 1], atol=2e-5, rtol=1e-5)


def test_family_options_reach_the_model():
    q2 = moe_config_from_hf(tiny_hf_config("qwen2_moe"))
    assert (q2.attention_bias, q2.attention_out_bias, q2.qk_norm) == (True, False, False)
    assert q2.dense_layers == (0, 2) and q2.shared_expert_intermediate_size == 40 and not q2.norm_topk_prob
    q3 = moe_config_from_hf(tiny_hf_config("qwen3_moe"))
    assert q3.qk_norm and q3.dense_layers == (0,) and q3.norm_topk_prob and not q3.dense_first_layer
    mx = moe_config_from_hf(tiny_hf_config("mixtral"))
    assert mx.dense_layers == () and mx.expert_intermediate_size == 48 and mx.norm_topk_prob
    ll = moe_config_from_hf(tiny_hf_config("llama"))
    assert ll.dense_layers == (0, 1, 2, 3) and ll.tie_embeddings and ll.attention_out_bias
    model, _ = load_hf_target(tiny_hf_model("llama"))
    assert model.lm_head.weight is model.embed_tokens.weight  # tied stays tied


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_to_hf_names_is_exact(family):
    hf = tiny_hf_model(family)
    hf_sd = hf.state_dict()
    cfg = moe_config_from_hf(hf.config)
    back = to_hf_state_dict(to_specrl_state_dict(hf_sd, cfg), cfg)
    assert sorted(back) == sorted(hf_sd)
    assert all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)
    ours, _ = load_hf_target(hf)
    exported = to_hf_model(ours, hf.config)
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, hf(ids).logits)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_load_from_saved_folder(family, tmp_path):
    """save_pretrained writes the on-disk per-expert names (Mixtral: block_sparse_moe.w1/w2/w3)."""
    hf = tiny_hf_model(family)
    hf.save_pretrained(tmp_path / "m")
    tiny_hf_tokenizer().save_pretrained(tmp_path / "m")
    ours, tok = load_hf_target(tmp_path / "m")
    assert tok is not None and tok.convert_tokens_to_ids("w7") == 7
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf(ids).logits, atol=2e-5, rtol=1e-5)


def test_unsupported_models_fail_with_one_line(tmp_path):
    import transformers

    cases = [
        (transformers.GPT2Config(), "model_type 'gpt2' is not supported"),
        (tiny_hf_config("llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
         "rope_type 'linear'"),
        (tiny_hf_config("qwen3_moe", hidden_act="gelu"), "hidden_act 'gelu'"),
        (tiny_hf_config("qwen2_moe", use_sliding_window=True, sliding_window=16), "use_sliding_window"),
        (tiny_hf_config("mixtral", sliding_window=16), "sliding_window=16"),
        (tiny_hf_config("llama", mlp_bias=True), "mlp_bias"),
    ]
    for config, msg in cases:
        with pytest.raises(HFAdapterError, match=msg) as err:
            moe_config_from_hf(config)
        assert "\n" not in str(err.value)
    with pytest.raises(HFAdapterError, match="no config.json"):
        load_hf_target(tmp_path)
    bad = to_specrl_state_dict(tiny_hf_model("qwen3_moe").state_dict(), moe_config_from_hf(tiny_hf_config("qwen3_moe")))
    bad["layers.0.extra.weight"] = torch.zeros(1)
    with pytest.raises(HFAdapterError, match="unexpected"):
        build_target(moe_config_from_hf(tiny_hf_config("qwen3_moe")), bad)


def test_default_config_serialisation_is_unchanged():
    """The family options are left out of to_dict at their defaults: old cache keys still match."""
    d = MoEConfig().to_dict()
    assert not set(d) & set(MoEConfig._EXTENSIONS)
    cfg = MoEConfig(qk_norm=False, dense_layers=[3, 1], shared_expert_intermediate_size=8)
    assert MoEConfig.from_dict(cfg.to_dict()) == cfg and cfg.dense_layers == (1, 3)


# ---------------------------------------------------------------- speculative decoding = HF generate
def _hf_greedy(hf, prompts, n_new):
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            g = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n_new,
                            min_new_tokens=n_new, eos_token_id=None, pad_token_id=0)
            outs.append(g[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="module")
def qwen3_moe_setup():
    """A tiny random Qwen3-MoE, its HF greedy outputs, a random draft and a briefly trained one."""
    torch.set_num_threads(1)
    hf = tiny_hf_model("qwen3_moe", scale=0.3)
    target, _ = load_hf_target(hf)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 96, (int(n),), generator=g).tolist() for n in torch.randint(2, 12, (8,), generator=g)]
    n_new = 24
    ref = _hf_greedy(hf, prompts, n_new)
    dcfg = Eagle3Config.for_target(target.cfg, draft_vocab_size=96, ttt_steps=3)
    torch.manual_seed(0)
    random_draft = dcfg.build(target.embed_tokens)
    trained = dcfg.build(target.embed_tokens)
    seqs = [p + r for p, r in zip(prompts, ref)]
    masks = [[0] * len(p) + [1] * len(r) for p, r in zip(prompts, ref)]
    data = capture_features(target, seqs, masks, batch_size=8, d2t=trained.d2t, feature_dtype=torch.float32)
    train_offline(trained, data, steps=80, lr=1e-2, batch_size=8, seed=0, ttt_steps=3, warmup=5)
    return target, prompts, n_new, ref, {"random": random_draft, "trained": trained}


@pytest.mark.parametrize("draft_kind", ["random", "trained"])
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_greedy_speculative_equals_hf_generate(qwen3_moe_setup, mode, draft_kind):
    target, prompts, n_new, ref, drafts = qwen3_moe_setup
    spec_cfg = {"chain": SpecConfig(mode="chain", gamma=4),
                "tree": SpecConfig(mode="tree", gamma=3, tree_topk=3, tree_budget=8)}[mode]
    params = SamplingParams(temperature=0.0, max_new_tokens=n_new)
    plain = EmbeddedEngine(target, EngineConfig(max_batch=8)).generate(prompts, params)
    assert [t.token_ids for t in plain] == ref
    for batch in (1, 8):
        spec = DrafterSpec(draft=drafts[draft_kind], spec=spec_cfg)
        engine = EmbeddedEngine(target, EngineConfig(max_batch=batch), drafter=spec)
        trajs = engine.generate(prompts, params)
        assert [t.token_ids for t in trajs] == ref
        for a, b in zip(trajs, plain):
            assert (a.logprobs - b.logprobs).abs().max().item() <= 1e-5
        drafted = sum(t.spec.drafted for t in trajs)
        accepted = sum(t.spec.accepted for t in trajs)
        verify = sum(t.spec.verify_steps for t in trajs)
        assert verify > 0 and accepted < drafted  # rejections: KV rollback (chain) / compaction (tree)
        if draft_kind == "trained":
            assert accepted / verify > 0.5  # accepted paths of several tokens are kept in the cache


def test_policy_exports_as_a_qwen3_moe_folder_with_on_disk_names(tmp_path):
    """specrl's MoE policy -> an HF Qwen3-MoE folder (what vLLM serves), built from our config."""
    from safetensors.torch import load_file

    from target_training.config import model_config_for
    from target_training.hf_adapter import hf_config_from_moe, save_hf_folder

    torch.manual_seed(0)
    model = model_config_for("quick", 64).build().eval()
    out = save_hf_folder(model, tmp_path / "hf")
    names = set(load_file(str(out / "model.safetensors")))
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names and "model.layers.0.mlp.gate_proj.weight" in names
    back, _ = load_hf_target(out, max_seq_len=model.cfg.max_seq_len)
    ids = torch.randint(0, 64, (2, 11))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, back(ids).logits)
    assert hf_config_from_moe(model.cfg).mlp_only_layers == [0]
    with pytest.raises(HFAdapterError, match="QK-norm"):
        hf_config_from_moe(dataclasses.replace(model.cfg, qk_norm=False))


def test_a_dense_model_without_qk_norm_exports_as_a_llama_folder(tmp_path):
    """A Llama (tied embeddings, attention biases) loaded into specrl -> save_hf_folder -> an HF
    Llama folder (what vLLM serves for the real SmolLM2 target) whose logits are the original's;
    a dense specrl model without QK-norm exports the same way (its unused MoE fields ignored)."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from target_training.config import model_config_for
    from target_training.hf_adapter import save_hf_folder

    hf = tiny_hf_model("llama")
    ours, _ = load_hf_target(hf)
    out = save_hf_folder(ours, tmp_path / "llama")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] and config["attention_bias"]
    assert "lm_head.weight" not in load_file(str(out / "model.safetensors"))  # tied: left out, as HF does
    back = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(back(ids).logits, hf(ids).logits)
    torch.manual_seed(0)
    dense = dataclasses.replace(model_config_for("quick", 64), qk_norm=False, dense_layers=tuple(range(4)))
    model = dense.build().eval()
    again, _ = load_hf_target(save_hf_folder(model, tmp_path / "dense"), max_seq_len=dense.max_seq_len)
    with torch.no_grad():
        assert torch.equal(model(ids % 64).logits, again(ids % 64).logits)
