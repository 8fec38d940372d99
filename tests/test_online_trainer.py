import copy
import math

import pytest
import torch

from draft_models.checkpoint import draft_state_dict_for_sglang
from draft_models.train import collate
from draft_models.ttt import ttt_loss
from specrl.buffer import FeatureBuffer
from specrl.config import DraftTrainConfig, OnlineDraftConfig
from specrl.drafts import new_draft
from specrl.online_trainer import OnlineDraftTrainer
from target_training.config import model_config_for


def _sequences(n=16, T=24, seed=0):
    """Counting sequences (x_{t+1} = x_t + 1, wrapping in 3..63): easy for a draft to learn."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(3, 64, (n,), generator=g)
    return [[3 + (int(s) - 3 + t) % 61 for t in range(T)] for s in starts]


@pytest.fixture
def setup():
    torch.manual_seed(0)
    policy = model_config_for("tiny", 64).build()
    seqs = _sequences()
    draft = new_draft(policy, seqs, DraftTrainConfig(draft_vocab_size=64, ttt_steps=2))
    return policy, seqs, draft


def _fill(buffer, policy, seqs, draft, soft: bool, version=0, grad=False):
    """Features from the policy's own forward (as a GRPOTrainer log-prob hook would see them)."""
    ids = torch.tensor(seqs)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 4:] = True  # 4 prompt tokens, the rest is the response
    layers = policy.cfg.feature_layer_ids
    with torch.set_grad_enabled(grad):
        out = policy(ids, tap_layers=layers)
        buffer.add_from_trainer_forward(ids, out.features(layers), out.logits if soft else None, mask,
                                        draft.d2t, version)
    return buffer


def _snapshot(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _eval_loss(draft, buffer, ttt_steps=2):
    with torch.no_grad():
        batch = collate(buffer.sample(len(buffer), torch.Generator().manual_seed(0)))
        loss, _ = ttt_loss(draft, batch["features"], batch["input_ids"], None, batch["loss_mask"], steps=ttt_steps)
        return loss.item()


@pytest.mark.parametrize("kw", [dict(lr=0), dict(batch_size=0), dict(ttt_steps=0), dict(max_grad_norm=-1),
                                dict(prefer_rejected=1.5), dict(acceptance_weight=-0.1), dict(weight_decay=-1),
                                dict(lr=float("nan")), dict(warmup_steps=-1), dict(warmup_steps=1.5),
                                dict(compute_dtype="fp16")])
def test_config_validation(kw):
    with pytest.raises(ValueError):
        OnlineDraftConfig(**kw)


def test_bf16_updates_compute_in_bf16_and_learn_like_fp32_while_the_weights_stay_fp32(setup):
    """compute_dtype "bf16": the update's forward runs under bf16 autocast (its loss differs from
    fp32's by rounding only), the draft's weights and AdamW's moments stay fp32, and 40 updates
    learn the counting task like fp32 updates on the same batches."""
    policy, seqs, draft = setup
    buf = _fill(FeatureBuffer(budget_bytes=10**7), policy, seqs, draft, soft=False)
    losses, evals = {}, {}
    for dtype in ("fp32", "bf16"):
        d = copy.deepcopy(draft)
        trainer = OnlineDraftTrainer(d, OnlineDraftConfig(lr=3e-3, batch_size=8, ttt_steps=2, prefer_rejected=0.0,
                                                          compute_dtype=dtype))
        gen = torch.Generator().manual_seed(0)
        losses[dtype] = [trainer.train_step(buf, gen)["draft_loss"] for _ in range(40)]
        evals[dtype] = _eval_loss(d, buf)
        assert all(p.dtype == torch.float32 for p in d.parameters())
        assert all(t.dtype == torch.float32 for st in trainer.optimizer.state.values() for t in st.values()
                   if torch.is_tensor(t) and t.is_floating_point())
    assert losses["bf16"][0] != losses["fp32"][0] and abs(losses["bf16"][0] / losses["fp32"][0] - 1) < 0.02
    assert evals["bf16"] < 0.5 * _eval_loss(draft, buf) and abs(evals["bf16"] / evals["fp32"] - 1) < 0.1


def test_loss_decreases_on_fixed_buffer(setup):
    policy, seqs, draft = setup
    buf = _fill(FeatureBuffer(budget_bytes=10**7), policy, seqs, draft, soft=False)
    trainer = OnlineDraftTrainer(draft, OnlineDraftConfig(lr=3e-3, batch_size=8, ttt_steps=2, prefer_rejected=0.0))
    before = _eval_loss(draft, buf)
    report = trainer.train_for(buf, max_steps=40, time_budget_s=60.0, generator=torch.Generator().manual_seed(0))
    after = _eval_loss(draft, buf)
    assert report["steps"] == 40 and report["updates"] == 40 and trainer.version == 40
    assert after < 0.5 * before, (before, after)
    m = trainer.train_step(buf, torch.Generator().manual_seed(1))
    assert {"draft_loss", "acc_0", "seconds", "grad_norm"} <= m.keys() and m["soft_targets"] is False
    assert m["acc_0"] > 0.5


def test_lr_warmup_is_linear_then_flat(setup):
    policy, seqs, draft = setup
    buf = _fill(FeatureBuffer(budget_bytes=10**7), policy, seqs, draft, soft=False)
    trainer = OnlineDraftTrainer(draft, OnlineDraftConfig(lr=1e-3, batch_size=4, warmup_steps=4))
    lrs = []
    for i in range(6):
        trainer.train_step(buf, torch.Generator().manual_seed(i))
        lrs.append(trainer.optimizer.param_groups[0]["lr"])
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])


