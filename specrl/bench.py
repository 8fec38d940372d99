"""Generation benchmarks: numbers go to stdout and to DIR/summary.json, never into unit tests.

Every figure in one summary is measured in the same process, one after another on the same
prompts, so ratios between rows are meaningful on a noisy machine.
"""
from __future__ import annotations

import dataclasses
import json
import platform
import time
from pathlib import Path

import torch

from rollout.engine import EmbeddedEngine, EngineConfig
from rollout.protocol import summarize_spec_stats
from specrl.presets import get_preset
from specrl.train_rl import build_task_and_policy, encode_prompts, rollout_params
from target_training.sft import default_cache_dir


def machine_info() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}


def timed_generate(engine, prompts, params, repeats: int = 2) -> dict:
    """Best-of-repeats tokens/s after one warm-up call (same prompts each time)."""
    return timed_generate_interleaved({"engine": engine}, prompts, params, repeats)["engine"]


def timed_generate_interleaved(engines: dict, prompts, params, repeats: int = 2) -> dict[str, dict]:
    """`timed_generate` for several engines, taking turns within each repeat, so a slow spell of
    a noisy machine hits every engine alike instead of whichever ran during it."""
    for engine in engines.values():
        engine.generate(prompts[: min(len(prompts), 2)], params)
    best: dict[str, dict] = {}
    for _ in range(repeats):
        for name, engine in engines.items():
            t0 = time.perf_counter()
            trajs = engine.generate(prompts, params)
            wall = time.perf_counter() - t0
            n = sum(len(t.token_ids) for t in trajs)
            if name not in best or n / wall > best[name]["tokens_per_s"]:
                best[name] = {"tokens_per_s": n / wall, "tokens": n, "wall_s": wall, "trajectories": trajs}
    return best


def bench_generate(task_name: str, preset_name: str, out_dir, batches: list[int], *, seed: int = 0,
                   cache_dir=None, prompts_per_batch: int = 2) -> dict:
    preset = get_preset(preset_name)
    tokenizer, task, policy, _ = build_task_and_policy(task_name, preset, cache_dir or default_cache_dir())
    params = rollout_params(preset, tokenizer, seed, greedy=True)
    rows = []
    for b in batches:
        examples = task.examples("heldout", b * prompts_per_batch, seed)
        engine = EmbeddedEngine(policy, EngineConfig(max_batch=b))
        r = timed_generate(engine, encode_prompts(tokenizer, examples), params)
        rows.append({"batch": b, "mode": "plain", "tokens_per_s": round(r["tokens_per_s"], 2), "tokens": r["tokens"],
                     "wall_s": round(r["wall_s"], 4)})
        print(f"batch {b:>3}: {r['tokens_per_s']:8.1f} tokens/s ({r['tokens']} tokens in {r['wall_s']:.2f}s)")
    return save_summary(out_dir, {"benchmark": "generate", "task": task_name, "preset": preset_name, "rows": rows})


# -- speculative decoding speed ------------------------------------------------------------
def _median_seconds(fn, repeats: int = 15) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


