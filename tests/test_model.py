import pytest
import torch

from target_training.config import ConfigError, MoEConfig, model_config_for
from rollout.engine import EngineConfig
from target_training.model import KVCache


def test_incremental_cache_matches_full_forward(tiny_model, tiny_cfg):
    x = torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(0))
    full = tiny_model(x, tap_layers=tiny_cfg.feature_layer_ids)
    cache = KVCache.for_model(tiny_cfg, 3, 64)
    outs = [tiny_model(x[:, :12], cache=cache).logits]
    outs += [tiny_model(x[:, t : t + 1], cache=cache).logits for t in range(12, 20)]
    assert torch.allclose(torch.cat(outs, 1), full.logits, atol=1e-5)
    assert cache.lengths.tolist() == [20, 20, 20]


def test_ragged_rollback_and_slot_subset(tiny_model, tiny_cfg):
    x = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(1))
    full = tiny_model(x).logits
    cache = KVCache.for_model(tiny_cfg, 3, 64)
    tiny_model(x, cache=cache)
    cache.rollback(torch.tensor([0, 2]), torch.tensor([4, 9]))
    assert cache.lengths.tolist() == [4, 16, 9]
    # ragged continuation: row 0 resumes at 4, row 2 at 9, in one batched call
    out0 = tiny_model(x[0:1, 4:8], cache=cache, slots=torch.tensor([0])).logits
    out2 = tiny_model(x[2:3, 9:13], cache=cache, slots=torch.tensor([2])).logits
    assert torch.allclose(out0, full[0:1, 4:8], atol=1e-5)
    assert torch.allclose(out2, full[2:3, 9:13], atol=1e-5)
    with pytest.raises(ValueError, match="rollback"):
        cache.rollback(torch.tensor([1]), torch.tensor([17]))


def test_tree_mask_equals_separate_branches(tiny_model, tiny_cfg):
    """Two branches verified in one block with a tree mask give the same logits as each branch alone."""
    prefix = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(2))
    a, b = torch.tensor([[10, 11]]), torch.tensor([[20, 21]])
    # block: [a0, a1, b0, b1]; a1 sees a0, b1 sees b0, branches do not see each other
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)[None]
    positions = torch.tensor([[6, 7, 6, 7]])
    cache = KVCache.for_model(tiny_cfg, 1, 32)
    tiny_model(prefix, cache=cache)
    tree = tiny_model(torch.cat([a, b], 1), cache=cache, attn_mask=mask, positions=positions).logits
    ref_a = tiny_model(torch.cat([prefix, a], 1)).logits[:, 6:]
    ref_b = tiny_model(torch.cat([prefix, b], 1)).logits[:, 6:]
    assert torch.allclose(tree[:, :2], ref_a, atol=1e-5)
    assert torch.allclose(tree[:, 2:], ref_b, atol=1e-5)


def test_compact_keeps_accepted_path(tiny_model, tiny_cfg):
    prefix = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(3))
    cache = KVCache.for_model(tiny_cfg, 1, 32)
    tiny_model(prefix, cache=cache)
    block = torch.tensor([[7, 8, 9]])  # node 0 = 7, nodes 1 (8) and 2 (9) are siblings under node 0
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)[None]
    tiny_model(block, cache=cache, attn_mask=mask, positions=torch.tensor([[5, 6, 6]]))
    cache.compact(torch.tensor([0]), torch.tensor([[5, 7]]), torch.tensor([5]))  # keep 7 then 9
    assert cache.lengths.tolist() == [7]
    nxt = tiny_model(torch.tensor([[3]]), cache=cache).logits
    ref = tiny_model(torch.cat([prefix, torch.tensor([[7, 9, 3]])], 1)).logits[:, -1:]
    assert torch.allclose(nxt, ref, atol=1e-5)


def test_router_aux_loss_and_taps(tiny_model, tiny_cfg):
    out = tiny_model(torch.randint(0, 64, (2, 10)), tap_layers=tiny_cfg.feature_layer_ids)
    assert out.aux_loss.item() > 0
    n_moe = tiny_cfg.num_layers - 1  # dense first layer
    assert out.expert_counts.shape == (n_moe, tiny_cfg.num_experts)
    assert int(out.expert_counts.sum()) == n_moe * 2 * 10 * tiny_cfg.top_k
    assert out.features(tiny_cfg.feature_layer_ids).shape == (2, 10, 3 * tiny_cfg.hidden_size)


@pytest.mark.parametrize("bad, match", [
    (dict(hidden_size=0), "hidden_size"),
    (dict(num_heads=3, num_kv_heads=2), "multiple"),
    (dict(top_k=9, num_experts=4), "top_k"),
    (dict(aux_layer_ids=(0, 1, 7), num_layers=4), "aux_layer_ids"),
])
def test_bad_config_values(bad, match):
    with pytest.raises(ConfigError, match=match):
        MoEConfig(**bad)


def test_unknown_model_preset():
    with pytest.raises(ConfigError, match="unknown model preset"):
        model_config_for("huge", 64)


