"""specrl inside slime (THUDM/slime; Miles uses the same hook names): a thin layer over SpecCoTrainer.

Why: slime already runs SGLang with a speculative draft (`--sglang-speculative-*`), and its
Megatron trainer already runs a log-prob forward over every rollout sequence. That forward
computes the three target layers EAGLE-3 reads, so the draft's training features cost a copy,
not a forward pass. This module adds no co-training logic of its own: it builds one
`specrl.cotrain.SpecCoTrainer` and hands slime's documented plug-in points to it through the
engine-agnostic protocols (`rollout.protocol`):

  --custom-generate-function-path specrl.integrations.slime.generate
      async generate(args, sample, sampling_params) -> Sample (specrl.integrations.slime_generate):
      the SGLang call and `sample.spec_info`.
  --custom-megatron-init-path specrl.integrations.slime.megatron_init
      custom_init(args): reads the JSON config named by $SPECRL_SLIME_CONFIG (SlimeSpecConfig).
  --custom-megatron-before-log-prob-hook-path specrl.integrations.slime.before_log_prob_hook
      custom_hook(args, model, store_prefix): on first use builds the adapter (the draft, the
      co-trainer, the feature source); arms the feature source for the actor's own pass
      (store_prefix "" by default; the reference model's "ref_" pass describes the wrong target).
      The feature source (`slime_capture.FeatureTap`, a FeatureSource) writes each packed
      sequence straight into the co-trainer's byte-budgeted FeatureBuffer.
  --custom-megatron-before-train-step-hook-path specrl.integrations.slime.before_train_step_hook
      custom_hook(args, rollout_id, step_id, model, optimizer, opt_param_scheduler): at step 0 of
      each rollout, the co-trainer's step boundary (`end_step`): this rollout's train steps move
      the policy, so later features carry the next version; then draft updates (the "between"
      window, at most `time_budget_s`), pushed as a new version to every SGLang engine
      (`rollout.draft_fanout.DraftFanout` over `SGLangEngine`s, DraftReceivers).

Faults: the feature tap never raises into Megatron's forward; a capture that fails (an OOM
included) disarms it, warns once, is counted (`train/feature_tap_faults`) and co-training skips
that rollout's draft update. Draft-side failures (OOM, NaN, a failed push) are the co-trainer's
to catch, count (`train/draft_faults`) and warn about; the host step goes on. Configuration errors
(a draft that does not fit the target, tensor parallelism) raise once, at the first hook.

One draft per job: only data-parallel rank `SlimeSpecConfig.draft_rank` builds the co-trainer,
captures, trains and pushes; on the other ranks every hook returns at once, so the engines have
one writer and the draft learns from that rank's share of the rollouts.

Field and signature sources: slime `slime/utils/types.py` (Sample, Sample.SpecInfo) and
`docs/en/get_started/customization.md` (hook signatures) at THUDM/slime commit
0d234f3e3a83c81b7d37209994e0b994deacbb24; `model(input_ids=..., packed_seq_params=...)` and the
hook call order from slime's `megatron_utils` log-prob forward (the same in Miles, miles-rl 0.0.2).
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from draft_models.checkpoint import load_draft
from rollout.draft_fanout import DraftFanout
from rollout.sglang_engine import SGLangEngine, SGLangEngineConfig
from specrl.config import CoTrainConfig, OnlineDraftConfig, SchedulerConfig
from specrl.cotrain import SpecCoTrainer

# The rollout side and the capture have modules of their own; their names are re-exported here,
# the module slime's command-line paths name.
from specrl.integrations.slime_capture import FeatureTap, default_tap_layers, unwrap  # noqa: F401
from specrl.integrations.slime_generate import (SPEC_INFO_FIELDS, add_spec_info, generate,  # noqa: F401
                                                register_tokenizer, spec_info_delta)

CONFIG_ENV = "SPECRL_SLIME_CONFIG"


@dataclass
class SlimeSpecConfig:
    draft_path: str  # the starting draft, SGLang layout (draft_models.checkpoint.save_draft)
    engine_urls: list[str] = field(default_factory=list)  # each SGLang server (not the router)
    tap_layer_ids: tuple[int, int, int] | None = None  # None: default_tap_layers(args.num_layers)
    capture_prefixes: tuple[str, ...] = ("",)  # store_prefix of the actor's own log-prob pass
    seq_first: bool = True
    # One draft per job: only this data-parallel rank captures, trains and pushes.
    draft_rank: int = 0
    # Co-training, translated by cotrain_config():
    buffer_bytes: int = 256 << 20
    online: OnlineDraftConfig = field(default_factory=OnlineDraftConfig)
    max_draft_steps: int = 32  # per rollout
    time_budget_s: float = 30.0  # per rollout
    min_buffer_records: int = 16
    memory_budget_bytes: int | None = None  # draft-side bytes (SchedulerConfig); None: its share of the device
    seed: int = 0
    # Draft pushes: SGLangEngineConfig fields (see rollout/sglang_engine.py).
    legacy_draft_flag: str | None = None  # older servers only; 0.5.23 routes pushes with selector="draft"
    hold_shared_draft_names: bool = False
    # HF names of the served target that a draft tensor name could hit (Llama/Qwen layout).
    target_param_names: tuple[str, ...] = ("lm_head.weight", "model.norm.weight", "model.embed_tokens.weight")

    def __post_init__(self) -> None:
        if isinstance(self.online, Mapping):
            self.online = OnlineDraftConfig(**self.online)
        if self.tap_layer_ids is not None:
            self.tap_layer_ids = tuple(int(i) for i in self.tap_layer_ids)
            if len(self.tap_layer_ids) != 3:
                raise ValueError(f"tap_layer_ids must name 3 layers, got {self.tap_layer_ids}")
        self.capture_prefixes = tuple(self.capture_prefixes)
        self.target_param_names = tuple(self.target_param_names)
        if self.time_budget_s < 0:
            raise ValueError(f"SlimeSpecConfig.time_budget_s must be >= 0, got {self.time_budget_s}")
        self.cotrain_config()  # validates the co-training fields

    def cotrain_config(self) -> CoTrainConfig:
        """The co-trainer's configuration: online, features from the trainer's forward, draft
        updates in the "between" window only (at the train-step hook) with a fixed time budget."""
        sched = SchedulerConfig(windows=("between",), min_budget_s=self.time_budget_s, max_budget_s=self.time_budget_s,
                                memory_budget_bytes=self.memory_budget_bytes)
        return CoTrainConfig(mode="online", feature_source="trainer", buffer_bytes=self.buffer_bytes,
                             online=self.online, max_draft_steps=self.max_draft_steps,
                             min_buffer_records=self.min_buffer_records, scheduler=sched, seed=self.seed)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "SlimeSpecConfig":
        with open(path) as f:
            d = json.load(f)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{path}: unknown SlimeSpecConfig keys {unknown}")
        return cls(**d)


def data_parallel_rank_and_size() -> tuple[int, int]:
    """This process's data-parallel rank and the data-parallel world size: Megatron's when its
    parallel state is up, else torch.distributed's, else (0, 1) (one process)."""
    try:
        from megatron.core import parallel_state as mpu

        if mpu.model_parallel_is_initialized():
            return int(mpu.get_data_parallel_rank()), int(mpu.get_data_parallel_world_size())
    except ImportError:
        pass
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_rank()), int(torch.distributed.get_world_size())
    return 0, 1


