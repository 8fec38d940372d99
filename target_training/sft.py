"""Warm start: a short supervised run so that RL begins from a policy with nonzero reward.

The SFT checkpoint is keyed by everything that determines it (task and its options, model
config, SFT config, tokenizer vocabulary) and cached on disk: every later run with the same
settings loads it instead of training again. A corrupted cache entry is reported, never
silently replaced.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from target_training.checkpoint import load_checkpoint, save_checkpoint
from target_training.config import MoEConfig, require_positive
from target_training.grpo import sft_loss
from target_training.model import MoETransformer


@dataclass
class SFTConfig:
    steps: int = 300
    batch_size: int = 32
    lr: float = 3e-3
    warmup: int = 20
    n_examples: int = 4000
    seed: int = 0

    def __post_init__(self) -> None:
        require_positive(self, ("steps", "batch_size", "n_examples", "lr"))


def default_cache_dir() -> Path:
    return Path(os.environ.get("SPECRL_CACHE", Path.home() / ".cache" / "specrl"))


def encode_example(tokenizer, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """(ids, loss_mask): bos + prompt + completion + eos, loss on completion and eos only."""
    p = tokenizer.encode_prompt(prompt)
    c = tokenizer.encode(completion) + [tokenizer.eos_id]
    return p + c, [0] * len(p) + [1] * len(c)


def sft_dataset(task, tokenizer, n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    return [encode_example(tokenizer, ex.prompt, task.sft_completion(ex, rng)) for ex in task.examples("train", n, seed)]


def collate(rows, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for b, (i, m) in enumerate(rows):
        ids[b, : len(i)] = torch.tensor(i)
        mask[b, : len(m)] = torch.tensor(m)
    return ids, mask


def train_sft(model: MoETransformer, data, cfg: SFTConfig, pad_id: int, progress=None) -> list[float]:
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, cfg.warmup)) * max(0.1, 1 - s / cfg.steps))
    losses = []
    model.train()
    for step in range(cfg.steps):
        idx = torch.randint(len(data), (cfg.batch_size,), generator=gen).tolist()
        ids, mask = collate([data[i] for i in idx], pad_id)
        loss = sft_loss(model, ids.to(model.embed_tokens.weight.device), mask.to(ids.device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if progress is not None:
            progress(step, loss.item())
    model.eval()
    return losses


def cache_key(task_spec: dict, model_cfg: MoEConfig, sft_cfg: SFTConfig, vocab_fingerprint: str) -> str:
    blob = json.dumps({"task": task_spec, "model": model_cfg.to_dict(), "sft": asdict(sft_cfg),
                       "vocab": vocab_fingerprint, "format": 1}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def warm_start(task, task_spec: dict, tokenizer, model_cfg: MoEConfig, sft_cfg: SFTConfig,
               cache_dir: Path | None = None, log=print, progress: bool | None = False) -> tuple[MoETransformer, dict]:
    """Load the cached SFT policy for these settings, or train and cache it; `progress`: a bar over
    the steps with the time left on stderr (None: on a terminal only)."""
    vocab_fp = hashlib.sha256(tokenizer.decode(list(range(tokenizer.vocab_size)), skip_special=False).encode()).hexdigest()[:16]
    path = Path(cache_dir or default_cache_dir()) / f"sft-{cache_key(task_spec, model_cfg, sft_cfg, vocab_fp)}"
    if path.exists():
        model, _, _, state = load_checkpoint(path, model_cfg)
        log(f"[sft] loaded cached warm start from {path}")
        return model.eval(), {"path": str(path), "cached": True, **(state or {})}
    torch.manual_seed(sft_cfg.seed)
    model = model_cfg.build()
    data = sft_dataset(task, tokenizer, sft_cfg.n_examples, sft_cfg.seed)
    t0 = time.perf_counter()
    log(f"[sft] training warm start: {model.num_parameters() / 1e6:.2f}M parameters, {sft_cfg.steps} steps")
    bar = tqdm(total=sft_cfg.steps, desc="sft warm start", unit="step",
               disable=None if progress is None else not progress)

    def tick(step: int, loss: float) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}")

    losses = train_sft(model, data, sft_cfg, tokenizer.pad_id, progress=tick)
    bar.close()
    info = {"sft_loss_end": sum(losses[-20:]) / len(losses[-20:]), "sft_s": time.perf_counter() - t0}
    save_checkpoint(path, model, model_cfg, state=info)
    log(f"[sft] done in {info['sft_s']:.1f}s, loss {info['sft_loss_end']:.3f}; cached at {path}")
    return model, {"path": str(path), "cached": False, **info}
