"""`specrl bench real`: plain decoding of a real pretrained model (target_training.real_models) on
the embedded engine, in fp32 and bf16, against HF `generate`, and with `--eagle3` EAGLE-3
speculation with the model's own offline draft (prints and saves JSON). With `--engine vllm`, vLLM
(rollout.vllm_engine, fp32) too: plain, and with `--eagle3` EAGLE-3 chains with the same draft.

Greedy, a fixed number of new tokens (no stop token, so every arm decodes the same count), chat
prompts of the word task's held-out problems in the model's chat template. Per batch size, the arms
take turns within each repeat (experiments.bench.common.timed_generate_interleaved) after one
warm-up call each; a cell is the median tokens/s over repeats. The JSON says whether the embedded
engine's fp32 tokens equal HF's (they should: the adapter's logits are HF's exactly) and how many
of bf16's tokens match fp32's (bf16 rounds the weights: another model, decoded losslessly).
An EAGLE-3 arm's speed-up is over plain decoding on its own engine (eagle3-fp32 over embedded-fp32,
vllm-eagle3-fp32 over vllm-fp32): the median over repeats of the two arms' tokens/s ratio within a
repeat. vLLM's arms start (tens of seconds each) in their untimed warm-up call.

The cost of speculating, two ways:
- `spec_step_in_plain_steps` (every EAGLE-3 arm): a speculative step's time (drafting and
  verifying) in plain steps of its own engine, implied by the two measured rates: accept length
  over speed-up, since both arms emit the same tokens.
- `c` and `verify_cost` (the embedded engine's EAGLE-3 arm): one draft step and one verify
  forward over one plain target step, from a profiled run of each engine per batch size
  (rollout.profile, full-batch steps only; specrl.bench.MEASUREMENT). vLLM has no such profile.

Outputs in DIR: summary.json.
"""
from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from types import SimpleNamespace

import torch

from experiments.bench.common import profiled_run, repeat_ratios, save_summary, timed_generate_interleaved
from rollout.engine import EmbeddedEngine, EngineConfig
from rollout.protocol import SamplingParams, accept_length
from rollout.drafters import DrafterSpec, SpecConfig
from specrl.config import DraftTrainConfig
from specrl.presets import REAL_DRAFT
from specrl.rl_setup import encode_prompts
from target_training.real_models import ChatTokenizer, load_real_target, real_hf_model
from target_training.tasks import get_task
from target_training.sft import default_cache_dir

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ENGINES = ("embedded", "vllm")
SPEEDUP_OVER = {"eagle3-fp32": "embedded-fp32", "vllm-eagle3-fp32": "vllm-fp32"}  # EAGLE-3 arm -> its plain arm


def word_prompts(tok, split: str, n: int, seed: int) -> list[list[int]]:
    """`n` of the real preset's word problems (target_training.tasks.WordTask; nothing is
    downloaded) in the model's chat template, encoded as the RL run encodes them."""
    return encode_prompts(ChatTokenizer(tok), get_task("word").examples(split, n, seed))


class HFGenerate:
    """HF `generate` (greedy, left-padded batch) behind the embedded engine's generate() shape."""

    def __init__(self, model, pad_id: int):
        self.model, self.pad_id = model.eval(), pad_id

    @torch.no_grad()
    def generate(self, prompts, params: SamplingParams, request_ids=None):  # greedy: no noise to key
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + list(p) for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = self.model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=params.max_new_tokens,
                                  min_new_tokens=params.max_new_tokens, eos_token_id=None, pad_token_id=self.pad_id)
        return [SimpleNamespace(token_ids=row[width:].tolist()) for row in out]


def real_draft(model, tok, cfg: DraftTrainConfig, cache_dir, log=print):
    """The real model's starting EAGLE-3 draft: trained offline on its own sampled answers to
    training problems of the word task, cached (specrl.drafts). The same prompts and settings as
    the real preset's RL run (specrl.train_rl.build_cotrainer, seed 0), so both use one draft."""
    from specrl.drafts import cached_offline_draft

    prompts = word_prompts(tok, "train", cfg.n_sequences, 7)
    return cached_offline_draft(model, prompts, cfg, (ChatTokenizer(tok).eos_id,), cache_dir, log=log)


