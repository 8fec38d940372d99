import pytest
import torch

from rollout.engine import EmbeddedEngine, EngineConfig
from rollout.protocol import SamplingParams
from target_training.grpo import GRPOConfig, GRPOTrainer, group_advantages, grpo_loss, pack_batch


def _rollouts(model, prompts, temperature=1.0):
    engine = EmbeddedEngine(model, EngineConfig(max_batch=4))
    params = SamplingParams(temperature=temperature, top_p=0.9, max_new_tokens=16, stop_token_ids=(2,), seed=3)
    return engine.generate(prompts, params)


def test_trainer_logprobs_equal_engine_logprobs(tiny_model, prompts):
    """True on-policy: the trainer's recomputed log-probs equal the engine's (fp32, <= 1e-5)."""
    trajs = _rollouts(tiny_model, prompts)
    trainer = GRPOTrainer(tiny_model, GRPOConfig(temperature=1.0))
    recomputed = trainer.recompute_logprobs(trajs)
    batch = pack_batch(trajs)
    diff = (recomputed - batch["old_logp"]).abs()[batch["response_mask"]]
    assert diff.numel() == sum(len(t.token_ids) for t in trajs)
    assert diff.max().item() <= 1e-5


def test_group_advantages():
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 2.0, 2.0]), 4)
    assert torch.allclose(adv[:4], torch.tensor([1.0, -1.0, 1.0, -1.0]), atol=1e-4)
    assert torch.all(adv[4:] == 0)  # identical rewards carry no signal


def test_clipping_blocks_gradient_beyond_trust_region():
    logp = torch.tensor([[0.0, -0.1, 0.5]], requires_grad=True)  # ratio e^0.5 > 1.2 on the last token
    old = torch.zeros(1, 3)
    mask = torch.tensor([[False, True, True]])
    loss, m = grpo_loss(logp, old, torch.tensor([1.0]), mask, clip_eps=0.2)
    loss.backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 2] == 0  # masked, and clipped (positive advantage, ratio > 1+eps)
    assert logp.grad[0, 1] < 0
    assert m["clip_frac"] == 0.5


def test_decoupled_objective_weights_each_token_by_its_behaviour_ratio_and_drops_the_capped():
    """GRPOConfig.behaviour_weight_cap: each token's surrogate times exp(old - behaviour); a token
    whose weight exceeds the cap gives no gradient, and the mean still divides by every token."""
    logp = torch.tensor([[0.0, -0.2, -0.4, -0.1]], requires_grad=True)
    old = logp.detach().clone()  # the trainer's log-probs before the update: every ratio is 1
    # token 1 fresh (weight 1), token 2 sampled by an older policy (weight e^0.5), token 3 by one
    # far off (weight e^2 = 7.4, over the cap of 5: dropped)
    behaviour = old - torch.tensor([[0.0, 0.0, 0.5, 2.0]])
    mask = torch.tensor([[False, True, True, True]])
    plain, _ = grpo_loss(logp, old, torch.tensor([1.0]), mask, clip_eps=0.2)
    loss, m = grpo_loss(logp, old, torch.tensor([1.0]), mask, clip_eps=0.2, behaviour_logp=behaviour, weight_cap=5.0)
    loss.backward()
    g, e = logp.grad[0], torch.tensor(0.5).exp()
    assert g[0] == 0 and g[3] == 0  # not a response token; capped
    assert torch.isclose(g[2] / g[1], e)  # weighted by exp(old - behaviour)
    assert torch.isclose(loss, -(1 + e) / 3)  # the mean divides by all 3 response tokens
    assert m["behaviour_capped"] == pytest.approx(1 / 3) and m["behaviour_weight"] == pytest.approx(float(1 + e) / 2)
    assert torch.isclose(plain, torch.tensor(-1.0))
    same, _ = grpo_loss(logp, old, torch.tensor([1.0]), mask, clip_eps=0.2, behaviour_logp=old, weight_cap=5.0)
    assert torch.isclose(same, plain)  # fresh rollouts (behaviour = old): the plain objective
    with pytest.raises(ValueError, match="behaviour_weight_cap must be positive and needs old_logprobs='trainer'"):
        GRPOConfig(behaviour_weight_cap=5.0, old_logprobs="engine")


def test_grpo_step_raises_reward_of_preferred_token(tiny_model, prompts):
    """A reward for emitting a token in 7..11 first must raise their probability after a few updates."""
    torch.manual_seed(0)
    trainer = GRPOTrainer(tiny_model, GRPOConfig(lr=3e-3))
    prompts = [prompts[0]] * 16

    def prob7():
        with torch.no_grad():
            return tiny_model(torch.tensor([prompts[0]])).logits[0, -1].softmax(-1)[7:12].sum().item()

    before = prob7()
    for step in range(4):
        engine = EmbeddedEngine(tiny_model, EngineConfig(max_batch=16))
        params = SamplingParams(temperature=1.5, max_new_tokens=2, seed=step)
        trajs = engine.generate(prompts, params, request_ids=range(step * 16, step * 16 + 16))
        rewards = [1.0 if t.token_ids[0] in (7, 8, 9, 10, 11) else 0.0 for t in trajs]
        trainer.config.temperature = 1.5
        m = trainer.step(trajs, rewards, group_size=16)
        assert m["logprob_mismatch"] < 1e-4  # engine and trainer agree: the update is on-policy
    assert prob7() > before


def test_kl_to_reference_needs_reference(tiny_model):
    import pytest

    with pytest.raises(ValueError, match="reference"):
        GRPOTrainer(tiny_model, GRPOConfig(kl_coef=0.1))


def test_the_logprob_mismatch_is_read_before_the_policy_moves(tiny_model, prompts):
    """`logprob_mismatch` gauges the engine against the trainer: with several minibatches per step,
    the later minibatches' forwards come after updates, and a gap taken there would measure the
    policy's own movement (a large learning rate makes it plain). It is read from the trainer's
    pass before the updates instead, so engine and trainer agree to fp32 rounding."""
    torch.manual_seed(0)
    trainer = GRPOTrainer(tiny_model, GRPOConfig(lr=5e-2, minibatch_size=4))
    engine = EmbeddedEngine(tiny_model, EngineConfig(max_batch=16))
    trajs = engine.generate([prompts[0]] * 16, SamplingParams(temperature=1.0, max_new_tokens=6, seed=1),
                            request_ids=range(16))
    m = trainer.step(trajs, [float(i % 2) for i in range(16)], group_size=16)
    assert m["logprob_mismatch"] < 1e-4
