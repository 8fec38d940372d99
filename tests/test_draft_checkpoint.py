"""EAGLE-3 draft checkpoints: SGLang layout, round trip, target checks, corruption, atomic save."""
from __future__ import annotations

import json

import pytest
import torch
from helpers import SGLANG_KEYS
from safetensors.torch import load_file, save_file

import draft_models.checkpoint as ckpt
from draft_models.checkpoint import DraftCheckpointError, draft_state_dict_for_sglang, load_draft, save_draft
from draft_models.config import Eagle3Config
from draft_models.vocab import build_draft_vocab
from target_training.config import MoEConfig, model_config_for

V, VD = 64, 40
pytestmark = pytest.mark.usefixtures("one_thread")




def make_pair(seed: int = 0):
    torch.manual_seed(seed)
    target = model_config_for("tiny", V).build().eval()
    draft = Eagle3Config.for_target(target.cfg, VD).build(target.embed_tokens)
    draft.set_vocab(*build_draft_vocab(torch.randint(0, 100, (V,)), V, VD, always_include=(0,)))
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return target, draft.eval()


def outputs(target, draft):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (2, 9), generator=g)
    with torch.no_grad():
        out = target(ids, tap_layers=target.cfg.feature_layer_ids)
        return draft(ids[:, 1:], out.features(target.cfg.feature_layer_ids)[:, :-1])


def other_target(**changes):
    base = model_config_for("tiny", V).to_dict()
    base.update(changes)
    return MoEConfig.from_dict(base).build()


def test_save_writes_sglang_layout_and_round_trips(tmp_path):
    target, draft = make_pair()
    out = save_draft(draft, tmp_path / "draft")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "manifest.json", "model.safetensors"]
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == SGLANG_KEYS  # no embedding
    assert set(draft_state_dict_for_sglang(draft)) == SGLANG_KEYS
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["torch_dtype"] == "float32"
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(target.cfg.feature_layer_ids)
    loaded = load_draft(out, target)
    assert loaded.cfg == draft.cfg and loaded.embed_tokens is target.embed_tokens
    for (a, b) in zip(outputs(target, draft), outputs(target, loaded)):
        assert torch.equal(a, b)
    assert torch.equal(loaded.d2t, draft.d2t) and torch.equal(loaded.t2d, draft.t2d)
    # overwrite an existing checkpoint with new weights
    with torch.no_grad():
        draft.lm_head.weight.mul_(2.0)
    save_draft(draft, out)
    assert torch.equal(load_draft(out, target).lm_head.weight, draft.lm_head.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]  # no temp or backup folders left


def test_embedding_in_file_is_ignored_and_target_embedding_used(tmp_path):
    target, draft = make_pair()
    out = save_draft(draft, tmp_path / "d")
    tensors = load_file(str(out / "model.safetensors"))
    tensors["embed_tokens.weight"] = torch.zeros(V, 64)  # SpecForge-style extra key
    (out / "manifest.json").unlink()  # SpecForge writes no manifest
    save_file(tensors, str(out / "model.safetensors"))
    assert load_draft(out, target).embed_tokens is target.embed_tokens


@pytest.mark.parametrize("changes, field", [
    (dict(hidden_size=96, num_heads=4, head_dim=24), "target_hidden_size"),
    (dict(vocab_size=80), "vocab_size"),
    (dict(aux_layer_ids=(0, 1, 2)), "eagle_aux_hidden_state_layer_ids"),
])
def test_mismatched_target_is_rejected_with_the_field_named(tmp_path, changes, field):
    target, draft = make_pair()
    out = save_draft(draft, tmp_path / "d")
    with pytest.raises(DraftCheckpointError, match=field) as e:
        load_draft(out, other_target(**changes))
    assert "\n" not in str(e.value)


def test_wrong_fc_shape_and_bad_vocab_are_rejected(tmp_path):
    target, draft = make_pair()
    out = save_draft(draft, tmp_path / "d")
    good = load_file(str(out / "model.safetensors"))
    (out / "manifest.json").unlink()  # a draft from another trainer: the structural checks still apply
    bad = dict(good, **{"fc.weight": torch.zeros(64, 128)})
    save_file(bad, str(out / "model.safetensors"))
    with pytest.raises(DraftCheckpointError, match="fc.weight"):
        load_draft(out, target)
    bad = dict(good, d2t=torch.full((VD,), V, dtype=torch.long))
    save_file(bad, str(out / "model.safetensors"))
    with pytest.raises(DraftCheckpointError, match="d2t"):
        load_draft(out, target)
    bad = {k: v for k, v in good.items() if k != "norm.weight"}
    save_file(bad, str(out / "model.safetensors"))
    with pytest.raises(DraftCheckpointError, match="norm.weight"):
        load_draft(out, target)


