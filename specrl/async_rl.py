"""Asynchronous GRPO with online draft co-training, driven by AReaL's own rollout machinery.

`train_async_rl` is the loop at a glance. AReaL's WorkflowExecutor keeps generating on its own
thread (RLVRWorkflow episodes, grouped by GRPO's group size, admitted by its StalenessManager:
at most η = `staleness` versions ahead of the trainer); the trainer thread, per step:
  1. takes the next batch of groups AReaL has ready (`prepare_batch`), never waiting for a
     rollout phase to end: generation for later steps is already running;
  2. the GRPO policy update, whose log-prob forward hands the draft its features (tagged with
     the trainer's policy version, the newest the engine will serve);
  3. publishes the new weights AReaL's way: pause the executor, load the weights into the
     engine between two chunks (requests in flight resume under the new version), set the
     version, resume;
  4. draft updates on features of the last η + 1 versions, pushed to the engine (versioned apart
     from the policy) between chunks, in two windows (`AsyncConfig.draft_windows`): "wait",
     before step 1, while the trainer's next batch is still being generated (one update at a
     time, as long as it is not ready), and "between", here, after the weights are published.
     Generation keeps running meanwhile on its own thread.

The engine is specrl's embedded engine on its own copy of the policy (the trainer updates its
module while generation runs), served through specrl.integrations.areal.ChunkServer.
Needs areal 1.0.4 (tests/lanes/areal.sh installs it); without it, one line names the fix.
"""
from __future__ import annotations

import copy
import dataclasses
import time

import torch

from rollout.engine import EmbeddedEngine, EngineConfig
from rollout.protocol import Trajectory
from specrl.integrations.areal import ChunkServer, areal_engine
from specrl.machine_load import STEP_KEY
from specrl.presets import RunPreset, get_preset
from specrl.rl_setup import build_task_and_policy, encode_prompts
from specrl.step_clock import StepClock
from specrl.train_rl import RLCallback, RLRun, build_cotrainer
from target_training.grpo import GRPOTrainer
from target_training.sft import default_cache_dir
from target_training.tasks import Example, get_task


