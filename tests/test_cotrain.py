"""Contract of the co-training plug-in inside a real RL loop (CI preset, a few steps)."""
import json

import pytest
import torch

from rollout.engine import EmbeddedEngine, EngineConfig
from rollout.protocol import SamplingParams
from rollout.speculative import SpecConfig
from specrl.cotrain import CoTrainConfig, SpecCoTrainer
from specrl.train_rl import train_rl


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same seeded 3-step run with speculation off, frozen and online."""
    cache = tmp_path_factory.mktemp("cache")
    out = {}
    for mode in ("off", "frozen", "online"):
        d = tmp_path_factory.mktemp(mode)
        summary = train_rl("arith", "ci", d, seed=3, steps=3, cache_dir=cache, progress=False, spec=mode,
                           log=lambda *a: None)
        out[mode] = (summary, _rows(d), d)
    return out


def test_speculation_is_lossless_end_to_end(runs):
    """Same seed: identical rewards and identical policy updates with speculation off, frozen or online."""
    base = [(r["reward"], r["loss"], r["response_len"]) for r in runs["off"][1]]
    for mode in ("frozen", "online"):
        assert [(r["reward"], r["loss"], r["response_len"]) for r in runs[mode][1]] == base
        assert runs[mode][0]["reward_end"] == runs["off"][0]["reward_end"]


def test_metrics_reported(runs):
    online = runs["online"][1]
    for key in ("rollout/spec_accept_length", "rollout/spec_accept_rate", "rollout/spec_accept_rate_per_pos",
                "train/draft_loss", "perf/draft_train_s", "perf/draft_sync_s"):
        assert key in online[-1]
    assert all(r["rollout/spec_accept_length"] > 1.0 for r in online)
    assert online[-1]["train/draft_version"] >= 1  # the online draft was trained and swapped in
    assert "rollout/spec_accept_length" not in runs["off"][1][0]  # off adds nothing
    assert runs["frozen"][1][-1].get("train/draft_steps") is None


def test_resume_restores_cotraining_state(runs, tmp_path):
    _, rows, d = runs["online"]
    state = torch.load(d / "ckpt" / "state.pt", weights_only=False)
    assert state["cotrain"]["mode"] == "online"
    assert state["cotrain"]["policy_version"] == 3
    assert state["cotrain"]["draft_trainer"]["version"] == rows[-1]["train/draft_version"]


def test_disabled_plugin_leaves_engine_and_trainer_untouched(tiny_model):
    from target_training.grpo import GRPOConfig, GRPOTrainer

    engine = EmbeddedEngine(tiny_model)
    trainer = GRPOTrainer(tiny_model, GRPOConfig())
    cot = SpecCoTrainer(None, CoTrainConfig(mode="off")).attach(engine, trainer)
    cot.begin_step()
    assert engine.speculator is None and engine.step_hooks == [] and trainer.logprob_hooks == []
    assert cot.on_rollout([]) == {} and cot.train_draft() == {} and cot.end_step() == {}


def test_draft_failure_falls_back_to_plain(sft_policy, offline_draft):
    """A crashing or NaN draft never stops generation: outputs equal plain decoding, the fault is counted."""
    tokenizer, task, policy, _ = sft_policy
    from specrl.train_rl import encode_prompts

    prompts = encode_prompts(tokenizer, task.examples("heldout", 12, 4))
    params = SamplingParams(temperature=1.0, max_new_tokens=30, stop_token_ids=(tokenizer.eos_id,), seed=2)
    plain = EmbeddedEngine(policy, EngineConfig(max_batch=4)).generate(prompts, params)
    cot = SpecCoTrainer(offline_draft, CoTrainConfig(mode="frozen", spec=SpecConfig(gamma=3)))
    engine = EmbeddedEngine(policy, EngineConfig(max_batch=4))
    cot.attach(engine)
    with torch.no_grad():
        cot.speculator.draft.fc.weight.fill_(float("nan"))
    with pytest.warns(RuntimeWarning, match="speculation disabled"):
        out = engine.generate(prompts, params)
    assert [t.token_ids for t in out] == [t.token_ids for t in plain]
    assert cot.speculator.faults and "NaN" in cot.speculator.faults[0]
    assert engine.last_stats["spec_faults"] == 1
    m = cot.on_rollout(out)  # counted in the metrics, per rollout and in total
    assert m["rollout/spec_faults"] == 1 and m["rollout/spec_faults_total"] == 1

    def boom(*a, **k):
        raise RuntimeError("CUDA out of memory (simulated)")

    with torch.no_grad():
        cot.speculator.draft.fc.weight.copy_(offline_draft.fc.weight)
    cot.speculator.draft.forward = boom
    with pytest.warns(RuntimeWarning, match="out of memory"):
        out = engine.generate(prompts, params)
    assert [t.token_ids for t in out] == [t.token_ids for t in plain]
    m = cot.on_rollout(out)
    assert m["rollout/spec_faults"] == 1 and m["rollout/spec_faults_total"] == 2
    del cot.speculator.draft.forward  # a healthy draft again: the next rollout counts no fault
    out = engine.generate(prompts, params)
    assert engine.last_stats["spec_faults"] == 0
    assert cot.on_rollout(out)["rollout/spec_faults"] == 0 and sum(t.spec.verify_steps for t in out) > 0


def test_draft_trainer_failure_does_not_stop_training(sft_policy, offline_draft, monkeypatch):
    import copy

    cot = SpecCoTrainer(copy.deepcopy(offline_draft), CoTrainConfig(mode="online", min_buffer_records=1))
    _, _, policy, _ = sft_policy
    ids = torch.randint(3, 60, (2, 12))
    out = policy(ids, tap_layers=policy.cfg.feature_layer_ids)
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[:, 6:] = True
    cot.buffer.add_from_trainer_forward(ids, out.features(policy.cfg.feature_layer_ids), out.logits, mask,
                                        cot.draft.d2t, 0)
    monkeypatch.setattr(cot.draft_trainer, "train_for", lambda *a, **k: (_ for _ in ()).throw(MemoryError("OOM")))
    cot.begin_step()
    with pytest.warns(RuntimeWarning, match="OOM"):
        m = cot.train_draft()
    assert m["train/draft_faults"] == 1
    cot.end_step()