def load_draft_for(config: SlimeSpecConfig, args, gpt):
    """The starting draft, reading the policy's live embedding by reference (no copy), so it
    follows the policy's updates. Refuses a vocabulary-parallel shard (tensor parallelism > 1)
    and context parallelism: the draft would see part of the embedding or of each sequence."""
    emb = gpt.embedding.word_embeddings
    vocab = int(getattr(args, "padded_vocab_size", None) or getattr(args, "vocab_size", None) or emb.weight.shape[0])
    if emb.weight.shape[0] != vocab:
        raise ValueError(f"specrl's slime adapter needs tensor parallel 1: this rank's embedding holds "
                         f"{emb.weight.shape[0]} of {vocab} rows (a vocabulary-parallel shard)")
    if int(getattr(args, "context_parallel_size", 1) or 1) > 1:
        raise ValueError("specrl's slime adapter needs context parallel 1: each rank sees part of every sequence")
    layer_ids = config.tap_layer_ids or default_tap_layers(int(args.num_layers))
    target = SimpleNamespace(embed_tokens=torch.nn.Embedding.from_pretrained(emb.weight.detach(), freeze=True),
                             cfg=SimpleNamespace(hidden_size=emb.weight.shape[1], vocab_size=vocab,
                                                 feature_layer_ids=tuple(layer_ids)))
    return load_draft(config.draft_path, target)


