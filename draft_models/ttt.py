"""Training-time test (TTT) for the EAGLE-3 draft: unroll it on its own outputs, in parallel.

Indexing, for one sequence of tokens x_0..x_{T-1} with target features f_0..f_{T-1}:
- step 0, row t: inputs (f_t, x_{t+1}), RoPE position t; predicts x_{t+2};
- step k, row t: inputs (step k-1's pre-norm output at row t, x_{t+1+k}), RoPE position t + k;
  predicts x_{t+2+k}, whose target distribution is the target's at position t+1+k.
Attention of step k at row t: step-0 keys at rows <= t, plus the keys of steps 1..k at row t
(the EAGLE-3 diagonal). This is exactly what inference computes when the draft, having run
step 0 over a prefix ending at row t, appends one entry per further step at the next cache
position: row t of step k equals inference on the prefix x_0..x_{t+1} after k chained steps
(tests/test_draft_model.py checks it for every t, with cache rollback).

Loss at (step k, row t) is counted when x_{t+2+k} exists (t <= T-3-k) and
loss_mask[:, t+2+k] (loss_mask marks the tokens to predict, e.g. response tokens; right
padding must carry loss_mask 0).
"""
from __future__ import annotations

import torch

from draft_models.vocab import draft_to_target_ids, restrict_to_draft, target_to_draft_ids
from rollout.acceptance import coupled_accept_prob, rejection_accept_prob


def shift_left(input_ids: torch.Tensor, k: int, pad: int = 0) -> torch.Tensor:
    """out[:, t] = input_ids[:, t + k], `pad` past the end."""
    if k == 0:
        return input_ids
    out = torch.full_like(input_ids, pad)
    if k < input_ids.shape[1]:
        out[:, : input_ids.shape[1] - k] = input_ids[:, k:]
    return out


def first_needed_row(loss_mask: torch.Tensor, steps: int) -> int:
    """The first row t whose output at some TTT step of `steps` can matter: step k at row t
    predicts x_{t+2+k} and feeds step k+1 at row t, so row t matters iff some loss_mask[:, t+2+j]
    (j < steps) is set. Rows before the batch's first answer token minus (1 + steps) feed only
    step 0's keys and values (a prompt): their attention, MLP and head need not run. 0 when
    nothing is masked (nothing to skip: the caller then counts no loss anyway)."""
    marked = loss_mask.to(torch.bool).any(0).nonzero()
    return max(0, int(marked[0]) - 1 - steps) if marked.numel() else 0


def ttt_unroll(draft, features: torch.Tensor, input_ids: torch.Tensor, steps: int | None = None, start: int = 0):
    """Run `steps` TTT steps -> list of (prenorm (B, T - start, H), logits (B, T - start, Vd)), one
    per step, at rows start..T-1. Step 0's keys and values cover every row (the later rows attend
    to them); `start` (first_needed_row) only skips outputs no loss reads, so the rows computed
    are the same as with start 0, up to float rounding."""
    steps = steps or draft.cfg.ttt_steps
    B, T = input_ids.shape
    if not 0 <= start < T:
        raise ValueError(f"start must be in [0, {T}), got {start}")
    device = input_ids.device
    rows = torch.arange(T, device=device)
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()[start:]  # (T - start, T)
    diag = torch.eye(T - start, dtype=torch.bool, device=device)
    hidden = features.detach()
    keys, values, outs = [], [], []
    for k in range(steps):
        ids_k, pos_k = shift_left(input_ids, 1 + k), (rows + k).expand(B, T)
        if k:  # rows start.. only: the step-0 keys of the earlier rows are all they give
            ids_k, pos_k = ids_k[:, start:], pos_k[:, start:]
        h, q, kk, vv = draft.prepare(ids_k, hidden, pos_k, project=(k == 0))
        keys.append(kk)
        values.append(vv)
        if k == 0 and start == 0:
            prenorm, logits = draft.finish(h, q, kk, vv, None)  # plain causal
        elif k == 0:
            prenorm, logits = draft.finish(h[:, start:], q[:, start:], kk, vv, causal[None, None])
        else:
            mask = torch.cat([causal] + [diag] * k, dim=1)[None, None]  # (1, 1, T - start, T + k (T - start))
            prenorm, logits = draft.finish(h, q, torch.cat(keys, 1), torch.cat(values, 1), mask)
        outs.append((prenorm, logits))
        hidden = prenorm
    return outs


