"""The starting draft: an EAGLE-3 head trained offline on the policy's own rollouts.

Data is what the RL run will ask the draft to predict: responses the policy samples on the
task's training prompts. The target features come from one full forward per batch
(draft_models.train.capture_features), the draft vocabulary from the response token counts.
Like the SFT warm start, the result is cached on disk, keyed by the policy checkpoint and the
settings, and reused.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from draft_models.checkpoint import DraftCheckpointError, load_draft, save_draft
from draft_models.config import Eagle3Config
from draft_models.train import capture_features, progress_bar, train_offline
from draft_models.vocab import build_draft_vocab, count_tokens
from rollout.engine import EmbeddedEngine, EngineConfig
from rollout.protocol import SamplingParams
from specrl.config import DraftTrainConfig
from specrl.presets import get_preset
from specrl.rl_setup import build_task_and_policy, encode_prompts
from target_training.checkpoint import load_checkpoint
from target_training.sft import default_cache_dir


def rollout_records(policy, prompts: list[list[int]], params: SamplingParams, max_batch: int = 64,
                    request_offset: int = 0, progress: bool | None = False):
    """Sample responses from the policy; return (sequences, loss_masks) with the loss on responses.
    `progress`: a bar over the tokens decoded (draft_models.train.progress_bar)."""
    # the KV cache sized to the work, not to the model's context (a real model's 8192 tokens at batch 64
    # would take tens of GB and be attended over in full at every step)
    max_len = min(policy.cfg.max_seq_len, max(len(p) for p in prompts) + params.max_new_tokens)
    engine = EmbeddedEngine(policy, EngineConfig(max_batch=max_batch, max_len=max_len))
    # every answer counted at its length cap: the time left it shows is an upper bound (answers stop early)
    bar = progress_bar(progress, total=len(prompts) * params.max_new_tokens, desc="draft rollouts", unit="tok")
    engine.step_hooks.append(lambda n_active, n_slots: bar.update(n_active))
    try:
        trajs = engine.generate(prompts, params, request_ids=range(request_offset, request_offset + len(prompts)))
        bar.total = bar.n  # the tokens there were: the bar ends full
    finally:
        bar.close()
    seqs = [t.full_ids for t in trajs]
    masks = [[0] * len(t.prompt_ids) + [1] * len(t.token_ids) for t in trajs]
    return seqs, masks


def new_draft(policy, sequences, cfg: DraftTrainConfig, special_ids=(0, 1, 2)):
    mcfg = policy.cfg
    dv = min(cfg.draft_vocab_size, mcfg.vocab_size)
    d2t, t2d = build_draft_vocab(count_tokens(sequences, mcfg.vocab_size), mcfg.vocab_size, dv,
                                 always_include=special_ids)
    dcfg = Eagle3Config.for_target(mcfg, dv, ttt_steps=cfg.ttt_steps)
    torch.manual_seed(cfg.seed)
    draft = dcfg.build(policy.embed_tokens)  # initialised on the CPU: the same start on every device
    draft.set_vocab(d2t, t2d)
    return draft.to(policy.embed_tokens.weight.device)


def fit_draft(draft, policy, sequences, masks, cfg: DraftTrainConfig, log=print,
              progress: bool | None = False) -> list[dict]:
    data = capture_features(policy, sequences, masks, batch_size=64, d2t=draft.d2t, progress=progress)
    hist = train_offline(draft, data, steps=cfg.steps, lr=cfg.lr, batch_size=cfg.batch_size, seed=cfg.seed,
                         ttt_steps=cfg.ttt_steps, warmup=20, progress=progress)
    last = hist[-min(20, len(hist)):]
    acc0 = sum(h.get("acc_0", 0.0) for h in last) / len(last)
    log(f"[draft] trained {cfg.steps} steps on {len(sequences)} rollouts: loss {last[-1]['loss']:.3f}, "
        f"step-0 top-1 {acc0:.3f}")
    return hist


def train_offline_draft(policy, prompts, cfg: DraftTrainConfig, stop_ids, log=print, progress: bool | None = False):
    t0 = time.perf_counter()
    params = SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens, stop_token_ids=stop_ids,
                            seed=cfg.seed)
    log(f"[draft] training the offline draft: {min(len(prompts), cfg.n_sequences)} rollouts, then {cfg.steps} steps")
    seqs, masks = rollout_records(policy, prompts[: cfg.n_sequences], params, request_offset=10_000_000,
                                  progress=progress)
    log(f"[draft] sampled {len(seqs)} rollouts ({sum(sum(m) for m in masks)} response tokens) in "
        f"{time.perf_counter() - t0:.0f}s; training {cfg.steps} steps")
    draft = new_draft(policy, seqs, cfg)
    fit_draft(draft, policy, seqs, masks, cfg, log, progress)
    return draft, {"draft_train_s": time.perf_counter() - t0}


def starting_draft(policy, tokenizer, task, preset, seed: int, cache_dir: Path, log=print,
                   progress: bool | None = None):
    """(draft, info): a run's starting draft for `preset` and `seed`, trained offline on the
    policy's answers to the preset's draft prompts, or taken from the cache (cached_offline_draft)."""
    prompts = encode_prompts(tokenizer, task.examples("train", preset.draft.n_sequences, seed + 7))
    return cached_offline_draft(policy, prompts, preset.draft, (tokenizer.eos_id,), cache_dir, log=log,
                                progress=progress)


def policy_fingerprint(policy) -> str:
    h = hashlib.sha256()
    for k, v in sorted(policy.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def cached_offline_draft(policy, prompts, cfg: DraftTrainConfig, stop_ids, cache_dir: Path, log=print,
                         progress: bool | None = None):
    """Load the offline draft for this policy and these settings, or train and cache it, with
    progress bars and the time left (`progress` None: on a terminal only)."""
    key = hashlib.sha256(json.dumps({"policy": policy_fingerprint(policy), "cfg": asdict(cfg),
                                     "prompts": hashlib.sha256(str(prompts).encode()).hexdigest()},
                                    sort_keys=True).encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"draft-{key}"
    if path.exists():
        try:
            draft = load_draft(path, policy)
        except DraftCheckpointError as e:
            # a cache entry is only a copy of what training produces: a damaged one is trained
            # again (deterministically) and replaced, so it never blocks a run or its --resume,
            # whose checkpoint holds the co-trained drafts anyway
            log(f"[draft] cached offline draft is damaged ({e}); training it again")
        else:
            log(f"[draft] loaded cached offline draft from {path}")
            return draft, {"path": str(path), "cached": True}
    draft, info = train_offline_draft(policy, prompts, cfg, stop_ids, log, progress)
    save_draft(draft, path)
    log(f"[draft] cached at {path}")
    return draft, {"path": str(path), "cached": False, **info}


def train_draft_command(task_name: str, preset_name: str, out_dir, *, policy_path=None, seed: int = 0,
                        cache_dir=None) -> dict:
    """`specrl train-draft`: offline draft for a policy (trained, or taken from the draft cache),
    saved in the SGLang EAGLE-3 layout, which vLLM also loads."""
    preset = get_preset(preset_name)
    out = Path(out_dir) / "draft"
    if out.exists():
        raise ValueError(f"{out} already exists; choose another --out")
    cache_dir = Path(cache_dir or default_cache_dir())
    tokenizer, task, policy, _ = build_task_and_policy(task_name, preset, cache_dir)
    if policy_path is not None:
        policy, _, _, _ = load_checkpoint(policy_path, policy.cfg)
        policy.eval()
    # the cache is keyed by the policy's weights and the settings: a train-rl run's starting draft is reused
    draft, info = starting_draft(policy, tokenizer, task, preset, seed, cache_dir)
    save_draft(draft, out)
    return {"draft": str(out), "draft_vocab_size": int(draft.d2t.numel()), **info}
