"""SGLang backend: server arguments, meta_info counters of several versions, draft export, the HTTP
client against a local fake server, and the rule that a policy sync never writes into the draft.

No SGLang runs here, and `FakeSGLang` is not SGLang: it is a small HTTP server written for these
tests that answers with the hand-written payload shapes in tests/data/sglang/ and routes weight
updates the way sglang 0.5.23's scheduler does (a begin/end session, `selector` "target" /
"draft" / "all", unknown fields ignored), or, with `api="legacy"`, like an older server with no
session endpoints that honours only the isolation flags it is given. Its draft loader is reduced
to "name or model. + name". The same rules are checked against sglang 0.5.23's own request types,
scheduler routing and EAGLE-3 loader in tests/test_upstream_sglang.py (the sglang lane). The slime
and veRL contract tests reuse this fake.
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from helpers import SGLANG_KEYS
from safetensors.torch import load_file

from draft_models.checkpoint import load_draft, save_draft
from draft_models.config import Eagle3Config
from draft_models.vocab import build_draft_vocab
from rollout.protocol import SamplingParams
from rollout.sglang_engine import (InProcessTransport, SGLangArgsError, SGLangEngine, SGLangEngineConfig,
                                   SpecMetaError, WeightIsolationError, check_policy_sync, check_reply, in_session,
                                   parse_spec_meta, reaches_draft, sglang_server_args, to_cli_args)
from rollout.drafters import DrafterSpec, SpecConfig
from target_training.config import model_config_for

DATA = Path(__file__).parent / "data" / "sglang"
V, VD = 64, 40
pytestmark = pytest.mark.usefixtures("one_thread")


def load_fixture(name: str):
    return json.loads((DATA / name).read_text())


# ------------------------------------------------------------------ fake server
def json_serializer(named):
    return json.dumps([[n, t.tolist(), str(t.dtype).removeprefix("torch.")] for n, t in named])


def json_deserialize(s):
    return [(n, torch.tensor(v, dtype=getattr(torch, d))) for n, v, d in json.loads(s)]


class FakeSGLang:
    """Holds a target and a draft parameter dict and routes updates like SGLang (see module doc)."""

    def __init__(self, target_sd, draft_sd, *, api="selector", version="0.5.23", legacy_flags=(),
                 generate_reply=None):
        self.target = {k: v.clone() for k, v in target_sd.items()}
        self.draft = {(k if k == "lm_head.weight" else "model." + k): v.clone() for k, v in draft_sd.items()
                      if k not in ("d2t", "t2d")}
        self.api, self.version = api, version
        self.legacy_flags = dict(legacy_flags)  # legacy server: request field -> "target" | "draft"
        self.session: str | None = None
        self.generate_reply = generate_reply if generate_reply is not None else load_fixture("generate_batch.json")
        self.requests: list[tuple[str, dict]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _reply(self, status, reply):
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path.strip("/") == "server_info" and fake.version is not None:
                    return self._reply(200, {"version": fake.version})
                return self._reply(404, {"detail": "Not Found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                endpoint = self.path.strip("/")
                fake.requests.append((endpoint, body))
                self._reply(*fake.handle(endpoint, body))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    # SGLang's loaders, reduced to name resolution and shape checks
    def _load_draft(self, named):
        for name, t in named:
            if "d2t" in name or "t2d" in name:
                continue
            key = name if name in self.draft else "model." + name
            if key in self.draft:
                if self.draft[key].shape != t.shape:
                    raise ValueError(f"draft {key}: shape {tuple(t.shape)} != {tuple(self.draft[key].shape)}")
                self.draft[key] = t.clone()

    def _load_target(self, named):
        for name, t in named:
            if name in self.target:
                if self.target[name].shape != t.shape:
                    raise ValueError(f"target {name}: shape {tuple(t.shape)} != {tuple(self.target[name].shape)}")
                self.target[name] = t.clone()

    def _route(self, roles, named):
        if "draft" in roles:
            self._load_draft(named)
        if "target" in roles:
            self._load_target(named)

    def handle(self, endpoint, body):
        if endpoint == "generate":
            return 200, self.generate_reply
        selector_api = self.api == "selector"
        if endpoint in ("begin_weight_update", "end_weight_update"):
            if not selector_api:
                return 404, {"detail": "Not Found"}
            if (endpoint == "begin_weight_update") == (self.session is not None):
                return 400, {"success": False, "message": "session state"}
            self.session = body.get("selector", "all") if endpoint == "begin_weight_update" else None
            return 200, load_fixture("update_ok.json")
        if endpoint == "update_weights_from_tensor":
            named = json_deserialize(body["serialized_named_tensors"][0])
        elif endpoint == "update_weights_from_disk":
            named = list(load_file(str(Path(body["model_path"]) / "model.safetensors")).items())
        else:
            return 404, {"detail": "Not Found"}
        if selector_api and endpoint == "update_weights_from_tensor":
            if self.session is None:
                return 400, {"success": False, "message": "update_weights_from_tensor must run between "
                                                          "begin_weight_update() and end_weight_update()"}
            selector = body.get("selector", "all")
            roles = {"target", "draft"} if selector == "all" else {selector}
        elif selector_api:  # disk: no selector, every runner
            roles = {"target", "draft"}
        else:
            flagged = [role for flag, role in self.legacy_flags.items() if body.get(flag)]
            roles = set(flagged) if flagged else {"target", "draft"}
        try:
            self._route(roles, named)
        except ValueError as e:
            return 400, {"success": False, "message": str(e)}
        return 200, load_fixture("update_ok.json")


def make_pair(seed=0):
    torch.manual_seed(seed)
    target = model_config_for("tiny", V).build().eval()
    draft = Eagle3Config.for_target(target.cfg, VD).build(target.embed_tokens)
    draft.set_vocab(*build_draft_vocab(torch.randint(0, 100, (V,)), V, VD, always_include=(0,)))
    return target, draft


@pytest.fixture
def pair():
    return make_pair()


@pytest.fixture
def fake(pair):
    from draft_models.checkpoint import draft_state_dict_for_sglang

    target, draft = pair
    servers = []

    def start(**kw):
        s = FakeSGLang(target.state_dict(), draft_state_dict_for_sglang(draft), **kw)
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.close()


def engine_for(server, **kw):
    return SGLangEngine(SGLangEngineConfig(base_url=server.url, timeout_s=10, serializer=json_serializer, **kw))


def draft_unchanged(server, draft):
    from draft_models.checkpoint import draft_state_dict_for_sglang

    sd = draft_state_dict_for_sglang(draft)
    return all(torch.equal(server.draft[k if k == "lm_head.weight" else "model." + k], sd[k])
               for k in sd if k not in ("d2t", "t2d"))


# ------------------------------------------------------------------ server arguments
def test_the_client_matches_the_engine_protocols_without_a_server():
    """build_engine("sglang") makes a client that contacts nobody until used; it is a
    RolloutEngine and a DraftReceiver, and its push_draft has the protocol's signature."""
    import inspect

    from rollout.protocol import DraftReceiver, RolloutEngine
    from specrl.rl_setup import build_engine

    eng = build_engine("sglang", None, None, None, sglang_url="http://127.0.0.1:9")
    assert isinstance(eng, SGLangEngine) and isinstance(eng, RolloutEngine) and isinstance(eng, DraftReceiver)
    assert eng.draft_version is None and eng.capabilities.switch is None
    ours, theirs = inspect.signature(SGLangEngine.push_draft), inspect.signature(DraftReceiver.push_draft)
    assert list(ours.parameters) == list(theirs.parameters) and ours.return_annotation == theirs.return_annotation


