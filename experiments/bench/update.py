"""`specrl bench update`: what the GRPO policy update costs, and what its cheaper forms change.

One rollout batch of the preset (its first RL step's prompts, sampled by the embedded engine at
the rollout temperature) is the input of every arm; each arm starts from the same weights and a
fresh optimizer and runs one update (`target_training.grpo.grpo_update`, the preset's GRPOConfig):

  full-fp32    logits at every position of the padded batch, in fp32: the log-prob path of a
               plain causal-LM forward (a 49k vocabulary over every prompt and padding position)
  answer-fp32  logits at the answer positions only (`logit_positions`), fp32
  answer-bf16  the same under bf16 autocast (GRPOConfig.compute_dtype "bf16"); weights, gradients,
               optimizer and the LM head stay fp32

Per arm: seconds per update (median over `repeats`, arms taking turns, the first turn of each arm
left out as warm-up when repeats > 1); the log-probs of the batch's answer tokens before any update
against full-fp32's (max and mean |gap|) and against the engine's (the ones the rollout recorded);
the update's losses; and how far its weight change is from full-fp32's,
||delta_arm - delta_full|| / ||delta_full||, beside the same figure for a second full-fp32 update
(`full-fp32-b`: the noise of the measurement itself, zero on a deterministic CPU).

The draft's online update on the same batch (`draft_rows`): the preset's starting draft, the
batch's features and soft targets captured by one policy forward, one `OnlineDraftTrainer`
update of 16 sequences from the same weights and a fresh optimizer per turn, and one held-out
measurement (`specrl.cotrain.heldout_accept_length`) of the batch:

  draft-all-rows  fp32, every row of the TTT unroll computed (draft_models.ttt.first_needed_row
                  held at 0: what the unroll did before it skipped the prompt rows)
  draft-fp32      fp32, the rows a loss reads (the default)
  draft-bf16      the same under bf16 autocast (OnlineDraftConfig.compute_dtype "bf16")
  draft-fp32-b    draft-fp32 again: the noise of the timing itself

Per arm: seconds per update and per held-out measurement (medians, the first turn left out), the
update's loss and its gap to draft-all-rows'.
Outputs in DIR: summary.json.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from experiments.bench.common import save_summary, turn_order
from specrl.presets import get_preset

ARMS = {"full-fp32": (True, "fp32"), "answer-fp32": (False, "fp32"), "answer-bf16": (False, "bf16")}


def rollout_batch(task_name: str, preset_name: str, seed: int, cache_dir, log=print):
    """(policy, trajectories, rewards, preset, tokenizer, task): the preset's first RL step, sampled
    by the embedded engine."""
    from rollout.engine import EmbeddedEngine, EngineConfig
    from specrl.rl_setup import build_task_and_policy, encode_prompts, generate_step, rollout_params, score, step_examples
    from target_training.sft import default_cache_dir

    preset = get_preset(preset_name)
    tokenizer, task, policy, _ = build_task_and_policy(task_name, preset, cache_dir or default_cache_dir(), log=log)
    pool = task.examples("train", preset.prompt_pool or max(512, preset.prompts_per_step * 8), seed + 1)
    examples = step_examples(task, pool, preset, seed, 0)
    engine = EmbeddedEngine(policy, EngineConfig(max_batch=preset.max_batch))
    t0 = time.perf_counter()
    rollout = generate_step(engine, encode_prompts(tokenizer, examples), rollout_params(preset, tokenizer, seed),
                            list(range(len(examples))), preset.group_size)
    log(f"[bench update] rollout of {len(examples)} answers in {time.perf_counter() - t0:.1f}s")
    return policy, list(rollout), score(task, tokenizer, examples, rollout), preset, tokenizer, task


def full_forward(model, temperature: float):
    """grpo_update's `forward` with logits at every position (the full-vocabulary path)."""
    from target_training.grpo import token_logprobs

    def forward(input_ids, response_mask, *, run_hooks):
        out = model(input_ids)
        return (*token_logprobs(out.logits, input_ids, temperature), out)

    return forward


@torch.no_grad()
def answer_logprobs(model, trajectories, cfg, full: bool) -> torch.Tensor:
    """The answer tokens' log-probs (concatenated over the batch, in order) before any update."""
    from target_training.grpo import answer_forward, pack_batch, token_logprobs, update_autocast

    batch = pack_batch(trajectories)
    ids, mask = batch["input_ids"], batch["response_mask"]
    mb = cfg.minibatch_size or len(trajectories)
    dev = next(model.parameters()).device
    parts = []
    for lo in range(0, len(trajectories), mb):
        x, m = ids[lo: lo + mb].to(dev), mask[lo: lo + mb].to(dev)
        if full:
            lp = token_logprobs(model(x).logits, x, cfg.temperature)[0]
        else:
            with update_autocast(cfg.compute_dtype, dev):
                lp = answer_forward(model, x, m, cfg.temperature)[0]
        parts.append(lp[m].cpu())
    return torch.cat(parts)


