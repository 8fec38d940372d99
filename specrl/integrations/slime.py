"""specrl inside slime (THUDM/slime; Miles uses the same hook names): online EAGLE-3 training.

Why: slime already runs SGLang with a speculative draft (`--sglang-speculative-*`), and its
Megatron trainer already runs a log-prob forward over every rollout sequence. That forward
computes the three target layers EAGLE-3 reads, so the draft's training features cost a copy,
not a forward pass. This module wires the pieces through slime's documented plug-in points only:

  --custom-generate-function-path specrl.integrations.slime.generate
      async generate(args, sample, sampling_params) -> Sample: posts to the SGLang router, fills
      tokens / response / rollout_log_probs / status and `sample.spec_info` (slime's
      spec_accept_token_num / spec_draft_token_num / spec_verify_ct / completion_token_num),
      read with `rollout.sglang_engine.parse_spec_meta` whatever the SGLang version.
  --custom-megatron-init-path specrl.integrations.slime.megatron_init
      custom_init(args): reads the JSON config named by $SPECRL_SLIME_CONFIG (SlimeSpecConfig).
  --custom-megatron-before-log-prob-hook-path specrl.integrations.slime.before_log_prob_hook
      custom_hook(args, model, store_prefix): arms forward hooks on the three tap layers of the
      GPTModel's `decoder.layers` for the actor's own pass (store_prefix "" by default; the
      reference model's "ref_" pass is skipped: its features describe the wrong target).
  --custom-megatron-before-train-step-hook-path specrl.integrations.slime.before_train_step_hook
      custom_hook(args, rollout_id, step_id, model, optimizer, opt_param_scheduler): at step 0 of
      each rollout, moves the captured features into a `specrl.buffer.FeatureBuffer`, trains the
      draft with `specrl.online_trainer.OnlineDraftTrainer` within a time budget, and pushes it to
      every SGLang engine with `rollout.sglang_engine.SGLangEngine.push_draft`.

The policy sync itself is slime's: it must reach the target runner only (sglang 0.5.23:
`selector="target"` in a weight-update session), see docs/integrations/slime.md. A draft-side
failure is caught, counted and warned about, and the feature tap never raises into Megatron's
forward; the RL step goes on (DESIGN.md section 1). Only data-parallel rank
`SlimeSpecConfig.draft_rank` captures, trains and pushes, so a job has one draft.

Field and signature sources: slime `slime/utils/types.py` (Sample, Sample.SpecInfo) and
`docs/en/get_started/customization.md` (hook signatures) at THUDM/slime commit
0d234f3e3a83c81b7d37209994e0b994deacbb24; `model(input_ids=..., packed_seq_params=...)` and the
hook call order from slime's `megatron_utils` log-prob forward.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from draft_models.checkpoint import load_draft
from rollout.sglang_engine import SGLangEngine, SGLangEngineConfig
from specrl.buffer import FeatureBuffer
from specrl.online_trainer import OnlineDraftConfig, OnlineDraftTrainer

# The rollout side and the capture have modules of their own; their names are re-exported here,
# the module slime's command-line paths name.
from specrl.integrations.slime_capture import FeatureTap, default_tap_layers, unwrap  # noqa: F401
from specrl.integrations.slime_generate import (SPEC_INFO_FIELDS, add_spec_info, generate,  # noqa: F401
                                                register_tokenizer, spec_info_delta)

CONFIG_ENV = "SPECRL_SLIME_CONFIG"


# ---------------------------------------------------------------------------------------------
# trainer side: configuration and the two Megatron hooks
# ---------------------------------------------------------------------------------------------
@dataclass
class SlimeSpecConfig:
    draft_path: str  # the starting draft, SGLang layout (draft_models.checkpoint.save_draft)
    engine_urls: list[str] = field(default_factory=list)  # each SGLang server (not the router)
    tap_layer_ids: tuple[int, int, int] | None = None  # None: default_tap_layers(args.num_layers)
    buffer_bytes: int = 256 << 20
    online: OnlineDraftConfig = field(default_factory=OnlineDraftConfig)
    max_draft_steps: int = 32  # per rollout
    time_budget_s: float = 30.0  # per rollout
    min_buffer_records: int = 16
    capture_prefixes: tuple[str, ...] = ("",)  # store_prefix of the actor's own log-prob pass
    seq_first: bool = True
    # Draft pushes: SGLangEngineConfig fields (see rollout/sglang_engine.py).
    legacy_draft_flag: str | None = None  # older servers only; 0.5.23 routes pushes with selector="draft"
    hold_shared_draft_names: bool = False
    # HF names of the served target that a draft tensor name could hit (Llama/Qwen layout).
    target_param_names: tuple[str, ...] = ("lm_head.weight", "model.norm.weight", "model.embed_tokens.weight")
    # One draft per job: only this data-parallel rank captures features, trains the draft and
    # pushes it; the other ranks' hooks do nothing (their engines get the same draft from it).
    draft_rank: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.online, Mapping):
            self.online = OnlineDraftConfig(**self.online)
        if self.tap_layer_ids is not None:
            self.tap_layer_ids = tuple(int(i) for i in self.tap_layer_ids)
            if len(self.tap_layer_ids) != 3:
                raise ValueError(f"tap_layer_ids must name 3 layers, got {self.tap_layer_ids}")
        self.capture_prefixes = tuple(self.capture_prefixes)
        self.target_param_names = tuple(self.target_param_names)
        if self.max_draft_steps < 0 or self.time_budget_s < 0 or self.min_buffer_records <= 0:
            raise ValueError("SlimeSpecConfig: max_draft_steps and time_budget_s must be >= 0, "
                             "min_buffer_records positive")

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "SlimeSpecConfig":
        with open(path) as f:
            d = json.load(f)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{path}: unknown SlimeSpecConfig keys {unknown}")
        return cls(**d)


def data_parallel_rank() -> int:
    """This process's data-parallel rank: Megatron's when its parallel state is up, else the
    torch.distributed rank, else 0 (one process)."""
    try:
        from megatron.core import parallel_state as mpu

        if mpu.model_parallel_is_initialized():
            return int(mpu.get_data_parallel_rank())
    except ImportError:
        pass
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_rank())
    return 0


class SlimeSpecRuntime:
    """Per trainer process: the draft, its buffer and trainer, the tap, and the engine clients."""

    def __init__(self, config: SlimeSpecConfig, args, model_chunks, engines=None):
        self.config = cfg = config
        gpt = unwrap(model_chunks[0])
        emb = gpt.embedding.word_embeddings
        layer_ids = cfg.tap_layer_ids or default_tap_layers(int(args.num_layers))
        vocab = int(getattr(args, "padded_vocab_size", None) or getattr(args, "vocab_size", None) or emb.weight.shape[0])
        if emb.weight.shape[0] != vocab:
            raise ValueError(f"the embedding on this rank holds {emb.weight.shape[0]} of {vocab} rows (vocab-"
                             f"parallel shard); specrl's draft needs the full embedding (tensor parallel 1)")
        target = SimpleNamespace(embed_tokens=torch.nn.Embedding.from_pretrained(emb.weight.detach(), freeze=True),
                                 cfg=SimpleNamespace(hidden_size=emb.weight.shape[1], vocab_size=vocab,
                                                     feature_layer_ids=tuple(layer_ids)))
        self.draft = load_draft(cfg.draft_path, target)  # shares the policy's embedding storage
        self.buffer = FeatureBuffer(cfg.buffer_bytes, seed=cfg.seed)
        self.trainer = OnlineDraftTrainer(self.draft, cfg.online)
        self.tap = FeatureTap(gpt, layer_ids, seq_first=cfg.seq_first)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        if engines is None:
            engines = [SGLangEngine(SGLangEngineConfig(base_url=u, legacy_draft_flag=cfg.legacy_draft_flag,
                                                       hold_shared_draft_names=cfg.hold_shared_draft_names))
                       for u in cfg.engine_urls]
        for e in engines:
            if e.target_param_names is None:
                e.target_param_names = set(cfg.target_param_names)
        self.engines = engines
        self.faults = 0
        self.metrics: dict = {}
        self.dp_rank = data_parallel_rank()
        self.trains = self.dp_rank == cfg.draft_rank

    def on_log_prob(self, store_prefix: str) -> None:
        if self.trains and store_prefix in self.config.capture_prefixes:
            self.tap.arm()
        else:
            self.tap.disarm()

    def on_train_step(self, rollout_id: int, step_id: int) -> dict:
        self.tap.disarm()
        if step_id != 0 or not self.trains:
            return {}
        cfg = self.config
        t0 = time.perf_counter()
        try:
            stored = sum(self.buffer.add(r, int(rollout_id)) for r in self.tap.drain())
            m = {"buffer/entries": len(self.buffer), "buffer/stored": stored}
            if len(self.buffer) >= cfg.min_buffer_records and cfg.max_draft_steps > 0:
                before = self.trainer.version
                res = self.trainer.train_for(self.buffer, cfg.max_draft_steps, cfg.time_budget_s, self.generator)
                m.update({"train/draft_loss": res["mean_loss"], "train/draft_steps": res["steps"],
                          "perf/draft_train_s": res["seconds"]})
                if self.trainer.version != before:
                    t_sync = time.perf_counter()
                    weights = self.trainer.export_weights()
                    for e in self.engines:
                        e.push_draft(weights, self.trainer.version)
                    m["perf/draft_sync_time"] = time.perf_counter() - t_sync
            m["train/draft_version"] = self.trainer.version
        except Exception as err:  # never stop the RL run for the draft
            self.faults += 1
            warnings.warn(f"specrl draft step skipped ({type(err).__name__}: {err})", RuntimeWarning)
            m = {}
        m["train/draft_faults"] = self.faults
        m["perf/draft_total_s"] = time.perf_counter() - t0
        self.metrics = m
        return m


_STATE: dict = {"config": None, "runtime": None}


def configure(config: SlimeSpecConfig | None, runtime: SlimeSpecRuntime | None = None) -> None:
    """Set the configuration (and optionally a prebuilt runtime) for this process."""
    _STATE["config"], _STATE["runtime"] = config, runtime


def runtime() -> SlimeSpecRuntime | None:
    return _STATE["runtime"]


def megatron_init(args) -> None:
    """--custom-megatron-init-path: read SlimeSpecConfig from the JSON file named by $SPECRL_SLIME_CONFIG."""
    path = os.environ.get(CONFIG_ENV)
    if not path:
        raise ValueError(f"specrl.integrations.slime.megatron_init needs ${CONFIG_ENV} (a SlimeSpecConfig JSON file)")
    configure(SlimeSpecConfig.from_json(path))


def _runtime_for(args, model) -> SlimeSpecRuntime:
    if _STATE["runtime"] is None:
        if _STATE["config"] is None:
            raise ValueError("specrl slime hooks are not configured: add --custom-megatron-init-path "
                             "specrl.integrations.slime.megatron_init")
        _STATE["runtime"] = SlimeSpecRuntime(_STATE["config"], args, model)
    return _STATE["runtime"]


def before_log_prob_hook(args, model, store_prefix) -> None:
    """--custom-megatron-before-log-prob-hook-path (args, model, store_prefix)."""
    _runtime_for(args, model).on_log_prob(store_prefix)


def before_train_step_hook(args, rollout_id, step_id, model, optimizer, opt_param_scheduler) -> None:
    """--custom-megatron-before-train-step-hook-path (args, rollout_id, step_id, model, optimizer,
    opt_param_scheduler); draft work runs once per rollout, at step 0."""
    _runtime_for(args, model).on_train_step(rollout_id, step_id)
