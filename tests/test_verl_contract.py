"""veRL contract: engine_kwargs for SGLang, spec counters in AgentLoopOutput.extra_fields, and the
weight-sync wrapper that keeps the draft out of the policy sync and pushes it afterwards."""
from __future__ import annotations

import asyncio

import pytest
import torch
from test_sglang_engine import FakeSGLang, json_serializer, load_fixture, make_pair

from draft_models.checkpoint import draft_state_dict_for_sglang
from rollout.sglang_engine import SGLangEngine, SGLangEngineConfig, SpecMetaError, WeightIsolationError
from rollout.speculative import SpecConfig
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
    assert turn1 == {"spec_verify_ct": 10, "spec_accepted_drafts": 19, "spec_proposed_drafts": 30,
                     "spec_completion_tokens": 30}
    merged = verl.merge_extra_fields(verl.merge_extra_fields({"teacher_ids": [1]}, turn1), turn2)
    assert merged["teacher_ids"] == [1] and merged["spec_verify_ct"] == 16 and merged["spec_accepted_drafts"] == 30
    assert verl.spec_extra_fields(load_fixture("meta_no_spec.json")) == {}
    m = verl.spec_metrics([merged, {}, verl.spec_extra_fields(load_fixture("meta_v0_5_correct_drafts.json"))])
    assert m["rollout/spec_verify_steps"] == 24
    assert m["rollout/spec_accept_length"] == pytest.approx((30 + 15 + 24) / 24)
    assert m["rollout/spec_accept_rate"] == pytest.approx(45 / 70)
    with pytest.raises(SpecMetaError):
        verl.spec_extra_fields(load_fixture("meta_contradictory_alias.json"))


@pytest.fixture
def served():
    target, draft = make_pair()
    server = FakeSGLang(target.state_dict(), draft_state_dict_for_sglang(draft))
    eng = SGLangEngine(SGLangEngineConfig(base_url=server.url, serializer=json_serializer,
                                          hold_shared_draft_names=True))
    eng.target_param_names = set(target.state_dict())
    yield target, draft, server, eng
    server.close()


def test_weight_sync_pushes_the_draft_after_the_policy(served):
    target, draft, server, eng = served
    seen = []

    async def update_policy(weights, **kwargs):  # stands in for veRL's rollout.update_weights
        for name, t in weights:
            seen.append(name)
        assert kwargs == {"global_steps": 5}

    fresh = {k: (v if k in ("d2t", "t2d") else v + 1.0) for k, v in draft_state_dict_for_sglang(draft).items()}
    sync = verl.DraftCarryingWeightSync(update_policy, eng, lambda: (fresh, 1), isolated=True)
    asyncio.run(sync.update_weights(iter(target.state_dict().items()), global_steps=5))
    assert seen == list(target.state_dict()) and sync.log == ["policy", "draft-1"]
    assert torch.equal(server.draft["model.fc.weight"], fresh["fc.weight"])
    assert all(torch.equal(server.target[k], v) for k, v in target.state_dict().items())
    asyncio.run(sync.update_weights(iter([]), global_steps=5))  # same draft version: not pushed again
    assert sync.log == ["policy", "draft-1", "policy"]


def test_weight_sync_refuses_draft_tensors_in_the_policy_stream(served):
    target, draft, _, eng = served
    seen = []

    def update_policy(weights):
        for name, _ in weights:
            seen.append(name)

    stream = [("layers.0.attn.q_proj.weight", torch.zeros(1)), ("fc.weight", draft.fc.weight)]
    sync = verl.DraftCarryingWeightSync(update_policy, eng, lambda: None, isolated=True)
    with pytest.raises(WeightIsolationError, match="carries draft tensors"):
        asyncio.run(sync.update_weights(stream))
    assert seen == ["layers.0.attn.q_proj.weight"]
    unisolated = verl.DraftCarryingWeightSync(update_policy, eng, lambda: None, isolated=False)
    with pytest.raises(WeightIsolationError, match="lacks disable_draft_model"):
        asyncio.run(unisolated.update_weights(iter(target.state_dict().items())))
