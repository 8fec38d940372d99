"""specrl inside a real TRL GRPOTrainer (trl 1.16, CPU): speculative rollouts, online draft
training and metrics in TRL's log; switched off, TRL runs exactly as vanilla TRL."""
import os
from types import SimpleNamespace

import pytest
import torch

from rollout.drafters import SpecConfig
from specrl.config import CoTrainConfig, OnlineDraftConfig, SchedulerConfig
from helpers import tiny_hf_model, tiny_hf_tokenizer

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
from specrl.integrations.trl import (SpecRLPlugin, TRLIntegrationError, TRLSpecConfig,  # noqa: E402
                                     check_trainer, specrl_grpo_kwargs)

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
pytestmark = pytest.mark.usefixtures("one_thread")
STEPS = 3


def _dataset():
    rows = [" ".join(f"w{(i * 7 + j) % 90 + 4}" for j in range(3 + i % 4)) for i in range(24)]
    return datasets.Dataset.from_dict({"prompt": rows})


def _reward(completions, **kwargs):
    return [len(set(c.split())) / (1.0 + len(c.split())) for c in completions]


def _run(tmp_path, name, plugin_config=None, disable_speculation=False, wrap_rollout=None):
    """STEPS GRPO steps on a tiny Qwen3-MoE; plugin_config None means vanilla TRL."""
    model = tiny_hf_model("qwen3_moe", scale=0.3)
    args = trl.GRPOConfig(output_dir=str(tmp_path / name), per_device_train_batch_size=8, num_generations=4,
                          max_completion_length=12, max_steps=STEPS, logging_steps=1, report_to="none",
                          use_cpu=True, seed=0, beta=0.0, learning_rate=2e-2, save_strategy="no",
                          disable_tqdm=True, bf16=False)  # fp32: TRL's forward and the engine compute alike
    kwargs, plugin = {}, None
    if plugin_config is not None:
        kwargs = specrl_grpo_kwargs(model, config=plugin_config)
        plugin = kwargs["rollout_func"].__self__ if "rollout_func" in kwargs else None
        if plugin is not None and disable_speculation:
            plugin.engine.set_speculation(False)
        if wrap_rollout is not None:
            kwargs["rollout_func"] = wrap_rollout(kwargs["rollout_func"])
    trainer = trl.GRPOTrainer(model=model, reward_funcs=_reward, args=args, train_dataset=_dataset(),
                              processing_class=tiny_hf_tokenizer(), **kwargs)
    trainer.train()
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == STEPS
    return trainer, plugin, steps


def _online_config(mode="online"):
    return TRLSpecConfig(cotrain=CoTrainConfig(
        mode=mode, feature_source="engine", spec=SpecConfig(mode="chain", gamma=3), min_buffer_records=4,
        max_draft_steps=4, online=OnlineDraftConfig(batch_size=4, lr=3e-3),
        scheduler=SchedulerConfig(min_budget_s=2.0)), draft_vocab_size=64)


def _core(rows):
    return [(r["loss"], r["reward"], r["completions/mean_length"]) for r in rows]


@pytest.fixture(scope="module")
def online_run(tmp_path_factory):
    torch.set_num_threads(1)
    seen = []

    def wrap(fn):
        def rollout(prompts, trainer):
            out = fn(prompts, trainer)
            seen.append(out)
            return out
        return rollout

    trainer, plugin, rows = _run(tmp_path_factory.mktemp("online"), "online", _online_config(), wrap_rollout=wrap)
    return trainer, plugin, rows, seen


def test_metrics_reach_trl_log_and_draft_is_trained(online_run):
    _, plugin, rows, _ = online_run
    print("TRL accept lengths:", [r["rollout/spec_accept_length"] for r in rows])
    for r in rows:
        # a fresh draft on a random tiny policy, coupled sampling (deterministic): measured 1.32,
        # 1.26, 1.19; 1.01, 1.00, 1.00 with the draft's proposal reading another token's noise, and
        # 1.00 with every draft token rejected (outputs unchanged in both: only this sees them)
        assert r["rollout/spec_accept_length"] > 1.1 and r["rollout/spec_verify_steps"] > 0
        assert "perf/draft_train_s" in r and "rollout/spec_accept_rate_per_pos/0" in r
    assert any("train/draft_loss" in r for r in rows)
    assert rows[-1]["train/draft_version"] >= 1  # trained and hot-swapped into the engine
    served, version = plugin.engine.draft_weights()
    trained = plugin.cotrain.draft_trainer.export_weights()
    assert all(torch.equal(served[k], trained[k]) for k in trained if version)


