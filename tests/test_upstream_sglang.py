"""specrl's SGLang client against sglang 0.5.23's own code (the sglang lane, tests/lanes/sglang.sh).

What is real here: sglang's request types (`io_struct`, validated through the same pydantic schema
its HTTP server uses, unknown fields ignored), its `ServerArgs` argument parser, its
`MultiprocessingSerializer`, its scheduler-side weight-update manager
(`SchedulerWeightUpdaterManager`: sessions, `selector` routing) and its EAGLE-3 loader
(`LlamaForCausalLMEagle3.load_weights` with sglang's `default_weight_loader`).

What is a stand-in, and why: no SGLang server or model runner starts on CPU (CUDA kernels, GPU
memory pools), so the HTTP hop is replaced by a transport that validates each body with sglang's
schema and hands it to the real manager; the manager's workers are small objects whose target
runner copies tensors by name and whose draft runner calls the real EAGLE-3 `load_weights` on
stand-in parameters shaped like the ones `LlamaForCausalLMEagle3` registers (its fused
`qkv_proj`/`gate_up_proj` shard loaders are restated in `_shard_loader`, since QKVParallelLinear
needs a tensor-parallel group). The manager's TP barrier and parallel context are patched out.
ServerArgs' resolution hooks (`handle_speculative_decoding`) need the model's HF config and
the device, so only the parser and the field names are checked.
"""
from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest
import torch
from upstream import import_sglang

from rollout.sglang_engine import SGLangEngine, SGLangEngineConfig, WeightIsolationError, default_serializer
from rollout.sglang_args import sglang_server_args, to_cli_args
from rollout.sglang_weights import reaches_draft
from rollout.drafters import SpecConfig

pytestmark = pytest.mark.sglang

H, I, HEADS, KV, HD, V, VD = 16, 24, 2, 1, 8, 48, 32
Q, KVS = HEADS * HD, KV * HD


@pytest.fixture(scope="module")
def sgl():
    io = import_sglang("sglang.srt.managers.io_struct")
    import sglang

    assert sglang.__version__ == "0.5.23", f"the sglang lane pins 0.5.23, found {sglang.__version__}"
    return SimpleNamespace(
        io=io, version=sglang.__version__,
        server_args=import_sglang("sglang.srt.server_args"),
        wu=import_sglang("sglang.srt.managers.scheduler_components.weight_updater"),
        eagle3=import_sglang("sglang.srt.models.llama_eagle3"),
        weight_utils=import_sglang("sglang.srt.model_loader.weight_utils"),
        ser=import_sglang("sglang.srt.utils").MultiprocessingSerializer,
        pydantic=__import__("pydantic"))


# ------------------------------------------------------------------ stand-in runners
def _shard_loader(offsets):
    """Stand-in for QKVParallelLinear / MergedColumnParallelLinear weight_loader: copy one shard's
    rows into the fused parameter (shape-checked like the real loader)."""
    def load(param, loaded, shard_id=None):
        if shard_id is None:  # the fused tensor itself
            assert loaded.shape == param.shape, f"fused: {tuple(loaded.shape)}"
            param.data.copy_(loaded)
            return
        start, size = offsets[shard_id]
        assert loaded.shape == (size, param.shape[1]), f"shard {shard_id}: {tuple(loaded.shape)}"
        param.data[start:start + size].copy_(loaded)
    return load


class StandInEagle3:
    """The parameters sglang 0.5.23's LlamaForCausalLMEagle3 registers for a one-layer draft with
    `draft_vocab_size` set and untied embeddings; `load_weights` is the real one."""

    def __init__(self, sgl, seed=0):
        g = torch.Generator().manual_seed(seed)
        shapes = {
            "model.embed_tokens.weight": (V, H), "model.fc.weight": (H, 3 * H),
            "model.layers.0.self_attn.qkv_proj.weight": (Q + 2 * KVS, 2 * H),
            "model.layers.0.self_attn.o_proj.weight": (H, Q),
            "model.layers.0.mlp.gate_up_proj.weight": (2 * I, H), "model.layers.0.mlp.down_proj.weight": (H, I),
            "model.layers.0.input_layernorm.weight": (H,), "model.layers.0.post_attention_layernorm.weight": (H,),
            "model.layers.0.hidden_norm.weight": (H,), "model.norm.weight": (H,), "lm_head.weight": (VD, H)}
        self.params = {n: torch.nn.Parameter(torch.randn(s, generator=g), requires_grad=False)
                       for n, s in shapes.items()}
        self.params["model.layers.0.self_attn.qkv_proj.weight"].weight_loader = _shard_loader(
            {"q": (0, Q), "k": (Q, KVS), "v": (Q + KVS, KVS)})
        self.params["model.layers.0.mlp.gate_up_proj.weight"].weight_loader = _shard_loader({0: (0, I), 1: (I, I)})
        self.hot_token_id = None
        self._load = sgl.eagle3.LlamaForCausalLMEagle3.load_weights

    def named_parameters(self):
        return iter(self.params.items())

    def snapshot(self):
        return {n: p.detach().clone() for n, p in self.params.items()}

    def load_weights(self, named):
        self._load(self, named)


