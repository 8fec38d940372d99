import pytest
import torch

from draft_models.train import _LOGP_FLOOR
from draft_models.vocab import build_draft_vocab, restrict_to_draft
from helpers import rows_held_as
from rollout.protocol import SpecStats, Trajectory
from specrl.buffer import FeatureBuffer
from target_training.grpo import GRPOConfig, GRPOTrainer

H3 = 12


def _record(T: int, marker: int = 0, vd: int | None = None, n_prompt: int = 1) -> dict:
    mask = torch.zeros(T, dtype=torch.bool)
    mask[n_prompt:] = True
    return {"input_ids": torch.full((T,), marker, dtype=torch.long), "features": torch.randn(T, H3),
            "target_logp": None if vd is None else torch.randn(T, vd).half(), "loss_mask": mask}


def _size(T: int, vd: int | None = None) -> int:  # int64 ids + fp16 features + bool mask (+ fp16 logp)
    return T * 8 + T * H3 * 2 + T + (0 if vd is None else T * vd * 2)


def _traj(P: int, n: int, accepted: int | None, drafted: int = 10, rid: int = 0) -> Trajectory:
    spec = None
    if accepted is not None:
        spec = SpecStats(verify_steps=3, drafted=drafted, accepted=accepted)
    return Trajectory(prompt_ids=list(range(3, 3 + P)), token_ids=[rid % 50 + 5] * n, logprobs=torch.zeros(n),
                      finish_reason="length", request_id=rid, features=torch.randn(P + n - 1, H3).half(), spec=spec)


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "100"])
def test_bad_budget_raises(bad):
    with pytest.raises(ValueError):
        FeatureBuffer(bad)


def test_budget_never_exceeded_and_bytes_accounted():
    g = torch.Generator().manual_seed(0)
    buf = FeatureBuffer(budget_bytes=_size(40) * 3 + 100)
    for i in range(200):
        T = int(torch.randint(3, 41, (1,), generator=g))
        vd = 8 if i % 3 == 0 else None
        buf.add(_record(T, i, vd), policy_version=int(torch.randint(0, 10, (1,), generator=g)))
        assert buf.nbytes <= buf.budget_bytes
        s = buf.stats()
        assert s["bytes"] == buf.nbytes
        assert s["entries"] == len(buf)
    stored = buf.sample(len(buf), None)
    assert sum(_size(r["input_ids"].numel(), None if r["target_logp"] is None else 8) for r in stored) == buf.nbytes
    assert buf.stats()["evicted"] > 0


def test_stalest_evicted_first():
    buf = FeatureBuffer(budget_bytes=_size(10) * 4)  # exactly four records of length 10
    for marker, version in [(0, 3), (1, 1), (2, 2), (3, 1)]:
        assert buf.add(_record(10, marker), version)

    def markers():
        return sorted(int(r["input_ids"][0]) for r in buf.sample(len(buf), torch.Generator().manual_seed(0)))

    buf.add(_record(10, 4), 4)
    assert markers() == [0, 2, 3, 4]  # lowest version, oldest insertion among equals (marker 1)
    buf.add(_record(10, 5), 4)
    assert markers() == [0, 2, 4, 5]  # then the other version-1 entry
    buf.add(_record(20, 6), 5)  # needs two slots: versions 2 then 3 go
    assert markers() == [4, 5, 6]
    assert buf.stats()["evicted"] == 4
    assert buf.stats()["version_min"] == 4 and buf.stats()["version_max"] == 5


def test_oversized_record_rejected_without_exception():
    buf = FeatureBuffer(budget_bytes=_size(10) * 2)
    buf.add(_record(10, 1), 0)
    assert buf.add(_record(50, 2), 7) is False
    assert buf.stats()["rejected_oversized"] == 1
    assert len(buf) == 1 and buf.nbytes == _size(10)  # nothing evicted for a record that can never fit