def test_server_args_chain_tree_and_cli():
    chain = sglang_server_args("/m", "/d", SpecConfig(mode="chain", gamma=4))
    assert chain == {"model_path": "/m", "speculative_algorithm": "EAGLE3", "speculative_draft_model_path": "/d",
                     "speculative_num_steps": 4, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 5,
                     "enable_draft_weights_cpu_backup": True}
    tree = sglang_server_args("/m", "/d", SpecConfig(mode="tree", gamma=4, tree_topk=4, tree_budget=12),
                              extra={"mem_fraction_static": 0.7, "disable_cuda_graph": False})
    assert (tree["speculative_eagle_topk"], tree["speculative_num_draft_tokens"]) == (4, 13)
    cli = to_cli_args(tree)
    assert cli[:4] == ["--model-path", "/m", "--speculative-algorithm", "EAGLE3"]
    assert "--enable-draft-weights-cpu-backup" in cli and "--disable-cuda-graph" not in cli
    assert cli[cli.index("--speculative-num-draft-tokens") + 1] == "13"
    assert to_cli_args({"speculative_num_steps": 3, "cuda_graph_bs": [1, 2]}, prefix="--sglang-") == [
        "--sglang-speculative-num-steps", "3", "--sglang-cuda-graph-bs", "1", "2"]


