"""`specrl bench precision`: is speculation token-identical to plain decoding in fp32 and in bf16?

Losslessness is exact arithmetic's promise; floating point keeps it only where plain decoding and
the verify forward compute each token's logits alike. In fp32 on CPU they do (every test and
benchmark checks it). In bf16, a verify forward scores γ+1 positions in one matmul where a plain
step scores one, so sums are taken in another order, and a near tie between the two best tokens
can flip: the speculative sequence then goes on from a different token. This benchmark measures
how often, on the preset's SFT policy and its offline draft, both cast to the dtype.

Per dtype and per decoding arm (greedy; sampled with coupled noise, whose token identity rests on
the same logits), against plain decoding in that dtype on the same held-out prompts:
  sequences_identical   share of sequences with every token equal
  tokens_differing      share of token positions that differ (after a flip the rest of a
                        sequence usually differs too, so this overstates the number of flips)
  first_flip_median     median index of the first differing token among the flipped sequences
  logprob_gap_max       max |log-prob of a token under speculation - under plain decoding| over
                        the positions before each sequence's first flip (the log-probs handed
                        to RL)
Outputs in DIR: summary.json.
"""
from __future__ import annotations

import copy
import dataclasses
import statistics

import torch

from experiments.bench.common import save_summary, speed_setup
from rollout.engine import EmbeddedEngine, EngineConfig
from rollout.drafters import DrafterSpec, SpecConfig
from specrl.presets import get_preset

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def compare(plain, spec) -> dict:
    """Token identity and log-prob gap of speculative trajectories against plain ones (same order)."""
    identical, differing, positions, firsts, gap = 0, 0, 0, [], 0.0
    for a, b in zip(plain, spec):
        n = max(len(a.token_ids), len(b.token_ids))
        first = next((i for i in range(n) if i >= len(a.token_ids) or i >= len(b.token_ids)
                      or a.token_ids[i] != b.token_ids[i]), None)
        positions += n
        same_upto = n if first is None else first
        if first is None:
            identical += 1
        else:
            firsts.append(first)
            differing += sum(1 for i in range(n) if i >= len(a.token_ids) or i >= len(b.token_ids)
                             or a.token_ids[i] != b.token_ids[i])
        if same_upto:
            gap = max(gap, (a.logprobs[:same_upto] - b.logprobs[:same_upto]).abs().max().item())
    return {"sequences_identical": identical / max(len(plain), 1), "tokens_differing": differing / max(positions, 1),
            "first_flip_median": statistics.median(firsts) if firsts else None, "flipped_sequences": len(firsts),
            "logprob_gap_max": gap}


def bench_precision(task_name: str, preset_name: str, out_dir, *, seed: int = 0, cache_dir=None, n_prompts: int = 256,
                    batch: int = 16, dtypes=("fp32", "bf16"), log=print) -> dict:
    preset = get_preset(preset_name)
    policy, draft, params, prompts_for = speed_setup(task_name, preset_name, seed, cache_dir, temperature=0.0)
    prompts = prompts_for(n_prompts)
    gamma = preset.cotrain.spec.gamma
    specs = {"chain": SpecConfig(mode="chain", gamma=gamma),
             "tree": SpecConfig(mode="tree", gamma=gamma, tree_topk=3, tree_budget=2 * gamma)}
    rows = []
    for name in dtypes:
        dt = DTYPES[name]
        # copies cast to the dtype (one deepcopy keeps the draft's embedding shared with the target),
        # so no arm runs on weights another dtype has rounded, whatever the order of `dtypes`
        target, d = (m.to(dt) for m in copy.deepcopy((policy, draft)))
        for temperature in (0.0, 1.0):
            p = dataclasses.replace(params, temperature=temperature)
            plain = EmbeddedEngine(target, EngineConfig(max_batch=batch)).generate(prompts, p)
            for mode, cfg in specs.items():
                engine = EmbeddedEngine(target, EngineConfig(max_batch=batch), drafter=DrafterSpec(draft=d, spec=cfg))
                row = {"dtype": name, "decoding": "greedy" if temperature == 0.0 else "sampled (coupled)",
                       "spec": mode, **compare(plain, engine.generate(prompts, p))}
                rows.append(row)
                log(f"[bench precision] {name} {row['decoding']:<17} {mode:<5}: sequences identical "
                    f"{row['sequences_identical']:.3f}, tokens differing {row['tokens_differing']:.4f}, "
                    f"log-prob gap {row['logprob_gap_max']:.2e}")
    return save_summary(out_dir, {"benchmark": "precision", "task": task_name, "preset": preset_name,
                                  "prompts": n_prompts, "batch": batch, "device": str(next(policy.parameters()).device),
                                  "rows": rows})


def headline(summary: dict) -> list[tuple[str, str]]:
    return [(f"{r['dtype']} {r['decoding']} {r['spec']}", f"{r['sequences_identical']:.3f} of sequences identical")
            for r in summary["rows"]]