def test_add_trajectories_pads_features_and_weights_rejections():
    buf = FeatureBuffer(budget_bytes=10**6)
    trajs = [_traj(4, 6, accepted=2, rid=1), _traj(3, 5, accepted=None, rid=2)]
    trajs.append(Trajectory(prompt_ids=[3], token_ids=[4, 5], logprobs=torch.zeros(2), finish_reason="stop"))
    assert buf.add_trajectories(trajs, policy_version=5) == 2  # the one without features is skipped
    recs = sorted(buf.sample(2, torch.Generator().manual_seed(0)), key=lambda r: -r["input_ids"].numel())
    r = recs[0]
    assert r["input_ids"].tolist() == trajs[0].full_ids
    assert r["features"].shape == (10, H3) and r["features"].dtype == torch.float16
    assert torch.equal(r["features"][:9], trajs[0].features) and not r["features"][9].any()
    assert r["loss_mask"].tolist() == [False] * 4 + [True] * 6
    assert r["target_logp"] is None and r["policy_version"] == 5
    assert torch.allclose(r["weight_per_pos"], r["loss_mask"].float() * 0.8)  # 1 - 2/10 on the response
    assert recs[1]["weight_per_pos"] is None  # no acceptance statistics
    bad = _traj(4, 6, accepted=1)
    bad.features = bad.features[:-1]
    with pytest.raises(ValueError):
        buf.add_trajectories([bad], 0)


def test_sampling_prefers_rejected_sequences():
    buf = FeatureBuffer(budget_bytes=10**6)
    rejected = [_traj(3, 5, accepted=2, rid=i) for i in range(5)]  # rejection rate 0.8
    accepted = [_traj(3, 5, accepted=10, rid=10 + i) for i in range(5)]  # rate 0: every draft accepted
    buf.add_trajectories(rejected + accepted, policy_version=0)
    is_rej = {tuple(t.full_ids): True for t in rejected} | {tuple(t.full_ids): False for t in accepted}

    def frac_rejected(prefer):
        recs = buf.sample(4000, torch.Generator().manual_seed(1), prefer_rejected=prefer)
        return sum(is_rej[tuple(r["input_ids"].tolist())] for r in recs) / len(recs)

    assert frac_rejected(1.0) == 1.0  # zero rejection, zero weight
    assert abs(frac_rejected(0.0) - 0.5) < 0.05
    assert abs(frac_rejected(0.5) - 0.75) < 0.05
    few = buf.sample(5, torch.Generator().manual_seed(2), prefer_rejected=1.0)  # without replacement
    assert sorted(int(r["input_ids"][-1]) for r in few) == sorted(t.token_ids[0] for t in rejected)


def test_sample_min_version_and_empty():
    buf = FeatureBuffer(budget_bytes=10**6)
    assert buf.sample(3, None) == []
    for v in range(4):
        buf.add(_record(6, v), v)
    recs = buf.sample(50, torch.Generator().manual_seed(0), min_version=2)
    assert {r["policy_version"] for r in recs} == {2, 3}
    assert buf.sample(5, None, min_version=9) == []


def test_trainer_forward_source_trims_padding(tiny_model, tiny_cfg):
    torch.manual_seed(0)
    B, T = 3, 10
    ids = torch.randint(3, 64, (B, T))
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, 4:10] = True  # full row
    mask[1, 2:6] = True  # right padding after position 5 -> length 6
    # row 2: no response token -> skipped
    ids[1, 6:] = 0
    d2t, _ = build_draft_vocab([ids.reshape(-1)], 64, 16)
    layers = tiny_cfg.feature_layer_ids
    out = tiny_model(ids, tap_layers=layers)
    feats = out.features(layers)
    buf = FeatureBuffer(budget_bytes=10**6)
    assert buf.add_from_trainer_forward(ids, feats, out.logits, mask, d2t, policy_version=3) == 2
    assert buf.stats()["skipped_empty"] == 1
    recs = sorted(buf.sample(2, torch.Generator().manual_seed(0)), key=lambda r: -r["input_ids"].numel())
    expected_logp = restrict_to_draft(torch.log_softmax(out.logits.float(), -1), d2t).clamp_min(_LOGP_FLOOR).half()
    for b, (r, n) in enumerate(zip(recs, (10, 6))):
        assert r["input_ids"].shape == (n,) and torch.equal(r["input_ids"], ids[b, :n])
        assert r["features"].shape == (n, 3 * tiny_cfg.hidden_size) and r["features"].dtype == torch.float16
        assert torch.equal(r["features"], feats[b, :n].detach().half())
        assert r["target_logp"].shape == (n, 16) and r["target_logp"].dtype == torch.float16
        assert torch.allclose(r["target_logp"].float(), expected_logp[b, :n].float(), atol=5e-3)
        assert torch.equal(r["loss_mask"], mask[b, :n]) and r["policy_version"] == 3
        assert not r["features"].requires_grad
    buf2 = FeatureBuffer(budget_bytes=10**6)
    buf2.add_from_trainer_forward(ids, feats, None, mask, d2t, policy_version=0)
    assert all(r["target_logp"] is None for r in buf2.sample(2, None))


