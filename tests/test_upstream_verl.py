"""The veRL adapter against the installed verl 0.9.1 (the verl lane, tests/lanes/verl.sh).

Real here: verl's `SPEC_DECODE_EXTRA_KEYS`, its `AgentLoopOutput` (pydantic model the adapter's
extra_fields must fit), its `compute_spec_decode_metrics` (what verl logs), and its hydra
`ppo_trainer` config composed with the adapter's overrides. The SGLang meta_info payloads are the
hand-written ones in tests/data/sglang (see its README). verl's `AsyncHttpServerAdapter` imports
sglang, which this lane does not install, so `TargetRoutedEngine` is checked against a stand-in in
tests/test_verl_contract.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from upstream import import_verl

from rollout.drafters import SpecConfig
from specrl.integrations import verl as adapter

pytestmark = pytest.mark.verl
DATA = Path(__file__).parent / "data" / "sglang"


def meta(name):
    return json.loads((DATA / name).read_text())


@pytest.fixture(scope="module")
def v():
    verl = import_verl("verl")
    assert verl.__version__ == "0.9.1", f"the verl lane pins 0.9.1, found {verl.__version__}"
    return verl


def test_extra_keys_are_verls(v):
    tool_loop = import_verl("verl.experimental.agent_loop.tool_agent_loop")
    assert adapter.EXTRA_KEYS == tuple(tool_loop.SPEC_DECODE_EXTRA_KEYS)


def test_metrics_equal_verls_compute_spec_decode_metrics(v):
    ray_trainer = import_verl("verl.trainer.ppo.ray_trainer")
    turns = [adapter.spec_extra_fields(meta(n)) for n in
             ("meta_v0_5_accept_token_num.json", "meta_dev_by_position.json", "meta_v0_5_correct_drafts.json",
              "meta_v0_4_verify_only.json")]
    rows = [adapter.merge_extra_fields(turns[0], turns[1]), turns[2], turns[3],
            {"spec_num_draft_tokens": 0, "spec_num_accepted_tokens": 0, "spec_num_verify_steps": 0}]
    # verl reads the three keys as numpy object columns of the batch's non_tensor_batch
    cols = [np.array([r[k] for r in rows], dtype=object) for k in adapter.EXTRA_KEYS]
    theirs = ray_trainer.compute_spec_decode_metrics(*cols)
    ours = adapter.spec_metrics(rows)
    assert set(theirs) == {"rollout/spec_accept_rate", "rollout/spec_accept_length"}
    for k, val in theirs.items():
        assert ours[k] == pytest.approx(val, rel=1e-12), k
    # specrl's token-weighted figures live under other names and differ from verl's per-request means
    assert all(k.startswith("rollout/specrl_") for k in set(ours) - set(theirs))
    assert ours["rollout/specrl_accept_length_token_weighted"] != pytest.approx(theirs["rollout/spec_accept_length"])


def test_extra_fields_fit_agent_loop_output(v):
    agent_loop = import_verl("verl.experimental.agent_loop.agent_loop")
    fields = adapter.spec_extra_fields(meta("meta_v0_5_correct_drafts.json"))
    out = agent_loop.AgentLoopOutput(prompt_ids=[1, 2], response_ids=[3, 4], response_mask=[1, 1],
                                     metrics=agent_loop.AgentLoopMetrics(), extra_fields=fields)
    assert out.extra_fields == fields


def test_hydra_overrides_compose_on_verls_ppo_trainer_config(v):
    from hydra import compose, initialize_config_dir

    cfg_dir = Path(v.__file__).parent / "trainer" / "config"
    overrides = adapter.hydra_overrides(adapter.engine_kwargs("/ckpt/draft", SpecConfig(mode="chain", gamma=3)))
    with initialize_config_dir(config_dir=str(cfg_dir), version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=["actor_rollout_ref.rollout.name=sglang", *overrides])
    sgl = cfg.actor_rollout_ref.rollout.engine_kwargs.sglang
    assert sgl.speculative_algorithm == "EAGLE3" and sgl.speculative_num_steps == 3
    assert sgl.speculative_num_draft_tokens == 4 and sgl.enable_draft_weights_cpu_backup is True