def test_truncated_or_corrupt_files_give_clear_errors(tmp_path):
    target, draft = make_pair()
    out = save_draft(draft, tmp_path / "d")
    weights = out / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(DraftCheckpointError, match="model.safetensors") as e:
        load_draft(out, target)
    assert "\n" not in str(e.value)
    weights.write_bytes(b"\x00garbage")
    with pytest.raises(DraftCheckpointError, match="model.safetensors"):
        load_draft(out, target)
    weights.unlink()
    with pytest.raises(DraftCheckpointError, match="model.safetensors"):
        load_draft(out, target)
    (out / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"], "hidden_')
    with pytest.raises(DraftCheckpointError, match="config.json"):
        load_draft(out, target)
    (out / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(DraftCheckpointError, match="config.json"):
        load_draft(out, target)
    with pytest.raises(DraftCheckpointError, match="nowhere"):
        load_draft(tmp_path / "nowhere", target)


def test_failed_save_leaves_existing_checkpoint_intact(tmp_path, monkeypatch):
    target, draft = make_pair()
    out = save_draft(draft, tmp_path / "d")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def half_write(tensors, path):
        path.write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "_write_safetensors", half_write)
    with torch.no_grad():
        draft.fc.weight.zero_()
    with pytest.raises(OSError, match="disk full"):
        save_draft(draft, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    assert not torch.equal(load_draft(out, target).fc.weight, draft.fc.weight)


def test_flipped_byte_in_weights_is_refused_by_the_manifest(tmp_path):
    """Before the manifest a flipped byte in a tensor's data loaded silently."""
    target, draft = make_pair()
    out = save_draft(draft, tmp_path / "d")
    w = out / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside a weight matrix: still a well-formed safetensors file
    w.write_bytes(bytes(data))
    with pytest.raises(DraftCheckpointError, match="model.safetensors is corrupted .SHA-256 mismatch.") as e:
        load_draft(out, target)
    assert "\n" not in str(e.value)
    (out / "manifest.json").unlink()
    load_draft(out, target)  # without a manifest nothing can tell: that is what the manifest is for


def test_identity_vocab_is_written_without_maps_and_reloads(tmp_path):
    """vLLM has no `draft_id_to_target_id` when the draft vocabulary is the target's and refuses a
    `d2t` then; the export leaves both maps out and load_draft restores the identity."""
    torch.manual_seed(0)
    target = model_config_for("tiny", V).build().eval()
    draft = Eagle3Config.for_target(target.cfg, V).build(target.embed_tokens).eval()
    out = save_draft(draft, tmp_path / "d")
    assert set(load_file(str(out / "model.safetensors"))) == SGLANG_KEYS - {"d2t", "t2d"}
    loaded = load_draft(out, target)
    assert torch.equal(loaded.d2t, draft.d2t) and torch.equal(loaded.t2d, draft.t2d)
    for a, b in zip(outputs(target, draft), outputs(target, loaded)):
        assert torch.equal(a, b)


def test_tap_ids_are_written_in_each_engines_convention(tmp_path):
    target, draft = make_pair()
    ids = list(target.cfg.feature_layer_ids)  # ours: the output of layer i, counted from 0
    cfg = json.loads((save_draft(draft, tmp_path / "d") / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == ids  # SGLang: output of layer i
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in ids]  # vLLM: after i layers
    # a folder written for vLLM only (top-level key) reads back as the same layers
    only_vllm = {k: v for k, v in cfg.items() if k != "eagle_config"}
    assert Eagle3Config.from_sglang_config(only_vllm).aux_layer_ids == tuple(ids)
    clash = dict(cfg, eagle_aux_hidden_state_layer_ids=ids)  # both keys, same numbers: two conventions disagree
    with pytest.raises(ValueError, match="two different tap layers"):
        Eagle3Config.from_sglang_config(clash)


def _sglang_0_5_23_capture_points(config: dict, num_layers: int) -> list[int]:
    """A hand-written mirror of how SGLang 0.5.23 picks the hidden states an EAGLE-3 draft gets
    (this test runs in the base lane, where sglang is not installed; tests/test_upstream_sglang.py runs sglang's own loader code in its lane):
    model_runner_components/spec_aux_hidden_state.py reads only eagle_config[...layer_ids]
    (None when absent); Qwen3MoeForCausalLM.set_eagle3_layers_to_capture captures
    [2, L // 2, L - 3] for None, else [i + 1 for i in ids]; the decoder marks those layers and
    records the hidden state entering them (= the output of the layer before)."""
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    entering = [2, num_layers // 2, num_layers - 3] if ids is None else [i + 1 for i in ids]
    return sorted({j - 1 for j in entering})  # as "output of layer j", the convention specrl uses


def test_sglang_reading_of_the_export_taps_our_layers(tmp_path):
    cfg8 = model_config_for("full", V)  # 8 layers: taps (1, 3, 4); SGLang can tap them all
    target = cfg8.build()
    draft = Eagle3Config.for_target(cfg8, VD).build(target.embed_tokens)
    cfg = json.loads((save_draft(draft, tmp_path / "d") / "config.json").read_text())
    assert _sglang_0_5_23_capture_points(cfg, cfg8.num_layers) == list(cfg8.feature_layer_ids)


def test_copy_draft_weights_is_all_or_nothing(tiny_model):
    """A broadcastable wrong shape, a non-finite value or a missing tensor is refused before any
    tensor is copied (the engines' hot swap goes through this copy)."""
    from draft_models.checkpoint import copy_draft_weights
    from specrl.config import DraftTrainConfig
    from specrl.drafts import new_draft

    draft = new_draft(tiny_model, [[3, 4, 5, 6]], DraftTrainConfig(draft_vocab_size=32))
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    names = [k for k, v in before.items() if v.is_floating_point() and v.dim() == 2]
    first, last = names[0], names[-1]
    good = {k: (v + 1.0 if v.is_floating_point() else v) for k, v in before.items()}
    for bad, why in (({**good, last: torch.zeros(1)}, "shape"),
                     ({**good, last: good[last].clone().fill_(float("inf"))}, "non-finite"),
                     ({k: v for k, v in good.items() if k != last}, "missing")):
        with pytest.raises(ValueError, match=why):
            copy_draft_weights(draft, bad)
        assert torch.equal(draft.state_dict()[first], before[first])  # nothing copied, not even the first
    copy_draft_weights(draft, good)
    assert torch.equal(draft.state_dict()[first], good[first])
