"""EAGLE-3 draft head: layout, vocabulary maps, cache consistency, TTT semantics, training."""
from __future__ import annotations

import copy

import pytest
import torch
from helpers import SGLANG_KEYS

from draft_models.config import Eagle3Config, Eagle3ConfigError
from draft_models.eagle3 import Eagle3Draft
from draft_models.train import capture_features, train_offline
from draft_models.ttt import ttt_loss, ttt_unroll
from draft_models.vocab import (build_draft_vocab, draft_logits_to_target, restrict_logprobs, restrict_probs,
                                target_to_draft_ids)
from target_training.config import model_config_for

V, VD = 64, 40


pytestmark = pytest.mark.usefixtures("one_thread")



def make_pair(seed: int = 0, draft_vocab: int = VD):
    torch.manual_seed(seed)
    target = model_config_for("tiny", V).build().eval()
    draft = Eagle3Config.for_target(target.cfg, draft_vocab).build(target.embed_tokens)
    d2t, t2d = build_draft_vocab(torch.randint(0, 1000, (V,)), V, draft_vocab, always_include=(0, 1))
    draft.set_vocab(d2t, t2d)
    with torch.no_grad():  # larger weights than the init so that outputs differ visibly
        for p in draft.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    return target, draft.eval()


def target_inputs(target, B, T, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    with torch.no_grad():
        out = target(ids, tap_layers=target.cfg.feature_layer_ids)
    return ids, out.features(target.cfg.feature_layer_ids), torch.log_softmax(out.logits, -1)


def test_parameter_names_match_sglang_layout_and_embedding_is_not_owned():
    target, draft = make_pair()
    assert isinstance(draft, Eagle3Draft)
    assert set(draft.state_dict()) == SGLANG_KEYS
    names = {n for n, _ in draft.named_parameters()}
    assert names == SGLANG_KEYS - {"d2t", "t2d"}
    target_ptrs = {p.data_ptr() for p in target.parameters()}
    assert not any(p.data_ptr() in target_ptrs for p in draft.parameters())
    assert draft.embed_tokens is target.embed_tokens  # by reference
    assert copy.deepcopy(draft).embed_tokens is target.embed_tokens  # snapshots keep the reference
    assert target.embed_tokens.weight.requires_grad  # the policy's embedding is untouched
    assert draft.fc.weight.shape == (64, 3 * 64)
    assert draft.midlayer.self_attn.q_proj.weight.shape[1] == 2 * 64
    assert draft.lm_head.weight.shape == (VD, 64)
    assert draft.d2t.dtype == torch.long and draft.t2d.dtype == torch.bool


def test_config_sglang_round_trip_and_validation():
    target, draft = make_pair()
    d = draft.cfg.to_sglang_config(torch_dtype="bfloat16")
    assert d["architectures"] == ["LlamaForCausalLMEagle3"] and d["model_type"] == "llama"
    assert d["num_hidden_layers"] == 1 and d["tie_word_embeddings"] is False and d["hidden_act"] == "silu"
    assert d["vocab_size"] == V and d["draft_vocab_size"] == VD and d["target_hidden_size"] == 64
    assert d["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(target.cfg.feature_layer_ids)
    assert d["torch_dtype"] == "bfloat16" and d["num_key_value_heads"] == target.cfg.num_kv_heads
    assert Eagle3Config.from_sglang_config(d) == draft.cfg
    with pytest.raises(Eagle3ConfigError, match="hidden_size"):
        Eagle3Config.for_target(target.cfg, VD, hidden_size=0)
    with pytest.raises(Eagle3ConfigError, match="num_kv_heads"):
        Eagle3Config.for_target(target.cfg, VD, num_kv_heads=3)
    with pytest.raises(Eagle3ConfigError, match="draft_vocab_size"):
        Eagle3Config.for_target(target.cfg, V + 1)
    with pytest.raises(Eagle3ConfigError, match="ttt_decay"):
        Eagle3Config.for_target(target.cfg, VD, ttt_decay=0.0)


def test_draft_vocab_maps():
    seqs = [[5, 5, 5, 9, 9, 2], [9, 7, 5, 9]]
    d2t, t2d = build_draft_vocab(seqs, 12, 4, always_include=(11,))
    chosen = torch.arange(4) + d2t
    # counts: 5 -> 4, 9 -> 4, 2 -> 1, 7 -> 1; 11 forced; the last slot goes to the lower tied id.
    assert chosen.tolist() == [2, 5, 9, 11]
    d2t2, _ = build_draft_vocab(seqs, 12, 4)
    assert (torch.arange(4) + d2t2).tolist() == [2, 5, 7, 9]
    assert t2d.tolist() == [i in (2, 5, 9, 11) for i in range(12)]
    logits = torch.randn(3, 4)
    full = draft_logits_to_target(logits, d2t, 12)
    assert torch.equal(full[:, chosen], logits) and torch.isinf(full[:, ~t2d]).all()
    assert target_to_draft_ids(torch.tensor([5, 6, 11]), t2d).tolist() == [1, -1, 3]
    logp = torch.log_softmax(torch.randn(2, 12), -1)
    r = restrict_logprobs(logp, d2t)
    assert torch.allclose(r.exp().sum(-1), torch.ones(2))
    assert torch.allclose(restrict_probs(logp.exp(), d2t), r.exp(), atol=1e-6)
    counts = torch.zeros(12, dtype=torch.long)
    counts[[3, 4]] = 10
    assert (torch.arange(2) + build_draft_vocab(counts, 12, 2)[0]).tolist() == [3, 4]


def test_forward_alignment_causality_and_fc_switch():
    target, draft = make_pair()
    ids, feats, _ = target_inputs(target, 2, 10)
    x, h = ids[:, 1:], feats[:, :-1]  # draft position t: feature t with token t+1
    pre, logits = draft(x, h)
    assert pre.shape == (2, 9, 64) and logits.shape == (2, 9, VD)
    x2 = x.clone()
    x2[:, 6] = (x2[:, 6] + 1) % V
    pre2, _ = draft(x2, h)
    assert torch.equal(pre2[:, :6], pre[:, :6]) and not torch.allclose(pre2[:, 6], pre[:, 6])
    # own outputs (width H) skip fc; a fused feature goes through it
    pre3, _ = draft(x, draft.fc(h))
    assert torch.allclose(pre3, pre, atol=1e-6)
    with pytest.raises(ValueError, match="width"):
        draft(x, h[..., :10])
    tl = draft.to_target_logits(logits)
    assert tl.shape == (2, 9, V) and torch.equal(tl.argmax(-1), draft.d2t[logits.argmax(-1)] + logits.argmax(-1))


def test_cache_incremental_equals_full_forward_with_ragged_rollback_and_tree():
    target, draft = make_pair()
    ids, feats, _ = target_inputs(target, 2, 13)
    x, h = ids[:, 1:], feats[:, :-1]
    T = x.shape[1]
    with torch.no_grad():
        full_pre, full_logits = draft(x, h)
        cache = draft.new_cache(2, 32)
        # ragged: row 0 prefills 5 then goes one by one, row 1 prefills 8; garbage then rollback
        p0, _ = draft(x[:1, :5], h[:1, :5], cache=cache, slots=torch.tensor([0]))
        p1, _ = draft(x[1:, :8], h[1:, :8], cache=cache, slots=torch.tensor([1]))
        assert (full_pre[0, :5] - p0[0]).abs().max() < 1e-5 and (full_pre[1, :8] - p1[0]).abs().max() < 1e-5
        draft(torch.zeros(2, 3, dtype=torch.long), torch.randn(2, 3, 64), cache=cache)  # junk, both rows
        cache.rollback(torch.tensor([0, 1]), torch.tensor([5, 8]))
        outs = {0: [], 1: []}
        for step in range(8):
            for row, start in ((0, 5), (1, 8)):
                t = start + step
                if t >= T:
                    continue
                pre, lg = draft(x[row:row + 1, t:t + 1], h[row:row + 1, t:t + 1], cache=cache,
                                slots=torch.tensor([row]))
                assert (pre[0, 0] - full_pre[row, t]).abs().max() < 1e-5
                assert (lg[0, 0] - full_logits[row, t]).abs().max() < 1e-5
                outs[row].append(t)
        assert outs[0][-1] == T - 1 and cache.lengths.tolist() == [T, T]
        # tree block: after the 6-long prefix, two siblings (each sees prefix + itself) equal
        # appending either one alone; an explicit causal mask equals the default
        tree = torch.tensor([[True, False], [False, True]])[None].expand(2, 2, 2)
        cache.rollback(torch.tensor([0, 1]), torch.tensor([6, 6]))
        pre_tree, _ = draft(x[:, 6:8], h[:, 6:8], cache=cache, attn_mask=tree,
                            positions=torch.full((2, 2), 6))  # siblings share their depth's RoPE position
        cache.rollback(torch.tensor([0, 1]), torch.tensor([6, 6]))
        pre_b, _ = draft(x[:, 7:8], h[:, 7:8], cache=cache)
        assert (pre_tree[:, 1] - pre_b[:, 0]).abs().max() < 1e-5
        assert (pre_tree[:, 0] - full_pre[:, 6]).abs().max() < 1e-5
        causal = torch.ones(T, T, dtype=torch.bool).tril().expand(2, T, T)
        assert torch.allclose(draft(x, h, attn_mask=causal)[0], full_pre, atol=1e-6)


def test_feed_with_last_writes_every_key_and_outputs_the_last_position_only():
    """`last`: the catch-up feed after plain decoding steps writes the keys and values of the
    whole run but runs attention, MLP and head at each row's last position: its outputs equal the
    full forward's there, and the cache it leaves drafts exactly as the full feed's does."""
    target, draft = make_pair()
    ids, feats, _ = target_inputs(target, 2, 13)
    x, h = ids[:, 1:], feats[:, :-1]
    with torch.no_grad():
        full_pre, full_logits = draft(x, h)
        caches = []
        for last in (None, torch.tensor([5, 8])):  # row 0 feeds 6 real positions, row 1 feeds 9
            cache = draft.new_cache(2, 32)
            draft(x[:, :3], h[:, :3], cache=cache)  # a prefix already in the draft cache
            pre, lg = draft(x[:, 3:12], h[:, 3:12], cache=cache, last=last)
            cache.rollback(torch.tensor([0, 1]), torch.tensor([9, 12]))  # padding dropped, as the engine does
            caches.append(cache)
        assert pre.shape[:2] == (2, 1) and lg.shape[:2] == (2, 1)
        for row, t in ((0, 8), (1, 11)):
            assert (pre[row, 0] - full_pre[row, t]).abs().max() < 1e-5
            assert (lg[row, 0] - full_logits[row, t]).abs().max() < 1e-5
        # the next draft step reads the same keys either way
        nxt = [draft(torch.tensor([[5], [7]]), h[:, 11:12], cache=c, slots=torch.tensor([0, 1]))[0] for c in caches]
        assert (nxt[0] - nxt[1]).abs().max() < 1e-6
    with pytest.raises(ValueError, match="last needs a cache"):
        draft(x, h, last=torch.tensor([1, 2]))


def test_ttt_steps_equal_chained_inference_with_cache():
    """Step k at row t of TTT == inference that ran step 0 over rows 0..t, then k chained steps,
    each appending one entry at the next cache position and feeding its pre-norm output back
    (tokens teacher-forced to x_{t+1+k}). Checked for every row t via cache rollback."""
    target, draft = make_pair()
    ids, feats, _ = target_inputs(target, 2, 11)
    B, T = ids.shape
    K = 4
    with torch.no_grad():
        outs = ttt_unroll(draft, feats, ids, steps=K)
        x0 = torch.cat([ids[:, 1:], torch.zeros(B, 1, dtype=torch.long)], 1)
        assert torch.allclose(outs[0][1], draft(x0, feats)[1], atol=1e-6)  # step 0 == plain causal forward
        cache = draft.new_cache(B, T + K)
        checked = 0
        for t in range(T - 1 - K + 1):
            # step 0 over the whole sequence (the chained steps of the previous t overwrote
            # entries), then keep the prefix 0..t: what inference holds after verifying x_{t+1}
            cache.reset(torch.arange(B))
            pre0, _ = draft(x0, feats, cache=cache)
            cache.rollback(torch.arange(B), torch.full((B,), t + 1))
            hid = pre0[:, t:t + 1]
            for k in range(1, K):
                if t + 1 + k >= T:
                    break
                hid, lg = draft(ids[:, t + 1 + k: t + 2 + k], hid, cache=cache)
                assert (lg[:, 0] - outs[k][1][:, t]).abs().max() < 1e-5, (t, k)
                assert (hid[:, 0] - outs[k][0][:, t]).abs().max() < 1e-5, (t, k)
                checked += 1
        assert checked >= 15


def test_ttt_loss_targets_masks_and_gradient_isolation():
    target, draft = make_pair()
    ids, feats, logp = target_inputs(target, 2, 12)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[:, :3] = False  # a prompt
    loss_full, m_full = ttt_loss(draft, feats, ids, logp, mask, steps=3)
    restricted = logp[..., torch.arange(VD) + draft.d2t]  # what capture_features stores
    loss_r, m_r = ttt_loss(draft, feats, ids, restricted, mask, steps=3)
    assert torch.allclose(loss_full, loss_r, atol=1e-5) and m_full["n_0"] == 2 * 9 and m_full["n_2"] == 2 * 8  # tokens 4..11
    assert abs(m_full["accept_1"] - m_r["accept_1"]) < 1e-6
    # weights: 1 + 0.8 + 0.64 of the per-step cross-entropies
    want = sum(draft.cfg.ttt_decay ** k * m_full[f"ce_{k}"] for k in range(3))
    assert abs(loss_full.item() - want) < 1e-4
    loss_a, m_a = ttt_loss(draft, feats, ids, logp, mask, steps=3, acceptance_weight=0.5)
    want_a = want - 0.5 * sum(draft.cfg.ttt_decay ** k * m_full[f"accept_{k}"] for k in range(3))
    assert abs(loss_a.item() - want_a) < 1e-4
    zero, m0 = ttt_loss(draft, feats, ids, logp, torch.zeros_like(mask), steps=2)
    assert zero.item() == 0.0 and m0["n_0"] == 0
    # hard labels; gradients reach only the draft
    feats_g = feats.clone().requires_grad_(True)
    loss_h, m_h = ttt_loss(draft, feats_g, ids, None, mask, steps=3)
    assert 0.0 <= m_h["acc_0"] <= 1.0
    target.zero_grad(set_to_none=True)
    (loss_h + loss_full).backward()
    assert all(p.grad is None for p in target.parameters())
    assert feats_g.grad is None
    assert all(p.grad is not None for p in draft.parameters())


def test_prompt_rows_are_skipped_without_changing_the_loss_its_gradient_or_the_expected_accept_length(monkeypatch):
    """ttt_loss and expected_accept_length compute only the rows some loss reads (from
    first_needed_row: the batch's first answer token minus 1 + steps). On prompts of different
    lengths, the loss, every gradient and the expected accept length equal the full computation
    (first_needed_row planted to 0) to float rounding; a start one row later than the bound loses
    a counted row, and the comparison sees it."""
    import draft_models.ttt as ttt

    target, draft = make_pair()
    ids, feats, logp = target_inputs(target, 3, 24)
    restricted = logp[..., torch.arange(VD) + draft.d2t]
    mask = torch.zeros(3, 24, dtype=torch.bool)
    for b, p in enumerate((9, 12, 15)):  # prompts of 9, 12, 15 tokens, then the answer
        mask[b, p:] = True
    steps = 3
    assert ttt.first_needed_row(mask, steps) == 9 - 1 - steps and ttt.first_needed_row(mask[:, :0], 2) == 0

    def run(start_rule):
        monkeypatch.setattr(ttt, "first_needed_row", start_rule)
        draft.zero_grad(set_to_none=True)
        loss, metrics = ttt.ttt_loss(draft, feats, ids, restricted, mask, steps=steps, acceptance_weight=0.3)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in draft.named_parameters()}
        return loss.item(), metrics, grads, ttt.expected_accept_length(draft, feats, ids, restricted, mask, 4)

    bound = ttt.first_needed_row
    full = run(lambda m, k: 0)
    skipped = run(bound)
    assert abs(full[0] - skipped[0]) < 1e-5 and full[1]["n_2"] == skipped[1]["n_2"]
    assert all(torch.allclose(full[2][n], g, atol=1e-6, rtol=1e-4) for n, g in skipped[2].items())
    assert abs(full[3][0] - skipped[3][0]) < 1e-5 and full[3][0] > 1.0
    late = run(lambda m, k: bound(m, k) + 1)  # a planted off-by-one drops row 5 of step 2
    assert late[1]["n_2"] == full[1]["n_2"] - 1 and abs(late[0] - full[0]) > 1e-4


def test_expected_accept_sums_combine_to_the_measurement_of_all_sequences_together():
    """Per-sequence sums (what the co-trainer keeps for the serving draft) measured in separate
    batches give the same E and per-depth acceptance as one measurement of all the sequences."""
    from draft_models.ttt import expected_accept_length, expected_accept_sums, mean_accept_length

    target, draft = make_pair()
    ids, feats, logp = target_inputs(target, 4, 20)
    restricted = logp[..., torch.arange(VD) + draft.d2t]
    mask = torch.zeros(4, 20, dtype=torch.bool)
    for b, p in enumerate((4, 6, 8, 20)):  # the last sequence has no answer token: no verify step counts in it
        mask[b, p:] = True
    whole = expected_accept_length(draft, feats, ids, restricted, mask, 3)
    parts = [s for lo, hi in ((0, 1), (1, 4)) for s in
             expected_accept_sums(draft, feats[lo:hi], ids[lo:hi], restricted[lo:hi], mask[lo:hi], 3)]
    assert parts[3][-1] == 0 and parts[0][-1] == 20 - 2 - 2
    e, depth = mean_accept_length(parts)
    assert abs(e - whole[0]) < 1e-5 and all(abs(a - b) < 1e-5 for a, b in zip(depth, whole[1]))
    assert mean_accept_length(parts[3:])[0] != mean_accept_length(parts[3:])[0]  # no row: NaN


def test_paired_gain_is_the_difference_of_the_means_and_its_error_covers_the_true_gain():
    """paired_gain: the gain is exactly one mean_accept_length less the other; over 4000 simulated
    held-out slices (16 sequences of 10-40 rows, per-row differences of mean 0.05 and spread 0.5)
    the gain +- 2.131 standard errors (Student's t, 15 degrees of freedom: 16 sequences) covers
    0.05 in 95% of them (binomial SE 0.35%); sums of different rows are refused."""
    import random

    from draft_models.ttt import mean_accept_length, paired_gain

    a = [[30.0, 5.0, 4.0, 10.0], [12.0, 2.0, 1.0, 6.0], [0.0, 0.0, 0.0, 0.0]]
    b = [[25.0, 4.0, 3.0, 10.0], [13.0, 2.0, 2.0, 6.0], [0.0, 0.0, 0.0, 0.0]]
    gain, se = paired_gain(a, b)
    assert gain == pytest.approx(mean_accept_length(a)[0] - mean_accept_length(b)[0]) and se > 0
    with pytest.raises(ValueError, match="same sequences"):
        paired_gain(a, [[25.0, 4.0, 3.0, 9.0], *b[1:]])
    assert paired_gain(a[:1], b[:1]) == (0.5, 0.0)
    rng = random.Random(0)
    covered, trials = 0, 4000
    for _ in range(trials):
        sa, sb = [], []
        for _ in range(16):
            n = rng.randint(10, 40)
            base = [rng.uniform(1.0, 6.0) for _ in range(n)]
            d = [rng.gauss(0.05, 0.5) for _ in range(n)]
            sa.append([sum(x + y for x, y in zip(base, d)), 0.0, n])
            sb.append([sum(base), 0.0, n])
        gain, se = paired_gain(sa, sb)
        covered += abs(gain - 0.05) <= 2.131 * se
    assert 0.935 <= covered / trials <= 0.965


def _periodic_sequences(n: int, T: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(n):
        period = 3 + i % 4
        pattern = (torch.randperm(V - 8, generator=g)[:period] + 8).tolist()
        seqs.append([1] + [pattern[j % period] for j in range(T - 1)])
    return seqs


def test_train_offline_learns_a_random_target_on_repeating_sequences():
    torch.manual_seed(0)
    target = model_config_for("tiny", V).build().eval()
    with torch.no_grad():  # a random but confident target (a trained policy is peaked, not uniform)
        target.lm_head.weight.mul_(100.0)
    seqs = _periodic_sequences(6, 24)
    d2t, t2d = build_draft_vocab(seqs, V, 48, always_include=(0, 1))
    draft = Eagle3Config.for_target(target.cfg, 48, ttt_steps=2).build(target.embed_tokens)
    draft.set_vocab(d2t, t2d)
    masks = [[0] * 4 + [1] * 20 for _ in seqs]
    data = capture_features(target, seqs, masks, batch_size=4, d2t=draft.d2t)
    assert data[0]["features"].dtype == torch.bfloat16 and data[0]["target_logp"].dtype == torch.float16
    assert data[0]["target_logp"].shape == (24, 48) and data[0]["features"].shape == (24, 192)
    assert data[0]["loss_mask"].tolist() == [False] * 4 + [True] * 20
    target.zero_grad(set_to_none=True)
    hist = train_offline(draft, data, steps=60, lr=5e-3, batch_size=4, seed=0)
    assert all(p.grad is None for p in target.parameters())
    first = sum(h["loss"] for h in hist[:5]) / 5
    last = sum(h["loss"] for h in hist[-5:]) / 5
    assert last < 0.3 * first, (first, last)
    acc0 = sum(h["acc_0"] for h in hist[-5:]) / 5
    assert acc0 > 0.9, [h["acc_0"] for h in hist[-5:]]
    assert sum(h["acc_1"] for h in hist[-5:]) / 5 > 0.7


def test_expected_accept_length_is_the_chained_product_of_per_step_acceptance(monkeypatch):
    """draft_models.ttt.expected_accept_length on planted draft outputs: a draft equal to the
    target accepts every proposal inside the answer (E_t = 1 + the answer tokens left, up to
    gamma); a uniform draft accepts sum_x min(p, 1/V) per step, chained as 1 + a + a^2 + ...;
    greedy counts argmax agreements. Rows are those whose first proposal is an answer token."""
    from types import SimpleNamespace

    import torch

    import draft_models.ttt as ttt

    B, T, V, gamma = 1, 8, 4, 3
    logp = torch.log_softmax(torch.tensor([[2.0, 0.0, 0.0, 0.0]]).expand(B, T, V).clone(), -1)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[:, 3:] = True  # answer tokens x_3..x_7
    draft = SimpleNamespace(cfg=SimpleNamespace(draft_vocab_size=V))
    ids, feats = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, 6)

    def planted(logits):
        monkeypatch.setattr(ttt, "ttt_unroll", lambda d, f, i, steps, start=0: [(None, logits[:, start:])] * steps)

    planted(logp.clone())  # q = p
    e, depth = ttt.expected_accept_length(draft, feats, ids, logp, mask, gamma)
    # rows t = 1..5 (first proposal x_{t+2} in the answer); steps left inside the sequence: min(gamma, T-2-t)
    assert e == pytest.approx(sum(1 + min(gamma, T - 2 - t) for t in range(1, 6)) / 5)
    planted(torch.zeros(B, T, V))  # uniform q
    a = float(torch.minimum(logp[0, 0].exp(), torch.full((V,), 1 / V)).sum())
    e, _ = ttt.expected_accept_length(draft, feats, ids, logp, mask, gamma)
    want = [1 + sum(a ** (k + 1) for k in range(min(gamma, T - 2 - t))) for t in range(1, 6)]
    assert e == pytest.approx(sum(want) / 5)
    wrong = torch.zeros(B, T, V)
    wrong[..., 1] = 5.0  # greedy: the draft's argmax is never the target's
    planted(wrong)
    assert ttt.expected_accept_length(draft, feats, ids, logp, mask, gamma, greedy=True)[0] == 1.0
    # at temperature 0.5 the draft proposes from softmax(logits / 0.5): its sharper q against the
    # target's p (given at that temperature) sets each step's acceptance
    planted(wrong)
    q = torch.softmax(wrong[0, 0] / 0.5, -1)
    a = float(torch.minimum(logp[0, 0].exp(), q).sum())
    e, depth = ttt.expected_accept_length(draft, feats, ids, logp, mask, gamma, temperature=0.5)
    assert depth[0] == pytest.approx(a) and a < float(torch.minimum(logp[0, 0].exp(), wrong[0, 0].softmax(-1)).sum())