@pytest.mark.parametrize("kw, match", [
    (dict(spec=SpecConfig(), algorithm="MEDUSA"), "algorithm must be one of"),
    (dict(spec=SpecConfig(), draft_path=""), "draft_path must be a non-empty path"),
    (dict(spec=SpecConfig(mode="tree", gamma=2, tree_topk=2, tree_budget=9)), "exceeds the 6 candidates"),
    (dict(spec=SpecConfig(mode="tree", tree_topk=1)), "tree_topk >= 2"),
    (dict(spec=SpecConfig(), extra={"speculative_num_steps": 9}), "contradicts the derived 4"),
    (dict(spec=SpecConfig(), extra={"bad-name": 1}), "must be identifiers"),
    (dict(spec={"mode": "chain"}), "must be a rollout.drafters.SpecConfig"),
])
def test_server_args_bad_values(kw, match):
    args = {"model_path": "/m", "draft_path": "/d", **kw}
    spec = args.pop("spec")
    with pytest.raises(SGLangArgsError, match=match):
        sglang_server_args(args.pop("model_path"), args.pop("draft_path"), spec, **args)
    with pytest.raises(ValueError, match=r"SpecConfig.gamma must be an integer in \[1, 64\], got 0"):
        SpecConfig(gamma=0)
    with pytest.raises(SGLangArgsError, match="finite"):
        to_cli_args({"mem_fraction_static": float("nan")})


# ------------------------------------------------------------------ meta_info counters
@pytest.mark.parametrize("name, verify, accepted, drafted, d_pos, a_pos", [
    ("meta_v0_4_verify_only.json", 11, 20, 0, [], []),
    ("meta_v0_5_accept_token_num.json", 10, 19, 30, [], []),
    ("meta_v0_5_correct_drafts.json", 8, 15, 24, [8, 8, 8], [7, 5, 3]),
    ("meta_dev_by_position.json", 6, 11, 16, [6, 6, 4], [5, 4, 2]),
])
def test_parse_spec_meta_across_versions(name, verify, accepted, drafted, d_pos, a_pos):
    s = parse_spec_meta(load_fixture(name))
    assert (s.verify_steps, s.accepted, s.drafted) == (verify, accepted, drafted)
    assert (s.drafted_per_pos, s.accepted_per_pos) == (d_pos, a_pos)
    assert s.accept_length == pytest.approx((accepted + verify) / verify)


def test_parse_spec_meta_absent_is_none():
    assert parse_spec_meta(load_fixture("meta_no_spec.json")) is None
    assert parse_spec_meta(None) is None


@pytest.mark.parametrize("meta, match", [
    (load_fixture("meta_contradictory_alias.json"), "spec_num_correct_drafts=11 but spec_accepted_drafts=12"),
    (load_fixture("meta_contradictory_rate.json"), "spec_accept_rate=0.9 but 19/30"),
    ({"spec_verify_ct": 2, "spec_accept_token_num": 5, "spec_draft_token_num": 4}, "exceeds spec_draft_token_num=4"),
    ({"spec_verify_ct": 3, "spec_accept_histogram": [1, 1]}, "sums to 2 verify steps but spec_verify_ct=3"),
    ({"spec_verify_ct": 2, "spec_accept_histogram": [1, 1], "spec_num_correct_drafts": 2}, "implies 1 accepted"),
    ({"spec_verify_ct": 4, "completion_tokens": 12, "spec_accept_length": 2.0}, "spec_accept_length=2.0 but"),
    ({"spec_verify_ct": -1}, "not a non-negative integer"),
    ({"spec_verify_ct": True}, "not a non-negative integer"),
    ({"spec_num_correct_drafts": 3}, "no spec_verify_ct"),
    ({"spec_verify_ct": 2, "completion_tokens": 3, "spec_accept_token_num": 4, "spec_draft_token_num": 8},
     "exceeds completion_tokens=3"),
    ([1, 2], "must be a JSON object"),
])
def test_parse_spec_meta_refuses_contradictions(meta, match):
    with pytest.raises(SpecMetaError, match=match) as e:
        parse_spec_meta(meta)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------ export round trip
