"""Which loss, which precision, and which learning rate and batch should the online draft train
with? The TTT cross-entropy against CE plus a TV-distance term (an LK-style hybrid), against the
same cross-entropy under bf16 autocast, and against larger learning rates and batches, on the
same data; each arm's held-out acceptance is read against the updates' measured seconds.

    python -m experiments.loss_compare --preset speed --seed 0 --out runs/loss-speed-0
    python -m experiments.loss_compare --preset real --arms ce,ce-bf16 --seed 0 --out runs/loss-real-0
    python -m experiments.loss_compare --preset speed-drift --rl-steps 20 --on-policy \
        --arms ce,lr-x2,lr-x4,batch-x2,batch-x2-lr-x2,ttt-2,ttt-1 --seed 3 --out runs/update-sd-3

Terms. The cross-entropy objective ("ce") is `draft_models.ttt.ttt_loss` as the co-trainer uses
it: soft cross-entropy against the target's distribution restricted to the draft vocabulary, per
TTT step. The hybrid ("ce+tv") subtracts `weight` times the expected per-step acceptance
sum_x min(p(x), q(x)) = 1 - TV(p, q) (OnlineDraftConfig.acceptance_weight): the quantity
rejection sampling accepts, which TV- and LK-style draft losses optimise directly. "ce-bf16" is
"ce" with its forward and backward under bf16 autocast (OnlineDraftConfig.compute_dtype; weights
and AdamW in fp32), what a CPU with AVX512-BF16 or a GPU computes about twice as fast.

How. One RL run of the preset (`specrl.train_rl`, its co-training told to train nothing, the
preset's chain at every engine step so that every arm is measured at that chain) runs
`rl_steps` steps, so the policy moves and the trainer's forward fills the feature buffer with
on-policy features and the held-out slice (every 8th answer, never trained on). Then two copies
of the starting draft train `updates` updates each on those records, with one sampling seed (the
same batches in the same order), one per arm, each update timed. Each is measured on the held-out answers
(expected accept length at the preset's chain, draft_models.ttt.expected_accept_length) and by
decoding the preset's evaluation prompts with the run's engine at the rollout temperature
(measured accept length; the tokens are the same in every arm, speculation being lossless).
The starting draft is measured the same way. Prints and writes DIR/summary.json.

The update's cost. The arms "lr-x2", "lr-x4" (the preset's online learning rate times 2 or 4),
"batch-x2" (twice its records per update), "batch-x2-lr-x2", "ttt-2" and "ttt-1" (2 unrolled TTT
steps per update, or 1, plain next-token training, instead of the draft's own: 4 in the toy
presets, DraftTrainConfig.ttt_steps) change what one update buys and, for the batch and the
unroll, what it costs. Each arm's held-out expected accept length is also measured after
4, 8, 16, ... updates (`curve`: rows of step, the updates made; seconds, their summed time;
heldout, the value), and `heldout_at_ce_seconds` reads every arm's curve at the seconds the "ce"
arm had spent at each of its points (rows of step, ce's updates; seconds; heldout, linear between
the arm's points, None past its last; gain_over_ce, the arm's gain over the starting draft there
over ce's): held-out acceptance per second of draft training, the currency of the co-training
budget. `--on-policy` trains on the
records of the co-trainer's recent policy versions only (CoTrainConfig.recent_versions), as the
co-trainer does; without it, on every record the run captured.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
from pathlib import Path

import torch

from experiments.bench.common import exit_code, write_summary  # at import: it records the code this process started with

# arm -> its OnlineDraftConfig fields over the preset's; "lr_scale" and "batch_scale" multiply the
# preset's learning rate and records per update
ARMS = {"ce": {"compute_dtype": "fp32"}, "ce+tv": {"acceptance_weight": 1.0, "compute_dtype": "fp32"},
        "ce-bf16": {"compute_dtype": "bf16"},
        "lr-x2": {"lr_scale": 2.0}, "lr-x4": {"lr_scale": 4.0}, "batch-x2": {"batch_scale": 2},
        "batch-x2-lr-x2": {"lr_scale": 2.0, "batch_scale": 2}, "ttt-2": {"ttt_steps": 2}, "ttt-1": {"ttt_steps": 1}}
LOSS_ARMS = ("ce", "ce+tv", "ce-bf16")  # the default: the objective and its precision


def arm_config(base, name: str):
    """The OnlineDraftConfig of arm `name` over the preset's `base`."""
    fields = dict(ARMS[name])
    lr = base.lr * fields.pop("lr_scale", 1.0)
    batch = base.batch_size * fields.pop("batch_scale", 1)
    return dataclasses.replace(base, lr=lr, batch_size=batch, **fields)


