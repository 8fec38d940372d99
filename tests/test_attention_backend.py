"""Attention kernel selection: SDPA on CPU, flash-attn only where it applies, clear errors."""
import pytest
import torch

from target_training import attention_backend as ab
from target_training.model import attend


@pytest.fixture(autouse=True)
def restore_preference():
    saved = ab._preference
    yield
    ab._preference = saved


def _qkv(B=2, T=7, H=4, Hkv=2, D=16, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(0)
    mk = lambda h: torch.randn(B, T, h, D, generator=g).to(device=device, dtype=dtype)
    return mk(H), mk(Hkv), mk(Hkv)


def test_cpu_selects_sdpa_and_attend_matches_reference():
    q, k, v = _qkv()
    assert ab.select(q, None) == "sdpa"
    assert ab.flash_unsupported_reason(q, None) is not None
    out = attend(q, k, v, None)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(2, 2).transpose(1, 2), v.repeat_interleave(2, 2).transpose(1, 2),
        is_causal=True).transpose(1, 2).reshape(2, 7, -1)
    assert torch.allclose(out, ref, atol=1e-6)


def test_reasons_name_the_blocker(monkeypatch):
    monkeypatch.setattr(ab, "flash_available", lambda: True)
    half = torch.zeros(1, 3, 2, 16, dtype=torch.float16)
    assert "float32" in ab.flash_unsupported_reason(half.float(), None)
    assert "head_dim 512" in ab.flash_unsupported_reason(torch.zeros(1, 3, 2, 512, dtype=torch.bfloat16), None)
    assert "mask" in ab.flash_unsupported_reason(half, torch.ones(1, 1, 3, 3, dtype=torch.bool))
    assert "CUDA" in ab.flash_unsupported_reason(half, None)
    monkeypatch.setattr(ab, "flash_available", lambda: False)
    assert "not installed" in ab.flash_unsupported_reason(half, None)


def test_unknown_and_forced_flash_errors(monkeypatch):
    with pytest.raises(ab.AttentionBackendError, match="one of"):
        ab.set_attention_backend("xformers")
    monkeypatch.setattr(ab, "flash_available", lambda: False)
    with pytest.raises(ab.AttentionBackendError, match="flash_attn is not installed") as e:
        ab.set_attention_backend("flash")
    assert "\n" not in str(e.value)
    monkeypatch.setenv("SPECRL_ATTENTION", "flash")
    ab._preference = None
    with pytest.raises(ab.AttentionBackendError, match="flash_attn is not installed"):
        ab.get_attention_backend()
    # installed but the call cannot use it: forcing fails on a causal call, masks fall back
    monkeypatch.setattr(ab, "flash_available", lambda: True)
    ab.set_attention_backend("flash")
    q = torch.zeros(1, 3, 2, 16)
    with pytest.raises(ab.AttentionBackendError, match="forced but dtype torch.float32"):
        ab.select(q, None)
    assert ab.select(q, torch.ones(1, 1, 3, 3, dtype=torch.bool)) == "sdpa"
    ab.set_attention_backend("sdpa")
    assert ab.select(q, None) == "sdpa"


def _flash_ready() -> bool:
    return torch.cuda.is_available() and ab.flash_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _flash_ready(), reason="needs CUDA and flash_attn")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_flash_equals_sdpa(dtype):
    q, k, v = _qkv(B=3, T=33, H=8, Hkv=2, D=64, dtype=dtype, device="cuda")
    ab.set_attention_backend("auto")
    assert ab.select(q, None) == "flash"
    flash = attend(q, k, v, None)
    ab.set_attention_backend("sdpa")
    sdpa = attend(q, k, v, None)
    assert flash.shape == sdpa.shape == (3, 33, 8 * 64)
    assert (flash.float() - sdpa.float()).abs().max().item() <= (2e-3 if dtype == torch.float16 else 1.6e-2)
    # the policy's causal forward goes through flash and agrees with SDPA end to end
    from target_training.config import model_config_for

    torch.manual_seed(0)
    model = model_config_for("tiny", 64).build().to("cuda", dtype).eval()
    ids = torch.randint(0, 64, (2, 20), device="cuda")
    with torch.no_grad():
        ab.set_attention_backend("auto")
        a = model(ids).logits.float()
        ab.set_attention_backend("sdpa")
        b = model(ids).logits.float()
    assert (a - b).abs().max().item() <= 5e-2