class SlimeAdapter:
    """slime's Megatron hooks, per trainer process, handed to one SpecCoTrainer.

    On data-parallel rank `config.draft_rank`: `cotrain` (the co-trainer), `tap` (its feature
    source) and `engines` (its draft receivers). On the other ranks all three are None and the
    hooks do nothing. `metrics` holds the last train-step hook's figures."""

    def __init__(self, config: SlimeSpecConfig, args, model_chunks, engines=None):
        self.config = cfg = config
        self.dp_rank, dp_size = data_parallel_rank_and_size()
        if not 0 <= cfg.draft_rank < dp_size:
            raise ValueError(f"SlimeSpecConfig.draft_rank {cfg.draft_rank} is not a data-parallel rank of this job "
                             f"(0..{dp_size - 1}): no rank would train the draft")
        self.trains = self.dp_rank == cfg.draft_rank
        self.cotrain = self.tap = self.engines = None
        self.metrics: dict = {}
        self._tap_faults_seen = 0
        if not self.trains:
            return
        gpt = unwrap(model_chunks[0])
        draft = load_draft_for(cfg, args, gpt)
        if engines is None:
            engines = [SGLangEngine(SGLangEngineConfig(base_url=u, legacy_draft_flag=cfg.legacy_draft_flag,
                                                       hold_shared_draft_names=cfg.hold_shared_draft_names))
                       for u in cfg.engine_urls]
        for e in engines:
            if getattr(e, "target_param_names", ()) is None:
                e.target_param_names = set(cfg.target_param_names)
        self.engines = DraftFanout(engines)
        self.tap = FeatureTap(gpt, seq_first=cfg.seq_first)
        self.cotrain = SpecCoTrainer(draft, cfg.cotrain_config()).attach(self.engines, self.tap)
        self.cotrain.begin_step()

    def on_log_prob(self, store_prefix: str) -> None:
        if self.tap is None:
            return
        if store_prefix in self.config.capture_prefixes:
            self.tap.arm()
        else:
            self.tap.disarm()

    def on_train_step(self, rollout_id: int, step_id: int) -> dict:
        """Step 0 of a rollout: one draft update window (skipped when the tap failed during this
        rollout's capture), the policy-version bump, and the step's metrics."""
        if self.tap is None:
            return {}
        self.tap.disarm()
        self.tap.set_response_lengths(None)
        if step_id != 0:
            return {}
        tap_failed = self.tap.faults > self._tap_faults_seen
        self._tap_faults_seen = self.tap.faults
        self.metrics = self.cotrain.end_step(train=not tap_failed) | {"train/feature_tap_faults": self.tap.faults}
        self.cotrain.begin_step()
        return self.metrics


_STATE: dict = {"config": None, "adapter": None}


def configure(config: SlimeSpecConfig | None, adapter: SlimeAdapter | None = None) -> None:
    """Set the configuration (and optionally a prebuilt adapter) for this process."""
    if _STATE["adapter"] is not None and _STATE["adapter"] is not adapter and _STATE["adapter"].tap is not None:
        _STATE["adapter"].tap.remove()  # a replaced adapter leaves no hooks on the model
    _STATE["config"], _STATE["adapter"] = config, adapter


def adapter() -> SlimeAdapter | None:
    return _STATE["adapter"]


def megatron_init(args) -> None:
    """--custom-megatron-init-path: read SlimeSpecConfig from the JSON file named by $SPECRL_SLIME_CONFIG."""
    path = os.environ.get(CONFIG_ENV)
    if not path:
        raise ValueError(f"specrl.integrations.slime.megatron_init needs ${CONFIG_ENV} (a SlimeSpecConfig JSON file)")
    configure(SlimeSpecConfig.from_json(path))


def _adapter_for(args, model) -> SlimeAdapter:
    if _STATE["adapter"] is None:
        if _STATE["config"] is None:
            raise ValueError("specrl slime hooks are not configured: add --custom-megatron-init-path "
                             "specrl.integrations.slime.megatron_init")
        _STATE["adapter"] = SlimeAdapter(_STATE["config"], args, model)
    return _STATE["adapter"]


def before_log_prob_hook(args, model, store_prefix) -> None:
    """--custom-megatron-before-log-prob-hook-path (args, model, store_prefix)."""
    _adapter_for(args, model).on_log_prob(store_prefix)


def before_train_step_hook(args, rollout_id, step_id, model, optimizer, opt_param_scheduler) -> None:
    """--custom-megatron-before-train-step-hook-path (args, rollout_id, step_id, model, optimizer,
    opt_param_scheduler); draft work runs once per rollout, at step 0."""
    _adapter_for(args, model).on_train_step(rollout_id, step_id)
