"""What an RL run is built from: the task and its SFT-warmed policy, the rollout engine, the
prompts of each step, the sampling settings, the rewards and the held-out evaluation.

Shared by `specrl.train_rl`, the offline draft (`specrl.drafts`) and the experiments, so that a
benchmark measures the same task, policy and sampling the RL run uses.
"""
from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from rollout.engine import EmbeddedEngine, EngineConfig
from rollout.protocol import Rollout, SamplingParams
from specrl.presets import RunPreset
from target_training.config import model_config_for
from target_training.real_models import ChatTokenizer, is_real_model, load_real_target
from target_training.sft import warm_start
from target_training.tasks import get_task
from target_training.tokenizer import CharTokenizer

EVAL_REQUEST_OFFSET = 1 << 40  # request ids of evaluation samples, disjoint from training rollouts
SEED_MAX = 2**32 - 1  # sampling noise keys on the seed's low 32 bits (rollout.sampling)
ENGINES = ("embedded", "vllm", "sglang")
DEVICES = ("auto", "cpu", "cuda")  # --device: "auto" is CUDA where torch sees a GPU and the engine is embedded


def resolve_device(name: str, engine: str = "embedded") -> torch.device:
    """The device the policy, its trainer, the draft and the embedded engine run on. "auto": the
    current CUDA device where torch sees one and the rollout engine is the embedded one (vLLM and
    SGLang serve the policy themselves; their trainer side stays on the CPU), else the CPU."""
    if name not in DEVICES and not (name.startswith("cuda:") and name[5:].isdigit()):
        raise ValueError(f"--device must be one of {', '.join(DEVICES)} or cuda:N, got {name!r}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() and engine == "embedded" else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if engine != "embedded":
            raise ValueError(f"--device {name} runs the embedded engine; --engine {engine} serves the policy itself "
                             "(drop --device or use --device cpu)")
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: this torch ({torch.__version__}) sees no CUDA device")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    return device


def check_seed(seed) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise ValueError(f"--seed must be an integer in [0, {SEED_MAX}], got {seed}")


def build_task_and_policy(task_name: str, preset: RunPreset, cache_dir: Path | None, log=print, progress=False,
                          device: torch.device | str = "cpu"):
    """(tokenizer, task, policy, sft_info): the task and its policy after the (cached) SFT warm start,
    or a real pretrained model (target_training.real_models) as it ships, with its chat tokenizer;
    the policy on `device` (the warm start itself trains on the CPU, so its cache serves any device)."""
    task = get_task(task_name, **preset.task_kwargs)
    if is_real_model(preset.model):
        policy, hf_tokenizer = load_real_target(preset.model, cache_dir, max_seq_len=preset.context or None, log=log)
        return ChatTokenizer(hf_tokenizer), task, policy.to(device), {"real_model": preset.model}
    tokenizer = CharTokenizer()
    model_cfg = model_config_for(preset.model, tokenizer.vocab_size)
    task_spec = {"name": task_name, **preset.task_kwargs}
    policy, sft_info = warm_start(task, task_spec, tokenizer, model_cfg, preset.sft, cache_dir, log=log,
                                  progress=progress)
    return tokenizer, task, policy.to(device), sft_info


def build_engine(name: str, policy, preset: RunPreset, out: Path, *, sglang_url: str = "http://127.0.0.1:30000"):
    """The rollout engine. The embedded one runs the trainer's policy module itself; vLLM serves
    an exported copy that `sync_policy` refreshes after every update; "sglang" is a client of
    the SGLang server at `sglang_url`, which it first contacts at its first call."""
    if name == "embedded":
        return EmbeddedEngine(policy, EngineConfig(max_batch=preset.max_batch))
    if name == "vllm":
        from rollout.vllm_engine import VLLMEngine, VLLMEngineConfig

        return VLLMEngine(policy, VLLMEngineConfig(max_batch=preset.max_batch, work_dir=str(out / "vllm")))
    if name == "sglang":
        from rollout.sglang_engine import SGLangEngine, SGLangEngineConfig

        return SGLangEngine(SGLangEngineConfig(base_url=sglang_url))
    raise ValueError(f"unknown engine {name!r}; choose from {ENGINES}")


def sync_policy(engine, policy) -> float | None:
    """Policy sync after an update (seconds); None for an engine that runs the policy module."""
    if engine.runs_in_place(policy):
        return None
    t0 = time.perf_counter()
    engine.load_policy_weights(policy.state_dict())
    return time.perf_counter() - t0


def encode_prompts(tokenizer, examples) -> list[list[int]]:
    return [tokenizer.encode_prompt(ex.prompt) for ex in examples]


def rollout_params(preset: RunPreset, tokenizer, seed: int, greedy: bool = False) -> SamplingParams:
    return SamplingParams(temperature=0.0 if greedy else preset.temperature, max_new_tokens=preset.max_new_tokens,
                          stop_token_ids=(tokenizer.eos_id,), seed=seed)


def step_examples(task, pool, preset: RunPreset, seed: int, step: int):
    """The prompts of RL step `step`, each repeated group_size times (deterministic in seed, step)."""
    rng = random.Random(seed * 100_003 + step)
    chosen = rng.sample(pool, preset.prompts_per_step)
    return [ex for ex in chosen for _ in range(preset.group_size)]


def spread_groups(n: int, group_size: int) -> list[int]:
    """The order in which a step's n = prompts x group_size requests are handed to the engine:
    member-major (the first member of every group, then the second, ...), so that each batch wave
    holds a few members of every group and the members admitted later find their siblings' answers
    ahead of them (rollout.drafters.history drafts from those). Results come back in the step's own order;
    coupled sampling keys each token by request id, so the order changes no token."""
    return [g * group_size + m for m in range(group_size) for g in range(n // group_size)]


def generate_step(engine, prompts, params, ids, group_size: int, **kw):
    """engine.generate over a step's grouped requests in `spread_groups` order; the Rollout in
    the step's own order (groups consecutive, as the GRPO update expects)."""
    order = spread_groups(len(prompts), group_size)
    out = engine.generate([prompts[i] for i in order], params, request_ids=[ids[i] for i in order], **kw)
    trajs = [None] * len(prompts)
    for i, t in zip(order, out):
        trajs[i] = t
    return Rollout(trajs, out.stats)


def score(task, tokenizer, examples, trajectories) -> list[float]:
    return [task.reward(ex, tokenizer.decode(t.token_ids)) for ex, t in zip(examples, trajectories)]


def evaluate(engine, task, tokenizer, examples, preset: RunPreset, seed: int) -> dict:
    """Held-out reward under the rollout's own sampling (the quantity GRPO maximises), averaged
    over `eval_samples` samples per prompt with fixed request ids, plus greedy accuracy."""
    k = preset.eval_samples
    reps = [ex for ex in examples for _ in range(k)]
    prompts = encode_prompts(tokenizer, reps)
    ids = [EVAL_REQUEST_OFFSET + i for i in range(len(reps))]
    sampled = engine.generate(prompts, rollout_params(preset, tokenizer, seed), request_ids=ids)
    rewards = score(task, tokenizer, reps, sampled)
    greedy = engine.generate(prompts[::k], rollout_params(preset, tokenizer, seed, greedy=True))
    correct = [task.is_correct(ex, tokenizer.decode(t.token_ids)) for ex, t in zip(examples, greedy)]
    return {"reward": sum(rewards) / len(rewards), "greedy_accuracy": sum(correct) / len(correct)}