class Runner:
    def __init__(self, load):
        self.sessions: list[str] = []
        self.weight_updater = SimpleNamespace(update_weights_from_tensor=self._update,
                                              begin_weight_update=lambda: self.sessions.append("begin"),
                                              end_weight_update=lambda run_post_load: self.sessions.append("end"))
        self._load_fn = load

    def _update(self, named_tensors, load_format=None):
        try:
            self._load_fn(named_tensors)
        except (AssertionError, RuntimeError, ValueError) as e:  # the model runner reports, not raises
            return False, f"Failed to update weights: {e}"
        return True, "ok"


def llama_policy(seed=1):
    g = torch.Generator().manual_seed(seed)
    sd = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(2):
        p = f"model.layers.{i}."
        sd.update({p + "self_attn.q_proj.weight": (Q, H), p + "self_attn.k_proj.weight": (KVS, H),
                   p + "self_attn.v_proj.weight": (KVS, H), p + "self_attn.o_proj.weight": (H, Q),
                   p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                   p + "mlp.down_proj.weight": (H, I), p + "input_layernorm.weight": (H,),
                   p + "post_attention_layernorm.weight": (H,)})
    return {n: torch.randn(s, generator=g) for n, s in sd.items()}


class ThroughSGLangScheduler:
    """Transport stand-in for HTTP + tokenizer manager: validates each body with sglang's own schema
    (as its FastAPI route does) and calls the real scheduler-side weight-update manager."""

    ROUTES = {"begin_weight_update": "BeginWeightUpdateReqInput", "end_weight_update": "EndWeightUpdateReqInput",
              "update_weights_from_tensor": "UpdateWeightsFromTensorReqInput"}

    def __init__(self, sgl, monkeypatch, target: dict, draft: StandInEagle3):
        monkeypatch.setattr(sgl.wu, "get_parallel", lambda: SimpleNamespace(tp_group=SimpleNamespace(cpu_group=None)))
        monkeypatch.setattr(torch.distributed, "barrier", lambda *a, **k: None)
        self.sgl, self.bodies, self.versions = sgl, [], []

        def load_target(named):
            for n, t in named:
                if n in target:
                    assert target[n].shape == t.shape, n
                    target[n] = t.clone()

        tp_worker = SimpleNamespace(weight_update_runners=lambda: [("target", Runner(load_target))],
                                    deserialize_own_rank=lambda ser: sgl.ser.deserialize(ser[0]))
        draft_worker = SimpleNamespace(weight_update_runners=lambda: [("draft", Runner(draft.load_weights))])
        scheduler = SimpleNamespace(record_weight_version_change=lambda new_version: self.versions.append(new_version))
        self.manager = sgl.wu.SchedulerWeightUpdaterManager(
            tp_worker=tp_worker, draft_worker=draft_worker, memory_saver_adapter=None,
            flush_cache=lambda **kw: True, is_fully_idle=lambda **kw: True, scheduler=scheduler)

    def server_version(self):
        from rollout.sglang_transport import parse_version

        return parse_version(self.sgl.version)

    def call(self, endpoint, body):
        wire = json.loads(json.dumps(body))  # what crosses HTTP
        req_type = getattr(self.sgl.io, self.ROUTES[endpoint])
        known = {f.name for f in __import__("msgspec").structs.fields(req_type)}
        assert set(wire) <= known, f"{endpoint}: fields sglang would ignore silently: {set(wire) - known}"
        req = self.sgl.pydantic.TypeAdapter(req_type).validate_python(wire)
        self.bodies.append((endpoint, req))
        out = getattr(self.manager, endpoint)(req)
        return {"success": out.success, "message": out.message}


def served(sgl, monkeypatch):
    target = {n: t.clone() for n, t in llama_policy(seed=1).items()}
    draft = StandInEagle3(sgl)
    transport = ThroughSGLangScheduler(sgl, monkeypatch, target, draft)
    eng = SGLangEngine(SGLangEngineConfig(serializer=default_serializer), transport=transport)
    return eng, transport, target, draft