class TokenizerView:
    """What AReaL's RLVRWorkflow asks of a tokenizer, over specrl's task tokenizer. The pad id is
    the stop id: RLVRWorkflow adds the pad id to the stop tokens."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_token_id = self.pad_token_id = tokenizer.eos_id

    def decode(self, ids, **kw) -> str:
        return self.tokenizer.decode(list(ids))


def task_reward(prompt, completions, prompt_ids, completion_ids, *, task_spec, example, **_):
    """AReaL reward function (runs in its reward process pool, hence picklable and module-level)."""
    spec = dict(task_spec)
    return float(get_task(spec.pop("name"), **spec).reward(Example(**example), completions))


def batch_to_trajectories(batch: list[dict], stop_ids: tuple[int, ...]):
    """AReaL's trajectory dicts (one per group, rows padded) as specrl Trajectories in group order,
    with their rewards and the policy version of each generated token."""
    trajs, rewards, versions = [], [], []
    for group in batch:
        for r in range(group["input_ids"].shape[0]):
            n = int(group["attention_mask"][r].sum())
            ids = group["input_ids"][r, :n].tolist()
            mask = group["loss_mask"][r, :n].bool()
            start = int(mask.nonzero()[0]) if mask.any() else n
            tokens = ids[start:]
            finish = "stop" if tokens and tokens[-1] in stop_ids else "length"
            trajs.append(Trajectory(prompt_ids=ids[:start], token_ids=tokens,
                                    logprobs=group["logprobs"][r, start:n].float().clone(), finish_reason=finish))
            rewards.append(float(group["rewards"][r]))
            versions.append(group["versions"][r, start:n].tolist())
    return trajs, rewards, versions


@dataclasses.dataclass
class AsyncConfig:
    staleness: int = 1  # η: AReaL's max_head_offpolicyness
    chunk_tokens: int = 16  # interruption granularity of a weight update (ChunkServer)
    concurrent_groups: int = 0  # AReaL's max_concurrent_rollouts in groups (0: (η + 1) x groups per step)
    # where the draft trains (specrl.scheduler): "wait", while the trainer waits for its next batch,
    # and/or "between", after the policy update, on the trainer's path (it delays the next update
    # and the next weights, so it lengthens the loop's step)
    draft_windows: tuple[str, ...] = ("wait",)
    # the decoupled PPO weight on stale rollouts (GRPOConfig.behaviour_weight_cap; AReaL's former
    # default cap is 5.0); None: the preset's objective, clipped against recomputed log-probs only
    behaviour_weight_cap: float | None = None


def train_async_rl(task_name: str, preset_name: str | RunPreset, *, spec: str = "online", acfg: AsyncConfig | None = None,
                   steps: int | None = None, seed: int = 0, cache_dir=None,
                   callbacks: tuple[RLCallback, ...] = (), log=print) -> dict:
    """`steps` asynchronous GRPO steps; returns {"rows": one dict per step, "summary": ..., "run": ...}.
    `callbacks` (specrl.train_rl.RLCallback) see an RLRun whose engine is the ChunkServer, plus
    `run.areal` (the AReaL engine) and `run.last_batch` (the step's trajectories and each
    token's policy version); they run with generation paused, outside the step's wall time."""
    from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
    from areal.workflow.rlvr import RLVRWorkflow
    from torchdata.stateful_dataloader import StatefulDataLoader

    acfg = acfg or AsyncConfig()
    preset = get_preset(preset_name) if isinstance(preset_name, str) else preset_name
    preset = preset.with_overrides(rl_steps=steps)
    cache_dir = default_cache_dir() if cache_dir is None else cache_dir
    torch.manual_seed(seed)
    tokenizer, task, policy, _ = build_task_and_policy(task_name, preset, cache_dir, log)
    trainer = GRPOTrainer(policy, dataclasses.replace(preset.grpo, behaviour_weight_cap=acfg.behaviour_weight_cap))
    engine = EmbeddedEngine(copy.deepcopy(policy), EngineConfig(max_batch=preset.max_batch))
    server = ChunkServer(engine, chunk_tokens=acfg.chunk_tokens, max_batch=preset.max_batch)
    # the draft learns from the versions a consumed rollout may come from, in the loop's windows
    cot = preset.cotrain
    preset = dataclasses.replace(preset, cotrain=dataclasses.replace(
        cot, recent_versions=acfg.staleness + 1,
        scheduler=dataclasses.replace(cot.scheduler, windows=tuple(acfg.draft_windows))))
    cotrain = build_cotrainer(spec, policy, tokenizer, task, preset, seed, cache_dir, log)
    cotrain.attach(server, trainer)

    B = preset.prompts_per_step
    groups_in_flight = acfg.concurrent_groups or (acfg.staleness + 1) * B
    config = InferenceEngineConfig(consumer_batch_size=B, max_head_offpolicyness=acfg.staleness,
                                   max_concurrent_rollouts=groups_in_flight, enable_rollout_tracing=False)
    areal = areal_engine(server, config, seed=seed)
    areal.initialize(train_data_parallel_size=1)
    gconfig = GenerationHyperparameters(max_new_tokens=preset.max_new_tokens, temperature=preset.temperature,
                                        stop_token_ids=[tokenizer.eos_id])
    task_spec = {"name": task_name, **preset.task_kwargs}
    workflow = RLVRWorkflow(reward_fn=task_reward, gconfig=gconfig, tokenizer=TokenizerView(tokenizer),
                            get_input_ids_fn=lambda data, tok, thinking: data["input_ids"],
                            data_extract_prompt_fn=lambda data: data)
    pool = task.examples("train", max(512, B * 8), seed + 1)
    data = [{"input_ids": ids, "task_spec": task_spec, "example": dataclasses.asdict(ex)}
            for ex, ids in zip(pool, encode_prompts(tokenizer, pool))]
    loader = StatefulDataLoader(data, batch_size=B, shuffle=True, drop_last=True, collate_fn=lambda x: x,
                                generator=torch.Generator().manual_seed(seed))

    run = RLRun(preset, seed, None, cache_dir, tokenizer, task, policy, server, trainer, cotrain)
    run.areal = areal

    def paused(fn):  # callbacks run with generation paused: they may time or inspect the engine alone
        areal.pause()
        server.pause_generation()
        try:
            return fn()
        finally:
            server.continue_generation()
            areal.resume()

    loop = _AsyncLoop(run, areal, server, loader, workflow, acfg)
    rows = []
    t_run = time.perf_counter()
    try:
        paused(lambda: [cb.on_start(run) for cb in callbacks])
        for step in range(preset.rl_steps):
            row = async_step(loop, step)
            rows.append(row)
            paused(lambda: [cb.on_step_end(run, step, row) for cb in callbacks])
            log(f"[async η={acfg.staleness}] step {step}: reward {row['reward']:.2f} staleness ≤ {row['staleness_max']} "
                f"accept {row.get('rollout/spec_accept_length', 0.0):.2f} step {row['step_s']:.2f}s")
        wall = time.perf_counter() - t_run
        summary = {"task": task_name, "spec": spec, "staleness": acfg.staleness, "chunk_tokens": acfg.chunk_tokens,
                   "steps": len(rows), "wall_s": wall, "steps_s": sum(r["step_s"] for r in rows),
                   "staleness_max": max((r["staleness_max"] for r in rows), default=0),
                   "stale_groups_dropped": sum(r["stale_groups_dropped"] for r in rows),
                   "policy_sync_wait_s": server.wait_for_chunk_s, "generation_busy_s": server.busy_s,
                   "spec_faults": len(server.draft_faults)}
        paused(lambda: [cb.on_end(run, summary) for cb in callbacks])
    finally:
        areal.destroy()
        server.close()
    return {"rows": rows, "summary": summary, "run": run}


@dataclasses.dataclass
class _AsyncLoop:
    """What every asynchronous step shares: the run, AReaL's engine, the chunk server, the data,
    and the groups AReaL returned beyond a step's batch."""

    run: RLRun
    areal: object
    server: ChunkServer
    loader: object
    workflow: object
    acfg: AsyncConfig
    fetched: int = 0  # groups taken from AReaL so far
    ready: list = dataclasses.field(default_factory=list)  # of them, the groups not used yet

    def fetch(self) -> list[dict]:
        got = self.areal.prepare_batch(self.loader, self.workflow, group_size=self.run.preset.group_size)
        self.fetched += len(got)
        return got


def async_step(loop: _AsyncLoop, step: int) -> dict:
    """One asynchronous GRPO step, in the shape of specrl.train_rl.rl_step: the co-trainer's step
    opens, the draft trains while the batch is still being generated ("wait" window), the batch
    AReaL has ready and its acceptance, the policy update, the weights published AReaL's way, the
    co-trainer's step boundary; returns the step's row."""
    run, areal, server, B = loop.run, loop.areal, loop.server, loop.run.preset.prompts_per_step
    cotrain, trainer, eos = run.cotrain, run.trainer, run.tokenizer.eos_id
    clock = StepClock()
    cotrain.begin_step()
    # the "wait" window: while the next batch is still being generated (groups taken from AReaL and
    # not yet used count as ready)
    waited = cotrain.train_while(lambda: batch_pending(areal, loop.fetched - len(loop.ready), B))
    clock.lap("draft_wait")
    batch, loop.ready, stale = fresh_groups(loop.ready, step, loop.acfg.staleness, B, loop.fetch)
    clock.lap("wait")
    trajs, rewards, versions = batch_to_trajectories(batch, (eos,))
    heads = [v[0] for v in versions if v]
    finished = server.take_finished()
    cotrain.on_rollout(finished)
    metrics = trainer.step(trajs, rewards, run.preset.group_size)
    clock.lap("update")
    areal.pause()
    server.load_policy_weights(run.policy.state_dict(), step + 1)
    areal.set_version(step + 1)
    areal.resume()
    clock.lap("policy_sync")
    row = {"step": step, **metrics, **cotrain.end_step(),
           "staleness_max": step - min(heads), "staleness_mean": step - sum(heads) / len(heads),
           "wait_s": clock.laps["wait"], "update_s": clock.laps["update"], "policy_sync_s": clock.laps["policy_sync"],
           "draft_wait_s": clock.laps["draft_wait"], "draft_wait_updates": waited,
           "draft_s": clock.lap("draft"), "step_s": clock.elapsed(), STEP_KEY: clock.others_busy_cores(),
           "tokens": sum(len(t.token_ids) for t in trajs), "rollouts_finished": len(finished),
           "stale_groups_dropped": stale, "spec_faults_total": len(server.draft_faults)}
    run.last_batch = (trajs, versions)
    return row


def fresh_groups(ready: list[dict], version: int, staleness: int, batch: int, fetch) -> tuple[list[dict], list[dict], int]:
    """The trainer's next `batch` groups, none more than `staleness` versions behind `version`
    (the trainer's): AReaL's StalenessManager bounds how many rollouts it admits per version,
    which bounds their staleness only if they finish in order; a group admitted early that
    finishes late can be consumed η + 1 versions on or more. Such groups are dropped here, at
    consumption, and counted. `ready` holds groups fetched earlier and not used; `fetch()` returns
    AReaL's next batch. Returns (batch, groups left for later, groups dropped)."""
    out, dropped = [], 0
    while len(out) < batch:
        if not ready:
            ready = list(fetch())
        group = ready.pop(0)
        head = int(group["versions"][group["loss_mask"].bool()].min())  # its oldest generated token
        if version - head > staleness:
            dropped += 1
        else:
            out.append(group)
    return out, ready, dropped


def batch_pending(areal, consumed: int, batch: int) -> bool:
    """Whether the trainer's next batch is still being generated: fewer than `batch` groups
    finished beyond the `consumed` ones, and some running (AReaL's StalenessManager counts)."""
    stat = areal.workflow_executor.staleness_manager.get_stats()
    return stat.accepted - consumed < batch and stat.running > 0


__all__ = ["train_async_rl", "async_step", "AsyncConfig", "TokenizerView", "task_reward", "batch_to_trajectories"]