def test_policy_sync_follows_trl_and_never_touches_the_draft(online_run):
    trainer, plugin, _, _ = online_run
    draft_before, _ = plugin.engine.draft_weights()
    assert plugin.sync_policy(trainer, force=True)
    hf = trainer.accelerator.unwrap_model(trainer.model)
    ids = torch.randint(3, 96, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(plugin.target(ids).logits, hf(ids).logits, atol=2e-5, rtol=1e-5)
    after, _ = plugin.engine.draft_weights()
    assert all(torch.equal(draft_before[k], after[k]) for k in draft_before)
    assert plugin.cotrain.policy_version == STEPS


def test_rollout_returns_the_policys_logprobs(online_run):
    """The first rollout's log-probs equal the HF policy's log_softmax(logits / T) at its tokens."""
    _, _, _, seen = online_run
    out = seen[0]
    hf = tiny_hf_model("qwen3_moe", scale=0.3)  # the policy before any update
    worst = 0.0
    with torch.no_grad():
        for p, c, lp in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"]):
            logits = hf(torch.tensor([p + c])).logits[0, len(p) - 1: -1]
            ref = torch.log_softmax(logits / 1.0, -1).gather(-1, torch.tensor(c)[:, None])[:, 0]
            worst = max(worst, (ref - torch.tensor(lp)).abs().max().item())
    assert len(out["completion_ids"]) == 8 and worst <= 1e-4


def test_speculation_is_lossless_inside_trl(online_run, tmp_path):
    """Same seed: the engine without speculation, with a frozen draft and with the online draft give
    identical completions, rewards and losses (coupled sampling)."""
    _, _, online_rows, _ = online_run
    _, _, plain = _run(tmp_path, "plain", _online_config("frozen"), disable_speculation=True)
    _, _, frozen = _run(tmp_path, "frozen", _online_config("frozen"))
    assert _core(frozen) == _core(plain) == _core(online_rows)
    assert all(r["rollout/spec_verify_steps"] > 0 for r in frozen)


def test_disabled_plugin_leaves_trl_vanilla():
    """Off, the plug-in hands GRPOTrainer nothing but the caller's own callbacks (no rollout
    function, no callback of its own) and building it leaves the model's weights, dtypes and
    mode and the host's RNG as they were: TRL then runs vanilla TRL, with nothing to compare."""
    from transformers import TrainerCallback

    off = TRLSpecConfig(cotrain=CoTrainConfig(mode="off"))
    model = tiny_hf_model("qwen3_moe", scale=0.3).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    plugin = SpecRLPlugin(model, config=off)
    user = TrainerCallback()
    assert plugin.grpo_kwargs() == {} and specrl_grpo_kwargs(model, config=off) == {}
    assert plugin.grpo_kwargs([user]) == {"callbacks": [user]}
    assert plugin.engine is None and plugin.cotrain is None
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert after[k].dtype == v.dtype and after[k].device == v.device and torch.equal(after[k], v), k
    assert model.training and torch.equal(torch.get_rng_state(), rng)


def test_unsupported_settings_fail_clearly():
    with pytest.raises(TRLIntegrationError, match="feature_source"):
        TRLSpecConfig(cotrain=CoTrainConfig(mode="online", feature_source="trainer"))
    base = dict(use_vllm=False, tools=None, environment_factories=None, _metrics={}, _tokenize_prompts=None)
    ok_args = dict(min_p=None, repetition_penalty=1.0, generation_kwargs=None, temperature=1.0, max_completion_length=8)
    check_trainer(SimpleNamespace(**base, args=SimpleNamespace(**ok_args)))
    for bad, msg in [(dict(repetition_penalty=1.1), "repetition_penalty"), (dict(min_p=0.1), "min_p"),
                     (dict(temperature=0.0), "temperature")]:
        with pytest.raises(TRLIntegrationError, match=msg):
            check_trainer(SimpleNamespace(**base, args=SimpleNamespace(**(ok_args | bad))))
    with pytest.raises(TRLIntegrationError, match="use_vllm"):
        check_trainer(SimpleNamespace(**(base | {"use_vllm": True}), args=SimpleNamespace(**ok_args)))
    plugin = SpecRLPlugin(tiny_hf_model("qwen3_moe"), config=_online_config("frozen"))
    assert set(plugin.grpo_kwargs()) == {"rollout_func", "callbacks"}


def test_draft_from_module_or_sglang_folder_reads_the_engines_target(tmp_path):
    from draft_models.checkpoint import save_draft
    from draft_models.config import Eagle3Config
    from target_training.hf_adapter import load_hf_target

    model = tiny_hf_model("qwen3_moe")
    other_target, _ = load_hf_target(model)
    draft = Eagle3Config.for_target(other_target.cfg, 64).build(other_target.embed_tokens)
    save_draft(draft, tmp_path / "draft")
    for source in (draft, tmp_path / "draft"):
        plugin = SpecRLPlugin(model, draft=source, config=_online_config("frozen"))
        engine_draft = plugin.cotrain.serving_draft()
        assert engine_draft.embed_tokens is plugin.target.embed_tokens  # not the other copy
        assert torch.equal(engine_draft.fc.weight, draft.fc.weight)
