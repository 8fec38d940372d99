"""Does `torch.compile` of the draft pay in the embedded engine? A measurement, not a feature.

Compiled forwards are worth having only where they pay. The draft is the safe place to try: what
it proposes changes only acceptance, never the tokens (verification is exact), so a compiled
draft cannot break losslessness. This script times plain decoding, the eager chain draft and
two compiled drafts, in turns on the same prompts, after compiling on a warm-up, and writes
summary.json:

  compiled  the draft's forward compiled by inductor with `dynamic=True` (batch, block and key
            lengths change every step). Until cc2e699 the draft's cache block read the longest
            slot length back from the tensor to size its keys, a graph break; since then the
            engine passes that length from the host (`key_len`), and it still loses on CPU.
  static    only the chain's one-token draft steps, each a static graph per row count
            (`dynamic=False`, `fullgraph=True`) that reads the whole draft cache (keys past a
            row's length are masked), as rollout/compiled.py does for the target; the forward
            over the pending features stays eager.

For the eager and static arms one more profiled run per arm gives the median draft and verify
phases of the full-batch steps (rollout.profile): whether a faster draft step makes the chain
step faster, or something else in the step pays for it (README, "Measured figures").

    python -m experiments.compile_draft --out DIR [--preset quick] [--batches 1,4,16]
"""
from __future__ import annotations

import copy
import time

import torch

from experiments import batch_sweep_main
from experiments.bench.common import profiled_run, save_summary, speed_setup, timed_generate_interleaved
from rollout.compiled import RECOMPILE_LIMIT
from rollout.engine import EmbeddedEngine, EngineConfig
from rollout.protocol import same_tokens
from rollout.drafters import DrafterSpec, SpecConfig
from rollout.drafters.eagle3 import Eagle3Proposer


def _whole_cache_step(draft, tokens, hidden, cache, slots):
    """One chain draft step reading every key of the draft cache: fixed shapes for a row count."""
    prenorm, logits = draft(tokens, hidden, cache=cache, slots=slots, key_len=cache.max_len, project=False)
    return prenorm, draft.to_target_logits(logits)


class _StaticStepProposer(Eagle3Proposer):
    def __init__(self, static_step, *args):
        super().__init__(*args)
        self.static_step = static_step

    def _draft_step(self, slots, key_len: int, hidden, tokens, positions=None, mask=None):
        if positions is None and mask is None and tokens.shape[1] == 1:
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):  # a graph per row count
                return self.static_step(self.draft, tokens, hidden, self.cache, slots)
        return super()._draft_step(slots, key_len, hidden, tokens, positions, mask)


def proposer_drafter(proposer_class, draft, config: SpecConfig, *args) -> DrafterSpec:
    """A drafter whose proposer is `proposer_class(*args, draft, config, n_slots, max_len)`, on
    `draft` itself (not a copy: a compiled forward stays bound to its module)."""
    return DrafterSpec("custom", spec=config,
                       proposer=lambda n_slots, max_len: proposer_class(*args, draft, config, n_slots, max_len))


def phase_medians(engine, prompts, params, batch: int) -> dict:
    """Median draft and verify-forward milliseconds over one profiled run's full-batch steps
    (milliseconds: the saved JSON keeps four decimals)."""
    import statistics

    _, prof = profiled_run(engine, prompts, params)
    steps = prof.select("spec", batch)
    return {f"{phase}_ms": 1e3 * statistics.median(r.phases.get(phase, 0.0) for r in steps) if steps else None
            for phase in ("draft", "verify_forward")}


def run(out_dir, preset: str = "quick", batches=(1, 4, 16), gamma: int = 4, repeats: int = 5,
        prompts_per_batch: int = 3, cache_dir=None, log=print) -> dict:
    policy, draft, params, prompts_for = speed_setup("arith", preset, 0, cache_dir, 0.0)
    compiled = copy.deepcopy(draft)
    compiled.forward = torch.compile(compiled.forward, dynamic=True)
    cfg = SpecConfig(mode="chain", gamma=gamma)
    rows = []
    for b in batches:
        prompts = prompts_for(prompts_per_batch * b)
        static_step = torch.compile(_whole_cache_step, dynamic=False, fullgraph=True)  # the `static` arm's draft steps
        engines = {"plain": EmbeddedEngine(policy, EngineConfig(max_batch=b)),
                   "eager": EmbeddedEngine(policy, EngineConfig(max_batch=b), drafter=DrafterSpec(draft=draft, spec=cfg)),
                   "compiled": EmbeddedEngine(policy, EngineConfig(max_batch=b),
                                              drafter=proposer_drafter(Eagle3Proposer, compiled, cfg)),
                   "static": EmbeddedEngine(policy, EngineConfig(max_batch=b),
                                            drafter=proposer_drafter(_StaticStepProposer, draft, cfg, static_step))}
        warm_s = {}
        for name in ("compiled", "static"):
            t0 = time.perf_counter()
            for _ in range(2):  # compile (and recompile for the dynamic shapes) outside the clock
                engines[name].generate(prompts, params)
            warm_s[name] = time.perf_counter() - t0
        timed = timed_generate_interleaved(engines, prompts, params, repeats)
        plain = timed["plain"]
        phases = {name: phase_medians(engines[name], prompts, params, b) for name in ("eager", "static")}
        for name, r in timed.items():
            rows.append({"batch": b, "arm": name, "tokens_per_s": r["tokens_per_s"],
                         "speedup": r["tokens_per_s"] / plain["tokens_per_s"], "engine_steps": r["engine_steps"],
                         "identical_to_plain": same_tokens(r["trajectories"], plain["trajectories"]),
                         **({"compile_warmup_s": warm_s[name]} if name in warm_s else {}),
                         **phases.get(name, {})})
        log(f"batch {b:>3}: " + "  ".join(f"{r['arm']} x{r['speedup']:.2f}" for r in rows if r["batch"] == b)
            + "  (draft / verify phase ms, eager " + " / ".join(_ms(v) for v in phases["eager"].values())
            + ", static " + " / ".join(_ms(v) for v in phases["static"].values())
            + "; warm-ups " + ", ".join(f"{k} {v:.1f}s" for k, v in warm_s.items()) + ")")
    summary = {"experiment": "compile_draft", "preset": preset, "gamma": gamma, "repeats": repeats,
               "rows": rows}
    return save_summary(out_dir, summary)


def _ms(ms) -> str:
    return "n/a" if ms is None else f"{ms:.2f}"


def main(argv=None) -> int:
    return batch_sweep_main(__doc__, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
