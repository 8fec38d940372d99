"""The drift experiment: does speculative decoding stay fast while RL moves the policy?

One GRPO run (`specrl.train_rl.train_rl`, with online speculation, so its rollouts are the
co-trained engine's) and, at evaluation points, four arms decoding the *same* held-out prompts
with the *current* policy:

  plain      no speculation (the yardstick for speed-up)
  frozen     the starting offline draft, never updated
  online     the draft specrl co-trains during the run (the engine's hot-swapped copy)
  reference  a draft retrained offline on the current policy (an upper bound): at the end of
             the run, and at every N-th evaluation point with `reference_every` N (the full
             preset: every point). At step 0 the reference is the starting draft itself: it is
             that same offline recipe on that same policy, so nothing is retrained there.

Decoding is sampled at the rollout temperature with counter-based noise, so every arm emits
exactly the same tokens (speculation is lossless) and only accept length and speed differ.
Drift is measured as the policy's token-level KL from its starting point on plain's samples.

The engine (`engine`, "embedded" or "vllm") is how the arms are built and decode
(`EmbeddedDecoding`, `VLLMDecoding`); the run, the evaluation points and the sweep are one.
On vLLM the RL rollouts come from a live vLLM with EAGLE-3 speculation (the policy synced in
place after every update, the online draft pushed after its updates: rollout.vllm_engine), and
the arms decode greedily: vLLM's greedy speculation is token-identical to plain vLLM, while its
sampled speculation follows the policy's law but not plain vLLM's tokens, and arms that emit
different tokens cannot be compared (the policy KL is still taken at the rollout temperature).

Outputs in DIR: metrics.jsonl (a row per evaluation point and arm; the online row of a point
with a reference carries `online_over_reference`, the ratio of their accept lengths; every
online row carries `online_over_frozen` with its 95% paired bootstrap interval over the
evaluation prompts, `online_over_frozen_low`/`_high`, the noise against which "online below
frozen at a point" is judged), summary.json, rl/ (the RL run's own metrics.jsonl and checkpoint) and the PNG plots of
`experiments.plots`.

What the online draft costs, `draft_added_fraction` in summary.json: RL step time with online
co-training over RL step time with the same speculation and no draft training, minus 1, from
this one run. Every piece of draft work runs sequentially on the RL loop's own thread in the
scheduler's windows (`perf/draft_train_s`, which includes the weight sync) or inside the
policy trainer's log-prob forward (`perf/feature_capture_s`), each timed by the clock around
it. Without draft training those pieces are simply absent and the rest of the step is the
same work (the engine speculates with the same draft weights either way), so
  draft_added_fraction = sum(draft_train_s + feature_capture_s) / sum(step_s - those) over the
RL steps. Evaluation and reference training run in callbacks, outside step_s.

The online draft's end speed-up over the frozen one: both decode the same tokens with the same
chain length, so a step costs about the same in either arm (the same forwards; only which experts
the drafted tokens wake differs), and the ratio of their engine steps at the last point
(`online_over_frozen_steps_end`) is the speed-up without the machine's noise;
`speedup_online_over_frozen_end` is its wall-clock measurement (median over the timed repeats of
the two arms' tokens/s ratio within a repeat). With `deep_target` (a model preset), the
speed-against-batch sweep is repeated on that preset's SFT policy and offline draft
(`speedup_vs_batch_deep_target`): the drift policy is small, so that sweep shows what the same
engine gives at a realistic draft/target cost ratio.

Reproducibility: with a fixed chain and counted updates (the CI presets, DRIFT_COTRAIN_FIXED)
every field of summary.json is byte-identical across runs on CPU with one seed, except those
listed in its `timing_fields` (wall-clock measurements). The other presets' online arm co-trains
with the RL presets' one configuration (presets.cotrained): adaptive speculation, and draft
updates bought by the value budget from measured seconds, so their update counts, and with them
the draft, may differ between two runs on a machine whose load differs; the tokens do not
(speculation is lossless).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from experiments.bench.common import Grouped, gate_counts, gate_over_start, machine_info, repeat_ratios, timed_generate_interleaved
from rollout.engine import EmbeddedEngine, EngineConfig
from rollout.protocol import accept_length_ratio_interval, same_tokens, summarize_spec_stats
from rollout.drafters import DrafterSpec, SpecConfig
from specrl.config import ControllerConfig
from specrl.controller import SpeculationController
from specrl.drafts import train_offline_draft
from specrl.machine_load import STEP_KEY, shared, shared_steps
from specrl.presets import DRIFT_COTRAIN_FIXED, RL_PRESETS, RunPreset, cotrained
from specrl.rl_setup import encode_prompts, rollout_params
from specrl.train_rl import RLCallback, RLRun, train_rl
from target_training.config import require_positive
from target_training.grpo import pack_batch

ARMS = ("plain", "frozen", "online", "reference")
# fields of summary.json that come from the wall clock and differ between runs of one seed
TIMING_FIELDS = ("speedup_frozen_start", "speedup_frozen_end", "speedup_online_end", "speedup_reference_end",
                 "speedup_online_over_frozen_end",
                 "speedup_vs_batch", "speedup_vs_batch_deep_target", "plain_tokens_per_s_end", "draft_added_fraction",
                 "rl_step_s", "wall_s", "others_busy_cores_rl_max", "rl_steps_shared", "others_busy_cores_eval_max")


class DriftError(ValueError):
    pass


@dataclass
class DriftPreset:
    rl: RunPreset  # the GRPO run (model, SFT, task and its drift-inducing reward, steps)
    eval_every: int = 10  # RL steps between evaluation points (plus step 0 and the end)
    eval_prompts: int = 32
    eval_batch: int = 8  # speculation pays best at small to moderate batch on an MoE target (docs/design.md section 4)
    timing_repeats: int = 2
    # the end point's repeats (0: timing_repeats): the end-of-run speed-ups are the run's headline
    # ratios, so they get more turns to find each arm's uninterrupted speed on a noisy machine
    final_timing_repeats: int = 0
    reference_every: int = 0  # retrain the reference at every N-th evaluation point (0: at the end only)
    speed_batches: tuple[int, ...] = (1, 4, 16, 64)  # the end-of-run speed-up vs batch size sweep
    # a model preset (e.g. "speed") whose SFT policy and offline draft get the same sweep after the
    # run: what speculation gives at a realistic draft/target cost ratio (the drifting policy is
    # small, so a draft step costs a quarter of its step); "" for none
    deep_target: str = ""

    def __post_init__(self) -> None:
        require_positive(self, ("eval_every", "eval_prompts", "eval_batch", "timing_repeats"), DriftError)
        if isinstance(self.final_timing_repeats, bool) or not isinstance(self.final_timing_repeats, int) \
                or self.final_timing_repeats < 0:
            raise DriftError(f"final_timing_repeats must be a non-negative integer, got {self.final_timing_repeats!r}")
        if isinstance(self.reference_every, bool) or not isinstance(self.reference_every, int) or self.reference_every < 0:
            raise DriftError(f"reference_every must be a non-negative integer, got {self.reference_every!r}")
        if not self.speed_batches or any(b <= 0 for b in self.speed_batches):
            raise DriftError(f"speed_batches must be positive batch sizes, got {self.speed_batches}")
        if self.deep_target and self.deep_target not in RL_PRESETS:
            raise DriftError(f"deep_target must be a model preset ({', '.join(sorted(RL_PRESETS))}), "
                             f"got {self.deep_target!r}")

    def repeats_at(self, final: bool) -> int:
        """Timed repeats of an evaluation point (the end point's own count, if it has one)."""
        return (self.final_timing_repeats or self.timing_repeats) if final else self.timing_repeats


def _drift_rl(base: str, **kw) -> RunPreset:
    return dataclasses.replace(RL_PRESETS[base], **kw)


DRIFT_PRESETS: dict[str, DriftPreset] = {
    "ci": DriftPreset(rl=_drift_rl("ci", rl_steps=4, task_kwargs=RL_PRESETS["drift"].task_kwargs,
                                   cotrain=dataclasses.replace(DRIFT_COTRAIN_FIXED, max_draft_steps=2)),
                      eval_every=2, eval_prompts=8, eval_batch=8, timing_repeats=1, speed_batches=(1, 8),
                      reference_every=1),
    # "ci" on the quick model (vLLM's CPU attention needs head_dim >= 32): the vLLM lane's run
    "ci-vllm": DriftPreset(rl=_drift_rl("ci-vllm", rl_steps=2, task_kwargs=RL_PRESETS["drift"].task_kwargs,
                                        cotrain=dataclasses.replace(DRIFT_COTRAIN_FIXED, max_draft_steps=2)),
                           eval_every=2, eval_prompts=8, eval_batch=8, timing_repeats=1, speed_batches=(1, 8),
                           reference_every=1),
    # The online arm co-trains with the RL presets' one configuration (presets.cotrained: the value
    # budget, the swap gate, the hard cap of 5% of the step), so what it shows is what `train-rl` and
    # `bench rl` get; its decisions follow measured seconds, so two runs with one seed may train differently.
    "quick": DriftPreset(rl=_drift_rl("drift"), eval_every=20, timing_repeats=3, final_timing_repeats=6,
                         reference_every=1),
    # the speed model under the drift task's bonus (RL preset "speed-drift"): speculation pays at the RL batch
    "speed-drift": DriftPreset(rl=_drift_rl("speed-drift"), eval_every=10, timing_repeats=2, final_timing_repeats=4,
                               reference_every=0, speed_batches=(1, 16, 64)),
    # The real model (SmolLM2-135M-Instruct on word problems): the RL preset "real" as it is (32 answers per
    # step, its learning rate and bf16 update) for 40 steps, evaluated every 10; the reference draft is
    # retrained at the end only (one offline training is about 9 minutes).
    "real": DriftPreset(rl=_drift_rl("real", rl_steps=40), eval_every=10, eval_prompts=16, eval_batch=8,
                        timing_repeats=1, speed_batches=(1, 8)),
    "full": DriftPreset(rl=_drift_rl("full", rl_steps=300, task_kwargs=RL_PRESETS["drift"].task_kwargs,
                                     cotrain=cotrained(SpecConfig(mode="chain", gamma=6))), eval_every=30, eval_prompts=64, eval_batch=64,
                      reference_every=1, deep_target="speed"),
}


def get_drift_preset(name: str) -> DriftPreset:
    if name not in DRIFT_PRESETS:
        raise DriftError(f"unknown drift preset {name!r}; choose from {sorted(DRIFT_PRESETS)}")
    return DRIFT_PRESETS[name]


@torch.no_grad()
def policy_kl(policy, start_policy, trajectories, temperature: float) -> float:
    """Mean over response tokens of KL(current || start), exact over the vocabulary, at the
    current policy's own samples (both at the sampling temperature)."""
    batch = pack_batch(trajectories)
    ids, mask = batch["input_ids"], batch["response_mask"][:, 1:]
    lp = (policy(ids).logits[:, :-1].float() / temperature).log_softmax(-1)  # (B, T-1, V)
    lq = (start_policy(ids).logits[:, :-1].float() / temperature).log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)  # (B, T-1)
    return float((kl * mask).sum() / mask.sum().clamp(min=1))