def test_train_for_counts_warmup_updates_by_their_share_of_the_rate(setup):
    policy, seqs, draft = setup
    buf = _fill(FeatureBuffer(budget_bytes=10**7), policy, seqs, draft, soft=False)
    warm = OnlineDraftTrainer(copy.deepcopy(draft), OnlineDraftConfig(lr=1e-3, batch_size=4, warmup_steps=4))
    r = warm.train_for(buf, 2, 3600.0, torch.Generator().manual_seed(0))
    assert r["updates"] == 2 and r["full_rate_updates"] == pytest.approx(0.25 + 0.5)
    r = warm.train_for(buf, 3, 3600.0, torch.Generator().manual_seed(1))
    assert r["full_rate_updates"] == pytest.approx(0.75 + 1.0 + 1.0)
    flat = OnlineDraftTrainer(copy.deepcopy(draft), OnlineDraftConfig(lr=1e-3, batch_size=4))
    assert flat.train_for(buf, 2, 3600.0, torch.Generator().manual_seed(0))["full_rate_updates"] == pytest.approx(2.0)


def test_soft_targets_step(setup):
    policy, seqs, draft = setup
    buf = _fill(FeatureBuffer(budget_bytes=10**7), policy, seqs, draft, soft=True)
    trainer = OnlineDraftTrainer(draft, OnlineDraftConfig(batch_size=4))
    m = trainer.train_step(buf, torch.Generator().manual_seed(0))
    assert m["soft_targets"] is True and math.isfinite(m["draft_loss"]) and not m["skipped_nonfinite"]
    buf.add({"input_ids": torch.tensor(seqs[0]), "features": buf.sample(1, None)[0]["features"],
             "target_logp": None, "loss_mask": torch.ones(24, dtype=torch.bool)}, 1)
    m = trainer.train_step(buf, torch.Generator().manual_seed(0), min_version=1)
    assert m["soft_targets"] is False and trainer.version == 2


def test_gradient_isolation(setup):
    """Features taken from a grad-enabled policy forward; a draft step leaves the policy untouched."""
    policy, seqs, draft = setup
    policy.train()
    buf = _fill(FeatureBuffer(budget_bytes=10**7), policy, seqs, draft, soft=True, grad=True)
    policy_before = _snapshot(policy)
    draft_before = _snapshot(draft)
    trainer = OnlineDraftTrainer(draft, OnlineDraftConfig(batch_size=8))
    for _ in range(2):
        m = trainer.train_step(buf, torch.Generator().manual_seed(0))
        assert not m["skipped_nonfinite"]
    assert all(p.grad is None for p in policy.parameters())
    assert _same(_snapshot(policy), policy_before)
    assert not _same(_snapshot(draft), draft_before)  # the draft did learn
    opt_params = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert id(policy.embed_tokens.weight) not in opt_params
    assert opt_params == {id(p) for p in draft.parameters()}