def ttt_loss(draft, features: torch.Tensor, input_ids: torch.Tensor, target_logp: torch.Tensor | None,
             loss_mask: torch.Tensor, steps: int | None = None, *, acceptance_weight: float = 0.0,
             decay: float | None = None):
    """TTT loss -> (loss (scalar tensor), metrics dict of floats).

    features (B, T, 3 * H_target) fused target features (detached here).
    input_ids (B, T) the sequence x_0..x_{T-1}.
    target_logp: the target's log-probs at every position, (B, T, V) over the full vocabulary or
      (B, T, Vd) already restricted to the draft vocabulary (not renormalised, as
      capture_features stores them); None trains on the hard labels x_{t+2+k}.
    loss_mask (B, T) bool or float weights on the predicted tokens.
    Per step k: soft cross-entropy against the target restricted to the draft vocabulary and
    renormalised, masked mean over valid rows, weight decay**k; summed over steps. With
    acceptance_weight > 0 the step loss also subtracts acceptance_weight * E[sum_x min(p(x), q(x))]
    (p: the target's unrenormalised probability, q: the draft's).
    Metrics: loss, and per step k: ce_k, acc_k (draft argmax == target argmax, in target ids;
    the target argmax is over the vocabulary target_logp covers), accept_k (mean sum min(p, q)),
    n_k (valid rows).
    """
    cfg = draft.cfg
    steps = steps or cfg.ttt_steps
    decay = cfg.ttt_decay if decay is None else decay
    B, T = input_ids.shape
    if features.shape[:2] != (B, T) or loss_mask.shape != (B, T):
        raise ValueError(f"features {tuple(features.shape)} and loss_mask {tuple(loss_mask.shape)} "
                         f"must match input_ids {(B, T)}")
    d2t, t2d, Vd = draft.d2t, draft.t2d, cfg.draft_vocab_size
    weights = loss_mask.to(torch.float32)

    if target_logp is not None:
        tl = target_logp.detach().float()
        if tl.shape[:2] != (B, T):
            raise ValueError(f"target_logp {tuple(tl.shape)} must match input_ids {(B, T)}")
        if tl.shape[-1] == Vd:
            p_logp = tl
            tgt_arg = draft_to_target_ids(tl.argmax(-1), d2t)
        elif tl.shape[-1] == cfg.vocab_size:
            p_logp = restrict_to_draft(tl, d2t)
            tgt_arg = tl.argmax(-1)
        else:
            raise ValueError(f"target_logp last dim {tl.shape[-1]} is neither vocab_size {cfg.vocab_size} "
                             f"nor draft_vocab_size {Vd}")
        p_soft = torch.softmax(p_logp, dim=-1)  # restricted and renormalised
        p_raw = p_logp.exp()  # the target's own probability of each draft token
    else:
        tgt_arg = shift_left(input_ids, 1)  # position j -> token j+1
        label_d = target_to_draft_ids(tgt_arg, t2d)

    s = first_needed_row(weights > 0, steps)  # rows before s carry no loss at any step
    outs = ttt_unroll(draft, features, input_ids, steps, start=s)
    total = features.new_zeros((), dtype=torch.float32)
    stats = []
    for k, (_, logits) in enumerate(outs):
        n = T - 2 - k  # rows t = 0..n-1 have a token x_{t+2+k} to predict; s..n-1 were computed
        if n <= s:
            stats.append(torch.zeros(4, device=input_ids.device))
            continue
        logq = torch.log_softmax(logits[:, :n - s].float(), dim=-1)  # (B, n - s, Vd)
        j = slice(1 + k + s, 1 + k + n)  # target positions t+1+k
        m = weights[:, 2 + k + s: 2 + k + n]
        if target_logp is not None:
            ce = -(p_soft[:, j] * logq).sum(-1)
            m_ce = m
            accept = rejection_accept_prob(p_raw[:, j], logq.exp())
        else:
            lab = label_d[:, j]
            inv = lab >= 0
            ce = -logq.gather(-1, lab.clamp_min(0)[..., None])[..., 0]
            m_ce = m * inv
            accept = logq.exp().gather(-1, lab.clamp_min(0)[..., None])[..., 0] * inv
        denom, denom_ce = m.sum().clamp_min(1.0), m_ce.sum().clamp_min(1.0)
        step_loss = (ce * m_ce).sum() / denom_ce
        mean_accept = (accept * m).sum() / denom
        if acceptance_weight:
            step_loss = step_loss - acceptance_weight * mean_accept
        total = total + (decay ** k) * step_loss
        with torch.no_grad():
            hit = (draft_to_target_ids(logq.argmax(-1), d2t) == tgt_arg[:, j]).float()
            stats.append(torch.stack([(ce * m_ce).sum() / denom_ce, (hit * m).sum() / denom,
                                      mean_accept, m.sum()]).detach())
    values = torch.cat([total.detach().reshape(1), torch.stack(stats).reshape(-1)]).cpu().tolist()  # one sync
    metrics: dict = {"loss": values[0]}
    values = [values[1 + 4 * k: 5 + 4 * k] for k in range(len(stats))]
    for k, (ce, acc, acc_rate, n) in enumerate(values):
        metrics[f"ce_{k}"] = ce
        metrics[f"acc_{k}"] = acc
        metrics[f"accept_{k}"] = acc_rate
        metrics[f"n_{k}"] = n
    return total, metrics


