"""Does a draft update under bf16 autocast learn what an fp32 one learns, on a real model's answers?

    python -m experiments.draft_precision --preset real --seed 0 --out runs/draft-precision-real-0

How. The preset's policy, as RL starts, samples `answers` answers to training prompts at the rollout
temperature; one policy forward captures their features and soft targets (as the trainer's
log-prob forward does for the co-trainer). The last `heldout` answers are held out. Two copies of
the preset's starting draft then make `updates` online updates each (`OnlineDraftTrainer`, the
preset's configuration: its warm-up and batch size) on the same batches in the same order, one in
fp32 and one under bf16 autocast (`OnlineDraftConfig.compute_dtype`; weights and AdamW stay fp32).
Each is measured on the held-out answers in fp32: expected accept length at the preset's chain
(`specrl.cotrain.heldout_accept_length`); and each update is timed. Prints and writes
DIR/summary.json (an existing one is never overwritten).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

from experiments.bench.common import exit_code, write_summary  # at import: it records the code this process started with

DTYPES = ("fp32", "bf16")


class Records:
    """A buffer over fixed records: `sample` draws with replacement from the generator it is given."""

    def __init__(self, records: list[dict]):
        self.records = records

    def sample(self, n: int, generator, prefer_rejected: float = 0.0, min_version=None) -> list[dict]:
        return [self.records[i] for i in torch.randint(0, len(self.records), (n,), generator=generator).tolist()]


def compare(task: str, preset_name: str, out_dir, *, seed: int = 0, answers: int = 64, heldout: int = 16,
            updates: int = 48, cache_dir=None, log=print) -> dict:
    from draft_models.train import capture_features
    from specrl.cotrain import heldout_accept_length
    from specrl.drafts import rollout_records, starting_draft
    from specrl.online_trainer import OnlineDraftTrainer
    from specrl.presets import get_preset
    from specrl.rl_setup import build_task_and_policy, encode_prompts, rollout_params
    from target_training.grpo import native_bf16
    from target_training.sft import default_cache_dir

    out = Path(out_dir)
    if (out / "summary.json").exists():
        raise FileExistsError(f"{out} already holds a result (summary.json); choose another --out")
    if not 0 < heldout < answers:
        raise ValueError(f"--heldout must be in [1, --answers), got {heldout} of {answers}")
    preset = get_preset(preset_name)
    cache_dir = cache_dir or default_cache_dir()
    tokenizer, task_obj, policy, _ = build_task_and_policy(task, preset, cache_dir, log=log)
    draft, _ = starting_draft(policy, tokenizer, task_obj, preset, seed, cache_dir, log=log, progress=False)
    pool = task_obj.examples("train", max(512, answers), seed + 1)
    t0 = time.perf_counter()
    seqs, masks = rollout_records(policy, encode_prompts(tokenizer, pool[:answers]), rollout_params(preset, tokenizer, seed),
                                  max_batch=preset.max_batch, request_offset=20_000_000)
    records = capture_features(policy, seqs, masks, batch_size=8, d2t=draft.d2t)
    log(f"[precision] {len(records)} answers ({sum(sum(m) for m in masks)} answer tokens) sampled and captured in "
        f"{time.perf_counter() - t0:.0f}s")
    train, held = Records(records[:-heldout]), records[-heldout:]
    gamma = preset.cotrain.spec.gamma
    result = {"task": task, "preset": preset_name, "seed": seed, "answers": answers, "heldout": heldout,
              "updates": updates, "gamma": gamma, "native_bf16": native_bf16(torch.device("cpu")),
              "start": heldout_accept_length(draft, held, gamma)[0], "arms": {}}
    for dtype in DTYPES:
        d = copy.deepcopy(draft)
        trainer = OnlineDraftTrainer(d, dataclasses.replace(preset.cotrain.online, compute_dtype=dtype))
        gen = torch.Generator().manual_seed(seed)
        steps = [trainer.train_step(train, gen) for _ in range(updates)]
        result["arms"][dtype] = {
            "heldout_expected_accept_length": heldout_accept_length(d, held, gamma)[0],
            "update_s_median": statistics.median(s["seconds"] for s in steps[1:] or steps),
            "loss_first": steps[0]["draft_loss"], "loss_last8": statistics.mean(s["draft_loss"] for s in steps[-8:])}
        log(f"[precision] {dtype}: held-out expected accept length {result['start']:.3f} -> "
            f"{result['arms'][dtype]['heldout_expected_accept_length']:.3f} after {updates} updates, "
            f"{result['arms'][dtype]['update_s_median']:.2f}s per update")
    fp32, bf16 = (result["arms"][k] for k in DTYPES)
    result["bf16_over_fp32_gain"] = ((bf16["heldout_expected_accept_length"] - result["start"])
                                     / (fp32["heldout_expected_accept_length"] - result["start"])
                                     if fp32["heldout_expected_accept_length"] != result["start"] else None)
    result["bf16_speedup"] = fp32["update_s_median"] / bf16["update_s_median"]
    return write_summary(out, result)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="real")
    ap.add_argument("--task", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--answers", type=int, default=64)
    ap.add_argument("--heldout", type=int, default=16)
    ap.add_argument("--updates", type=int, default=48)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    from specrl.presets import get_preset

    def run():
        if a.updates < 1:
            raise ValueError(f"--updates must be >= 1, got {a.updates}")
        compare(a.task or get_preset(a.preset).task, a.preset, a.out, seed=a.seed, answers=a.answers,
                heldout=a.heldout, updates=a.updates)
    return exit_code(run)


if __name__ == "__main__":
    sys.exit(main())