def bench_real(model_name: str, out_dir, *, batches=(1, 8, 32), dtypes=("fp32", "bf16"), max_new_tokens: int = 64,
               repeats: int = 3, hf: bool = True, eagle3: bool = False, draft_steps: int | None = None, gamma: int = 4,
               engine: str = "embedded", cache_dir=None, log=print) -> dict:
    """Plain decoding per dtype (and HF generate); with `eagle3`, also EAGLE-3 chains of `gamma` in
    fp32 with the model's cached offline draft (REAL_DRAFT, `draft_steps` training steps); with
    engine="vllm", also vLLM in fp32: plain, and with `eagle3` EAGLE-3 chains with the same draft."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")
    if engine == "vllm":
        if "fp32" not in dtypes:
            raise ValueError("--engine vllm runs vLLM in fp32, compared with the embedded fp32 arm: "
                             "include fp32 in --dtypes")
        from rollout.vllm_engine import require_vllm

        require_vllm()  # one line naming the fix, before the model is loaded

    out = Path(out_dir)
    cache_dir = cache_dir or default_cache_dir()
    arms, tok, info, draft = {}, None, {}, None
    for name in dtypes:
        model, tok = load_real_target(model_name, cache_dir, dtype=DTYPES[name], log=log)
        prompts = word_prompts(tok, "heldout", max(batches), 0)
        # the KV cache sized to the work (the model's own context, 8192 tokens, would be attended over in full)
        max_len = max(len(p) for p in prompts) + max_new_tokens
        arms[f"embedded-{name}"] = EmbeddedEngine(model, EngineConfig(max_batch=max(batches), max_len=max_len))
        if eagle3 and name == "fp32":
            cfg = REAL_DRAFT if draft_steps is None else dataclasses.replace(REAL_DRAFT, steps=draft_steps)
            draft, info = real_draft(model, tok, cfg, cache_dir, log=log)
            info = {**info, "config": dataclasses.asdict(cfg), "draft_parameters": draft.num_parameters()}
            arms["eagle3-fp32"] = EmbeddedEngine(model, EngineConfig(max_batch=max(batches), max_len=max_len),
                                                 drafter=DrafterSpec(draft=draft, spec=SpecConfig(mode="chain", gamma=gamma)))
        if engine == "vllm" and name == "fp32":
            arms.update(vllm_arms(model, draft if eagle3 else None, max_len, max(batches), gamma))
    if hf:
        hf_model, _ = real_hf_model(model_name, cache_dir, log=log)
        arms["hf-generate-fp32"] = HFGenerate(hf_model, tok.pad_token_id if tok.pad_token_id is not None else 0)
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    try:
        rows = _timed_rows(arms, prompts, params, batches, repeats, log)
        if "eagle3-fp32" in arms:
            _add_embedded_costs(rows, arms, prompts, params, gamma, log)
    finally:
        for arm in arms.values():
            if hasattr(arm, "shutdown"):  # vLLM's processes
                arm.shutdown()
    summary = save_summary(out, {"benchmark": "real", "model": model_name, "engine": engine,
                                 "max_new_tokens": max_new_tokens, "repeats": repeats, "greedy": True,
                                 "prompt_tokens": [len(p) for p in prompts], "gamma": gamma if eagle3 else None,
                                 "draft": info or None, "rows": rows})
    log(f"  {'batch':>5}  {'arm':<18} {'tokens/s':>9}  {'speed-up':>8}  {'accept':>6}  {'spec step':>9}  "
        f"{'c':>6}  same tokens as embedded-fp32")
    for r in rows:
        x = f"x{r['speedup']:.2f}" if "speedup" in r else "-"
        a = f"{r['accept_length']:.2f}" if "accept_length" in r else "-"
        k = f"{r['spec_step_in_plain_steps']:.2f}" if "spec_step_in_plain_steps" in r else "-"
        c = f"{r['c']:.3f}" if r.get("c") is not None else "-"
        log(f"  {r['batch']:>5}  {r['arm']:<18} {r['tokens_per_s']:>9.1f}  {x:>8}  {a:>6}  {k:>9}  {c:>6}  "
            f"{r.get('sequences_equal_to_embedded_fp32', '-')}")
    return summary


def vllm_arms(model, draft, max_len: int, max_batch: int, gamma: int) -> dict:
    """vLLM plain ("vllm-fp32") and, with a draft, EAGLE-3 chains of `gamma` ("vllm-eagle3-fp32"):
    the context window sized to the work, the KV cache to the largest batch (no request waits for
    room, as none does on the embedded engine's per-slot cache)."""
    from rollout.vllm_engine import VLLMEngine, VLLMEngineConfig, kv_cache_bytes_for

    kv = max(VLLMEngineConfig.kv_cache_bytes, kv_cache_bytes_for(model.cfg, max_len, max_batch, draft=draft))
    cfg = VLLMEngineConfig(max_batch=max_batch, max_len=max_len, kv_cache_bytes=kv)
    arms = {"vllm-fp32": VLLMEngine(model, cfg)}
    if draft is not None:
        arms["vllm-eagle3-fp32"] = VLLMEngine(model, cfg, drafter=DrafterSpec(draft=draft, spec=SpecConfig(mode="chain", gamma=gamma)))
    return arms


def _timed_rows(arms: dict, prompts, params, batches, repeats: int, log) -> list[dict]:
    rows = []
    for batch in batches:
        timed = timed_generate_interleaved(arms, prompts[:batch], params, repeats=repeats)
        tokens = {a: [t.token_ids for t in r["trajectories"]] for a, r in timed.items()}
        for arm, r in timed.items():
            row = {"batch": batch, "arm": arm, "tokens_per_s": statistics.median(r["tokens_per_s_repeats"]),
                   "tokens_per_s_repeats": r["tokens_per_s_repeats"]}
            if arm != "embedded-fp32" and "embedded-fp32" in tokens:
                same = [a == b for a, b in zip(tokens[arm], tokens["embedded-fp32"])]
                row["sequences_equal_to_embedded_fp32"] = f"{sum(same)}/{len(same)}"
            if arm in SPEEDUP_OVER:
                # speed-up: the median over repeats of the two arms' tokens/s ratio within a repeat
                row["speedup"] = statistics.median(repeat_ratios(r, timed[SPEEDUP_OVER[arm]]))
                row["speedup_over"] = SPEEDUP_OVER[arm]
                stats = [t.spec for t in r["trajectories"]]
                row["accept_length"] = accept_length(sum(s.accepted for s in stats), sum(s.verify_steps for s in stats))
                row["spec_step_in_plain_steps"] = row["accept_length"] / row["speedup"]
            rows.append(row)
        log("[bench real] batch %d: %s" % (batch, ", ".join(f"{r['arm']} {r['tokens_per_s']:.1f} tok/s"
                                                           for r in rows if r["batch"] == batch)))
    return rows


def _add_embedded_costs(rows: list[dict], arms: dict, prompts, params, gamma: int, log) -> None:
    """Adds `c` and `verify_cost` to each eagle3-fp32 row: a profiled (untimed) run of the plain
    and the EAGLE-3 embedded engines at that row's batch size (experiments.bench.speed.engine_step_costs)."""
    from experiments.bench.speed import engine_step_costs

    for row in rows:
        if row["arm"] != "eagle3-fp32":
            continue
        batch = row["batch"]
        _, plain = profiled_run(arms["embedded-fp32"], prompts[:batch], params)
        _, spec = profiled_run(arms["eagle3-fp32"], prompts[:batch], params)
        costs = engine_step_costs(plain, spec, batch, gamma)
        row.update({k: costs[k] for k in ("c", "verify_cost", "target_step_s", "draft_step_s", "verify_s")})
        if costs["c"] is not None:
            log(f"[bench real] batch {batch}: embedded draft step c = {costs['c']:.3f} of a target step, "
                f"verify forward {costs['verify_cost']:.2f} target steps")