class EmbeddedDecoding:
    """The arms on specrl's embedded engine: a fresh engine per arm and batch size, sampled at
    the rollout temperature (counter-based noise makes every lossless arm emit the same
    tokens); the online draft is the co-trainer's hot-swapped copy. The speed sweep adds the
    online draft under the adaptive controller (plain decoding where speculation does not pay)."""

    def __init__(self, preset: DriftPreset):
        self.preset = preset
        self.warm_pool = None  # the controller's warm-up prompts, apart from the timed ones

    def notes(self) -> dict:
        """Engine-specific facts for summary.json (how the arms decoded)."""
        return {"eval_decoding": "sampled at the rollout temperature"}

    def eval_params(self, run: RLRun):
        return rollout_params(run.preset, run.tokenizer, run.seed)

    def time_arms(self, run: RLRun, arms: dict, batch: int, prompts, params, repeats: int) -> dict[str, dict]:
        """Each arm's engine at this batch size, timed in turns on the same prompts, `repeats`
        times. `arms` maps a name to a draft, a (draft, speculation controller) pair, or None for
        plain decoding."""
        spec = run.preset.cotrain.spec
        engines = {arm: self._engine(run, batch, d, spec) for arm, d in arms.items()}
        return timed_generate_interleaved(engines, prompts, params, repeats)

    @staticmethod
    def _engine(run: RLRun, batch: int, arm, spec: SpecConfig) -> EmbeddedEngine:
        if arm is None:
            return EmbeddedEngine(run.policy, EngineConfig(max_batch=batch))
        draft, controller = arm if isinstance(arm, tuple) else (arm, None)
        return EmbeddedEngine(run.policy, EngineConfig(max_batch=batch), drafter=DrafterSpec(draft=draft, spec=spec),
                              policy=controller)

    def sweep_arms(self, run: RLRun, online, batch: int, params) -> dict:
        """The adaptive arm, like for like: it may pick any chain length up to the other arms'
        gamma, and its statistics are warmed on other prompts before the timed runs."""
        spec = run.preset.cotrain.spec
        if self.warm_pool is None:
            self.warm_pool = encode_prompts(run.tokenizer,
                                            run.task.examples("heldout", self.preset.eval_prompts, run.seed + 13))
        adaptive = (online, SpeculationController(ControllerConfig(gammas=tuple(range(1, spec.gamma + 1)))))
        warm = sweep_prompts(self.warm_pool, batch)
        self._engine(run, batch, adaptive, spec).generate(warm, params, request_ids=range(len(warm)))
        return {"adaptive": adaptive}

    def close(self) -> None:
        pass