def test_policy_sync_never_writes_into_draft(setup):
    """Loading new policy weights changes none of the draft's own tensors. The token embedding is
    shared by design (EAGLE-3 reads the target's frozen embedding): the draft sees the new one."""
    policy, seqs, draft = setup
    trainer = OnlineDraftTrainer(draft, OnlineDraftConfig())
    draft_before = _snapshot(draft)
    exported = trainer.export_weights()
    g = torch.Generator().manual_seed(5)
    perturbed = {k: v + 0.1 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
                 for k, v in policy.state_dict().items()}
    policy.load_state_dict(perturbed)
    assert _same(_snapshot(draft), draft_before)
    assert _same(trainer.export_weights(), exported)
    assert draft.embed_tokens is policy.embed_tokens
    assert torch.equal(draft.embed_tokens.weight, perturbed["embed_tokens.weight"])


def test_nan_features_skip_step(setup):
    policy, seqs, draft = setup
    buf = _fill(FeatureBuffer(budget_bytes=10**7), policy, seqs, draft, soft=False)
    bad = FeatureBuffer(budget_bytes=10**7)
    for r in buf.sample(4, torch.Generator().manual_seed(0)):
        feats = r["features"].clone()
        feats[3] = float("nan")
        bad.add({**r, "features": feats}, 0)
    trainer = OnlineDraftTrainer(draft, OnlineDraftConfig(batch_size=4))
    before = _snapshot(draft)
    m = trainer.train_step(bad, torch.Generator().manual_seed(0))
    assert m["skipped_nonfinite"] is True and trainer.version == 0
    assert _same(_snapshot(draft), before)
    assert not trainer.optimizer.state  # no moment was updated either
    assert all(p.grad is None for p in draft.parameters())
    report = trainer.train_for(bad, max_steps=3, time_budget_s=30.0, generator=None)
    assert report["steps"] == 3 and report["skipped_nonfinite"] == 3 and report["updates"] == 0
    assert math.isnan(report["mean_loss"])
    assert not trainer.train_step(buf, torch.Generator().manual_seed(0))["skipped_nonfinite"]  # recovers


def test_train_for_limits_and_empty_buffer(setup):
    policy, seqs, draft = setup
    buf = _fill(FeatureBuffer(budget_bytes=10**7), policy, seqs, draft, soft=False)
    trainer = OnlineDraftTrainer(draft, OnlineDraftConfig(batch_size=4, ttt_steps=1))
    assert trainer.train_for(buf, max_steps=3, time_budget_s=60.0, generator=None)["steps"] == 3
    assert trainer.train_for(buf, max_steps=100, time_budget_s=0.0, generator=None)["steps"] == 0
    assert trainer.train_for(FeatureBuffer(10**6), max_steps=5, time_budget_s=60.0, generator=None)["steps"] == 0
    m = trainer.train_step(FeatureBuffer(10**6), None)
    assert m["skipped_empty"] and trainer.version == 3


def test_export_weights_is_a_detached_cpu_copy(setup):
    _, _, draft = setup
    trainer = OnlineDraftTrainer(draft, OnlineDraftConfig())
    w = trainer.export_weights()
    assert w.keys() == draft_state_dict_for_sglang(draft).keys()
    assert "fc.weight" in w and "d2t" in w and not any("embed" in k for k in w)
    assert all(t.device.type == "cpu" and not t.requires_grad for t in w.values())
    with torch.no_grad():
        draft.fc.weight.add_(1.0)
    assert not torch.equal(w["fc.weight"], draft.fc.weight)


def test_refuses_draft_that_owns_the_embedding(setup):
    _, _, draft = setup
    draft.register_parameter("leaked_embedding", draft.embed_tokens.weight)
    with pytest.raises(ValueError):
        OnlineDraftTrainer(draft, OnlineDraftConfig())


