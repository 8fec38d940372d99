"""Where and how much the draft trains inside an RL step: the memory budget counts the draft's
parameters, gradients, optimizer state, activations and the buffer (measured), and the
"interleaved" window runs between the policy update's micro-steps."""
import copy
from types import SimpleNamespace

import pytest
import torch
from helpers import fill_buffer

from rollout.engine import EmbeddedEngine, EngineConfig
from rollout.drafters import SpecConfig
from specrl.config import CoTrainConfig, DraftTrainConfig, SchedulerConfig
from specrl.cotrain import SpecCoTrainer
from specrl.drafts import new_draft
from target_training.grpo import GRPOConfig, GRPOTrainer


def _fill(cot, model, **kw):
    fill_buffer(cot, model, **{"n": 8, **kw})


def _cotrainer(model, memory_budget_bytes, batch_size=8, windows=("between",)):
    draft = new_draft(model, [[3, 4, 5, 6]], DraftTrainConfig(draft_vocab_size=64))
    from specrl.config import OnlineDraftConfig

    cfg = CoTrainConfig(mode="online", spec=SpecConfig(gamma=3), min_buffer_records=1, max_draft_steps=1,
                        online=OnlineDraftConfig(batch_size=batch_size),
                        scheduler=SchedulerConfig(budget_fraction=1.0, min_budget_s=60.0, windows=windows,
                                                  memory_budget_bytes=memory_budget_bytes))
    return SpecCoTrainer(draft, cfg)


def test_memory_breakdown_is_measured(tiny_model, one_thread):
    cot = _cotrainer(tiny_model, None)
    _fill(cot, tiny_model)
    cot.begin_step()
    m = cot.end_step()
    n_params = sum(p.numel() * p.element_size() for p in cot.draft.parameters() if p.requires_grad)
    assert m["train/draft_steps"] == 1
    assert m["mem/draft_params_bytes"] == n_params == m["mem/draft_grads_bytes"]
    assert m["mem/draft_optimizer_bytes"] == 2 * n_params  # projected before the first step
    assert m["mem/buffer_bytes"] == cot.buffer.nbytes > 0
    per_record = cot.draft_trainer.activation_bytes_per_record
    assert per_record > 0  # measured by the update (autograd's saved tensors and the batch)
    cot.begin_step()
    m = cot.end_step()
    opt = sum(t.numel() * t.element_size() for st in cot.draft_trainer.optimizer.state.values()
              for t in st.values() if torch.is_tensor(t))
    assert m["mem/draft_optimizer_bytes"] == opt >= 2 * n_params  # now AdamW's real state
    assert m["mem/draft_activation_bytes"] == int(per_record * 8)
    assert m["mem/draft_total_bytes"] == (2 * n_params + opt + cot.buffer.nbytes
                                          + m["mem/draft_activation_bytes"])
    assert m["sched/memory_shrunk"] == 0 and m["sched/memory_skipped"] == 0
    assert cot.engine is None and cot.faults == 0  # no engine attached: nothing to swap into, no fault


def test_an_update_over_budget_is_shrunk_or_skipped_and_reported(tiny_model, one_thread):
    probe = _cotrainer(tiny_model, None)
    _fill(probe, tiny_model)
    probe.begin_step()
    m = probe.end_step()  # measure the activations of a batch of 8
    fixed = (m["mem/draft_params_bytes"] + m["mem/draft_grads_bytes"] + m["mem/draft_optimizer_bytes"]
             + m["mem/buffer_bytes"])
    per_record = probe.draft_trainer.activation_bytes_per_record

    def run(budget):
        cot = _cotrainer(tiny_model, budget)
        cot.draft_trainer.activation_bytes_per_record = per_record  # as measured by the probe
        _fill(cot, tiny_model)
        cot.begin_step()
        seen = []
        step = cot.draft_trainer.train_step
        cot.draft_trainer.train_step = lambda *a, **k: seen.append(k.get("batch_size")) or step(*a, **k)
        return cot.end_step(), seen

    m, seen = run(int(fixed + 3.5 * per_record))
    assert seen == [3] and m["sched/memory_shrunk"] == 1 and m["train/draft_steps"] == 1
    with pytest.warns(RuntimeWarning, match="draft update skipped: .* exceed the draft's memory budget"):
        m, seen = run(int(fixed + 0.5 * per_record))
    assert seen == [] and m["sched/memory_skipped"] == 1 and m["train/draft_steps"] == 0
    assert m["train/draft_version"] == 0


def test_interleaved_window_trains_between_micro_steps(tiny_model, one_thread):
    """GRPOTrainer calls microstep_hooks between its micro-steps; the co-trainer trains there and
    accounts the time to the interleaved window."""
    model = copy.deepcopy(tiny_model)
    cot = _cotrainer(model, None, windows=("interleaved",))
    engine = EmbeddedEngine(model, EngineConfig(max_batch=8))
    trainer = GRPOTrainer(model, GRPOConfig(lr=1e-4, minibatch_size=2))
    cot.attach(engine, trainer)
    assert trainer.microstep_hooks == [cot._interleaved_hook]
    calls = []
    trainer.microstep_hooks.append(lambda done, total: calls.append((done, total)))
    from rollout.protocol import SamplingParams

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 60, (5,), generator=g).tolist() for _ in range(8)]
    cot.begin_step()
    trajs = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=8, seed=1))
    cot.on_rollout(trajs)
    trainer.step(trajs, [float(i % 2) for i in range(8)], group_size=4)  # 4 micro-steps of 2
    assert calls == [(1, 4), (2, 4), (3, 4)]  # between micro-steps: not after the last
    m = cot.end_step()
    # the update ran in the interleaved window; the boundary may run the gate of a candidate that
    # waited there for the step's first held-out answers (CoTrainConfig.heldout_every), no update
    assert m["perf/draft_train_interleaved_s"] > 0
    assert not cot._waiting and m["train/draft_gated_total"] == 1
    assert m["train/draft_steps"] == 1 and m["train/draft_version"] == 1  # max_draft_steps caps it


def test_interleaved_needs_a_trainer_with_hooks(tiny_model):
    cot = _cotrainer(tiny_model, None, windows=("interleaved",))
    with pytest.raises(ValueError, match="microstep_hooks"):
        cot.attach(EmbeddedEngine(tiny_model), SimpleNamespace(add_feature_hook=lambda layer_ids, hook: None))
