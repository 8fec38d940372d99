"""specrl inside TRL's GRPOTrainer: lossless speculative rollouts and an online EAGLE-3 draft.

Why: TRL generates with `model.generate` (or vLLM) and lets a user replace that step with
`GRPOTrainer(..., rollout_func=f)`, where `f(prompts, trainer)` returns `prompt_ids`,
`completion_ids` and `logprobs` (trl 1.16, experimental API). specrl hooks in at exactly two
places and nothing else in TRL:

- `rollout_func`: the HF policy, converted once by `target_training.hf_adapter` into the
  embedded engine's model, generates with speculative decoding (chain or tree, lossless: the
  same tokens plain decoding would give under greedy and "coupled" sampling, and the policy's
  own log-probs). Before a rollout the engine's copy of the policy is refreshed from TRL's model
  whenever an optimizer step happened since the last sync; the sync writes the target's tensors
  only, never the draft (the draft reads the target embedding by reference).
- a `transformers.TrainerCallback` that drives `specrl.cotrain.SpecCoTrainer` around each
  optimizer step (begin_step, and end_step: the step boundary) and hands its metrics
  (`rollout/spec_accept_length`, `train/draft_loss`, ...) to TRL's logger.

Features for online draft training come from the engine (`CoTrainConfig.feature_source =
"engine"`): it computes the target's hidden states at every verified position anyway, whereas
TRL's own log-prob forward runs the HF model, which has no feature taps.

    plugin = SpecRLPlugin(model, draft=None, config=TRLSpecConfig())
    trainer = GRPOTrainer(model=model, ..., **plugin.grpo_kwargs())

With `CoTrainConfig(mode="off")`, `grpo_kwargs()` is empty: TRL runs exactly as without specrl.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import TrainerCallback

from draft_models.checkpoint import load_draft
from draft_models.config import Eagle3Config
from rollout.engine import EmbeddedEngine, EngineConfig
from rollout.protocol import SamplingParams
from specrl.config import CoTrainConfig
from specrl.cotrain import SpecCoTrainer
from target_training.hf_adapter import load_hf_target, to_specrl_state_dict


class TRLIntegrationError(ValueError):
    """A TRL setting that the specrl rollout cannot honour (one-line message)."""


@dataclass
class TRLSpecConfig:
    # Speculation and draft training; feature_source must be "engine" under TRL (see module doc).
    cotrain: CoTrainConfig = field(default_factory=lambda: CoTrainConfig(mode="online", feature_source="engine"))
    max_batch: int = 64  # engine slots (sequences decoded together)
    max_len: int | None = None  # KV cache per slot; None: longest prompt of the call + max_completion_length
    sampling_mode: str = "coupled"  # "coupled" (speculation reproduces plain sampling) or "rng"
    draft_vocab_size: int = 32000  # for a fresh draft (draft=None), capped at the vocabulary size
    draft_seed: int = 0  # initialisation of a fresh draft (the host's RNG is left untouched)

    def __post_init__(self) -> None:
        if self.cotrain.mode != "off" and self.cotrain.feature_source != "engine":
            raise TRLIntegrationError(f"TRLSpecConfig.cotrain.feature_source must be 'engine' with TRL, got "
                                      f"{self.cotrain.feature_source!r} (TRL's forward has no feature taps)")
        if self.draft_vocab_size <= 0:
            raise TRLIntegrationError(f"TRLSpecConfig.draft_vocab_size must be positive, got {self.draft_vocab_size}")
        EngineConfig(max_batch=self.max_batch, max_len=self.max_len, sampling_mode=self.sampling_mode)  # validates


class SpecRLPlugin:
    """The converted policy, its speculative engine and the co-trainer, for one GRPOTrainer.

    model: the HF policy TRL trains (converted once; later synced by value before rollouts).
    draft: an Eagle3Draft built for the converted target, a path to an SGLang EAGLE-3 draft
    folder, or None for a fresh draft (useful with mode="online" only)."""

    def __init__(self, model, draft=None, config: TRLSpecConfig | None = None):
        self.config = cfg = config or TRLSpecConfig()
        self.enabled = cfg.cotrain.mode != "off"
        self.trainer = None  # the GRPOTrainer, known from the first rollout_func call
        self.callback = SpecRLCallback(self)
        self.last_metrics: dict = {}
        self._synced_step = 0
        self._next_request_id = 0
        if not self.enabled:
            self.target = self.engine = self.cotrain = None
            return
        dev = next(model.parameters()).device
        self.target, _ = load_hf_target(model, device=dev, load_tokenizer=False)
        self.cotrain = SpecCoTrainer(self._resolve_draft(draft), cfg.cotrain)
        self.engine = EmbeddedEngine(self.target, EngineConfig(max_batch=cfg.max_batch, max_len=cfg.max_len,
                                                               sampling_mode=cfg.sampling_mode))
        self.cotrain.attach(self.engine)  # no specrl trainer: features come from the engine

    def _resolve_draft(self, draft):
        if isinstance(draft, (str, os.PathLike)):
            return load_draft(Path(draft), self.target, device=self.target.embed_tokens.weight.device)
        if draft is None:
            tcfg = self.target.cfg
            dcfg = Eagle3Config.for_target(tcfg, min(self.config.draft_vocab_size, tcfg.vocab_size))
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.config.draft_seed)
                draft = dcfg.build(self.target.embed_tokens)
            return draft.to(self.target.embed_tokens.weight.device)
        draft.set_target_embedding(self.target.embed_tokens)  # read the engine's copy of the policy
        return draft

    def grpo_kwargs(self, callbacks=None) -> dict:
        """Keyword arguments for `GRPOTrainer(...)`: the rollout function and the callback
        (appended to `callbacks`). Empty, apart from `callbacks`, when the plug-in is off."""
        callbacks = list(callbacks or [])
        if not self.enabled:
            return {"callbacks": callbacks} if callbacks else {}
        return {"rollout_func": self.rollout, "callbacks": callbacks + [self.callback]}

    # -- TRL hooks ------------------------------------------------------------------------
    def rollout(self, prompts: list, trainer) -> dict:
        """TRL's rollout_func: one completion per prompt (TRL already repeats each prompt
        num_generations times), generated speculatively by the embedded engine."""
        first = self.trainer is None
        if first:
            check_trainer(trainer)
            self.trainer = trainer
        self.sync_policy(trainer, force=first)  # first call: TRL may have cast or moved the model
        prompt_ids = trainer._tokenize_prompts(prompts)[0]  # TRL's own tokenisation and chat template
        args = trainer.args
        max_new = int(args.max_completion_length)
        if self.config.max_len is None:
            longest = max(len(p) for p in prompt_ids)
            self.engine.max_len = min(self.target.cfg.max_seq_len, longest + max_new)
        params = SamplingParams(temperature=float(args.temperature), top_p=float(args.top_p or 1.0),
                                top_k=int(args.top_k or 0), max_new_tokens=max_new,
                                stop_token_ids=tuple(trainer.eos_token_ids), seed=int(args.seed))
        # request ids key the sampling noise: distinct for every sample of the run, on every process
        n, rank, world = len(prompt_ids), trainer.accelerator.process_index, trainer.accelerator.num_processes
        start = self._next_request_id + rank * n
        self._next_request_id += n * world
        trajs = self.engine.generate(prompt_ids, params, request_ids=range(start, start + n),
                                     capture_features=self.cotrain.capture_engine_features)
        self.cotrain.on_rollout(trajs)
        return {"prompt_ids": [t.prompt_ids for t in trajs], "completion_ids": [t.token_ids for t in trajs],
                "logprobs": [t.logprobs.tolist() for t in trajs]}

    @torch.no_grad()
    def sync_policy(self, trainer, force: bool = False) -> bool:
        """Copy TRL's current policy into the engine's model if it changed since the last sync."""
        step = trainer.state.global_step
        if step == self._synced_step and not force:
            return False
        hf = trainer.accelerator.unwrap_model(trainer.model)
        self.engine.load_policy_weights(to_specrl_state_dict(hf.state_dict(), self.target.cfg))
        self._synced_step = step
        return True

    def begin_step(self) -> None:
        self.cotrain.begin_step()

    def end_step(self) -> dict:
        """After an optimizer step: the co-trainer's step boundary (the policy moved; the draft
        trains in the idle window); log."""
        self.last_metrics = self.cotrain.end_step()
        if self.trainer is not None:
            log_to_trl(self.trainer, self.last_metrics)
        return self.last_metrics


class SpecRLCallback(TrainerCallback):
    """Drives the co-trainer around TRL's optimizer steps (see SpecRLPlugin.end_step)."""

    def __init__(self, plugin: SpecRLPlugin):
        self.plugin = plugin

    def on_step_begin(self, args, state, control, **kwargs):
        if self.plugin.enabled:
            self.plugin.begin_step()

    def on_step_end(self, args, state, control, **kwargs):
        if self.plugin.enabled:
            self.plugin.end_step()