class SwappedDraft(Grouped):
    """One draft arm on a shared speculative VLLMEngine: `ready()` pushes its draft in."""

    def __init__(self, engine, draft, batch: int):
        super().__init__(engine, batch)
        self.weights = {k: v.detach().clone() for k, v in draft.state_dict().items()}

    def ready(self) -> None:
        self.engine.push_draft(self.weights, self.engine.draft_version)


class VLLMDecoding:
    """The arms on vLLM, greedy (module docstring). Two vLLM engines serve them: a plain one
    (started at the first evaluation, the policy synced in place at every point) and the RL
    run's own speculative engine, into which each draft arm swaps its draft (`push_draft`,
    outside the clock: `ready()`); the online draft is put back after each point. One engine
    per arm would cost a vLLM start per arm. Every engine is fed in groups of the point's batch
    size (`Grouped`). The sweep has no adaptive arm: vLLM runs a fixed chain length."""

    def __init__(self, preset: DriftPreset):
        self.preset = preset
        self.plain_engine = None

    def notes(self) -> dict:
        return {"eval_decoding": "greedy (vLLM's sampled speculation is lossless in law, not token-identical to plain vLLM)",
                "rl_rollouts": "vLLM, EAGLE-3 with the online draft, sampled at the rollout temperature, "
                               "policy synced in place after every update"}

    def eval_params(self, run: RLRun):
        return rollout_params(run.preset, run.tokenizer, run.seed, greedy=True)

    def time_arms(self, run: RLRun, arms: dict, batch: int, prompts, params, repeats: int) -> dict[str, dict]:
        from rollout.vllm_engine import VLLMEngine, VLLMEngineConfig

        if self.plain_engine is None:
            self.plain_engine = VLLMEngine(run.policy, VLLMEngineConfig(max_batch=max(batch, *self.preset.speed_batches),
                                                                        work_dir=str(run.out / "vllm-plain")))
        else:
            self.plain_engine.load_policy_weights(run.policy.state_dict())
        spec = run.engine
        online, version = spec.draft_weights()  # put back after the point
        # the draft arms speculate whatever the run's choice per rollout; its switch is put back after
        # the point (a vLLM restart, paid by the run's next rollout), and the choice never sees these calls
        switched_on = spec.speculating
        spec.set_speculation(True)
        engines = {arm: Grouped(self.plain_engine, batch) if d is None else SwappedDraft(spec, d, batch)
                   for arm, d in arms.items()}
        try:
            return timed_generate_interleaved(engines, prompts, params, repeats)
        finally:
            spec.push_draft(online, version)
            spec.set_speculation(switched_on)

    def sweep_arms(self, run: RLRun, online, batch: int, params) -> dict:
        return {}

    def close(self) -> None:
        if self.plain_engine is not None:
            self.plain_engine.shutdown()


