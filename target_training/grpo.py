"""GRPO for the MoE policy: group-relative advantages, clipped ratio, optional KL, router loss.

The trainer consumes `rollout.protocol.Trajectory`-shaped data (prompt ids, generated ids,
the engine's log-probs) but imports nothing from `rollout`: anything with those attributes
works. The engine's log-probs are the "old" log-probs; on the first epoch the recomputed
ones must match them (tests/test_grpo.py checks fp32 max |diff| <= 1e-5), which is what makes
the update truly on-policy.

Feature hooks: callables registered in `logprob_hooks` receive every log-prob forward's
(input_ids, ModelOutput, response_mask), the output's logits (N, V) at the answer positions only
(`logit_positions(response_mask)`); specrl's co-training uses them to take target
features from the trainer's own forward instead of paying for another one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from target_training.model import ModelOutput, MoETransformer


COMPUTE_DTYPES = ("fp32", "bf16", "auto")


def native_bf16(device: torch.device) -> bool:
    """Whether `device` computes in bf16 natively (AVX512-BF16 or AMX on a CPU)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        cpu = torch.cpu
        return bool(getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()
                    or getattr(cpu, "_is_amx_tile_supported", lambda: False)())
    return False


def update_autocast(compute_dtype: str, device: torch.device):
    """The autocast context of an update's forwards for GRPOConfig.compute_dtype on `device`."""
    bf16 = compute_dtype == "bf16" or (compute_dtype == "auto" and native_bf16(device))
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)


