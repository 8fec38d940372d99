"""Named run presets: every size and step count an experiment uses lives here, in one place."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from rollout.drafters import SpecConfig
from specrl.config import CoTrainConfig, ControllerConfig, DraftBudgetConfig, DraftTrainConfig, OnlineDraftConfig, SchedulerConfig
from target_training.config import require_positive
from target_training.grpo import GRPOConfig
from target_training.sft import SFTConfig


class PresetError(ValueError):
    pass


MAX_RL_STEPS = 1_000_000  # more is a typo, not a run: refused before anything is trained


def adaptive_spec(spec: SpecConfig) -> dict:
    """The CoTrainConfig fields that speculate adaptively (specrl.controller) up to `spec`'s chain:
    per batch size, plain decoding where a verify step costs more than the tokens it saves (the
    RL rollout's full batch on a CPU), chains of 1..spec.gamma where they pay (its long tail),
    chosen from the engine's own measured step times and the draft's measured acceptance."""
    return {"spec": spec, "adaptive": True, "controller": ControllerConfig(gammas=tuple(range(1, spec.gamma + 1)))}


def reproducible(cotrain: CoTrainConfig) -> CoTrainConfig:
    """`cotrain` with every decision fixed at the start of the run instead of re-timed as it goes:
    the configured chain at every engine step (no step controller, and so no choice per rollout),
    draft updates by count in the window after the policy update (the scheduler's time budget
    left wide; the "value" rule, which weighs measured seconds, becomes the cap every step), not
    priced by measured seconds. Two runs with one seed, or a run and its resume,
    then decode, speculate and train alike on any machine; only their speeds differ."""
    sched = cotrain.scheduler
    return dataclasses.replace(cotrain, adaptive=False, scheduler=dataclasses.replace(
        sched, budget_fraction=COUNTED_SCHEDULER.budget_fraction, min_budget_s=COUNTED_SCHEDULER.min_budget_s,
        windows=COUNTED_SCHEDULER.windows, draft_steps=dataclasses.replace(
            sched.draft_steps, saving_share=None, max_share=None,
            rule="fixed" if sched.draft_steps.rule == "value" else sched.draft_steps.rule)))


# Priced updates come few and far between, and a fresh AdamW's first steps move every weight by about
# the learning rate, which can leave a few updates worse than none: co-training warms its learning
# rate up over this many updates (the swap gate refuses what is worse anyway).
PRICED_WARMUP = 10
# Share of the RL step that co-training (draft updates, held-out measurement, feature capture) may
# take over any 10 steps, whatever the gains: the hard cap of the one co-training configuration.
COTRAIN_MAX_SHARE = 0.05
# Standard errors taken off each candidate's held-out gain before the value rule counts it
# (DraftBudgetConfig.gain_z): a gain the held-out slice cannot tell from noise buys no updates.
# Where the policy barely moves (`speed`), the gains after the first burst sit within 2 standard
# errors of zero and buying on them doubled co-training's share; where it drifts (`speed-drift`)
# they stand 2.5-9 errors clear and the cap binds first (docs/results.md, "Gains counted net of
# their noise").
GAIN_Z = 2.0
# The budget of the one co-training configuration (specrl/draft_budget.py, rule "value"): updates
# while the held-out gain they buy, less GAIN_Z of its standard errors and valued in rollout
# seconds over the next 10 rollouts, exceeds their measured cost; probes of 2 updates where the
# gain is unknown; the hard cap above.
VALUE_BUDGET = DraftBudgetConfig(rule="value", base_steps=2, max_share=COTRAIN_MAX_SHARE, gain_z=GAIN_Z)
# Draft updates in one burst every this many RL steps (CoTrainConfig.train_every): the held-out
# measurement and the gate, each about half an update, are then paid once per burst, and the same
# cap buys more updates (docs/results.md, "Bursts every 4 steps").
TRAIN_EVERY = 4


def cotrained(spec: SpecConfig, compute_dtype: str = "fp32") -> CoTrainConfig:
    """The one co-training configuration of the RL presets, `bench rl` and the drift experiment,
    around a model's chain `spec`: adaptive speculation and the run choice, features from the
    trainer's forward (every 8th answer held out: the swap gate and the budget measure drafts on
    them), at most 8 updates of 16 sequences per RL step at the online trainer's default learning
    rate (warmed up over PRICED_WARMUP updates), on the policy versions since the last burst, in the
    window after the policy update of every TRAIN_EVERY-th step; the value budget decides how many
    (VALUE_BUDGET), the scheduler's time budget is left wide. The draft updates in the policy update's precision (`compute_dtype`, the
    preset's GRPOConfig.compute_dtype)."""
    return CoTrainConfig(**adaptive_spec(spec), feature_source="trainer", max_draft_steps=8, recent_versions=2,
                         train_every=TRAIN_EVERY,
                         online=OnlineDraftConfig(warmup_steps=PRICED_WARMUP, compute_dtype=compute_dtype),
                         scheduler=SchedulerConfig(budget_fraction=1.0, min_budget_s=3600.0, windows=("between",),
                                                   draft_steps=VALUE_BUDGET))


def unbudgeted(cotrain: CoTrainConfig) -> CoTrainConfig:
    """`cotrain` with the cap of draft updates every RL step (rule "fixed", no hard cap): the cost of
    following the policy whatever it buys (`bench rl`'s online-unpriced arm)."""
    sched = cotrain.scheduler
    return dataclasses.replace(cotrain, scheduler=dataclasses.replace(
        sched, draft_steps=dataclasses.replace(sched.draft_steps, rule="fixed", max_share=None, saving_share=None)))


@dataclass
class RunPreset:
    model: str  # a key of target_training.config.PRESETS, or a real model (target_training.real_models)
    sft: SFTConfig
    grpo: GRPOConfig
    rl_steps: int
    prompts_per_step: int
    group_size: int
    max_new_tokens: int
    temperature: float = 1.0
    eval_prompts: int = 64
    eval_samples: int = 4  # sampled completions per held-out prompt
    checkpoint_every: int = 5
    max_batch: int = 64
    prompt_pool: int = 0  # training prompts the steps sample from (0: max(512, 8 x prompts_per_step)); a small
    #                       pool revisits prompts sooner, as epochs over a small dataset do
    task_kwargs: dict = field(default_factory=dict)
    task: str = "arith"  # the task a run takes when the command line names none
    context: int = 0  # a real model's tokens of prompt + answer (its KV cache and positions); 0: the model's own
    bench_steps: int = 20  # `specrl bench rl`'s RL steps per arm when --steps is not given
    # keep the starting policy as the GRPO reference: the update logs KL from the start (kl_ref, the k3
    # estimate on the rollout's tokens) every step, for one more no-grad forward; grpo.kl_coef > 0 needs it
    kl_from_start: bool = False
    draft: DraftTrainConfig = field(default_factory=DraftTrainConfig)
    # speculation and online draft training for --spec frozen|online (mode and seed are set per run)
    cotrain: CoTrainConfig = field(default_factory=lambda: CoTrainConfig(**adaptive_spec(SpecConfig(mode="chain", gamma=4))))

    def __post_init__(self) -> None:
        require_positive(self, ("rl_steps", "bench_steps", "prompts_per_step", "group_size", "max_new_tokens", "eval_prompts",
                                "eval_samples", "checkpoint_every", "max_batch"), PresetError)
        if self.rl_steps > MAX_RL_STEPS:
            raise PresetError(f"--steps must be at most {MAX_RL_STEPS}, got {self.rl_steps}")
        if self.group_size < 2:
            raise PresetError(f"GRPO needs group_size >= 2, got {self.group_size}")
        if self.prompt_pool < 0 or 0 < self.prompt_pool < self.prompts_per_step:
            raise PresetError(f"--prompt-pool must hold at least the {self.prompts_per_step} prompts of a step, "
                              f"got {self.prompt_pool}")

    def with_overrides(self, **kw) -> "RunPreset":
        return dataclasses.replace(self, **{k: v for k, v in kw.items() if v is not None})


# A scheduler whose count of updates alone decides: the time budget is left wide, so a busy spell of
# the machine cannot cut an update and two runs with one seed train alike.
COUNTED_SCHEDULER = SchedulerConfig(budget_fraction=1.0, min_budget_s=3600.0, windows=("between",))
# One update of 12 sequences per RL step, every decision fixed at the start: the CI-sized drift runs and
# `specrl bench overlap` (the cost of one update, in both scheduler modes).
DRIFT_COTRAIN_FIXED = reproducible(dataclasses.replace(cotrained(SpecConfig(mode="chain", gamma=6)), max_draft_steps=1,
                                                       train_every=1,
                                                       scheduler=COUNTED_SCHEDULER,
                                                       online=OnlineDraftConfig(lr=1e-3, batch_size=12)))


def counted_cotrain(updates_per_step: int) -> CoTrainConfig:
    """Co-training that makes exactly `updates_per_step` draft updates per RL step (once the buffer
    holds min_buffer_records records, i.e. from the first step on), in the window after the policy
    update, every decision fixed at the start (`reproducible`): a time share would make two runs,
    or a run and its resume, train different numbers of steps."""
    return reproducible(CoTrainConfig(spec=SpecConfig(mode="chain", gamma=4), max_draft_steps=updates_per_step,
                                      scheduler=COUNTED_SCHEDULER))


# The real model's offline EAGLE-3 draft: 256 sampled answers (temperature 0.7, up to 96 tokens) to its task's
# problems, a draft vocabulary of the 2048 tokens most frequent in them, TTT of 4 steps. Sized for the
# 2-core CPU: with 8192 draft tokens and batches of 16, one training step took several seconds.
REAL_DRAFT = DraftTrainConfig(n_sequences=256, steps=300, lr=3e-3, batch_size=8, draft_vocab_size=2048, ttt_steps=4,
                              temperature=0.7, max_new_tokens=96)

# Draft updates per RL step with --spec online in the CI presets (fixed counts; the others: cotrained).
DRAFT_UPDATES_PER_STEP = {"ci": 2}

RL_PRESETS: dict[str, RunPreset] = {
    # CI-sized: seconds. Used by the tests.
    "ci": RunPreset(model="tiny", sft=SFTConfig(steps=60, batch_size=16, lr=3e-3, n_examples=512),
                    grpo=GRPOConfig(lr=3e-4), rl_steps=2, prompts_per_step=4, group_size=4,
                    max_new_tokens=48, eval_prompts=16, eval_samples=2, checkpoint_every=1, max_batch=16,
                    draft=DraftTrainConfig(n_sequences=128, steps=40, batch_size=16, max_new_tokens=48),
                    cotrain=counted_cotrain(DRAFT_UPDATES_PER_STEP["ci"])),
    # The CI run on vLLM: "ci" on the quick model (vLLM's CPU attention needs head_dim >= 32).
    "ci-vllm": RunPreset(model="quick", sft=SFTConfig(steps=60, batch_size=16, lr=3e-3, n_examples=512),
                         grpo=GRPOConfig(lr=3e-4), rl_steps=2, prompts_per_step=4, group_size=4,
                         max_new_tokens=48, eval_prompts=16, eval_samples=2, checkpoint_every=1, max_batch=16,
                         draft=DraftTrainConfig(n_sequences=128, steps=40, batch_size=16, max_new_tokens=48),
                         cotrain=counted_cotrain(DRAFT_UPDATES_PER_STEP["ci"])),
    # The quick CPU run: a few minutes on 2 cores.
    "quick": RunPreset(model="quick", sft=SFTConfig(steps=400, batch_size=32, lr=3e-3, n_examples=4000),
                       grpo=GRPOConfig(lr=3e-5), rl_steps=120, prompts_per_step=16, group_size=8,
                       max_new_tokens=64, eval_prompts=128, checkpoint_every=5, max_batch=64,
                       cotrain=cotrained(SpecConfig(mode="chain", gamma=4))),
    # Policy drift on purpose (docs/design.md section 1b): the rare "cols" worked-step style is 5% of the SFT data,
    # so the starting draft (trained on the SFT policy's samples) has seen little of it; a reward
    # bonus for that format moves the policy there during RL, and the later steps sharpen it.
    "drift": RunPreset(model="quick", sft=SFTConfig(steps=600, batch_size=32, lr=3e-3, n_examples=4000),
                       grpo=GRPOConfig(lr=2e-4), rl_steps=100, prompts_per_step=16, group_size=8,
                       max_new_tokens=64, eval_prompts=64, eval_samples=2, checkpoint_every=10, max_batch=64,
                       task_kwargs={"format_bonus": 1.0, "bonus_rule": "format", "rare_weight": 0.05},
                       cotrain=cotrained(SpecConfig(mode="chain", gamma=6))),
    # The speed benchmarks' deeper target (12 layers, a draft step a few percent of a target step): its
    # offline draft trains longer than the default (the draft's training, not its data, limited its
    # acceptance), and its chains are 6 long, since a cheap draft step makes a longer chain pay.
    "speed": RunPreset(model="speed", sft=SFTConfig(steps=300, batch_size=32, lr=3e-3, n_examples=4000),
                       grpo=GRPOConfig(lr=3e-5), rl_steps=60, prompts_per_step=16, group_size=8,
                       max_new_tokens=64, eval_prompts=128, checkpoint_every=5, max_batch=64,
                       draft=DraftTrainConfig(steps=2400, lr=2e-3),
                       cotrain=cotrained(SpecConfig(mode="chain", gamma=6))),
    # Both effects in one run: the 12-layer "speed" model (a draft step a few percent of a target step, so
    # speculation pays at the RL batch) with the "drift" task's format bonus and learning rate (the rare
    # worked-step style, 5% of the SFT data, pays a bonus, so the policy moves away from what the starting
    # draft saw). 40 RL steps cover the move (KL from the start is logged per step).
    "speed-drift": RunPreset(model="speed", sft=SFTConfig(steps=300, batch_size=32, lr=3e-3, n_examples=4000),
                             grpo=GRPOConfig(lr=2e-4), rl_steps=40, prompts_per_step=16, group_size=8,
                             max_new_tokens=64, eval_prompts=64, eval_samples=2, checkpoint_every=10, max_batch=64,
                             task_kwargs={"format_bonus": 1.0, "bonus_rule": "format", "rare_weight": 0.05},
                             draft=DraftTrainConfig(steps=2400, lr=2e-3), bench_steps=40, kl_from_start=True,
                             cotrain=cotrained(SpecConfig(mode="chain", gamma=6))),
    # A real pretrained model (SmolLM2-135M-Instruct, target_training/real_models.py; no SFT warm start: it
    # is an instruction model already) on multi-step word problems (target_training.tasks.WordTask) in its
    # chat template, answers of up to 256 tokens with a long tail (sampled at temperature 0.7: at 1.0 this small
    # model rambles, half its answers reach the cap and none is right). 8 prompts x 4 samples per step, policy
    # updates in minibatches of 8 sequences, in bf16 where the CPU computes it natively (GRPOConfig.compute_dtype;
    # `specrl bench update` measures its cost and its log-prob gap to fp32), at a learning rate of 3e-5: at 1e-5
    # the KL from the start stalled at 0.06-0.10 over 40 steps, at 3e-5 it passed 0.2 by step 6 (KL from the
    # start is logged every step). The starting draft is REAL_DRAFT, trained on the model's own answers; its
    # online updates run in the policy's precision too (bf16 where native: 2.2x faster on this CPU).
    "real": RunPreset(model="smollm2-135m", task="word", context=448, sft=SFTConfig(), kl_from_start=True,
                      grpo=GRPOConfig(lr=3e-5, minibatch_size=8, temperature=0.7, compute_dtype="auto"),
                      rl_steps=20, prompts_per_step=8,
                      group_size=4, max_new_tokens=256, temperature=0.7, eval_prompts=16, eval_samples=1, checkpoint_every=10, max_batch=32,
                      draft=REAL_DRAFT, cotrain=cotrained(SpecConfig(mode="chain", gamma=4), compute_dtype="auto")),
    "full": RunPreset(model="full", sft=SFTConfig(steps=1500, batch_size=32, lr=2e-3, n_examples=20000),
                      grpo=GRPOConfig(lr=1e-4), rl_steps=200, prompts_per_step=16, group_size=8,
                      max_new_tokens=96, eval_prompts=256, checkpoint_every=10, max_batch=64,
                      cotrain=cotrained(SpecConfig(mode="chain", gamma=4))),
}


def get_preset(name: str) -> RunPreset:
    if name not in RL_PRESETS:
        raise PresetError(f"unknown preset {name!r}; choose from {sorted(RL_PRESETS)}")
    return RL_PRESETS[name]