def unchanged(before, draft):
    return [n for n, t in draft.snapshot().items() if not torch.equal(t, before[n])]


# ------------------------------------------------------------------ tests
def test_policy_sync_cannot_change_a_draft_tensor(sgl, monkeypatch):
    eng, transport, target, draft = served(sgl, monkeypatch)
    assert eng.weight_api == "selector"  # sglang 0.5.23 has sessions and selector
    before = draft.snapshot()
    new_policy = llama_policy(seed=2)
    eng.load_policy_weights(new_policy, version=7)
    assert [e for e, _ in transport.bodies] == ["begin_weight_update", "update_weights_from_tensor", "end_weight_update"]
    assert transport.bodies[1][1].selector == "target" and transport.versions == ["7"]
    assert transport.manager._session is None
    assert all(torch.equal(target[n], t) for n, t in new_policy.items())
    assert unchanged(before, draft) == []


def test_selector_all_would_overwrite_what_the_guard_predicts(sgl, monkeypatch):
    """Without routing, the real loader writes the policy's layer-0 / norm / lm_head names into the
    draft; `reaches_draft` names exactly the policy tensors it took."""
    _, transport, _, draft = served(sgl, monkeypatch)
    policy = llama_policy(seed=3)
    same_shape = {n: t for n, t in policy.items()
                  if n.startswith("model.layers.0.") and not n.endswith(("q_proj.weight", "k_proj.weight",
                                                                        "v_proj.weight"))}
    same_shape["model.norm.weight"] = policy["model.norm.weight"]
    before = draft.snapshot()
    body = {"serialized_named_tensors": [default_serializer(list(same_shape.items()))], "selector": "all"}
    assert transport.call("begin_weight_update", {"selector": "all"})["success"]
    assert transport.call("update_weights_from_tensor", body)["success"]
    assert transport.call("end_weight_update", {})["success"]
    changed = unchanged(before, draft)
    assert sorted(changed) == sorted(["model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_up_proj.weight",
                                      "model.layers.0.mlp.down_proj.weight", "model.layers.0.input_layernorm.weight",
                                      "model.layers.0.post_attention_layernorm.weight", "model.norm.weight"])
    assert sorted(reaches_draft(same_shape)) == sorted(same_shape)


def test_guard_matches_the_real_loader_name_by_name(sgl):
    """For every policy / legacy / map name: the real loader writes into the draft => the guard flags it."""
    names = list(llama_policy()) + ["midlayer.self_attn.o_proj.weight", "model.midlayer.mlp.down_proj.weight",
                                    "midlayer.hidden_norm.weight", "fc.weight", "norm.weight", "embed_tokens.weight",
                                    "model.rotary_emb.inv_freq", "t2d", "model.layers.0.self_attn.qkv_proj.weight"]
    draft = StandInEagle3(sgl)
    written = {}

    for pname, p in draft.params.items():
        real = getattr(p, "weight_loader", sgl.weight_utils.default_weight_loader)

        def record(param, loaded, *shard, _name=pname, _real=real):
            written.setdefault(_name, 0)
            written[_name] += 1
            try:
                _real(param, loaded, *shard)
            except AssertionError:
                pass  # a shape mismatch fails the update; the name still reached the draft
        p.weight_loader = record

    flagged = set(reaches_draft(names))
    shapes = {n: draft.params[n].shape for n in draft.params}
    for name in names:
        written.clear()
        draft.hot_token_id = None
        t = torch.zeros(shapes.get(name, (4,)))
        draft.load_weights([(name, t)])
        took = bool(written) or draft.hot_token_id is not None
        assert took <= (name in flagged), f"{name} reaches the draft but the guard passes it"
    draft.load_weights([("d2t", torch.zeros(VD, dtype=torch.long))])
    assert draft.hot_token_id is not None and "d2t" in reaches_draft(["d2t"])
    llama_flagged = [n for n in llama_policy() if n in flagged]
    assert len(llama_flagged) == 12  # embed, norm, lm_head and the nine layer-0 tensors