@dataclass
class GRPOConfig:
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    clip_eps: float = 0.2
    kl_coef: float = 0.0  # > 0 needs a reference model
    max_grad_norm: float = 1.0
    ppo_epochs: int = 1
    minibatch_size: int = 0  # sequences per optimizer step; 0 = the whole batch
    aux_loss_coef: float | None = None  # router load-balancing weight; None = model config's
    temperature: float = 1.0  # must equal the rollout temperature
    adv_eps: float = 1e-6
    # "trainer": the ratio's denominator is the trainer's own log-prob of the rollout (so the
    # update depends only on the tokens, never on how the engine computed its numbers);
    # "engine": the engine's log-probs (they agree to ~1e-6, see tests/test_grpo.py).
    old_logprobs: str = "trainer"
    # Decoupled PPO for stale rollouts (AReaL's objective, its token-mask mode): with a cap, each token's clipped
    # surrogate is also weighted by exp(trainer's log-prob before the update - the rollout's own
    # log-prob), the importance weight from the policy that sampled it to the one the clip is
    # taken against, and tokens whose weight exceeds the cap are left out of the loss (the mean
    # still divides by every response token). None: no such weight. Needs old_logprobs "trainer"
    # (with "engine" the two log-probs are one and the weight is 1).
    behaviour_weight_cap: float | None = None
    # The compute dtype of the update's forwards and backward (weights, gradients and the optimizer
    # stay fp32; logits are computed in fp32 from the last hidden state): "fp32"; "bf16" (autocast);
    # "auto": bf16 where the device has native bf16 arithmetic (a CPU with AVX512-BF16 or AMX, a
    # GPU that supports it), else fp32. Under bf16 the trainer's log-probs differ from the engine's
    # fp32 ones (`logprob_mismatch` reports the largest gap): with old_logprobs "trainer" the ratio
    # compares the trainer with itself, and behaviour_weight_cap corrects for the gap if asked.
    compute_dtype: str = "fp32"

    def __post_init__(self) -> None:
        for name in ("lr", "clip_eps", "max_grad_norm", "temperature"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GRPOConfig.{name} must be positive, got {getattr(self, name)}")
        if self.old_logprobs not in ("trainer", "engine"):
            raise ValueError(f"GRPOConfig.old_logprobs must be 'trainer' or 'engine', got {self.old_logprobs!r}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"GRPOConfig.compute_dtype must be one of {COMPUTE_DTYPES}, got {self.compute_dtype!r}")
        if self.behaviour_weight_cap is not None and (self.behaviour_weight_cap <= 0 or self.old_logprobs != "trainer"):
            raise ValueError(f"GRPOConfig.behaviour_weight_cap must be positive and needs old_logprobs='trainer', got "
                             f"{self.behaviour_weight_cap!r} with {self.old_logprobs!r}")
        if self.ppo_epochs <= 0 or self.minibatch_size < 0 or self.kl_coef < 0:
            raise ValueError("GRPOConfig: ppo_epochs must be positive, minibatch_size and kl_coef non-negative")


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """(N,) rewards in consecutive groups of group_size -> (N,) normalised advantages."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    g = rewards.view(-1, group_size).float()
    adv = (g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True, unbiased=False) + eps)
    return adv.view(-1)


def pack_batch(trajectories: Sequence, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded (B, T) ids; response_mask[b, j] marks generated tokens; old_logp aligned with it."""
    lengths = [len(t.prompt_ids) + len(t.token_ids) for t in trajectories]
    B, T = len(trajectories), max(lengths)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    old = torch.zeros(B, T, dtype=torch.float32)
    for b, t in enumerate(trajectories):
        P, n = len(t.prompt_ids), len(t.token_ids)
        ids[b, : P + n] = torch.tensor(list(t.prompt_ids) + list(t.token_ids))
        mask[b, P : P + n] = True
        old[b, P : P + n] = torch.as_tensor(t.logprobs, dtype=torch.float32)
    return {"input_ids": ids, "response_mask": mask, "old_logp": old}


def logit_positions(response_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: the positions j whose next token j + 1 is a response token, the only logits
    a policy update reads (the model's `logits_at`)."""
    pos = torch.zeros_like(response_mask, dtype=torch.bool)
    pos[:, :-1] = response_mask[:, 1:].to(torch.bool)
    return pos


def answer_lengths(response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) long: each row's last response position + 1 (0 for a row without one), the length a
    right-padded row keeps when its padding is cut."""
    mask = response_mask.flatten(1).to(torch.bool)
    pos = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return (mask * pos).amax(1)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float,
                   positions: torch.Tensor | None = None, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob (B, T) of token j given tokens < j, and the entropy (B, T) of that predictive
    distribution, both 0 where not computed (j = 0; with `positions`, every j - 1 not marked).

    logits: (B, T, V) of a full forward, or (N, V) at the N positions `positions` (B, T) marks
    (`logit_positions`). The entropy is a metric: computed without autograd, `chunk` rows at a time,
    so it never holds a second (N, V) tensor."""
    B, T = input_ids.shape
    if positions is None:
        positions = torch.zeros(B, T, dtype=torch.bool, device=input_ids.device)
        positions[:, :-1] = True
        logits = logits[:, :-1].reshape(-1, logits.shape[-1])
    if logits.shape[0] != int(positions.sum()):
        raise ValueError(f"logits {tuple(logits.shape)} do not match the {int(positions.sum())} marked positions")
    nxt = torch.zeros_like(input_ids)
    nxt[:, :-1] = input_ids[:, 1:]
    scaled = logits.float() / temperature  # (N, V)
    lp_sel = scaled.gather(-1, nxt[positions][:, None])[:, 0] - torch.logsumexp(scaled, -1)
    with torch.no_grad():
        ent_sel = torch.cat([-(lq.exp() * lq).sum(-1) for lq in
                             (scaled[i: i + chunk].detach().log_softmax(-1) for i in range(0, scaled.shape[0], chunk))]
                            ) if scaled.shape[0] else scaled.new_zeros(0)
    shifted = torch.zeros(B, T, dtype=torch.bool, device=positions.device)
    shifted[:, 1:] = positions[:, :-1]  # the token j each marked position j - 1 predicts
    lp = lp_sel.new_zeros(B, T).masked_scatter(shifted, lp_sel)
    ent = ent_sel.new_zeros(B, T).masked_scatter(shifted, ent_sel)
    return lp, ent


def answer_forward(model, input_ids: torch.Tensor, response_mask: torch.Tensor, temperature: float, **model_kw):
    """A policy forward with logits at the answer positions only (`logit_positions`): (logp (B, T),
    entropy (B, T), ModelOutput whose logits are (N, V) at those positions); `model_kw` go to the
    model (its feature taps)."""
    positions = logit_positions(response_mask)
    out = model(input_ids, logits_at=positions, **model_kw)
    return (*token_logprobs(out.logits, input_ids, temperature, positions), out)


def grpo_loss(logp, old_logp, adv, mask, clip_eps: float, ref_logp=None, kl_coef: float = 0.0,
              behaviour_logp=None, weight_cap: float | None = None):
    """Token-level clipped surrogate (mean over response tokens), optional k3 KL to a reference.
    With `behaviour_logp` (the log-probs of the policy that sampled the tokens) and `weight_cap`,
    the decoupled objective: each token's surrogate times exp(old_logp - behaviour_logp), tokens
    whose weight exceeds the cap dropped (GRPOConfig.behaviour_weight_cap)."""
    m = mask.float()
    n = m.sum().clamp(min=1)
    ratio = torch.exp(logp - old_logp)
    a = adv[:, None]
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - clip_eps, 1 + clip_eps) * a)
    extra = {}
    if weight_cap is not None:
        w = torch.exp(old_logp.detach() - behaviour_logp)
        keep = (w <= weight_cap) & mask
        surrogate = surrogate * torch.where(keep, w, torch.zeros_like(w))
        kept = keep.float()
        extra = {"behaviour_weight": ((torch.where(keep, w, torch.zeros_like(w)) * kept).sum()
                                      / kept.sum().clamp(min=1)).item(),  # mean over the kept tokens
                 "behaviour_capped": ((m - kept).sum() / n).item()}  # fraction of tokens dropped
    pg_loss = -(surrogate * m).sum() / n
    loss = pg_loss
    kl = torch.zeros(())
    if ref_logp is not None:
        d = ref_logp - logp
        kl = ((torch.exp(d) - d - 1) * m).sum() / n
        loss = loss + kl_coef * kl
    clip_frac = (((ratio - 1).abs() > clip_eps).float() * m).sum() / n
    return loss, {"pg_loss": pg_loss.item(), "kl_ref": kl.item(), "clip_frac": clip_frac.item(), **extra}


def router_balance(expert_counts: torch.Tensor | None) -> float:
    """Normalised entropy of the per-layer expert load, averaged over MoE layers (1.0 = uniform)."""
    if expert_counts is None:
        return 1.0
    frac = expert_counts.float() / expert_counts.sum(-1, keepdim=True).clamp(min=1)
    ent = -(frac * frac.clamp(min=1e-12).log()).sum(-1)
    return (ent / math.log(expert_counts.shape[-1])).mean().item()


def grpo_update(model, trajectories: Sequence, rewards: Sequence[float], group_size: int, cfg: GRPOConfig,
                apply_gradients: Callable[[torch.Tensor], float | None], *, forward=None, ref_model=None,
                aux_coef: float | None = None, microstep_hooks: Sequence[Callable[[int, int], None]] = ()) -> dict:
    """One GRPO update of `model` on a rollout batch (groups of group_size consecutive
    trajectories): ppo_epochs passes over minibatches of minibatch_size sequences, each a
    clipped-surrogate loss (plus `aux_coef` times the router loss; None: none added) handed to
    `apply_gradients(loss)`, which zeroes, backpropagates, clips and steps and returns the
    gradient norm (None: not known). `forward(input_ids, response_mask, *, run_hooks)` ->
    (logp (B, T), entropy (B, T), ModelOutput) defaults to the model's forward with logits at the
    answer positions only and token_logprobs. Returns the metrics averaged over the updates, plus
    reward and response_len.

    Cost: each minibatch is cut to its own longest sequence (right padding: exact); the pass that
    computes the old log-probs before any update skips the first minibatch, whose first forward
    precedes every update and gives them; forwards run under GRPOConfig.compute_dtype."""
    def at_answers(net):  # `forward`'s signature over answer_forward
        return lambda input_ids, response_mask, *, run_hooks: answer_forward(net, input_ids, response_mask,
                                                                              cfg.temperature)

    forward = forward or at_answers(model)
    dev = next(model.parameters()).device
    autocast = lambda: update_autocast(cfg.compute_dtype, dev)  # noqa: E731
    batch = {k: v.to(dev) for k, v in pack_batch(trajectories).items()}
    adv = group_advantages(torch.as_tensor(rewards, dtype=torch.float32), group_size, cfg.adv_eps).to(dev)
    B = batch["input_ids"].shape[0]
    mb = cfg.minibatch_size or B
    lengths = answer_lengths(batch["response_mask"])  # (B,)

    def rows(lo: int):  # minibatch [lo, lo + mb) cut to its longest sequence: (slice, T_mb)
        return slice(lo, lo + mb), max(1, int(lengths[lo: lo + mb].max()))

    def logprob_pass(fwd, out: torch.Tensor, first: int) -> torch.Tensor:  # no-grad log-probs into out
        with torch.no_grad(), autocast():
            for lo in range(first, B, mb):
                sl, T = rows(lo)
                out[sl, :T] = fwd(batch["input_ids"][sl, :T], batch["response_mask"][sl, :T], run_hooks=False)[0]
        return out

    ref_logp = None if ref_model is None else logprob_pass(at_answers(ref_model), torch.zeros_like(batch["old_logp"]), 0)
    engine_logp = batch["old_logp"]
    trainer_old = cfg.old_logprobs == "trainer"
    old_logp = engine_logp.clone() if trainer_old else engine_logp
    if trainer_old and (cfg.ppo_epochs > 1 or mb < B):  # later minibatches follow an update
        logprob_pass(forward, old_logp, mb)  # the first minibatch's come from its first forward below
    sums: dict[str, float] = {}
    n_updates = 0
    total_updates = cfg.ppo_epochs * -(-B // mb)
    model.train()
    for epoch in range(cfg.ppo_epochs):
        for lo in range(0, B, mb):
            sl, T = rows(lo)
            mask = batch["response_mask"][sl, :T]
            with autocast():
                logp, ent, out = forward(batch["input_ids"][sl, :T], mask, run_hooks=epoch == 0)
            if n_updates == 0:  # no update yet: the trainer's own old log-probs of this minibatch
                first = (sl, T, logp.detach())
                if trainer_old:
                    old_logp[sl, :T] = first[2]
            loss, m = grpo_loss(logp, old_logp[sl, :T], adv[sl], mask, cfg.clip_eps,
                                ref_logp[sl, :T] if ref_logp is not None else None, cfg.kl_coef,
                                behaviour_logp=engine_logp[sl, :T], weight_cap=cfg.behaviour_weight_cap)
            if aux_coef is not None:
                loss = loss + aux_coef * out.aux_loss
            grad_norm = apply_gradients(loss)
            mf = mask.float()
            m.update(loss=loss.item(), aux_loss=out.aux_loss.item())
            if grad_norm is not None:
                m["grad_norm"] = grad_norm
            m.update(entropy=((ent * mf).sum() / mf.sum().clamp(min=1)).item(),
                     router_balance=router_balance(out.expert_counts))
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + v
            n_updates += 1
            if n_updates < total_updates:
                for hook in microstep_hooks:
                    hook(n_updates, total_updates)
    model.eval()
    # the engine's log-probs against the trainer's before any update moved the policy: the whole
    # batch with trainer old log-probs, else the first minibatch (its forward preceded the updates)
    sl, T, logp0 = (slice(0, B), engine_logp.shape[1], old_logp) if trainer_old else first
    mismatch = ((engine_logp[sl, :T] - logp0).abs() * batch["response_mask"][sl, :T].float()).max().item()
    metrics = {k: v / n_updates for k, v in sums.items()}
    metrics["logprob_mismatch"] = mismatch  # the largest gap over the response tokens it covers
    metrics["reward"] = float(torch.as_tensor(rewards, dtype=torch.float32).mean())
    metrics["response_len"] = float(batch["response_mask"].sum(1).float().mean())
    return metrics


class GRPOTrainer:
    def __init__(self, model: MoETransformer, config: GRPOConfig, *, ref_model: MoETransformer | None = None,
                 accelerator=None):
        if config.kl_coef > 0 and ref_model is None:
            raise ValueError("GRPOConfig.kl_coef > 0 needs a reference model")
        self.config = config
        self.ref_model = ref_model.eval().requires_grad_(False) if ref_model is not None else None
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=config.betas,
                                           weight_decay=config.weight_decay)
        self.accelerator = accelerator
        if accelerator is not None:
            model, self.optimizer = accelerator.prepare(model, self.optimizer)
        self.model = model
        self.step_count = 0
        self.logprob_hooks: list[Callable[[torch.Tensor, ModelOutput, torch.Tensor], None]] = []
        self.tap_layers: tuple[int, ...] = ()  # set by whoever registers a feature hook
        # called as hook(done, total) after every optimizer micro-step but the last: a window for
        # co-located work inside the update (specrl's "interleaved" draft training)
        self.microstep_hooks: list[Callable[[int, int], None]] = []

    def add_feature_hook(self, layer_ids: tuple[int, ...], hook: Callable) -> None:
        """Feature source of the co-training core (rollout.protocol.FeatureSource): tap
        `layer_ids` in the log-prob forward this trainer runs anyway and hand its output to hook."""
        self.tap_layers = tuple(layer_ids)
        self.logprob_hooks.append(hook)

    @property
    def unwrapped(self) -> MoETransformer:
        return self.accelerator.unwrap_model(self.model) if self.accelerator is not None else self.model

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def forward_logprobs(self, input_ids: torch.Tensor, response_mask: torch.Tensor, *, run_hooks: bool = True):
        """`answer_forward` of the policy; the feature hooks get its output."""
        logp, ent, out = answer_forward(self.model, input_ids, response_mask, self.config.temperature,
                                        tap_layers=self.tap_layers if run_hooks and self.logprob_hooks else ())
        if run_hooks:
            for hook in self.logprob_hooks:
                hook(input_ids, out, response_mask)
        return logp, ent, out

    @torch.no_grad()
    def recompute_logprobs(self, trajectories) -> torch.Tensor:
        """Trainer-side log-probs of the generated tokens, (B, T) aligned with pack_batch."""
        batch = pack_batch(trajectories)
        with update_autocast(self.config.compute_dtype, self.device):
            logp, _, _ = self.forward_logprobs(batch["input_ids"].to(self.device),
                                               batch["response_mask"].to(self.device), run_hooks=False)
        return logp.cpu() * batch["response_mask"]

    def step(self, trajectories: Sequence, rewards: Sequence[float], group_size: int) -> dict:
        """One GRPO update on a rollout batch (groups of group_size consecutive trajectories)."""
        cfg = self.config
        aux_coef = cfg.aux_loss_coef if cfg.aux_loss_coef is not None else self.unwrapped.cfg.router_aux_loss_coef
        metrics = grpo_update(self.model, trajectories, rewards, group_size, cfg, self._apply_gradients,
                              forward=self.forward_logprobs, ref_model=self.ref_model, aux_coef=aux_coef,
                              microstep_hooks=self.microstep_hooks)
        self.step_count += 1
        return metrics

    def _apply_gradients(self, loss: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        if self.accelerator is not None:
            self.accelerator.backward(loss)
        else:
            loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        return grad_norm.item()

    def state_dict(self) -> dict:
        return {"step": self.step_count, "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step"])
        self.optimizer.load_state_dict(state["optimizer"])


def sft_loss(model: MoETransformer, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on the positions loss_mask marks (the completion), (B, T) inputs."""
    out = model(input_ids)
    logits = out.logits[:, :-1]
    target = input_ids[:, 1:]
    m = loss_mask[:, 1:].float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), reduction="none")
    return (ce.view_as(m) * m).sum() / m.sum().clamp(min=1) + model.cfg.router_aux_loss_coef * out.aux_loss