DECODINGS = {"embedded": EmbeddedDecoding, "vllm": VLLMDecoding}


class DriftEvaluator(RLCallback):
    """Evaluates the four arms at step 0, every `eval_every` steps and at the end of the run, on
    `engine` (a key of DECODINGS)."""

    def __init__(self, preset: DriftPreset, log=print, task: str = "arith", engine: str = "embedded"):
        self.preset, self.log, self.task = preset, log, task  # task: the run's task name or file
        self.decoding = DECODINGS[engine](preset)
        self.rows: list[dict] = []
        self.frozen_draft = self.start_policy = self.prompts = None
        self.reference_draft = None
        self.speed_rows: list[dict] = []
        self.deep_rows: list[dict] = []
        self.points = 0  # evaluation points done

    # -- callbacks ---------------------------------------------------------------------------
    def on_start(self, run: RLRun) -> None:
        self.start_policy = copy.deepcopy(run.policy).eval()
        self.frozen_draft = copy.deepcopy(self.online_draft(run))
        examples = run.task.examples("heldout", self.preset.eval_prompts, run.seed + 11)
        self.prompts = encode_prompts(run.tokenizer, examples)
        self.evaluate(run, step=0)

    def on_step_end(self, run: RLRun, step: int, row: dict) -> None:
        done = step + 1
        if done % self.preset.eval_every == 0 and done != run.preset.rl_steps:
            self.evaluate(run, step=done)

    def on_end(self, run: RLRun, summary: dict) -> None:
        try:
            self.evaluate(run, step=run.preset.rl_steps, final=True)
            self.speed_rows = self.speed_vs_batch(run)
            if self.preset.deep_target:
                self.deep_rows = self.deep_target_sweep(run)
        finally:
            self.decoding.close()

    # -- measurement -------------------------------------------------------------------------
    def eval_params(self, run: RLRun):
        """How the arms decode (the engine's choice: `EmbeddedDecoding`, `VLLMDecoding`)."""
        return self.decoding.eval_params(run)

    def drafts(self, run: RLRun, step: int, final: bool) -> dict:
        arms = {"plain": None, "frozen": self.frozen_draft, "online": self.online_draft(run)}
        every = self.preset.reference_every
        if final or (every and self.points % every == 0):
            # step 0: the starting draft is the offline recipe on the current policy already
            self.reference_draft = self.frozen_draft if step == 0 else self.train_reference(run)
            arms["reference"] = self.reference_draft
        return arms

    def online_draft(self, run: RLRun):
        """The co-trained draft as the engine serves it (a copy, read through the engine's protocol)."""
        return run.cotrain.serving_draft()

    def train_reference(self, run: RLRun):
        cfg = run.preset.draft
        prompts = encode_prompts(run.tokenizer, run.task.examples("train", cfg.n_sequences, run.seed + 7))
        draft, _ = train_offline_draft(run.policy, prompts, cfg, (run.tokenizer.eos_id,), log=lambda *_: None)
        return draft

    def evaluate(self, run: RLRun, step: int, final: bool = False) -> None:
        run.policy.eval()
        params = self.eval_params(run)
        results = self.time_arms(run, self.drafts(run, step, final), self.preset.eval_batch, self.prompts, params,
                                 self.preset.repeats_at(final))
        self.points += 1
        plain = results.pop("plain")
        self.rows.append({"step": step, "arm": "plain", "tokens": plain["tokens"],
                          "tokens_per_s": plain["tokens_per_s"], "tokens_per_s_repeats": plain["tokens_per_s_repeats"],
                          "engine_steps": plain["engine_steps"], "mean_response_len": plain["tokens"] / len(self.prompts),
                          "others_busy_cores": plain.get("others_busy_cores"),
                          "kl_from_start": policy_kl(run.policy, self.start_policy, plain["trajectories"],
                                                     run.preset.temperature)})
        for arm, r in results.items():
            if not same_tokens(r["trajectories"], plain["trajectories"]):
                raise RuntimeError(f"arm {arm!r} changed the generated tokens at step {step}")  # lossless or bust
            agg = summarize_spec_stats(t.spec for t in r["trajectories"])  # same in every repeat
            self.rows.append({"step": step, "arm": arm, "tokens": r["tokens"], "tokens_per_s": r["tokens_per_s"],
                              "tokens_per_s_repeats": r["tokens_per_s_repeats"], "engine_steps": r["engine_steps"],
                              "accept_length": agg["accept_length"], "accept_rate": agg["accept_rate"],
                              "accept_rate_per_pos": agg["accept_rate_per_pos"],
                              "speedup": r["tokens_per_s"] / plain["tokens_per_s"]})
        pts = {r["arm"]: r for r in self.rows if r["step"] == step}
        if "reference" in pts and pts["reference"]["accept_length"] > 0:  # 0: nothing verified, no ratio
            pts["online"]["online_over_reference"] = pts["online"]["accept_length"] / pts["reference"]["accept_length"]
        # online over frozen with its paired bootstrap interval over the evaluation prompts: the
        # noise band within which "online below frozen" at one point is the draw of prompts
        ratio, lo, hi = accept_length_ratio_interval([t.spec for t in results["online"]["trajectories"]],
                                                     [t.spec for t in results["frozen"]["trajectories"]],
                                                     seed=run.seed * 1000 + step)
        if ratio == ratio:  # nan: nothing verified
            pts["online"].update(online_over_frozen=ratio, online_over_frozen_low=lo, online_over_frozen_high=hi)
        self._log_point(step)

    def time_arms(self, run: RLRun, arms: dict, batch: int, prompts, params, repeats: int) -> dict[str, dict]:
        """Each arm at this batch size, timed in turns on the same prompts, `repeats` times, on the
        run's engine. `arms` maps a name to a draft (or an engine's ready speculator), or None
        for plain decoding."""
        return self.decoding.time_arms(run, arms, batch, prompts, params, repeats)

    def speed_vs_batch(self, run: RLRun) -> list[dict]:
        """Speed-up of each draft over plain decoding at several batch sizes, final policy, with
        the engine's extra arms (the embedded engine's adaptive one)."""
        params = self.eval_params(run)
        online = self.online_draft(run)
        rows = []
        for b in self.preset.speed_batches:
            arms = {"plain": None, "frozen": self.frozen_draft, "online": online, "reference": self.reference_draft,
                    **self.decoding.sweep_arms(run, online, b, params)}
            results = self.time_arms(run, arms, b, sweep_prompts(self.prompts, b), params, self.preset.timing_repeats)
            base = results["plain"]["tokens_per_s"]
            for arm, r in results.items():
                row = {"batch": b, "arm": arm, "tokens_per_s": r["tokens_per_s"], "speedup": r["tokens_per_s"] / base,
                       "others_busy_cores": r.get("others_busy_cores")}
                if arm != "plain":
                    row["accept_length"] = summarize_spec_stats(t.spec for t in r["trajectories"])["accept_length"]
                    row["speedup_repeats"] = repeat_ratios(r, results["plain"])
                rows.append(row)
        return rows

    def deep_target_sweep(self, run: RLRun) -> list[dict]:
        """The speed-against-batch sweep on the deeper target (`DriftPreset.deep_target`): its SFT
        policy and offline draft (trained once and cached), not drifted, decoding with the run's
        chain length and sampling. Chain and adaptive arms as `specrl bench speed` measures them,
        with the bound's parts (c, verify cost) from the engine's own steps."""
        from experiments.bench.common import speed_setup
        from experiments.bench.speed import EmbeddedArms, measure_batch

        t0 = time.perf_counter()
        spec = run.preset.cotrain.spec
        temperature = self.eval_params(run).temperature
        policy, draft, params, prompts_for = speed_setup(self.task, self.preset.deep_target, run.seed,
                                                         run.cache_dir, temperature)
        rows = []
        for b in self.preset.speed_batches:
            n = sweep_size(b)
            pool = prompts_for(2 * n)
            arm_set = EmbeddedArms(policy, draft, [spec], adaptive_gammas=tuple(range(1, spec.gamma + 1)))
            for row in measure_batch(arm_set, pool[:n], params, b, repeats=self.preset.timing_repeats,
                                     warm_prompts=pool[n:]):
                if row.get("identical_to_plain") is False:
                    raise RuntimeError(f"the deep target's {row['mode']} arm changed the generated tokens at batch {b}")
                row.pop("profile", None)
                rows.append({"preset": self.preset.deep_target, "engine": "embedded",
                             "target_layers": policy.cfg.num_layers, **row})
        self.log(f"[drift] deep target {self.preset.deep_target!r} ({policy.cfg.num_layers} layers): "
                 + "  ".join(f"b{r['batch']} {r['mode']} x{r['speedup']:.2f}" for r in rows if r["mode"] != "plain")
                 + f"  ({time.perf_counter() - t0:.0f}s)")
        return rows

    def _log_point(self, step: int) -> None:
        pts = [r for r in self.rows if r["step"] == step]
        parts = [f"{r['arm']} tau {r['accept_length']:.2f} x{r['speedup']:.2f}" for r in pts if r["arm"] != "plain"]
        parts += [f"online/frozen {r['online_over_frozen']:.3f} [{r['online_over_frozen_low']:.3f}-"
                  f"{r['online_over_frozen_high']:.3f}]" for r in pts if "online_over_frozen" in r]
        parts += [f"online/reference {r['online_over_reference']:.3f}" for r in pts if "online_over_reference" in r]
        plain = next(r for r in pts if r["arm"] == "plain")
        busy = plain.get("others_busy_cores")
        self.log(f"[drift] step {step:>3}: KL {plain['kl_from_start']:.3f}  " + "  ".join(parts)
                 + (f"  (other processes kept {busy:.2f} cores busy: these speeds are not this run's alone)"
                    if shared(busy) else ""))