@torch.no_grad()
def expected_accept_sums(draft, features: torch.Tensor, input_ids: torch.Tensor, target_logp: torch.Tensor,
                         loss_mask: torch.Tensor, gamma: int, *, greedy: bool = False,
                         temperature: float = 1.0, coupled: bool = False) -> list[list[float]]:
    """The draft's expected accept length per verify step with chains of `gamma`, on sequences the
    policy wrote, as per-sequence sums -> B lists [sum_t E_t, sum_t a_{t,0}, ..., sum_t a_{t,gamma-1},
    rows]: mean_accept_length turns any set of them into (E, per-depth acceptance), so a
    sequence measured once for a draft need not be measured again for it.

    Terms. A verify step starts after row t (the prefix x_0..x_{t+1}); the draft proposes
    x_{t+2}..x_{t+1+gamma} by chaining its own steps (the TTT unroll, row t of step k). Step k is
    accepted with probability a_{t,k} = sum_x min(p(x), q(x)) under rejection sampling (p: the
    target at position t+1+k, unrenormalised over the draft vocabulary, since a token outside it
    is never proposed; q: the draft), the probability that the two Gumbel-max draws agree under
    coupled sampling (`coupled`: rollout.acceptance.coupled_accept_prob, at most the former), or
    1[argmax q == argmax p] with `greedy`. Each is the acceptance of the engine's rule of that
    name (the embedded engine samples coupled by default; vLLM and SGLang by rejection). The step emits
    E_t = 1 + sum_{k<gamma} prod_{j<=k} a_{t,j} tokens (the bonus token plus the accepted run);
    a position past the answer's end accepts nothing. E is the mean of E_t over rows t whose
    first proposed token x_{t+2} is an answer token (loss_mask).

    Conditions. Greedy: exact, since the policy's greedy answer is the chain a verify step
    confirms. Sampled: each a_{t,k} is exact; the chain's inputs are the tokens the policy
    sampled, where a verify step feeds the draft its own accepted proposals (the same tokens
    whenever they are accepted, a different draw of the same target distribution otherwise).
    It needs the target's log-probs (the trainer-side capture records them, whether or not
    speculation served those rollouts).

    features (B, T, 3H), input_ids (B, T), target_logp (B, T, Vd) at the draft vocabulary
    (FeatureBuffer's soft targets), loss_mask (B, T). temperature: the draft's proposals are
    sampled from softmax(logits / temperature), as the engine samples them; target_logp must be at
    the same temperature (FeatureBuffer.heldout_temperature does this for its held-out rows)."""
    B, T = input_ids.shape
    if target_logp is None or target_logp.shape[-1] != draft.cfg.draft_vocab_size:
        raise ValueError("expected_accept_sums needs the target's log-probs at the draft vocabulary")
    mask = loss_mask.to(torch.bool)
    s = first_needed_row(mask, 1)  # rows before s start no verify step inside an answer
    outs = ttt_unroll(draft, features, input_ids, gamma, start=s)
    p = target_logp.float().exp()
    running = torch.ones(B, T, device=input_ids.device)  # prod_{j<=k} a_{t,j} so far
    expected = torch.ones(B, T, device=input_ids.device)
    depth = []
    for k, (_, logits) in enumerate(outs):
        n = max(0, T - 2 - k)  # rows with a token x_{t+2+k}; s..n-1 were computed
        a = torch.zeros(B, T, device=input_ids.device)
        if n > s:
            q = logits[:, :n - s].float()
            q = torch.softmax(q if temperature == 1.0 else q / temperature, dim=-1)
            pk = p[:, 1 + k + s: 1 + k + n]
            if greedy:
                a[:, s:n] = (q.argmax(-1) == pk.argmax(-1)).float()
            else:
                a[:, s:n] = (coupled_accept_prob if coupled else rejection_accept_prob)(pk, q)
            a[:, s:n] *= mask[:, 2 + k + s: 2 + k + n]
        running = running * a
        expected = expected + running
        depth.append(a)
    rows = torch.zeros(B, T, dtype=torch.bool, device=input_ids.device)
    rows[:, : max(0, T - 2)] = mask[:, 2:]
    w = rows.float()
    sums = torch.stack([(expected * w).sum(1)] + [(a * w).sum(1) for a in depth] + [w.sum(1)], 1)
    return sums.cpu().tolist()


