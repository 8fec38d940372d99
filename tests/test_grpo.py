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


def _sgd(model, lr):
    """apply_gradients for grpo_update: plain SGD, so that rounding-level gradient differences stay
    rounding-level in the weights (Adam's first steps turn a near-zero gradient into a full step)."""
    def apply(loss):
        model.zero_grad(set_to_none=True)
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= lr * p.grad
        return None
    return apply


def _reference_update(model, trajs, rewards, group_size, cfg):
    """GRPO as written plainly: logits at every position of the whole padded batch, the old log-probs
    from a pass over every minibatch before the first update, fp32 (what grpo_update must equal)."""
    from target_training.grpo import group_advantages

    step = _sgd(model, cfg.lr)
    batch = pack_batch(trajs)
    ids, mask = batch["input_ids"], batch["response_mask"]
    adv = group_advantages(torch.tensor(rewards), group_size)

    def logp_of(rows):
        lp = (model(ids[rows]).logits[:, :-1].float() / cfg.temperature).log_softmax(-1)
        return torch.cat([torch.zeros(lp.shape[0], 1), lp.gather(-1, ids[rows, 1:, None])[..., 0]], 1)

    with torch.no_grad():
        old = torch.cat([logp_of(slice(lo, lo + cfg.minibatch_size)) for lo in range(0, len(trajs), cfg.minibatch_size)])
    model.train()
    for lo in range(0, len(trajs), cfg.minibatch_size):
        sl = slice(lo, lo + cfg.minibatch_size)
        step(grpo_loss(logp_of(sl), old[sl], adv[sl], mask[sl], cfg.clip_eps)[0])
    model.eval()


def test_the_update_at_answer_positions_on_trimmed_minibatches_equals_the_plain_full_vocabulary_update(tiny_model,
                                                                                                        prompts):
    """grpo_update computes logits at the answer positions only, cuts each minibatch to its own
    longest sequence and takes the first minibatch's old log-probs from its first forward; in fp32
    on CPU the weights after the update (plain SGD steps) equal those of the plain algorithm (every
    position's logits, the padded batch, a full pass for the old log-probs) to float rounding. The
    router's load-balancing loss is left out: it averages over every token a forward sees, padding
    included, so cutting padding changes it (for the better: padding is not routed text)."""
    import copy

    from target_training.grpo import grpo_update

    torch.manual_seed(0)
    engine = EmbeddedEngine(tiny_model, EngineConfig(max_batch=16))
    # lengths vary a lot: the minibatches are padded to different lengths
    trajs = engine.generate([prompts[i % 8] for i in range(16)],
                            SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=(5, 6, 7, 8), seed=2),
                            request_ids=range(16))
    assert len({len(t.prompt_ids) + len(t.token_ids) for t in trajs}) > 4
    rewards = [float(i % 3 == 0) for i in range(16)]
    cfg = GRPOConfig(lr=0.5, minibatch_size=4, clip_eps=0.1)
    start = copy.deepcopy(tiny_model.state_dict())
    reference = copy.deepcopy(tiny_model)
    _reference_update(reference, trajs, rewards, 8, cfg)
    m = grpo_update(tiny_model, trajs, rewards, 8, cfg, _sgd(tiny_model, cfg.lr), aux_coef=None)
    assert m["clip_frac"] > 0  # later minibatches move away from the old log-probs: they matter here
    moved = max((a - b).abs().max().item() for a, b in zip(reference.state_dict().values(), start.values()))
    gap = max((a - b).abs().max().item() for a, b in zip(tiny_model.state_dict().values(),
                                                          reference.state_dict().values()))
    assert moved > 1e-2 and gap < 1e-4 * moved, (gap, moved)


def test_token_logprobs_at_marked_positions_equal_the_full_ones_there(tiny_model):
    from target_training.grpo import logit_positions, token_logprobs

    torch.manual_seed(1)
    ids = torch.randint(3, 64, (3, 9))
    mask = torch.zeros(3, 9, dtype=torch.bool)
    mask[0, 4:9], mask[1, 2:5], mask[2, 7:9] = True, True, True
    pos = logit_positions(mask)
    with torch.no_grad():
        full_lp, full_ent = token_logprobs(tiny_model(ids).logits, ids, 0.8)
        out = tiny_model(ids, logits_at=pos)
        lp, ent = token_logprobs(out.logits, ids, 0.8, pos)
    assert out.logits.shape == (int(mask.sum()), 64)
    assert torch.allclose(lp[mask], full_lp[mask], atol=1e-6) and torch.allclose(ent[mask], full_ent[mask], atol=1e-5)
    assert lp[~mask].abs().max() == 0 and ent[~mask].abs().max() == 0


def test_bf16_compute_keeps_the_update_close_to_fp32_and_fp32_weights(tiny_model, prompts):
    """compute_dtype "bf16": the forwards run under autocast (the log-probs move by bf16 rounding,
    not more), the weights stay fp32, and "auto" follows the device's native bf16."""
    from target_training.grpo import native_bf16, update_autocast

    engine = EmbeddedEngine(tiny_model, EngineConfig(max_batch=8))
    trajs = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=10, seed=4))
    fp32 = GRPOTrainer(tiny_model, GRPOConfig(compute_dtype="fp32")).recompute_logprobs(trajs)
    bf16 = GRPOTrainer(tiny_model, GRPOConfig(compute_dtype="bf16")).recompute_logprobs(trajs)
    mask = pack_batch(trajs)["response_mask"]
    gap = (fp32 - bf16).abs()[mask]
    assert 0 < gap.max() < 0.5 and gap.mean() < 0.05
    m = GRPOTrainer(tiny_model, GRPOConfig(compute_dtype="bf16", minibatch_size=4)).step(trajs, [0.0, 1.0] * 4, 2)
    assert all(p.dtype == torch.float32 for p in tiny_model.parameters()) and m["logprob_mismatch"] > 1e-4
    assert update_autocast("auto", torch.device("cpu")).fast_dtype == torch.bfloat16
    assert update_autocast("auto", torch.device("cpu"))._enabled == native_bf16(torch.device("cpu"))
    with pytest.raises(ValueError, match="compute_dtype"):
        GRPOConfig(compute_dtype="fp16")