def sweep_size(batch: int) -> int:
    """Prompts per batch size in the speed sweeps: 2 * batch, at least 4."""
    return max(2 * batch, 4)


def sweep_prompts(pool: list, batch: int) -> list:
    """The prompts of one batch size in the speed sweep: `pool` repeated to `sweep_size(batch)`."""
    n = sweep_size(batch)
    return (pool * (1 + n // len(pool)))[:n]


def summarize(evaluator: DriftEvaluator, rl_rows: list[dict], rl_summary: dict, seed: int, wall_s: float) -> dict:
    rows = evaluator.rows
    last_step = max(r["step"] for r in rows)

    def at(step, arm, key):
        return next(r[key] for r in rows if r["step"] == step and r["arm"] == arm)

    draft_s = sum(r["perf/draft_overhead_s"] for r in rl_rows)  # draft_train_s + feature_capture_s
    step_s = sum(r["step_s"] for r in rl_rows)
    ratios = [r["online_over_reference"] for r in rows if "online_over_reference" in r]
    later = [r for r in rows if r["step"] > 0 and "online_over_frozen" in r]  # step 0: the same draft
    below = [r["step"] for r in later if r["online_over_frozen"] < 1.0]
    below_beyond_noise = [r["step"] for r in later if r["online_over_frozen_high"] < 1.0]
    online_end, frozen_end = (next(r for r in rows if r["step"] == last_step and r["arm"] == arm)
                              for arm in ("online", "frozen"))
    steps_ratio = (frozen_end["engine_steps"] / online_end["engine_steps"]
                   if online_end["engine_steps"] and frozen_end["engine_steps"] else None)
    summary = {
        "seed": seed, "rl_steps": rl_summary["rl_steps"],
        "tau_start": at(0, "frozen", "accept_length"),
        "tau_frozen_end": at(last_step, "frozen", "accept_length"),
        "tau_online_end": at(last_step, "online", "accept_length"),
        "tau_reference_end": at(last_step, "reference", "accept_length"),
        # how much of its starting acceptance each draft keeps as the policy moves
        "frozen_end_over_start": at(last_step, "frozen", "accept_length") / at(0, "frozen", "accept_length"),
        "online_end_over_start": at(last_step, "online", "accept_length") / at(0, "online", "accept_length"),
        # the online draft's accept length over the reference's, worst evaluation point (per point in metrics.jsonl)
        "online_over_reference_min": min(ratios, default=None),
        # evaluation points after step 0 where the online draft's accept length is below frozen's, and
        # those where it is below beyond the noise (the bootstrap interval's top under 1)
        "online_below_frozen_points": below, "online_below_frozen_beyond_noise": below_beyond_noise,
        "online_below_frozen_n": len(below), "online_below_frozen_beyond_noise_n": len(below_beyond_noise),
        "online_over_frozen_min": min((r["online_over_frozen"] for r in later), default=None),
        "reference_steps": sorted(r["step"] for r in rows if r["arm"] == "reference"),
        "reward_start": rl_summary["reward_start"], "reward_end": rl_summary["reward_end"],
        "kl_end": at(last_step, "plain", "kl_from_start"),
        "response_len_start": at(0, "plain", "mean_response_len"),
        "response_len_end": at(last_step, "plain", "mean_response_len"),
        # the online draft's end speed-up over the frozen one in engine steps (module docstring);
        # the wall-clock ratio below measures it with the machine's noise on top
        "online_over_frozen_steps_end": steps_ratio,
        # the online draft's updates over the run, and the trained drafts the swap gate measured and refused
        # (the updates made, not the trainer's version: a refused candidate's revert also bumps that)
        "draft_updates": sum(r.get("train/draft_steps") or 0 for r in rl_rows) if rl_rows else None,
        **gate_counts(rl_rows),
        # online over frozen where the gate looks: the serving draft over the starting one on the
        # RL rollouts' held-out sequences at each gate (CoTrainConfig.gate_floor), per gate and lowest
        "gate_over_start": gate_over_start(rl_rows),
        "gate_serving_over_start_min": min((g["serving_over_start"] for g in gate_over_start(rl_rows)), default=None),
        # wall-clock fields (TIMING_FIELDS): not reproducible bit for bit
        "speedup_frozen_start": at(0, "frozen", "speedup"),
        "speedup_frozen_end": at(last_step, "frozen", "speedup"),
        "speedup_online_end": at(last_step, "online", "speedup"),
        "speedup_reference_end": at(last_step, "reference", "speedup"),
        # median over the end point's repeats of online tokens/s over frozen tokens/s in the same repeat
        "speedup_online_over_frozen_end": statistics.median(repeat_ratios(online_end, frozen_end)),
        "speedup_vs_batch": evaluator.speed_rows,
        "speedup_vs_batch_deep_target": evaluator.deep_rows,  # [] unless the preset names a deep target
        "plain_tokens_per_s_end": at(last_step, "plain", "tokens_per_s"),
        "draft_added_fraction": draft_s / max(step_s - draft_s, 1e-9),  # see the module docstring
        "rl_step_s": step_s / max(1, len(rl_rows)),
        "wall_s": wall_s,
        # whether the timings had the machine to themselves (specrl.machine_load): the most cores other
        # processes kept busy over an RL step and over an evaluation's timed decoding, and the RL steps
        # shared beyond the idle machine's background (None where nothing could be read)
        "others_busy_cores_rl_max": _max_known(r.get(STEP_KEY) for r in rl_rows),
        "rl_steps_shared": shared_steps(rl_rows),
        "others_busy_cores_eval_max": _max_known(r.get("others_busy_cores")
                                                 for r in [*rows, *evaluator.speed_rows, *evaluator.deep_rows]),
        "timing_fields": list(TIMING_FIELDS),
        "machine": machine_info(),
    }
    return summary


def _max_known(values) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def deterministic_part(summary: dict) -> dict:
    """The fields of a summary that one seed reproduces exactly."""
    return {k: v for k, v in summary.items() if k not in TIMING_FIELDS and k not in ("timing_fields", "machine")}


def run_drift(preset: str | DriftPreset, out_dir, *, seed: int = 0, task: str = "arith", cache_dir=None,
              progress: bool = True, plots: bool = True, reference_every: int | None = None,
              engine: str = "embedded", rl_steps: int | None = None, deep_target: str | None = None,
              train_every: int | None = None, device: str = "auto", log=print) -> dict:
    """The experiment on `engine` ("embedded" or "vllm", a key of DECODINGS). `rl_steps`
    shortens the preset's RL run (evaluation points stay every `eval_every` steps and at the end);
    `deep_target` overrides the preset's (a model preset name, "" for none); `train_every` the
    online draft's burst period (CoTrainConfig.train_every)."""
    t0 = time.perf_counter()
    preset_name = preset
    preset = preset if isinstance(preset, DriftPreset) else get_drift_preset(preset)
    if reference_every is not None:
        preset = dataclasses.replace(preset, reference_every=reference_every)  # validated by DriftPreset
    if deep_target is not None:
        preset = dataclasses.replace(preset, deep_target=deep_target)  # validated by DriftPreset
    if rl_steps is not None:
        preset = dataclasses.replace(preset, rl=preset.rl.with_overrides(rl_steps=rl_steps))  # validated by RunPreset
    if train_every is not None:  # validated by CoTrainConfig
        cotrain = dataclasses.replace(preset.rl.cotrain, train_every=train_every)
        preset = dataclasses.replace(preset, rl=preset.rl.with_overrides(cotrain=cotrain))
    out = Path(out_dir)
    if (out / "summary.json").exists() or (out / "rl").exists():
        raise DriftError(f"output folder {out} already holds a drift run; choose another --out")
    if engine not in DECODINGS:
        raise DriftError(f"unknown engine {engine!r}; choose {' or '.join(DECODINGS)}")
    if engine == "vllm":
        from rollout.vllm_engine import require_vllm

        require_vllm()  # one line naming the fix, before anything is trained
    out.mkdir(parents=True, exist_ok=True)
    evaluator = DriftEvaluator(preset, log=log, task=task, engine=engine)
    rl_summary = train_rl(task, preset.rl, out / "rl", seed=seed, cache_dir=cache_dir, progress=progress,
                          spec="online", engine=engine, device=device, callbacks=(evaluator,), log=log)
    rl_rows = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines() if line]
    with open(out / "metrics.jsonl", "w") as f:
        for row in evaluator.rows:
            f.write(json.dumps(row) + "\n")
    summary = {**summarize(evaluator, rl_rows, rl_summary, seed, time.perf_counter() - t0), "engine": engine,
               "train_every": preset.rl.cotrain.train_every, **evaluator.decoding.notes()}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if plots:
        from experiments.plots import drift_plots

        name = preset_name if isinstance(preset_name, str) else "custom"
        drift_plots(out, setup=f"drift preset {name}, {engine} engine, eval batch {preset.eval_batch}, seed {seed}, "
                               f"{preset.rl.rl_steps} RL steps")
    return summary


def _below_frozen(summary: dict) -> str:
    """Where the online draft's accept length fell below frozen's (evaluation steps), and where
    beyond its bootstrap interval over the evaluation prompts."""
    if summary.get("online_over_frozen_min") is None:
        return "no point after step 0"
    steps = summary["online_below_frozen_points"]
    return (f"at {len(steps)} point(s) {steps}, beyond the noise at {summary['online_below_frozen_beyond_noise']}; "
            f"lowest ratio {summary['online_over_frozen_min']:.3f}")


def _machine_shared(summary: dict) -> str:
    """Whether other processes shared the machine while this run timed (specrl.machine_load)."""
    rl, ev = summary.get("others_busy_cores_rl_max"), summary.get("others_busy_cores_eval_max")
    if rl is None and ev is None:
        return "not measured on this system"
    n_shared = summary.get("rl_steps_shared", 0)
    if not n_shared and not shared(ev):
        return f"alone (other processes at most {max(rl or 0.0, ev or 0.0):.2f} cores)"
    return (f"shared: other processes kept up to {rl or 0.0:.2f} cores busy in {n_shared} RL step(s) and up to "
            f"{ev or 0.0:.2f} in the evaluations' timings; those times are not this run's alone")


def headline(summary: dict) -> list[tuple[str, str]]:
    """The figures a drift run ends with (`specrl drift`)."""
    return [("accept length", f"start {summary['tau_start']:.3f}; end: frozen {summary['tau_frozen_end']:.3f}, "
                              f"online {summary['tau_online_end']:.3f}, reference {summary['tau_reference_end']:.3f}"),
            ("speed-up at the end", f"frozen x{summary['speedup_frozen_end']:.2f}, online x{summary['speedup_online_end']:.2f}, "
                                    f"reference x{summary['speedup_reference_end']:.2f}"),
            ("online over frozen", f"x{summary['speedup_online_over_frozen_end']:.3f} (engine steps: " + (
                "not counted by this engine)" if summary['online_over_frozen_steps_end'] is None
                else f"x{summary['online_over_frozen_steps_end']:.3f})")),
            ("online below frozen", _below_frozen(summary)),
            ("online draft cost", f"{summary['draft_added_fraction']:+.1%} RL step time"),
            ("policy", f"KL from start {summary['kl_end']:.3f}; held-out reward {summary['reward_start']:.3f} -> "
                       f"{summary['reward_end']:.3f}"),
            ("wall time", f"{summary['wall_s']:.0f}s"),
            ("machine", _machine_shared(summary))]


__all__ = ["run_drift", "DriftPreset", "DRIFT_PRESETS", "DriftEvaluator", "policy_kl", "deterministic_part",
           "TIMING_FIELDS", "DriftError", "ARMS"]