def test_state_dict_round_trip(setup):
    policy, seqs, draft = setup
    buf = _fill(FeatureBuffer(budget_bytes=10**7), policy, seqs, draft, soft=False)
    cfg = OnlineDraftConfig(batch_size=4, ttt_steps=2)
    trainer = OnlineDraftTrainer(draft, cfg)
    trainer.train_for(buf, max_steps=3, time_budget_s=60.0, generator=torch.Generator().manual_seed(0))
    sd = trainer.state_dict()
    torch.manual_seed(123)  # a differently initialised draft
    other = OnlineDraftTrainer(new_draft(policy, seqs, DraftTrainConfig(draft_vocab_size=64, ttt_steps=2, seed=9)), cfg)
    other.load_state_dict(sd)
    assert other.version == 3 and _same(_snapshot(other.draft), _snapshot(draft))
    trainer.train_step(buf, torch.Generator().manual_seed(7))
    other.train_step(buf, torch.Generator().manual_seed(7))
    assert _same(_snapshot(other.draft), _snapshot(draft))  # the optimizer moments came back too


def test_batch_size_bound_is_checked_before_any_allocation():
    with pytest.raises(ValueError, match=f"at most {OnlineDraftConfig.MAX_BATCH_SIZE}"):
        OnlineDraftConfig(batch_size=10**9)


def test_nan_weights_roll_back_to_the_last_finite_ones_and_training_resumes(setup):
    """One NaN in the trainer's draft: the next step rolls back (counted, one warning) and the
    steps after it update again; without rollback every later step would be skipped."""
    policy, seqs, draft = setup
    buf = _fill(FeatureBuffer(10**7), policy, seqs, draft, soft=True)
    tr = OnlineDraftTrainer(draft, OnlineDraftConfig(batch_size=8, snapshot_every=2))
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        assert not tr.train_step(buf, g)["skipped_nonfinite"]
    good = _snapshot(draft)  # snapshot_every=2: the copy after update 4 is these weights
    with torch.no_grad():
        draft.fc.weight[0, 0] = float("nan")
    with pytest.warns(RuntimeWarning, match="rolled back") as rec:
        m = tr.train_step(buf, g)
    assert len(rec) == 1 and len(str(rec[0].message).splitlines()) == 1
    assert m["rolled_back"] and m["skipped_nonfinite"] and tr.counters["rollbacks"] == 1
    assert _same(_snapshot(draft), good) and tr.weights_finite()
    version = tr.version
    for _ in range(3):
        m = tr.train_step(buf, g)
        assert not m["skipped_nonfinite"] and math.isfinite(m["draft_loss"])
    assert tr.version == version + 3 and tr.counters["rollbacks"] == 1


def test_an_update_that_makes_weights_nonfinite_is_undone(setup):
    policy, seqs, draft = setup
    buf = _fill(FeatureBuffer(10**7), policy, seqs, draft, soft=False)
    tr = OnlineDraftTrainer(draft, OnlineDraftConfig(batch_size=8))
    before = _snapshot(draft)
    tr.optimizer.param_groups[0]["lr"] = float("inf")
    tr.config.lr = float("inf")  # the step itself writes inf * update into the weights
    with pytest.warns(RuntimeWarning, match="update made its weights non-finite"):
        m = tr.train_step(buf, torch.Generator().manual_seed(0))
    assert m["rolled_back"] and tr.weights_finite() and _same(_snapshot(draft), before)


