"""Sampling primitives shared by plain and speculative decoding.

Two ways to draw a token from the processed target distribution p:
- `rng` mode: torch.multinomial with the engine's generator (speculative decoding then uses
  rejection sampling, which is lossless in distribution).
- `coupled` mode: Gumbel-max with counter-based noise keyed by (seed, request id, token
  index). The draw is a pure function of the request and the distribution, so a request's
  tokens do not depend on its batch neighbours, and a draft that proposes with the same noise
  makes speculative decoding reproduce plain decoding token for token under sampling too.
"""
from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
_M1, _M2 = 0x7FEB352D, 0x2C1B3C6D  # odd multipliers below 2**31: products stay inside int64


def _mix32(x):
    """A 32-bit avalanche hash on int64 tensors (or Python ints) holding values in [0, 2**32)."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = (x * _M1) & MASK32
    x = x ^ (x >> 15)
    x = (x * _M2) & MASK32
    x = x ^ (x >> 16)
    return x


def counter_uniform(seed: int, request_ids: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniforms in (0, 1) of shape steps.shape + (vocab,), a pure function of the inputs.

    request_ids must broadcast against steps (both int64).
    """
    key = _mix32((seed & MASK32) ^ 0x5BD1E995)  # on the host: nothing to copy to the device
    key = _mix32(key ^ (request_ids.long() & MASK32))
    key = _mix32(key + 0x9E3779B9 ^ (steps.long() & MASK32))
    idx = torch.arange(vocab, device=steps.device, dtype=torch.long)
    h = _mix32(_mix32(key[..., None] ^ ((idx * 0x61C88647) & MASK32)) + idx)
    return ((h >> 8).double() + 0.5) / float(1 << 24)


def gumbel_noise(seed: int, request_ids: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    u = counter_uniform(seed, request_ids, steps, vocab)
    return (-torch.log(-torch.log(u))).float()


def coupled_noise(seed: int, request_ids: torch.Tensor, first_step: torch.Tensor, n: int, vocab: int) -> torch.Tensor:
    """The noise of n consecutive tokens per request, (B, n, V): row i is for token first_step + i.

    A speculative step needs the noise of every position it may reach (the draft proposes with
    it, the target verifies with it); one call for all of them costs a fraction of one per
    position, since the hash is a handful of small tensor ops whatever the size."""
    steps = first_step[:, None] + torch.arange(n, device=first_step.device)  # (B, n)
    return gumbel_noise(seed, request_ids[:, None], steps, vocab)


def gumbel_argmax(logp: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The coupled draw: argmax(logp + noise) over the last dim, an exact sample from softmax(logp)."""
    return (logp + noise).argmax(-1)


def process_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Log-probs (float32) of the distribution actually sampled from: temperature, then top-k,
    then top-p; filtered tokens get -inf. Greedy (temperature 0) returns a one-hot log-dist."""
    logits = logits.float()
    if temperature == 0.0:
        out = torch.full_like(logits, float("-inf"))
        return out.scatter_(-1, logits.argmax(-1, keepdim=True), 0.0)
    logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p (keeps >= 1 token)
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.log_softmax(-1)


def policy_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probs handed to the RL loss: log_softmax(logits / T) over the full vocabulary
    (T = 1 for greedy). The trainer recomputes exactly this."""
    x = logits.float()
    if temperature > 0 and temperature != 1.0:  # dividing by 1 changes no bit: skip the op
        x = x / temperature
    return x.log_softmax(-1)


def sample(logp: torch.Tensor, *, mode: str, generator: torch.Generator | None = None, seed: int = 0,
           request_ids: torch.Tensor | None = None, steps: torch.Tensor | None = None) -> torch.Tensor:
    """Draw one token per row of logp (..., V) (as from process_logits)."""
    if mode == "coupled":
        return gumbel_argmax(logp, gumbel_noise(seed, request_ids, steps, logp.shape[-1]))
    if mode == "rng":
        flat = logp.reshape(-1, logp.shape[-1]).exp()
        return torch.multinomial(flat, 1, generator=generator).view(logp.shape[:-1])
    raise ValueError(f"unknown sampling mode {mode!r}; expected 'coupled' or 'rng'")