def one_update(model, start: dict, trajectories, rewards, group_size: int, cfg, full: bool) -> tuple[float, dict, dict]:
    """(seconds, metrics, weights after) of one update from `start`."""
    from target_training.grpo import GRPOTrainer, grpo_update

    model.load_state_dict(start)
    trainer = GRPOTrainer(model, cfg)
    aux = cfg.aux_loss_coef if cfg.aux_loss_coef is not None else model.cfg.router_aux_loss_coef
    t0 = time.perf_counter()
    if full:
        metrics = grpo_update(model, trajectories, rewards, group_size, cfg, trainer._apply_gradients,
                              forward=full_forward(model, cfg.temperature), aux_coef=aux)
    else:
        metrics = trainer.step(trajectories, rewards, group_size)
    seconds = time.perf_counter() - t0
    return seconds, metrics, {k: v.detach().clone() for k, v in model.state_dict().items()}


DRAFT_ARMS = {"draft-all-rows": (False, "fp32"), "draft-fp32": (True, "fp32"), "draft-bf16": (True, "bf16"),
              "draft-fp32-b": (True, "fp32")}  # arm -> (skip the rows no loss reads, compute dtype)


def draft_rows(policy, trajectories, preset, tokenizer, task, seed: int, cache_dir, repeats: int, log=print) -> list:
    """The draft-update arms (module docstring) on the batch's captured features."""
    import draft_models.ttt as ttt
    from draft_models.train import capture_features
    from specrl.cotrain import heldout_accept_length
    from specrl.online_trainer import OnlineDraftTrainer
    from specrl.drafts import starting_draft
    from target_training.sft import default_cache_dir

    draft, _ = starting_draft(policy, tokenizer, task, preset, seed, cache_dir or default_cache_dir(), log=log,
                           progress=False)
    records = capture_features(policy, [t.full_ids for t in trajectories],
                               [[0] * len(t.prompt_ids) + [1] * len(t.token_ids) for t in trajectories],
                               batch_size=8, d2t=draft.d2t)
    for r in records:
        r["policy_version"] = 0
    start = {k: v.detach().clone() for k, v in draft.state_dict().items()}
    batch = records[:preset.cotrain.online.batch_size]

    class Batch:  # the same records every update
        def sample(self, n, generator, prefer_rejected=0.0, min_version=None):
            return batch[:n]

    bound = ttt.first_needed_row
    times: dict[str, list] = {a: [] for a in DRAFT_ARMS}
    losses: dict[str, float] = {}
    try:
        for arm in [a for k in range(repeats + 1) for a in turn_order(list(DRAFT_ARMS), k)]:
            skip, dtype = DRAFT_ARMS[arm]
            ttt.first_needed_row = bound if skip else (lambda mask, steps: 0)
            draft.load_state_dict(start)
            trainer = OnlineDraftTrainer(draft, dataclasses.replace(preset.cotrain.online, compute_dtype=dtype))
            m = trainer.train_step(Batch(), None)
            draft.load_state_dict(start)
            t0 = time.perf_counter()
            heldout_accept_length(draft, records, preset.cotrain.spec.gamma)
            times[arm].append((m["seconds"], time.perf_counter() - t0))
            losses.setdefault(arm, m["draft_loss"])
    finally:
        ttt.first_needed_row = bound
        draft.load_state_dict(start)
    rows, base = [], None
    for arm in DRAFT_ARMS:
        timed = times[arm][1:]
        row = {"arm": arm, "seconds": statistics.median(t[0] for t in timed),
               "heldout_seconds": statistics.median(t[1] for t in timed), "sequences": len(batch),
               "draft_loss": losses[arm], "loss_gap": abs(losses[arm] - losses["draft-all-rows"])}
        base = base or row["seconds"]
        row["speedup"] = base / row["seconds"]
        rows.append(row)
        log(f"[bench update] {arm:<14} median {row['seconds']:.3f}s per draft update (x{row['speedup']:.2f}), "
            f"held-out measurement {row['heldout_seconds']:.3f}s; loss {row['draft_loss']:.5f}")
    return rows