def test_export_round_trip_has_sglang_names(pair, tmp_path):
    target, draft = pair
    out = save_draft(draft, tmp_path / "draft")
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == SGLANG_KEYS
    assert not any("embed" in k for k in tensors)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == VD
    back = load_draft(out, target)
    for k, t in back.state_dict().items():
        assert torch.equal(t, draft.state_dict()[k]), k


# ------------------------------------------------------------------ HTTP client
def test_generate_maps_tokens_logprobs_and_counters(fake):
    server = fake()
    eng = engine_for(server)
    trajs = eng.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=1.0, max_new_tokens=4, stop_token_ids=(2,)),
                         request_ids=[10, 11])
    endpoint, body = server.requests[-1]
    assert endpoint == "generate" and body["return_logprob"] is True and body["input_ids"] == [[1, 2, 3], [4, 5]]
    assert body["sampling_params"] == {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 4,
                                       "stop_token_ids": [2]}
    a, b = trajs
    assert a.token_ids == [7, 9, 11, 2] and a.finish_reason == "stop" and a.request_id == 10
    assert torch.equal(a.logprobs, torch.tensor([-0.5, -0.25, -1.5, -0.125]))
    assert b.token_ids == [5, 6, 7] and b.finish_reason == "length" and b.full_ids == [4, 5, 5, 6, 7]
    assert (a.spec.verify_steps, a.spec.accepted, a.spec.drafted) == (2, 1, 2)
    with pytest.raises(ValueError, match="does not return EAGLE-3 target features"):
        eng.generate([[1]], SamplingParams(), capture_features=True)
    with pytest.raises(RuntimeError, match="returned 2 outputs for 1 prompts"):
        eng.generate([[1]], SamplingParams())


def test_generate_refuses_inconsistent_outputs(fake):
    reply = load_fixture("generate_batch.json")[:1]
    reply[0]["output_ids"] = [7, 9]
    eng = engine_for(fake(generate_reply=reply))
    with pytest.raises(ValueError, match="disagree with output_token_logprobs"):
        eng.generate([[1]], SamplingParams())
    with pytest.raises(RuntimeError, match="unreachable"):
        SGLangEngine(SGLangEngineConfig(base_url="http://127.0.0.1:9", timeout_s=2)).generate([[1]], SamplingParams())


# ------------------------------------------------------------------ policy sync never writes the draft
def perturbed(sd, scale=1.0):
    return {k: v + scale for k, v in sd.items()}


def test_policy_sync_leaves_the_draft_untouched(fake, pair):
    target, draft = pair
    server = fake()
    new_policy = perturbed(target.state_dict())
    # The hazard this guards against: with selector "all" (the default) the draft loader also
    # takes the policy's names it resolves (norm.weight here) into the draft.
    raw = engine_for(server)
    in_session(raw.transport, "all", lambda: raw.transport.call(
        "update_weights_from_tensor", raw._tensor_body([("norm.weight", new_policy["norm.weight"])])), "raw")
    assert not draft_unchanged(server, draft)

    server = fake()
    eng = engine_for(server)
    eng.load_policy_weights(new_policy, version=3)
    assert [e for e, _ in server.requests] == ["begin_weight_update", "update_weights_from_tensor",
                                               "end_weight_update"]
    assert server.requests[0][1] == {"selector": "target"} and server.session is None
    body = server.requests[1][1]
    assert body["selector"] == "target" and body["weight_version"] == "3"
    assert len(body["serialized_named_tensors"]) == 1
    assert all(torch.equal(server.target[k], v) for k, v in new_policy.items())
    assert draft_unchanged(server, draft)


def test_update_without_session_fails_and_failed_update_closes_session(fake, pair):
    target, _ = pair
    server = fake()
    eng = engine_for(server)
    with pytest.raises(RuntimeError, match="must run between begin_weight_update"):
        check_reply(eng.transport.call("update_weights_from_tensor", eng._tensor_body([])), "bare update")
    bad = {k: (torch.zeros(3) if k == "norm.weight" else v) for k, v in target.state_dict().items()}
    with pytest.raises(RuntimeError, match="policy sync failed: target norm.weight: shape"):
        eng.load_policy_weights(bad)
    assert server.requests[-1][0] == "end_weight_update" and server.session is None


