"""`specrl bench speed --engine vllm`: speculative decoding speed on the real vLLM.

Arms, all greedy on the same prompts, timed in turns (`specrl.bench.timed_generate_interleaved`):

  vllm-plain      vLLM without speculation (the yardstick)
  vllm-eagle3     vLLM with EAGLE-3 chains of gamma drafts from the offline draft
  vllm-online     the same with another draft folder (`--online-draft`, e.g. a drift run's)
  embedded-plain  specrl's embedded engine without speculation, on the same model

Batch sizes. A vLLM engine's batch limit (`max_num_seqs`) is fixed when it starts, and a start
costs tens of seconds on 2 cores, so one engine per arm serves every batch size and each arm's
`generate` is fed the prompts in consecutive groups of `batch` (`Grouped`): every step of a
group decodes at most `batch` sequences. The embedded engine gets the same groups, so the two
engines run the same batches.

Every speculative row checks that its tokens equal vLLM plain's (greedy speculation must be
lossless) and carries the bound's measured parts from vLLM's own steps
(`rollout.vllm_profile`), so a row that misses a speed-up says why: accept length against the
cost of a verify step and of a draft step relative to a plain step.
"""
from __future__ import annotations

from rollout.protocol import same_tokens
from specrl.bench import (MEASUREMENT, format_row, format_table, model_summary, preset_chain_length, save_summary,
                          spec_row, speed_setup, timed_generate_interleaved)

VLLM_MEASUREMENT = {
    **{k: MEASUREMENT[k] for k in ("accept_length", "alpha", "c", "verify_cost", "bound", "efficiency",
                                   "bound_median", "speedup_median", "efficiency_median")},
    "tokens_per_s": "generated tokens / wall seconds of one generate() call over the row's prompts fed in groups of "
                    "`batch` (Grouped), best of the timed repeats after one warm-up call; the arms take turns "
                    "within each repeat; vLLM started once per arm before any timing",
    "target_step_s": "lower quartile of the wall time of vLLM's target forward (GPUModelRunner._model_forward in the "
                     "worker) over exactly `batch` tokens in the plain engine: full-batch decode steps, from one "
                     "extra timed run (rollout.vllm_profile)",
    "verify_s": "the same for the speculative engine's forwards over batch * (gamma + 1) tokens: full-batch verify steps",
    "draft_step_s": "lower quartile of the drafter's proposal per step (propose_draft_token_ids: its forward over the "
                    "newly accepted tokens, then the chain) divided by gamma",
    "identical_to_plain": "greedy tokens equal vLLM plain's on every prompt",
    "identical_to_vllm_plain": "(embedded-plain row) greedy tokens equal vLLM plain's on every prompt",
}


class Grouped:
    """An engine whose generate() runs the prompts in consecutive groups of `batch`, so that no
    step decodes more than `batch` sequences whatever the engine's own limit."""

    def __init__(self, engine, batch: int):
        self.engine, self.batch = engine, batch

    def generate(self, prompts, params):
        out = []
        for i in range(0, len(prompts), self.batch):
            group = prompts[i:i + self.batch]
            out += self.engine.generate(group, params, request_ids=range(i, i + len(group)))
        return out


def vllm_arms(policy, draft, gamma: int, max_batch: int, online_draft=None) -> dict:
    """One live engine per arm (vLLM starts on first use)."""
    from rollout.engine import EmbeddedEngine, EngineConfig
    from rollout.speculative import SpecConfig
    from rollout.vllm_engine import VLLMEngine, VLLMEngineConfig

    cfg = VLLMEngineConfig(max_batch=max_batch)
    arms = {"vllm-plain": VLLMEngine(policy, cfg),
            "vllm-eagle3": VLLMEngine(policy, cfg, draft=draft, spec=SpecConfig(gamma=gamma))}
    if online_draft is not None:
        arms["vllm-online"] = VLLMEngine(policy, cfg, draft=online_draft, spec=SpecConfig(gamma=gamma))
    arms["embedded-plain"] = EmbeddedEngine(policy, EngineConfig(max_batch=max_batch))
    return arms