def test_a_held_out_prompt_is_never_trained_on_from_either_source(tiny_model, tiny_cfg):
    """GRPO groups: 4 prompts, 4 answers each, rows grouped by prompt. The answers to a held-out
    prompt are all kept out of training: 2 of them measure drafts (heldout_per_prompt), the other
    2 are dropped, and none of its answers is trained on, so the held-out value does not read a
    draft's memory of sibling answers. The same prompts at the next policy version (a later
    epoch) are split the same way, and the engine's trajectories of a held-out prompt are not
    stored either."""
    P, T, G = 5, 12, 4
    buf = FeatureBuffer(budget_bytes=10**7, heldout_every=2, heldout_records=16, heldout_per_prompt=2)
    gen = torch.Generator().manual_seed(5)
    prompts = rows_held_as([True, False, True, False], buf.heldout_prompt, P, P, gen)
    ids = torch.cat([torch.cat([p.expand(G, P), torch.randint(3, 64, (G, T - P), generator=gen)], 1) for p in prompts])
    mask = torch.zeros(len(ids), T, dtype=torch.bool)
    mask[:, P:] = True
    d2t, _ = build_draft_vocab([ids.reshape(-1)], 64, 16)
    layers = tiny_cfg.feature_layer_ids
    out = tiny_model(ids, tap_layers=layers)
    held_keys = {tuple(prompts[i].tolist()) for i in (0, 2)}
    for version in (0, 1):
        stored = buf.add_from_trainer_forward(ids, out.features(layers), out.logits, mask, d2t, policy_version=version)
        assert stored == 2 * G and len(buf.heldout) == 4 * (version + 1)
        assert buf.counters["skipped_heldout"] == 4 * (version + 1)
        assert {tuple(r["input_ids"][:P].tolist()) for r in buf.heldout} == held_keys
        trained = {tuple(e["input_ids"][:P].tolist()) for e in buf._entries.values()}
        assert trained == {tuple(prompts[i].tolist()) for i in (1, 3)}  # no answer to a held-out prompt
    trajs = [Trajectory(prompt_ids=prompts[i].tolist(), token_ids=[7, 8, 9], logprobs=torch.zeros(3),
                        finish_reason="length", features=torch.randn(P + 2, H3).half()) for i in range(4)]
    assert buf.add_trajectories(trajs, policy_version=2) == 2 and buf.counters["skipped_heldout"] == 10


@pytest.mark.parametrize("heldout_only", [False, True])
def test_logits_at_the_answer_positions_give_the_soft_targets_full_logits_give_where_they_are_read(
        tiny_model, tiny_cfg, heldout_only):
    """The trainer's forward computes logits at the answer positions only, (N, V): the stored soft
    targets equal the full-logit ones wherever the draft's loss and the held-out measure read them
    (positions whose next token is an answer token), hold the floor elsewhere, and the held-out
    rows (a frozen draft's only ones) pick the right rows' logits."""
    from target_training.grpo import logit_positions

    torch.manual_seed(3)
    B, T = 5, 11
    mask = torch.zeros(B, T, dtype=torch.bool)
    held = FeatureBuffer(budget_bytes=1, heldout_every=2).heldout_prompt
    gen = torch.Generator().manual_seed(3)
    ids = torch.cat([rows_held_as([b % 2 == 0], held, T, lo, gen)  # rows 0, 2 and 4 held out
                     for b, (lo, _) in enumerate([(4, 11), (2, 6), (5, 9), (3, 11), (6, 8)])])
    for b, (lo, hi) in enumerate([(4, 11), (2, 6), (5, 9), (3, 11), (6, 8)]):
        mask[b, lo:hi] = True
    d2t, _ = build_draft_vocab([ids.reshape(-1)], 64, 16)
    layers = tiny_cfg.feature_layer_ids
    with torch.no_grad():
        full = tiny_model(ids, tap_layers=layers)
        compact = tiny_model(ids, tap_layers=layers, logits_at=logit_positions(mask))
    bufs = []
    for out in (full, compact):
        buf = FeatureBuffer(budget_bytes=10**6, heldout_every=2, heldout_records=8)
        buf.heldout_only = heldout_only
        buf.add_from_trainer_forward(ids, out.features(layers), out.logits, mask, d2t, policy_version=1)
        bufs.append(buf)
    pairs = list(zip(bufs[0].heldout, bufs[1].heldout))
    if not heldout_only:
        pairs += list(zip(bufs[0].sample(len(bufs[0]), torch.Generator().manual_seed(0)),
                          bufs[1].sample(len(bufs[1]), torch.Generator().manual_seed(0))))
    assert len(bufs[1].heldout) == 3 and len(pairs) == (3 if heldout_only else 5)
    for a, b in pairs:
        assert torch.equal(a["input_ids"], b["input_ids"])
        read = torch.zeros_like(a["loss_mask"])
        read[:-1] = a["loss_mask"][1:]
        assert torch.allclose(a["target_logp"][read].float(), b["target_logp"][read].float(), atol=1e-3)
        assert (b["target_logp"][~read].float() == _LOGP_FLOOR).all()
    with pytest.raises(ValueError, match="answer positions"):
        bufs[1].add_from_trainer_forward(ids, compact.features(layers), compact.logits[:-1], mask, d2t, 1)