def delta_gap(start: dict, after: dict, ref_after: dict) -> float:
    """||(after - start) - (ref_after - start)|| / ||ref_after - start|| over every weight."""
    num = sum(float((after[k].float() - ref_after[k].float()).pow(2).sum()) for k in start)
    den = sum(float((ref_after[k].float() - start[k].float()).pow(2).sum()) for k in start)
    return (num / den) ** 0.5 if den > 0 else float("nan")


def bench_update(task_name: str, preset_name: str, out_dir, *, seed: int = 0, cache_dir=None, repeats: int = 3,
                 log=print) -> dict:
    from target_training.grpo import native_bf16

    policy, trajectories, rewards, preset, tokenizer, task = rollout_batch(task_name, preset_name, seed, cache_dir,
                                                                           log=log)
    start = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    engine_lp = torch.cat([torch.as_tensor(t.logprobs, dtype=torch.float32) for t in trajectories])
    ref_lp = answer_logprobs(policy, trajectories, dataclasses.replace(preset.grpo, compute_dtype="fp32"), full=True)
    arms = {**ARMS, "full-fp32-b": ARMS["full-fp32"]}
    seconds: dict[str, list[float]] = {a: [] for a in arms}
    metrics: dict[str, dict] = {}
    after: dict[str, dict] = {}
    for arm in [a for k in range(repeats) for a in turn_order(list(arms), k)]:
        full, dtype = arms[arm]
        cfg = dataclasses.replace(preset.grpo, compute_dtype=dtype)
        s, m, w = one_update(policy, start, trajectories, rewards, preset.group_size, cfg, full)
        seconds[arm].append(s)
        metrics.setdefault(arm, m)
        after.setdefault(arm, w)
        log(f"[bench update] {arm:<12} {s:7.2f}s  loss {m['loss']:+.5f}  entropy {m['entropy']:.4f}")
    policy.load_state_dict(start)
    rows = []
    base = None
    for arm, (full, dtype) in arms.items():
        timed = seconds[arm][1:] if len(seconds[arm]) > 1 else seconds[arm]
        lp = answer_logprobs(policy, trajectories, dataclasses.replace(preset.grpo, compute_dtype=dtype), full=full)
        gap, eng = (lp - ref_lp).abs(), (lp - engine_lp).abs()
        row = {"arm": arm, "seconds": statistics.median(timed), "seconds_all": seconds[arm],
               "logprob_gap_max": float(gap.max()), "logprob_gap_mean": float(gap.mean()),
               "engine_gap_max": float(eng.max()), "engine_gap_mean": float(eng.mean()),
               "delta_gap": delta_gap(start, after[arm], after["full-fp32"]),
               **{k: metrics[arm][k] for k in ("loss", "pg_loss", "entropy", "clip_frac", "grad_norm",
                                               "logprob_mismatch") if k in metrics[arm]}}
        base = base or row["seconds"]
        row["speedup"] = base / row["seconds"]
        rows.append(row)
        log(f"[bench update] {arm:<12} median {row['seconds']:.2f}s (x{row['speedup']:.2f}); log-prob gap to "
            f"full-fp32 max {row['logprob_gap_max']:.2e} mean {row['logprob_gap_mean']:.2e}; weight change off "
            f"full-fp32's by {row['delta_gap']:.3f}")
    lengths = [len(t.token_ids) for t in trajectories]
    drafts = draft_rows(policy, trajectories, preset, tokenizer, task, seed, cache_dir, repeats, log=log)
    return save_summary(out_dir, {"draft_rows": drafts,
        "benchmark": "update", "task": task_name, "preset": preset_name, "seed": seed, "repeats": repeats,
        "sequences": len(trajectories), "answer_tokens": sum(lengths), "prompt_tokens":
        sum(len(t.prompt_ids) for t in trajectories), "minibatch_size": preset.grpo.minibatch_size,
        "native_bf16": native_bf16(torch.device("cpu")), "threads": torch.get_num_threads(), "rows": rows})


def headline(summary: dict) -> list[tuple[str, str]]:
    return [(r["arm"], f"{r['seconds']:.1f}s per update (x{r['speedup']:.2f}), log-prob gap max "
                       f"{r['logprob_gap_max']:.1e}") for r in summary["rows"]] + [
        (r["arm"], f"{r['seconds']:.3f}s per draft update (x{r['speedup']:.2f}), held-out measurement "
                   f"{r['heldout_seconds']:.3f}s") for r in summary.get("draft_rows", [])]