def measure_vllm_batch(arms: dict, prompts, params, batch: int, gamma: int, repeats: int) -> list[dict]:
    """Every arm at one batch size: timed in turns, then one run of each vLLM arm under the
    step timers for the bound's parts."""
    from rollout.speculative import SpecConfig
    from rollout.vllm_profile import StepTimer, vllm_step_costs

    grouped = {name: Grouped(e, batch) for name, e in arms.items()}
    timed = timed_generate_interleaved(grouped, prompts, params, repeats)
    timers = {}
    for name, g in grouped.items():
        if name.startswith("vllm"):
            with StepTimer(arms[name]) as timers[name]:
                g.generate(prompts, params)
    plain = timed["vllm-plain"]
    rows = [{"batch": batch, "mode": "plain", "arm": "vllm-plain", "tokens_per_s": plain["tokens_per_s"], "speedup": 1.0}]
    for name in [n for n in arms if n not in ("vllm-plain", "embedded-plain")]:
        costs = vllm_step_costs(timers["vllm-plain"], timers[name], batch, gamma)
        rows.append({**spec_row(batch, SpecConfig(gamma=gamma), timed[name], plain, costs, {}), "arm": name})
    emb = timed["embedded-plain"]
    rows.append({"batch": batch, "mode": "plain", "arm": "embedded-plain", "tokens_per_s": emb["tokens_per_s"],
                 "speedup": emb["tokens_per_s"] / plain["tokens_per_s"],
                 "identical_to_vllm_plain": same_tokens(emb["trajectories"], plain["trajectories"])})
    return rows


def bench_speed_vllm(task_name: str, preset_name: str, out_dir, batches: list[int], *, seed: int = 0,
                     cache_dir=None, gamma: int | None = None, prompts_per_batch: int = 3, repeats: int = 3,
                     online_draft_dir=None, log=print) -> dict:
    """The vLLM speed table (module docstring), saved as DIR/summary.json."""
    from rollout.vllm_engine import require_vllm

    require_vllm()  # one line naming the fix, before the policy is built
    gamma = preset_chain_length(preset_name, gamma)
    policy, draft, params, prompts_for = speed_setup(task_name, preset_name, seed, cache_dir, 0.0)
    online = None
    if online_draft_dir is not None:
        from draft_models.checkpoint import load_draft

        online = load_draft(online_draft_dir, policy).eval()
    arms = vllm_arms(policy, draft, gamma, max(batches), online)
    rows = []
    try:
        for b in batches:
            new = measure_vllm_batch(arms, prompts_for(b * prompts_per_batch), params, b, gamma, repeats)
            for row in new:
                log(format_row(row))
            rows += new
    finally:
        for e in arms.values():
            if hasattr(e, "shutdown"):
                e.shutdown()
    summary = save_summary(out_dir, {"benchmark": "speed-vllm", "engine": "vllm", "task": task_name,
                                     "preset": preset_name, "temperature": 0.0, "gamma": gamma,
                                     "model": model_summary(policy, draft), "measurement": VLLM_MEASUREMENT,
                                     "repeats": repeats, "prompts_per_batch": prompts_per_batch, "rows": rows})
    log(format_table(summary["rows"]))
    best = max((r for r in rows if r["mode"] != "plain"), key=lambda r: r["speedup"], default=None)
    if best is not None:
        log(f"best speculative row: {best['arm']} batch {best['batch']} x{best['speedup']:.2f} "
            f"(accept length {best['accept_length']:.2f}, bound {best['bound'] if best['bound'] is None else round(best['bound'], 2)})")
    return summary


__all__ = ["bench_speed_vllm", "Grouped", "VLLM_MEASUREMENT"]