def test_overflow_and_bad_mask_errors(tiny_model, tiny_cfg):
    cache = KVCache.for_model(tiny_cfg, 1, 8)
    with pytest.raises(ValueError, match="overflow"):
        tiny_model(torch.zeros(1, 9, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="attn_mask"):
        tiny_model(torch.zeros(1, 4, dtype=torch.long), attn_mask=torch.ones(1, 3, 3, dtype=torch.bool))
    # a window over more keys than the slot has cached before the block: refused, unless the
    # caller passes the key length from the host and so vouches for the window (no read)
    window = torch.ones(1, 2, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match="window of 5 keys does not fit"):
        cache.begin_block(None, 2, window)
    cache.lengths[0] = 3
    assert cache.begin_block(None, 2, window).mask.shape == (1, 1, 2, 5)
    assert cache.begin_block(None, 2, window, key_len=5).mask.shape == (1, 1, 2, 5)


@pytest.mark.parametrize("n_tokens", [1, 5, 8, 33, 130, 600])
def test_sorted_and_masked_expert_dispatch_are_bitwise_equal(n_tokens, monkeypatch):
    from target_training.model import MoE
    torch.manual_seed(n_tokens)
    cfg = model_config_for("quick", 96)
    moe = MoE(cfg)
    x = torch.randn(1, n_tokens, cfg.hidden_size)
    monkeypatch.setattr(MoE, "SORTED_DISPATCH_MAX_TOKENS", 10**9)
    with torch.no_grad():
        sorted_out, (sorted_aux, sorted_counts) = moe(x)
    monkeypatch.setattr(MoE, "SORTED_DISPATCH_MAX_TOKENS", 0)
    with torch.no_grad():
        masked_out, (masked_aux, masked_counts) = moe(x)
    assert torch.equal(sorted_out, masked_out)
    assert torch.equal(sorted_counts, masked_counts)
    assert sorted_aux is None and masked_aux is None  # the load-balancing loss is for training only
    # a forward that records gradients always takes the masked dispatch, whatever its size: the
    # sorted one's backward sums in another order, and training must stay bit-for-bit reproducible
    monkeypatch.setattr(MoE, "SORTED_DISPATCH_MAX_TOKENS", 10**9)
    monkeypatch.setattr(MoE, "_experts_sorted", lambda *a: pytest.fail("sorted dispatch under autograd"))
    assert torch.equal(moe(x)[0], masked_out)


@pytest.mark.parametrize("n_tokens", [1, 5, 20, 32, 33])
def test_dense_expert_dispatch_matches_the_exact_one_to_rounding(n_tokens):
    """moe_dispatch="dense": up to DENSE_DISPATCH_MAX_TOKENS no-grad tokens run every expert on
    every token (no host read); the output equals the exact dispatch's to rounding (not bitwise),
    the router counts exactly; beyond the size, and under autograd, the exact dispatch runs."""
    from target_training.model import MoE

    torch.manual_seed(n_tokens)
    cfg = model_config_for("quick", 96)
    moe = MoE(cfg)
    x = torch.randn(1, n_tokens, cfg.hidden_size)
    with torch.no_grad():
        exact, (_, exact_counts) = moe(x)
        dense, (aux, dense_counts) = moe(x, "dense")
    assert torch.equal(exact_counts, dense_counts) and aux is None
    if n_tokens <= MoE.DENSE_DISPATCH_MAX_TOKENS:
        assert torch.allclose(dense, exact, rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(dense, exact)
    with torch.enable_grad():
        assert torch.equal(moe(x, "dense")[0], moe(x)[0])  # training never takes the dense dispatch


def test_moe_dispatch_is_checked():
    from target_training.model import MoETransformer

    with pytest.raises(ValueError, match="moe_dispatch must be one of"):
        MoETransformer(model_config_for("tiny", 32))(torch.zeros(1, 2, dtype=torch.long), moe_dispatch="grouped")
    with pytest.raises(ValueError, match="EngineConfig.moe_dispatch must be one of"):
        EngineConfig(moe_dispatch="fast")


@pytest.mark.parametrize("head_dim", [8, 16, 32, 64])
def test_rope_table_holds_the_formulas_values(head_dim):
    """A cached forward looks RoPE up in a table of every cache position (rope_cos_sin with
    n_positions): bit for bit the formula's values, at any batch shape, and the table grows to
    the largest cache asked for."""
    from target_training.model import _ROPE_TABLES, rope_cos_sin

    g = torch.Generator().manual_seed(head_dim)
    for n_positions in (40, 300):
        for B, T in ((1, 1), (3, 1), (4, 5), (5, 13)):
            pos = torch.randint(0, n_positions, (B, T), generator=g)
            direct = rope_cos_sin(pos, head_dim, 10000.0)
            looked_up = rope_cos_sin(pos, head_dim, 10000.0, n_positions)
            assert all(torch.equal(a, b) for a, b in zip(direct, looked_up))
            assert looked_up[0].shape == (B, T, 1, head_dim)
    assert _ROPE_TABLES[(head_dim, 10000.0, torch.device("cpu"))][0].shape[0] >= 300