def curve_points(updates: int) -> list[int]:
    """The update counts at which an arm's held-out acceptance is measured: 4, 8, 16, ... and `updates`."""
    points, n = [], 4
    while n < updates:
        points.append(n)
        n *= 2
    return points + [updates]


def read_at(curve: list[dict], seconds: float) -> float | None:
    """A curve's held-out value at `seconds` of updates (linear between its points, from the
    starting draft's value at 0 s); None past its last point."""
    for a, b in zip(curve, curve[1:]):
        if a["seconds"] <= seconds <= b["seconds"]:
            w = (seconds - a["seconds"]) / (b["seconds"] - a["seconds"]) if b["seconds"] > a["seconds"] else 1.0
            return a["heldout"] + w * (b["heldout"] - a["heldout"])
    return None


def measure(run, draft, prompts, params, ids) -> dict:
    """A draft's held-out expected accept length and its measured accept length on `prompts`."""
    from draft_models.checkpoint import draft_state_dict_for_sglang
    from rollout.protocol import summarize_spec_stats
    from specrl.cotrain import heldout_accept_length

    expected, depth = heldout_accept_length(draft, run.cotrain.buffer.heldout, run.preset.cotrain.spec.gamma,
                                            coupled=run.cotrain.acceptance == "coupled")  # the engine's rule
    weights = {k: v.detach().cpu().clone() for k, v in draft_state_dict_for_sglang(draft).items()}
    run.engine.set_speculation(True)
    run.engine.push_draft(weights, run.engine.draft_version + 1)
    out = run.engine.generate(prompts, params, request_ids=ids)
    agg = summarize_spec_stats(t.spec for t in out)
    return {"heldout_expected_accept_length": expected, "heldout_accept_per_depth": depth,
            "measured_accept_length": agg["accept_length"], "tokens": sum(len(t.token_ids) for t in out),
            "answers": [list(t.token_ids) for t in out]}