def test_logprob_hook_on_grpo_trainer(tiny_model, tiny_cfg):
    """Wired as a GRPOTrainer log-prob hook, the buffer fills from the trainer's own forward."""
    buf = FeatureBuffer(budget_bytes=10**6)
    trainer = GRPOTrainer(tiny_model, GRPOConfig())
    d2t, _ = build_draft_vocab([list(range(64))], 64, 32)
    trainer.tap_layers = tiny_cfg.feature_layer_ids
    trainer.logprob_hooks.append(buf.logprob_hook(trainer.tap_layers, d2t, lambda: trainer.step_count))
    ids = torch.randint(3, 64, (2, 8))
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[:, 3:7] = True
    trainer.forward_logprobs(ids, mask)
    assert len(buf) == 2 and all(r["input_ids"].numel() == 7 for r in buf.sample(2, None))
    assert buf.stats()["with_soft_targets"] == 2


def test_state_dict_round_trip():
    buf = FeatureBuffer(budget_bytes=_size(10) * 3, seed=4)
    for i in range(5):
        buf.add(_record(10, i), i)
    buf.add(_record(99, 9), 9)
    meta = buf.state_dict()
    assert "entries" not in meta and meta["versions"] == [2, 3, 4]
    full = buf.state_dict(include_tensors=True)
    other = FeatureBuffer(budget_bytes=1)
    other.load_state_dict(full)
    assert other.stats() == buf.stats()
    a = buf.sample(6, torch.Generator().manual_seed(3))
    b = other.sample(6, torch.Generator().manual_seed(3))
    assert [r["input_ids"].tolist() for r in a] == [r["input_ids"].tolist() for r in b]
    assert all(torch.equal(x["features"], y["features"]) for x, y in zip(a, b))
    light = FeatureBuffer(budget_bytes=1)
    light.load_state_dict(meta)
    assert len(light) == 0 and light.counters == buf.counters and light.seed == 4
    assert light.budget_bytes == buf.budget_bytes


def _held_bytes(buf: FeatureBuffer) -> int:
    """Bytes of the distinct storages the buffer's records keep alive."""
    storages = {}
    for e in buf._entries.values():
        for k in ("input_ids", "features", "target_logp", "loss_mask", "weight_per_pos"):
            t = e[k]
            if t is not None:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("feature_dtype", [torch.float16, torch.float32])
def test_reported_bytes_equal_held_bytes_with_mixed_lengths(feature_dtype):
    """One long and fifteen short responses in a batch, features already fp16 (or fp32, cast on
    store): the records must not keep views of the whole batch tensors alive."""
    torch.manual_seed(0)
    B, T, vd = 16, 300, 24
    ids = torch.randint(3, 64, (B, T))
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, 4:T] = True  # the long response
    mask[1:, 4:12] = True  # fifteen short ones
    feats = torch.randn(B, T, 3 * 16).to(feature_dtype)
    logits = torch.randn(B, T, 64)
    d2t, _ = build_draft_vocab([ids.reshape(-1)], 64, vd)
    buf = FeatureBuffer(budget_bytes=10**8)
    assert buf.add_from_trainer_forward(ids, feats, logits, mask, d2t, policy_version=0) == B
    w = torch.rand(B, T)
    for b in range(4):  # direct adds of row views, with per-position weights
        n = 20 + b
        buf.add({"input_ids": ids[b, :n], "features": feats[b, :n].half(), "loss_mask": mask[b, :n],
                 "target_logp": None}, 1, weight_per_pos=w[b, :n])
    held = _held_bytes(buf)
    assert abs(held - buf.nbytes) <= 0.01 * held, (held, buf.nbytes)
