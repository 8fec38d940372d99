"""veRL contract: engine_kwargs for SGLang, spec counters in AgentLoopOutput.extra_fields, and the
weight-sync wrapper that keeps the draft out of the policy sync and pushes it afterwards."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
from test_sglang_engine import FakeSGLang, json_serializer, load_fixture, make_pair

from draft_models.checkpoint import draft_state_dict_for_sglang
from rollout.sglang_engine import (HTTPTransport, SGLangEngine, SGLangEngineConfig, SpecMetaError,
                                   WeightIsolationError)
from rollout.drafters import SpecConfig
from specrl.integrations import verl

pytestmark = pytest.mark.usefixtures("one_thread")


def test_engine_kwargs_and_overrides():
    kw = verl.engine_kwargs("/ckpt/draft", SpecConfig(mode="chain", gamma=3), extra={"attention_backend": "fa3"})
    assert kw == {"sglang": {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": "/ckpt/draft",
                             "speculative_num_steps": 3, "speculative_eagle_topk": 1,
                             "speculative_num_draft_tokens": 4, "enable_draft_weights_cpu_backup": True,
                             "attention_backend": "fa3"}}
    ov = verl.hydra_overrides(kw)
    assert ov[0] == "+actor_rollout_ref.rollout.engine_kwargs.sglang.speculative_algorithm=EAGLE3"
    assert "+actor_rollout_ref.rollout.engine_kwargs.sglang.enable_draft_weights_cpu_backup=true" in ov
    with pytest.raises(ValueError, match="algorithm must be one of"):
        verl.engine_kwargs("/d", SpecConfig(), algorithm="NGRAM")


def test_extra_fields_across_turns_and_metrics():
    turn1 = verl.spec_extra_fields(load_fixture("meta_v0_5_accept_token_num.json"))
    turn2 = verl.spec_extra_fields(load_fixture("meta_dev_by_position.json"))
    assert turn1 == {"spec_num_draft_tokens": 30, "spec_num_accepted_tokens": 19, "spec_num_verify_steps": 10}
    merged = verl.merge_extra_fields(verl.merge_extra_fields({"teacher_ids": [1]}, turn1), turn2)
    assert merged["teacher_ids"] == [1] and merged["spec_num_verify_steps"] == 16
    assert merged["spec_num_accepted_tokens"] == 30 and merged["spec_num_draft_tokens"] == 46
    assert verl.spec_extra_fields(load_fixture("meta_no_spec.json")) == {}
    third = verl.spec_extra_fields(load_fixture("meta_v0_5_correct_drafts.json"))
    assert third == {"spec_num_draft_tokens": 24, "spec_num_accepted_tokens": 15, "spec_num_verify_steps": 8}
    m = verl.spec_metrics([merged, {}, third])
    # veRL's meaning: per-request ratios, averaged over the two requests that carry counters
    assert m["rollout/spec_accept_length"] == pytest.approx(((1 + 30 / 16) + (1 + 15 / 8)) / 2)
    assert m["rollout/spec_accept_rate"] == pytest.approx((30 / 46 + 15 / 24) / 2)
    # specrl's token-weighted figures under their own names
    assert m["rollout/specrl_verify_steps"] == 24
    assert m["rollout/specrl_accept_length_token_weighted"] == pytest.approx((30 + 15 + 24) / 24)
    assert m["rollout/specrl_accept_rate_token_weighted"] == pytest.approx(45 / 70)
    assert verl.spec_metrics([{}, {"x": 1}]) == {}
    with pytest.raises(ValueError, match="but not all of"):
        verl.spec_metrics([{"spec_num_draft_tokens": 3}])
    with pytest.raises(SpecMetaError):
        verl.spec_extra_fields(load_fixture("meta_contradictory_alias.json"))


class StandInVerlAdapter:
    """Not veRL: stands in for verl 0.9.1's AsyncHttpServerAdapter (which imports sglang, absent
    from the verl lane), keeping only its `_make_async_request(endpoint, payload)`; it posts to the
    fake SGLang server like the real adapter posts to SGLang."""

    def __init__(self, url):
        self.transport = HTTPTransport(url)
        self.sent = []

    async def _make_async_request(self, endpoint, payload=None):
        self.sent.append((endpoint, payload))
        return self.transport.call(endpoint, payload or {})

    async def flush_cache(self):
        return {"success": True}


def verl_like_update(engine):
    """What veRL 0.9.1's SGLangRollout.update_weights does with its engine: bucket the stream and
    send each bucket with `engine.update_weights_from_tensor(req)` (one bucket here)."""
    async def update_weights(weights, **kwargs):
        named = list(weights)
        req = SimpleNamespace(serialized_named_tensors=[json_serializer(named)], load_format=None, flush_cache=True)
        reply = await engine.update_weights_from_tensor(req)
        assert reply["success"], reply
        update_weights.kwargs = kwargs
    return update_weights


@pytest.fixture
def served():
    target, draft = make_pair()
    server = FakeSGLang(target.state_dict(), draft_state_dict_for_sglang(draft))
    eng = SGLangEngine(SGLangEngineConfig(base_url=server.url, serializer=json_serializer))
    yield target, draft, server, eng
    server.close()


def test_weight_sync_routes_the_policy_to_the_target_then_pushes_the_draft(served):
    target, draft, server, eng = served
    routed = verl.TargetRoutedEngine(StandInVerlAdapter(server.url))
    update = verl_like_update(routed)
    new_policy = {k: v + 1.0 for k, v in target.state_dict().items()}
    fresh = {k: (v if k in ("d2t", "t2d") else v + 1.0) for k, v in draft_state_dict_for_sglang(draft).items()}
    before_draft = {k: v.clone() for k, v in server.draft.items()}
    sync = verl.DraftCarryingWeightSync(update, eng, lambda: (fresh, 1), routed=routed)
    asyncio.run(sync.update_weights(iter(new_policy.items()), global_steps=5))
    assert update.kwargs == {"global_steps": 5} and sync.log == ["policy", "draft-1"]
    endpoints = [e for e, _ in server.requests]
    assert endpoints[:3] == ["begin_weight_update", "update_weights_from_tensor", "end_weight_update"]
    assert server.requests[1][1]["selector"] == "target" and server.requests[4][1]["selector"] == "draft"
    assert all(torch.equal(server.target[k], v) for k, v in new_policy.items())
    assert torch.equal(server.draft["model.fc.weight"], fresh["fc.weight"])
    assert not torch.equal(server.draft["model.norm.weight"], before_draft["model.norm.weight"])  # the push did it
    asyncio.run(sync.update_weights(iter([]), global_steps=5))  # same draft version: not pushed again
    assert sync.log == ["policy", "draft-1", "policy"]


def test_stock_verl_sync_would_reach_the_draft_and_is_refused_unrouted(served):
    target, draft, server, eng = served
    adapter = StandInVerlAdapter(server.url)
    # What stock verl 0.9.1 sends (no selector) inside a session: selector "all", the draft takes norm.weight.
    asyncio.run(adapter._make_async_request("begin_weight_update", {"selector": "all"}))
    body = {"serialized_named_tensors": [json_serializer([("norm.weight", target.norm.weight + 1.0)])],
            "load_format": None, "flush_cache": True}
    asyncio.run(adapter._make_async_request("update_weights_from_tensor", body))
    asyncio.run(adapter._make_async_request("end_weight_update", {}))
    assert torch.equal(server.draft["model.norm.weight"], target.norm.weight + 1.0)

    seen = []

    def update_policy(weights):
        for name, _ in weights:
            seen.append(name)

    unrouted = verl.DraftCarryingWeightSync(update_policy, eng, lambda: None)
    with pytest.raises(WeightIsolationError, match="overwrite the draft's"):
        asyncio.run(unrouted.update_weights(iter(target.state_dict().items())))
    assert seen == []  # the first name (embed_tokens.weight) already reaches the draft
    stream = [("layers.3.attn.q_proj.weight", torch.zeros(1)), ("fc.weight", draft.fc.weight)]
    with pytest.raises(WeightIsolationError, match="carries draft tensors"):
        asyncio.run(verl.DraftCarryingWeightSync(update_policy, eng, lambda: None).update_weights(stream))
    assert seen == ["layers.3.attn.q_proj.weight"]


def test_target_routed_engine_base64_encodes_bytes_like_verl():
    adapter = SimpleNamespace(calls=[])

    async def make(endpoint, payload=None):
        adapter.calls.append((endpoint, payload))
        return {"success": True}

    adapter._make_async_request = make
    routed = verl.TargetRoutedEngine(adapter)
    req = SimpleNamespace(serialized_named_tensors=[b"\x00\x01"], load_format="x", flush_cache=False)
    asyncio.run(routed.update_weights_from_tensor(req))
    assert adapter.calls == [("update_weights_from_tensor", {"serialized_named_tensors": ["AAE="], "load_format": "x",
                                                             "flush_cache": False, "selector": "target"})]