def test_legacy_server_needs_an_isolation_flag_or_an_opt_in(fake, pair):
    target, draft = pair
    server = fake(api="legacy", version="0.4.9")
    eng = engine_for(server)
    with pytest.raises(WeightIsolationError, match="no weight-update selector"):
        eng.load_policy_weights(target.state_dict())
    assert [e for e, _ in server.requests] == [] and eng.weight_api == "legacy"
    opted = engine_for(server, allow_unisolated_sync=True)  # the loader guard still refuses
    with pytest.raises(WeightIsolationError, match="overwrite the draft's"):
        opted.load_policy_weights(target.state_dict())
    assert server.requests == [] and draft_unchanged(server, draft)
    deep = {k: v for k, v in perturbed(target.state_dict()).items() if k.startswith("layers.1.")}
    opted.load_policy_weights(deep)  # no name the draft loader resolves: allowed once opted in
    assert "selector" not in server.requests[-1][1] and draft_unchanged(server, draft)

    flagged = fake(api="legacy", version=None, legacy_flags={"disable_draft_model": "target"})
    eng = engine_for(flagged, legacy_policy_flag="disable_draft_model")
    new_policy = perturbed(target.state_dict())
    eng.load_policy_weights(new_policy)
    assert flagged.requests[-1][1]["disable_draft_model"] is True
    assert all(torch.equal(flagged.target[k], v) for k, v in new_policy.items()) and draft_unchanged(flagged, draft)


def test_policy_sync_refuses_draft_names(fake, pair):
    target, draft = pair
    server = fake()
    merged = {**target.state_dict(), "fc.weight": draft.fc.weight, "model.midlayer.mlp.up_proj.weight": torch.ones(1)}
    with pytest.raises(WeightIsolationError, match="carries draft tensors"):
        engine_for(server).load_policy_weights(merged)
    assert server.requests == [] and draft_unchanged(server, draft)