@torch.no_grad()
def step_costs(policy, draft, prompts: list[list[int]], spec_cfg) -> dict:
    """Seconds of one single-token target step, one verify forward and one draft step, at this batch.

    Each is timed on caches prefilled with the prompts and rolled back after every call, so
    all three see the same context lengths."""
    from rollout.speculative import Speculator
    from rollout.tree import tree_attention_mask
    from target_training.model import KVCache

    B = len(prompts)
    cfg = policy.cfg
    spec = Speculator(draft, spec_cfg)
    cache = KVCache.for_model(cfg, B, cfg.max_seq_len + spec.block_slack())
    dcache = draft.new_cache(B, cfg.max_seq_len + spec.block_slack())
    T = max(len(p) for p in prompts)
    ids = torch.zeros(B, T, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    lens = torch.tensor([len(p) for p in prompts])
    slots = torch.arange(B)
    out = policy(ids, cache=cache, tap_layers=cfg.feature_layer_ids)
    cache.rollback(slots, lens)
    feats = out.features(cfg.feature_layer_ids)
    draft(ids, feats, cache=dcache)
    dcache.rollback(slots, lens)
    taps = cfg.feature_layer_ids
    if spec_cfg.mode == "chain":
        n_verify, n_draft = spec_cfg.gamma + 1, 1
        parents = torch.arange(-1, n_verify - 1).expand(B, n_verify)
    else:
        n_verify, n_draft = spec_cfg.tree_budget + 1, spec_cfg.tree_topk
        parents = torch.tensor([-1] + [(i - 1) // spec_cfg.tree_topk for i in range(1, n_verify)]).expand(B, n_verify)
    vmask = tree_attention_mask(parents, torch.ones(B, n_verify, dtype=torch.bool))
    one = ids[:, :1]
    block = ids[:, :1].expand(B, n_verify).contiguous()
    dh = torch.zeros(B, n_draft, draft.cfg.hidden_size)
    dids = ids[:, :1].expand(B, n_draft).contiguous()

    def target_step():
        policy(one, cache=cache, slots=slots, tap_layers=taps)
        cache.rollback(slots, lens)

    def verify():
        policy(block, cache=cache, slots=slots, attn_mask=vmask, tap_layers=taps)
        cache.rollback(slots, lens)

    def draft_step():
        draft(dids, dh, cache=dcache, slots=slots)
        dcache.rollback(slots, lens)

    t1, tv, td = _median_seconds(target_step), _median_seconds(verify), _median_seconds(draft_step)
    return {"target_step_s": t1, "verify_s": tv, "draft_step_s": td, "verify_cost": tv / t1, "c": td / t1,
            "verify_tokens": n_verify}


def measure_speculation(policy, draft, prompts, params, batch: int, spec_cfg, plain: dict, repeats: int = 3) -> dict:
    """One speculative configuration at one batch size against a plain run on the same prompts:
    tokens/s, speed-up, accept length, alpha, measured costs and the DESIGN section 4 bound."""
    from rollout.speculative import Speculator

    engine = EmbeddedEngine(policy, EngineConfig(max_batch=batch), speculator=Speculator(draft, spec_cfg))
    r = timed_generate(engine, prompts, params, repeats=repeats)
    same = [t.token_ids for t in r["trajectories"]] == [t.token_ids for t in plain["trajectories"]]
    agg = summarize_spec_stats(t.spec for t in r["trajectories"])
    costs = step_costs(policy, draft, prompts[:batch], spec_cfg)
    bound = agg["accept_length"] / (costs["verify_cost"] + spec_cfg.gamma * costs["c"])
    speedup = r["tokens_per_s"] / plain["tokens_per_s"]
    return {"batch": batch, "mode": spec_cfg.mode, "gamma": spec_cfg.gamma,
            "tree_budget": spec_cfg.tree_budget if spec_cfg.mode == "tree" else None,
            "tokens_per_s": r["tokens_per_s"], "speedup": speedup, "accept_length": agg["accept_length"],
            "alpha": agg["accept_rate"], "c": costs["c"], "verify_cost": costs["verify_cost"],
            "verify_tokens": costs["verify_tokens"], "bound": bound, "efficiency": speedup / bound,
            "identical_to_plain": same}


def format_row(row: dict) -> str:
    if row["mode"] == "plain":
        return f"batch {row['batch']:>3} plain: {row['tokens_per_s']:8.1f} tok/s"
    tag = f"{row['mode']} g={row['gamma']}" + (f" n={row['tree_budget']}" if row.get("tree_budget") else "")
    return (f"batch {row['batch']:>3} {tag:>14}: {row['tokens_per_s']:8.1f} tok/s  x{row['speedup']:.2f}  "
            f"tau {row['accept_length']:.2f}  alpha {row['alpha']:.2f}  c {row['c']:.2f}  verify {row['verify_cost']:.2f}  "
            f"bound {row['bound']:.2f}  eff {row['efficiency']:.2f}")


def speed_setup(task_name: str, preset_name: str, seed: int, cache_dir, temperature: float):
    """The policy, its cached offline draft, sampling params and a prompt maker for speed runs."""
    from rollout.protocol import SamplingParams
    from specrl.drafts import DraftTrainConfig, cached_offline_draft

    SamplingParams(temperature=temperature)  # a bad --temperature fails before the expensive setup
    preset = get_preset(preset_name)
    cache_dir = cache_dir or default_cache_dir()
    tokenizer, task, policy, _ = build_task_and_policy(task_name, preset, cache_dir)
    draft_prompts = encode_prompts(tokenizer, task.examples("train", 1024, seed + 7))
    draft, _ = cached_offline_draft(policy, draft_prompts, DraftTrainConfig(max_new_tokens=preset.max_new_tokens),
                                    (tokenizer.eos_id,), cache_dir)
    # replace() re-runs SamplingParams validation, so a bad --temperature is refused
    params = dataclasses.replace(rollout_params(preset, tokenizer, seed), temperature=temperature)

    def prompts_for(n: int):
        return encode_prompts(tokenizer, task.examples("heldout", n, seed))

    return policy, draft, params, prompts_for


def plain_row(policy, prompts, params, batch: int, repeats: int = 3) -> tuple[dict, dict]:
    plain = timed_generate(EmbeddedEngine(policy, EngineConfig(max_batch=batch)), prompts, params, repeats=repeats)
    return plain, {"batch": batch, "mode": "plain", "tokens_per_s": plain["tokens_per_s"], "speedup": 1.0}


def save_summary(out_dir, summary: dict) -> dict:
    summary["rows"] = [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in summary["rows"]]
    summary["machine"] = machine_info()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def bench_speed(task_name: str, preset_name: str, out_dir, batches: list[int], *, seed: int = 0, cache_dir=None,
                chain_gamma: int = 4, tree_depth: int = 4, tree_topk: int = 4, tree_budget: int = 12,
                prompts_per_batch: int = 3, temperature: float = 0.0) -> dict:
    """Plain, chain and tree decoding at each batch size, all in one process, plus the measured
    parts of the speed-up bound: accept length, per-token acceptance, draft cost c, verify cost."""
    from rollout.speculative import SpecConfig

    policy, draft, params, prompts_for = speed_setup(task_name, preset_name, seed, cache_dir, temperature)
    modes = [SpecConfig(mode="chain", gamma=chain_gamma),
             SpecConfig(mode="tree", gamma=tree_depth, tree_topk=tree_topk, tree_budget=tree_budget)]
    rows = []
    for b in batches:
        prompts = prompts_for(b * prompts_per_batch)
        plain, row = plain_row(policy, prompts, params, b)
        rows.append(row)
        rows.extend(measure_speculation(policy, draft, prompts, params, b, scfg, plain) for scfg in modes)
        for row in rows[-3:]:
            print(format_row(row))
    return save_summary(out_dir, {"benchmark": "speed", "task": task_name, "preset": preset_name,
                                  "temperature": temperature, "rows": rows})