def test_draft_push_goes_to_the_draft_only(sgl, monkeypatch):
    from draft_models.checkpoint import draft_state_dict_for_sglang  # noqa: F401 - names the push uses

    eng, transport, target, draft = served(sgl, monkeypatch)
    before_target = {n: t.clone() for n, t in target.items()}
    g = torch.Generator().manual_seed(5)
    push = {"fc.weight": torch.randn(H, 3 * H, generator=g), "midlayer.self_attn.o_proj.weight": torch.randn(H, Q, generator=g),
            "midlayer.self_attn.q_proj.weight": torch.randn(Q, 2 * H, generator=g),
            "norm.weight": torch.randn(H, generator=g), "lm_head.weight": torch.randn(VD, H, generator=g),
            "d2t": torch.zeros(VD, dtype=torch.long)}
    eng.push_draft(push, 4)
    report = eng.last_push
    assert report["held"] == [] and "d2t" not in report["sent"]
    assert transport.bodies[1][1].selector == "draft" and transport.bodies[0][1].selector == "draft"
    assert torch.equal(draft.params["model.fc.weight"], push["fc.weight"])
    assert torch.equal(draft.params["model.layers.0.self_attn.o_proj.weight"], push["midlayer.self_attn.o_proj.weight"])
    assert torch.equal(draft.params["model.layers.0.self_attn.qkv_proj.weight"][:Q], push["midlayer.self_attn.q_proj.weight"])
    assert torch.equal(draft.params["lm_head.weight"], push["lm_head.weight"])
    assert all(torch.equal(target[n], t) for n, t in before_target.items())


def test_update_outside_a_session_is_refused_by_sglang(sgl, monkeypatch):
    eng, transport, _, _ = served(sgl, monkeypatch)
    body = eng._tensor_body([("model.norm.weight", torch.ones(H))], selector="target")
    reply = transport.call("update_weights_from_tensor", body)
    assert reply["success"] is False and "begin_weight_update" in reply["message"]


def test_server_args_parse_with_sglangs_parser(sgl):
    ServerArgs = sgl.server_args.ServerArgs
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    for spec in (SpecConfig(mode="chain", gamma=3), SpecConfig(mode="tree", gamma=3, tree_topk=2, tree_budget=6)):
        args = sglang_server_args("/ckpt/policy", "/ckpt/draft", spec, extra={"mem_fraction_static": 0.7})
        parsed = ServerArgs.from_cli_args(parser.parse_args(to_cli_args(args)))
        for key, value in args.items():
            assert getattr(parsed, key) == value, key
    bad = to_cli_args({"model_path": "/m", "speculative_draft_steps": 3})  # no such field
    with pytest.raises(SystemExit):
        parser.parse_args(bad)


def test_in_process_engine_policy_sync_reaches_the_target_only(sgl, monkeypatch):
    """sglang 0.5.23's `Engine.update_weights_from_tensor` takes no selector; the client bridges with
    sglang's own request type. The Engine object is the real class (its begin/end/serialize methods
    run), built without starting a server; its tokenizer manager is a stand-in that hands requests
    to the real scheduler-side manager."""
    import asyncio

    from rollout.sglang_engine import InProcessTransport

    engine_mod = import_sglang("sglang.srt.entrypoints.engine")
    monkeypatch.setattr(engine_mod, "get_parallel", lambda: SimpleNamespace(tp_size=1))
    target = {n: t.clone() for n, t in llama_policy(seed=1).items()}
    draft = StandInEagle3(sgl)
    sched = ThroughSGLangScheduler(sgl, monkeypatch, target, draft)

    async def relay(name, req, request=None):
        out = getattr(sched.manager, name)(req)
        sched.bodies.append((name, req))
        return out.success, out.message

    eng = engine_mod.Engine.__new__(engine_mod.Engine)
    eng.loop = asyncio.new_event_loop()
    eng.tokenizer_manager = SimpleNamespace(
        begin_weight_update=lambda req, r=None: relay("begin_weight_update", req),
        end_weight_update=lambda req, r=None: relay("end_weight_update", req),
        update_weights_from_tensor=lambda req, r=None: relay("update_weights_from_tensor", req))
    client = SGLangEngine(SGLangEngineConfig(), transport=InProcessTransport(eng))
    assert client.weight_api == "selector"
    before = draft.snapshot()
    new_policy = llama_policy(seed=4)
    client.load_policy_weights(new_policy, version=2)
    assert [n for n, _ in sched.bodies] == ["begin_weight_update", "update_weights_from_tensor", "end_weight_update"]
    assert isinstance(sched.bodies[1][1], sgl.io.UpdateWeightsFromTensorReqInput)
    assert sched.bodies[1][1].selector == "target" and sched.bodies[0][1].selector == "target"
    assert all(torch.equal(target[n], t) for n, t in new_policy.items())
    assert unchanged(before, draft) == []
    eng.loop.close()