def mean_accept_length(sums: list[list[float]]) -> tuple[float, list[float]]:
    """Per-sequence sums (expected_accept_sums) -> (E, per-depth acceptance) over all their rows:
    the same figures as one measurement of all the sequences together; NaN without any row."""
    n = sum(r[-1] for r in sums)
    if not n:
        gamma = len(sums[0]) - 2 if sums else 0
        return float("nan"), [float("nan")] * gamma
    total = [sum(col) for col in zip(*sums)]
    return total[0] / n, [x / n for x in total[1:-1]]


def paired_gain(sums_a: list[list[float]], sums_b: list[list[float]]) -> tuple[float, float]:
    """Draft a's expected accept length over draft b's on the same sequences (expected_accept_sums
    of each, in the same order) -> (gain, its standard error). The gain is the difference of the
    two mean_accept_length values; its error treats the sequences as the sampled units (a ratio
    estimator: per sequence, a's sum less b's less gain times its rows), so sequences that share
    a prompt (a GRPO group) make it read somewhat low. NaN gain without rows; error 0 with fewer
    than two sequences."""
    if len(sums_a) != len(sums_b) or any(a[-1] != b[-1] for a, b in zip(sums_a, sums_b)):
        raise ValueError("paired_gain needs both drafts' sums on the same sequences")
    n = sum(a[-1] for a in sums_a)
    if not n:
        return float("nan"), 0.0
    d = [a[0] - b[0] for a, b in zip(sums_a, sums_b)]
    gain = sum(d) / n
    k = len(d)
    if k < 2:
        return gain, 0.0
    var = k / (k - 1) * sum((x - gain * a[-1]) ** 2 for x, a in zip(d, sums_a)) / n ** 2
    return gain, var ** 0.5


def expected_accept_length(draft, features: torch.Tensor, input_ids: torch.Tensor, target_logp: torch.Tensor,
                           loss_mask: torch.Tensor, gamma: int, *, greedy: bool = False,
                           temperature: float = 1.0, coupled: bool = False) -> tuple[float, list[float]]:
    """The draft's expected accept length per verify step with chains of `gamma` over a batch of
    sequences -> (E, per-depth acceptance) (see expected_accept_sums for the terms)."""
    return mean_accept_length(expected_accept_sums(draft, features, input_ids, target_logp, loss_mask, gamma,
                                                   greedy=greedy, temperature=temperature, coupled=coupled))