def check_trainer(trainer) -> None:
    """Refuse the TRL settings the embedded engine cannot reproduce (one-line errors)."""
    args = trainer.args
    problems = [
        (getattr(trainer, "use_vllm", False), "use_vllm=True (specrl's engine replaces vLLM)"),
        (bool(getattr(trainer, "tools", None)), "tools (multi-turn tool calls)"),
        (getattr(trainer, "environment_factories", None) is not None, "environment_factory"),
        (getattr(args, "min_p", None) not in (None, 0.0), f"min_p={getattr(args, 'min_p', None)}"),
        (getattr(args, "repetition_penalty", 1.0) not in (None, 1.0),
         f"repetition_penalty={getattr(args, 'repetition_penalty', None)}"),
        (bool(getattr(args, "generation_kwargs", None)), "generation_kwargs"),
        (not float(args.temperature) > 0, f"temperature={args.temperature} (GRPO samples; must be > 0)"),
        (getattr(args, "max_completion_length", None) is None, "max_completion_length=None (set it)"),
    ]
    for bad, what in problems:
        if bad:
            raise TRLIntegrationError(f"specrl's TRL rollout does not support {what}")
    if not isinstance(getattr(trainer, "_metrics", None), dict) or not hasattr(trainer, "_tokenize_prompts"):
        raise TRLIntegrationError("this TRL version lacks GRPOTrainer._metrics/_tokenize_prompts (tested: trl 1.16)")


def log_to_trl(trainer, metrics: dict) -> None:
    """Queue numeric metrics in TRL's per-step store (GRPOTrainer.log averages and reports them);
    lists become one key per entry (`.../0`, `.../1`, ...), None and non-finite values are skipped."""
    store = trainer._metrics["train"]
    for key, value in metrics.items():
        values = {f"{key}/{i}": v for i, v in enumerate(value)} if isinstance(value, (list, tuple)) else {key: value}
        for k, v in values.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                store[k].append(float(v))


def specrl_grpo_kwargs(model, draft=None, config: TRLSpecConfig | None = None, callbacks=None) -> dict:
    """One call: `GRPOTrainer(model=model, ..., **specrl_grpo_kwargs(model, draft))`. The plug-in
    is reachable afterwards as `kwargs["rollout_func"].__self__` (absent when mode is "off")."""
    return SpecRLPlugin(model, draft, config).grpo_kwargs(callbacks)


__all__ = ["TRLSpecConfig", "SpecRLPlugin", "SpecRLCallback", "TRLIntegrationError", "specrl_grpo_kwargs",
           "check_trainer", "log_to_trl"]