def test_loader_guard_covers_layer0_legacy_words_and_vocab_maps():
    llama = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight",
             "model.layers.0.input_layernorm.weight", "model.layers.1.self_attn.o_proj.weight", "model.norm.weight",
             "lm_head.weight", "midlayer.self_attn.o_proj.weight", "model.aux_norm_mid.weight", "d2t", "t2d",
             "model.rotary_emb.inv_freq"]
    assert reaches_draft(llama) == ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                                    "model.layers.0.mlp.up_proj.weight", "model.layers.0.input_layernorm.weight",
                                    "model.norm.weight", "lm_head.weight", "midlayer.self_attn.o_proj.weight",
                                    "model.aux_norm_mid.weight", "d2t"]
    assert reaches_draft(["model.layers.1.mlp.down_proj.weight"], draft_layers=2) == [
        "model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(WeightIsolationError, match="9 names"):
        check_policy_sync(llama[:7] + ["model.layers.0.self_attn.k_proj.weight", "model.layers.0.mlp.gate_proj.weight",
                                       "model.layers.0.post_attention_layernorm.weight"], isolated=False)
    check_policy_sync(["model.layers.3.self_attn.q_proj.weight"], isolated=False)  # nothing the draft loads


# ------------------------------------------------------------------ draft push
def trained(draft, scale=0.5):
    from draft_models.checkpoint import draft_state_dict_for_sglang

    return {k: (v if k in ("d2t", "t2d") else v + scale) for k, v in draft_state_dict_for_sglang(draft).items()}


def test_draft_push_tensor_keeps_the_policy_untouched(fake, pair):
    target, draft = pair
    server = fake()
    eng = engine_for(server)
    eng.push_draft(trained(draft), 1)  # selector "draft": no target name needed
    report = eng.last_push
    assert report["held"] == [] and "d2t" not in report["sent"] and "t2d" not in report["sent"]
    assert server.requests[0][1] == {"selector": "draft"} and server.requests[1][1]["selector"] == "draft"
    assert server.requests[1][1]["weight_version"] == "draft-1"
    assert torch.equal(server.draft["lm_head.weight"], trained(draft)["lm_head.weight"])
    assert all(torch.equal(server.target[k], v) for k, v in target.state_dict().items())
    changed = trained(draft)
    changed["d2t"] = changed["d2t"].roll(1)
    with pytest.raises(WeightIsolationError, match="vocabulary map d2t"):
        eng.push_draft(changed, 3)


def test_draft_push_on_a_legacy_server(fake, pair):
    target, draft = pair
    server = fake(api="legacy", version="0.4.9")
    eng = engine_for(server)
    with pytest.raises(WeightIsolationError, match="target parameter names unknown"):
        eng.push_draft(trained(draft), 1)
    eng.target_param_names = set(target.state_dict())
    with pytest.raises(WeightIsolationError, match=r"overwrite target tensors \['norm.weight', 'lm_head.weight'\]"):
        eng.push_draft(trained(draft), 1)
    held = engine_for(server, hold_shared_draft_names=True)
    held.target_param_names = set(target.state_dict())
    held.push_draft(trained(draft), 1)
    report = held.last_push
    assert report["held"] == ["norm.weight", "lm_head.weight"]
    assert torch.equal(server.draft["model.fc.weight"], trained(draft)["fc.weight"])
    assert all(torch.equal(server.target[k], v) for k, v in target.state_dict().items())

    routed_server = fake(api="legacy", version=None, legacy_flags={"draft_only": "draft"})
    routed = engine_for(routed_server, legacy_draft_flag="draft_only")
    routed.push_draft(trained(draft), 2)
    report = routed.last_push
    assert report["held"] == [] and routed_server.requests[-1][1]["draft_only"] is True
    assert torch.equal(routed_server.draft["lm_head.weight"], trained(draft)["lm_head.weight"])
    assert all(torch.equal(routed_server.target[k], v) for k, v in target.state_dict().items())


def test_draft_push_disk_needs_routing(fake, pair, tmp_path):
    target, draft = pair
    with pytest.raises(WeightIsolationError, match="update_weights_from_disk has no selector"):
        engine_for(fake(), draft_transport="disk", export_dir=str(tmp_path)).push_draft(draft, 1)
    server = fake(api="legacy", version=None, legacy_flags={"draft_only": "draft"})
    with torch.no_grad():
        draft.fc.weight.add_(1.0)
    eng = engine_for(server, draft_transport="disk", export_dir=str(tmp_path), legacy_draft_flag="draft_only")
    eng.push_draft(draft, 2)
    endpoint, body = server.requests[-1]
    assert endpoint == "update_weights_from_disk" and body["model_path"].endswith("draft-v2") and body["draft_only"]
    assert torch.equal(server.draft["model.fc.weight"], draft.fc.weight)
    assert all(torch.equal(server.target[k], v) for k, v in target.state_dict().items())
    with pytest.raises(ValueError, match="needs export_dir"):
        SGLangEngineConfig(draft_transport="disk")


def test_in_process_engine_without_selector_kwarg_is_refused(pair):
    target, _ = pair
    calls = []

    class OldEngine:  # an sglang.Engine with sessions but no selector on update, and no tokenizer manager
        def begin_weight_update(self, selector="all"):
            calls.append(("begin", selector))
            return True, "ok"

        def end_weight_update(self):
            calls.append(("end",))
            return True, "ok"

        def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
            raise AssertionError("must not be called")

    eng = SGLangEngine(SGLangEngineConfig(weight_api="selector"), InProcessTransport(OldEngine()))
    with pytest.raises(WeightIsolationError, match="takes no selector and this Engine lacks"):
        eng.load_policy_weights(target.state_dict())
    assert calls == [("begin", "target"), ("end",)]


def test_draft_receiver_interface(fake, pair):
    target, draft = pair
    server = fake()
    eng = engine_for(server)
    spec = SpecConfig(mode="chain", gamma=3)
    eng.install_draft(DrafterSpec(draft=draft, spec=spec))
    weights, version = eng.draft_weights()
    assert version == 0 and eng.spec is spec and eng.draft_faults == []
    assert torch.equal(weights["fc.weight"], draft.fc.weight) and torch.equal(server.draft["model.fc.weight"],
                                                                               draft.fc.weight)
    fresh = trained(draft)
    eng.push_draft(fresh, 5)
    weights, version = eng.draft_weights()
    assert version == 5 and torch.equal(weights["lm_head.weight"], fresh["lm_head.weight"])
    with pytest.raises(ValueError, match="policy cannot be installed"):
        eng.install_draft(DrafterSpec(draft=draft, spec=spec), policy=object())
    with pytest.raises(ValueError, match="EAGLE-3 drafts; got drafter 'custom'"):
        eng.install_draft(DrafterSpec("custom", spec=spec, proposer=lambda n, m: None))
