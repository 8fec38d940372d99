"""Where can a coupled draw flip? Replays a run's policy to an RL step with speculation off and
prints, for the answers of that step, the gap between the two best Gumbel-perturbed scores at
each answer token.

    python -m experiments.near_ties --preset speed-drift --seed 1 --step 36 --answer 46 --out runs/near-ties

Terms. With coupled sampling the token at answer position t is argmax(logp + g_t) (g_t: the
request's counter-based Gumbel noise, rollout.sampling.coupled_noise). Speculation verifies with
the target's logits from a block forward, whose sums run in another order than a plain step's;
where the two best perturbed scores lie closer than that rounding, the two can pick different
tokens (docs/design.md, lossless acceptance). `gap` is that margin, recomputed here from one
teacher-forced forward of the policy over each plain answer; `agree` says the recomputed argmax
is the answer's token (the replay decoded what the run decoded).

How. `specrl.train_rl.start_run` and `rl_step` with speculation off, `step` steps (the policy
after `step` updates: every arm of a `bench rl` run applies the same updates until its answers
part), then the step's prompts decoded plainly as `rl_step` decodes them. Writes DIR/summary.json:
per requested answer its length and its smallest gaps (token index, gap), and over all the
step's tokens the smallest gaps and the share below 1e-4 (the scalars `smallest_gap`,
`second_smallest_gap` and per answer `smallest_gap`, `smallest_gap_token` for the results JSON).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from experiments.bench.common import exit_code, write_summary  # at import: it records the code this process started with


def token_gaps(policy, prompt, answer, ids_key: int, seed: int, temperature: float):
    """(gaps, agree) per answer token: top-1 minus top-2 of logp + noise, and whether top-1 is the token."""
    from rollout.sampling import coupled_noise, process_logits

    seq = torch.tensor([list(prompt) + list(answer)])
    with torch.no_grad():
        logits = policy(seq).logits
    n, start = len(answer), len(prompt) - 1
    logp = process_logits(logits[0, start:start + n], temperature)
    noise = coupled_noise(seed, torch.tensor([ids_key]), torch.tensor([0]), n, logp.shape[-1])[0]
    top = (logp + noise).topk(2, dim=-1)
    return (top.values[:, 0] - top.values[:, 1]).tolist(), (top.indices[:, 0] == torch.tensor(list(answer))).tolist()


def near_ties(preset_name: str, out_dir, *, seed: int, step: int, answers=(), cache_dir=None, log=print) -> dict:
    from specrl.presets import get_preset
    from specrl.rl_setup import encode_prompts, generate_step, rollout_params, step_examples
    from specrl.train_rl import rl_step, start_run

    out = Path(out_dir)
    if (out / "summary.json").exists():
        raise FileExistsError(f"{out} already holds a near-tie replay (summary.json); choose another --out")
    preset = get_preset(preset_name)
    if step < 0:
        raise ValueError(f"--step must be >= 0, got {step}")
    n_answers = preset.prompts_per_step * preset.group_size
    if any(not 0 <= a < n_answers for a in answers):
        raise ValueError(f"--answer must be in [0, {n_answers}) for preset {preset_name}, got {list(answers)}")
    run, _, _ = start_run(preset.task, preset, out / "rl", seed=seed, resume=False, steps=None, cache_dir=cache_dir,
                          progress=False, spec="off", engine="embedded", log=log, evaluate_start=False)
    for s in range(step):
        rl_step(run, s)
    examples = step_examples(run.task, run.pool, preset, run.seed, step)
    ids = [step * len(examples) + i for i in range(len(examples))]
    prompts = encode_prompts(run.tokenizer, examples)
    trajs = generate_step(run.engine, prompts, rollout_params(preset, run.tokenizer, run.seed), ids, preset.group_size)
    run.engine.shutdown()
    per, every, agree = {}, [], True
    for i, t in enumerate(trajs):
        gaps, ok = token_gaps(run.policy, prompts[i], t.token_ids, ids[i], run.seed, preset.temperature)
        every += gaps
        agree = agree and all(ok)
        if i in answers:
            order = sorted(range(len(gaps)), key=gaps.__getitem__)[:5]
            per[str(i)] = {"tokens": len(gaps), "smallest": [[k, gaps[k]] for k in order], "agree": all(ok),
                           "smallest_gap": gaps[order[0]], "smallest_gap_token": order[0]}
            log(f"[near ties] answer {i}: {len(gaps)} tokens, smallest gaps "
                + ", ".join(f"token {k}: {gaps[k]:.3g}" for k in order))
    every.sort()
    result = {"preset": preset_name, "seed": seed, "step": step, "answers": per, "tokens": len(every),
              "smallest_gaps": every[:10], "smallest_gap": every[0] if every else None,
              "second_smallest_gap": every[1] if len(every) > 1 else None,
              "share_below_1e-4": sum(g < 1e-4 for g in every) / max(1, len(every)),
              "agree": agree}
    log(f"[near ties] step {step}: {len(every)} answer tokens, smallest gaps "
        + ", ".join(f"{g:.3g}" for g in every[:3]) + f"; replay agrees with its own tokens: {agree}")
    return write_summary(out, result)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="speed-drift")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step", type=int, required=True)
    ap.add_argument("--answer", type=int, action="append", default=[], help="an answer's index in the step (repeatable)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    return exit_code(lambda: near_ties(a.preset, a.out, seed=a.seed, step=a.step, answers=tuple(a.answer)))


if __name__ == "__main__":
    sys.exit(main())