def test_load_state_dict_refuses_nan_draft_and_nan_moments(setup):
    policy, seqs, draft = setup
    buf = _fill(FeatureBuffer(10**7), policy, seqs, draft, soft=True)
    tr = OnlineDraftTrainer(draft, OnlineDraftConfig(batch_size=8))
    tr.train_step(buf, torch.Generator().manual_seed(0))
    sd = tr.state_dict()
    start = _snapshot(draft)
    bad = {**sd, "draft": {k: (v.clone().fill_(float("nan")) if v.is_floating_point() else v)
                           for k, v in sd["draft"].items()}}
    fresh = OnlineDraftTrainer(new_draft(policy, seqs, DraftTrainConfig(draft_vocab_size=64, ttt_steps=2)),
                               OnlineDraftConfig(batch_size=8))
    start = _snapshot(fresh.draft)
    with pytest.warns(RuntimeWarning, match="resumed draft state is unusable"):
        fresh.load_state_dict(bad)
    assert _same(_snapshot(fresh.draft), start) and fresh.counters["rollbacks"] == 1
    assert fresh.version == sd["version"] + 1
    assert not fresh.train_step(buf, torch.Generator().manual_seed(0))["skipped_nonfinite"]
    # finite weights with NaN optimizer moments: weights kept, AdamW restarted
    moments = {**sd, "optimizer": {**sd["optimizer"], "state": {
        k: {n: (t.clone().fill_(float("nan")) if torch.is_tensor(t) and t.is_floating_point() and t.dim() else t)
            for n, t in v.items()} for k, v in sd["optimizer"]["state"].items()}}}
    other = OnlineDraftTrainer(new_draft(policy, seqs, DraftTrainConfig(draft_vocab_size=64, ttt_steps=2)),
                               OnlineDraftConfig(batch_size=8))
    other.load_state_dict(moments)
    assert _same(_snapshot(other.draft), sd["draft"]) and not other.optimizer.state
    assert not other.train_step(buf, torch.Generator().manual_seed(0))["skipped_nonfinite"]


def test_step_time_is_saved_so_a_resume_budgets_like_the_run(setup):
    policy, seqs, draft = setup
    buf = _fill(FeatureBuffer(10**7), policy, seqs, draft, soft=True)
    tr = OnlineDraftTrainer(draft, OnlineDraftConfig(batch_size=8))
    tr.train_for(buf, 2, 60.0, torch.Generator().manual_seed(0))
    assert tr.step_seconds is not None
    other = OnlineDraftTrainer(new_draft(policy, seqs, DraftTrainConfig(draft_vocab_size=64, ttt_steps=2)),
                               OnlineDraftConfig(batch_size=8))
    other.load_state_dict(tr.state_dict())
    assert other.step_seconds == tr.step_seconds
    # a budget below the measured step time: neither starts a step (before the fix the resumed one did)
    budget = tr.step_seconds / 2
    assert tr.train_for(buf, 4, budget, None)["steps"] == 0
    assert other.train_for(buf, 4, budget, None)["steps"] == 0


def test_activation_bytes_count_each_storage_once_wherever_it_lies():
    """A new storage at an address an earlier one held (here two storages over one buffer, as when
    the allocator hands a freed storage's memory on) is counted; views of one storage are not."""
    from specrl.online_trainer import _SavedBytes

    memory = bytearray(4000)
    w = torch.ones(1000, requires_grad=True)
    hook = _SavedBytes([w])
    with hook:
        for _ in range(2):
            a = torch.frombuffer(memory, dtype=torch.float32)  # a new storage at the same address
            ((w * a).sum() + (w[:500] * a[500:]).sum()).backward()  # saves w (a parameter) and a, then views of them
    assert hook.nbytes == 2 * 4000


def test_activation_bytes_are_the_same_in_identical_steps(setup):
    policy, seqs, draft = setup
    buf = _fill(FeatureBuffer(10**7), policy, seqs, draft, soft=True)
    state = _snapshot(draft)
    figures = []
    for _ in range(2):
        draft.load_state_dict(state)
        tr = OnlineDraftTrainer(draft, OnlineDraftConfig(batch_size=8))
        figures.append([tr.train_step(buf, torch.Generator().manual_seed(i))["activation_bytes"] for i in range(3)])
    assert figures[0] == figures[1] and min(figures[0]) > 0


def test_a_burst_that_the_estimate_alone_shuts_says_so(setup):
    """`shut` tells the caller that only the step-time estimate kept the burst from starting (the
    co-trainer re-measures a stale one); no budget, an empty buffer or a burst that ran are not."""
    policy, seqs, draft = setup
    buf = _fill(FeatureBuffer(10**7), policy, seqs, draft, soft=False)
    tr = OnlineDraftTrainer(draft, OnlineDraftConfig(batch_size=4, ttt_steps=1))
    assert not tr.train_for(buf, 1, 60.0, None)["shut"]
    tr.step_seconds = 100.0
    assert tr.train_for(buf, 4, 30.0, None)["shut"]
    assert not tr.train_for(buf, 4, 0.0, None)["shut"]
    assert not tr.train_for(FeatureBuffer(10**6), 4, 300.0, None)["shut"]