def compare(task: str, preset_name: str, out_dir, *, seed: int = 0, rl_steps: int = 6, updates: int = 64,
            arms=LOSS_ARMS, on_policy: bool = False, cache_dir=None, log=print) -> dict:
    from specrl.cotrain import heldout_accept_length
    from specrl.online_trainer import OnlineDraftTrainer
    from specrl.presets import get_preset
    from specrl.rl_setup import encode_prompts, rollout_params
    from specrl.train_rl import rl_step, start_run

    out = Path(out_dir)
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise ValueError(f"unknown arm(s) {unknown or arms}; choose from {', '.join(ARMS)}")
    if (out / "summary.json").exists():
        raise FileExistsError(f"{out} already holds a loss comparison (summary.json); choose another --out")
    base = get_preset(preset_name)
    preset = dataclasses.replace(base, rl_steps=rl_steps,
                                 cotrain=dataclasses.replace(base.cotrain, max_draft_steps=0, buffer_bytes=512 << 20,
                                                             adaptive=False))  # the chain at every step
    run, _, _ = start_run(task, preset, out / "rl", seed=seed, resume=False, steps=None, cache_dir=cache_dir,
                          progress=False, spec="online", engine="embedded", log=log, evaluate_start=False)
    for step in range(rl_steps):
        row = rl_step(run, step)
        log(f"[loss] RL step {step}: reward {row['reward']:.3f}, kl_ref {row.get('kl_ref', 0.0):.4f}")
    if not run.cotrain.buffer.heldout:
        raise ValueError(f"no held-out answers after {rl_steps} RL steps (one prompt in "
                         f"{preset.cotrain.heldout_every} is held out): raise --rl-steps")
    start = copy.deepcopy(run.cotrain.draft)
    examples = run.heldout[:32]
    prompts = encode_prompts(run.tokenizer, examples)
    params = rollout_params(preset, run.tokenizer, seed)
    ids = list(range(10_000, 10_000 + len(prompts)))
    buffer = run.cotrain.buffer
    min_version = run.cotrain.min_train_version() if on_policy else None
    records = buffer.count(min_version)
    result = {"task": task, "preset": preset_name, "seed": seed, "rl_steps": rl_steps, "updates": updates,
              "on_policy": on_policy, "min_version": min_version, "train_records": records,
              "heldout_records": len(buffer.heldout), "gamma": preset.cotrain.spec.gamma, "arms": {}}
    result["arms"]["start"] = measure(run, copy.deepcopy(start), prompts, params, ids)
    start_value = result["arms"]["start"]["heldout_expected_accept_length"]
    points = curve_points(updates)
    for name in arms:
        draft = copy.deepcopy(start)
        config = arm_config(preset.cotrain.online, name)
        trainer = OnlineDraftTrainer(draft, config)
        gen = torch.Generator().manual_seed(seed)
        steps, curve = [], [{"step": 0, "seconds": 0.0, "heldout": start_value}]
        for n in points:
            while len(steps) < n:
                steps.append(trainer.train_step(buffer, gen, min_version=min_version))
            value, _ = heldout_accept_length(draft, buffer.heldout, preset.cotrain.spec.gamma,
                                             coupled=run.cotrain.acceptance == "coupled")
            curve.append({"step": n, "seconds": sum(x["seconds"] for x in steps), "heldout": value})
        m = measure(run, draft, prompts, params, ids)
        m["lr"], m["batch_size"] = config.lr, config.batch_size
        m["loss_first"], m["loss_last"] = steps[0]["draft_loss"], steps[-1]["draft_loss"]
        m["update_s_median"] = statistics.median(x["seconds"] for x in steps[1:] or steps)
        m["curve"] = curve
        result["arms"][name] = m
    answers = [m.pop("answers") for m in result["arms"].values()]
    result["same_tokens"] = all(a == answers[0] for a in answers)
    if "ce" in arms:  # every arm at the seconds "ce" had spent at each of its points
        marks = [(p["step"], p["seconds"], p["heldout"]) for p in result["arms"]["ce"]["curve"][1:]]
        for name in arms:
            rows = []
            for n, t, ce_value in marks:
                value = read_at(result["arms"][name]["curve"], t)
                gain = None if value is None or ce_value <= start_value else (value - start_value) / (ce_value - start_value)
                rows.append({"step": n, "seconds": t, "heldout": value, "gain_over_ce": gain})
            result["arms"][name]["heldout_at_ce_seconds"] = rows
    run.engine.shutdown()
    for name, m in result["arms"].items():
        log(f"[loss] {name:<14} held-out expected accept length {m['heldout_expected_accept_length']:.3f}, "
            f"measured {m['measured_accept_length']:.3f}"
            + (f", {m['update_s_median']:.3f} s per update" if "update_s_median" in m else "")
            + (" ; at the seconds of ce's " + "/".join(str(p) for p in points) + " updates: "
               + " ".join("-" if p["heldout"] is None else f"{p['heldout']:.3f}" for p in m["heldout_at_ce_seconds"])
               if "heldout_at_ce_seconds" in m else ""))
    return write_summary(out, result)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="speed")
    ap.add_argument("--task", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rl-steps", type=int, default=6)
    ap.add_argument("--updates", type=int, default=64)
    ap.add_argument("--arms", default=",".join(LOSS_ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--on-policy", action="store_true",
                    help="train on the co-trainer's recent policy versions only (CoTrainConfig.recent_versions)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    from specrl.presets import get_preset

    def run():
        if a.rl_steps < 1 or a.updates < 1:
            raise ValueError(f"--rl-steps and --updates must be >= 1, got {a.rl_steps}, {a.updates}")
        compare(a.task or get_preset(a.preset).task, a.preset, a.out, seed=a.seed, rl_steps=a.rl_steps,
                updates=a.updates, arms=tuple(x for x in a.arms.split(",") if x), on_policy=a.on_policy)
    return exit_code(run)


if __name__ == "__main__":
    sys.exit(main())
