"""Overlapped draft training (specrl.overlap): the burst runs on its own thread on a snapshot of
the buffer and of the target embedding, the engine's draft is swapped only at a step boundary,
and the trained weights equal the sequential mode's on the same batches."""
import copy
import dataclasses

import pytest
import torch
from helpers import engine_draft, fill_buffer, overlap_pair

from rollout.engine import EmbeddedEngine
from specrl.config import SchedulerConfig
from specrl.cotrain import SpecCoTrainer


def _fill(cot, model, **kw):
    fill_buffer(cot, model, **{"n": 12, **kw})


def _weights(draft):
    return {k: v.clone() for k, v in draft.state_dict().items()}


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def test_overlapped_burst_equals_sequential_and_swaps_at_the_boundary(tiny_model, one_thread):
    model = copy.deepcopy(tiny_model)
    seq, ovl = overlap_pair(model)
    start = _weights(engine_draft(ovl.engine))
    emb = model.embed_tokens.weight.detach().clone()

    seq.begin_step()
    m_seq = seq.end_step()  # trains 3 updates now and swaps them in
    seq_trained = _weights(seq.draft)

    ovl.begin_step()
    m = ovl.end_step()  # the boundary: starts the burst and returns at once
    assert ovl._overlap.busy and m["train/draft_steps"] == 0
    with torch.no_grad():
        model.embed_tokens.weight.add_(1.0)  # the policy update rewrites the embedding meanwhile
    ovl._overlap._thread.join()
    assert _same(_weights(engine_draft(ovl.engine)), start)  # the engine's copy is untouched by the burst

    ovl.begin_step()
    m = ovl.end_step()  # the boundary: collect, swap, start the next burst
    assert m["train/draft_steps"] == 3 and m_seq["train/draft_steps"] == 3
    assert m["perf/draft_overlap_s"] > 0 and m["perf/draft_wait_s"] >= 0
    ovl._overlap._thread.join()
    # the burst trained on the embedding as it was at its start: exactly the sequential result
    with torch.no_grad():
        model.embed_tokens.weight.copy_(emb)
    assert _same(_weights(engine_draft(ovl.engine)), seq_trained)
    assert ovl.engine.draft_version == 3
    assert ovl.draft.embed_tokens is not model.embed_tokens  # the next burst reads its snapshot
    ovl.state_dict()  # collects it
    assert ovl.draft.embed_tokens is model.embed_tokens  # back on the live embedding


def test_a_failing_burst_is_counted_and_the_run_goes_on(tiny_model, one_thread):
    _, ovl = overlap_pair(copy.deepcopy(tiny_model))

    def boom(*a, **k):
        raise MemoryError("OOM in the burst (simulated)")

    real = ovl.draft_trainer.train_for
    ovl.draft_trainer.train_for = boom
    ovl.begin_step()
    ovl.end_step()
    ovl.draft_trainer.train_for = real
    ovl.begin_step()
    with pytest.warns(RuntimeWarning, match="OOM in the burst"):
        m = ovl.end_step()
    assert m["train/draft_faults"] == 1 and m["train/draft_steps"] == 0
    assert ovl.draft.embed_tokens is not None and ovl._overlap.busy  # the next burst started
    sd = ovl.state_dict()  # waits for the burst: a consistent trainer state
    assert not ovl._overlap.busy and sd["draft_trainer"]["version"] == 3


def test_overlap_needs_a_valid_mode():
    with pytest.raises(ValueError, match="SchedulerConfig.mode"):
        SchedulerConfig(mode="parallel")
    with pytest.raises(ValueError, match="overlap_threads"):
        SchedulerConfig(mode="overlap", overlap_threads=0)


def test_bench_overlap_runs_and_saves_json(sft_policy, tmp_path):
    """The benchmark's machinery on the CI preset (one timed step; its timings mean nothing here)."""
    import json

    from experiments.bench.overlap import bench_overlap

    cache = sft_policy[3]
    r = bench_overlap("arith", "ci", tmp_path, steps=1, warmup=1, cache_dir=cache, log=lambda *a: None)
    assert json.loads((tmp_path / "bench_overlap.json").read_text()) == r
    assert set(r["step_s_mean"]) == {"none", "sequential", "overlap", "overlap_rollout"}
    assert r["draft_steps_per_rl_step"]["sequential"] == 1  # DRIFT_COTRAIN_FIXED: one update per step
    assert r["draft_steps_per_rl_step"]["overlap"] == 1  # the burst started at step 0, collected at step 1
    assert r["overlap_hidden_s_mean"]["overlap"] > 0 and r["overlap_hidden_s_mean"]["overlap_rollout"] > 0


def test_bench_overlap_phases_runs_the_updates_it_times(sft_policy, tmp_path):
    """`bench overlap --phases` on the CI preset: every arm ran, the sequential and overlapped arms
    really trained (the co-trainer's draft version moved by updates per call), the thread count
    is restored; its timings mean nothing here."""
    import json

    import torch

    from experiments.bench.overlap import bench_overlap_phases

    threads = torch.get_num_threads()
    r = bench_overlap_phases("arith", "ci", tmp_path, batches=(2,), updates=1, repeats=2,
                             cache_dir=sft_policy[3], log=lambda *a: None)
    assert json.loads((tmp_path / "bench_overlap_phases.json").read_text()) == r
    assert torch.get_num_threads() == threads
    assert {row["main_threads"] for row in r["rows"]} == {threads, 1}
    for row in r["rows"]:
        assert all(len(w) == 2 and min(w) > 0 for w in row["walls"].values())
        assert row["update_s_in_line"] > 0 and row["burst_s_overlapped"] > 0
    # rows (one per thread count: one row when the suite already runs on one thread) x repeats x
    # (sequential + overlap), one update each
    assert r["draft_updates_done"] == len(r["rows"]) * 2 * 2
    with pytest.raises(ValueError, match="updates > 0"):
        bench_overlap_phases("arith", "ci", tmp_path, updates=0)


def test_a_burst_until_the_rollout_is_collected_there_and_gives_the_loop_its_threads_back(tiny_model):
    """overlap_until="rollout": the burst started at a step boundary is collected when the next
    rollout ends (before the policy update), the RL loop runs with rollout_threads meanwhile and
    gets its own count back, and the trained weights are the sequential mode's."""
    model = copy.deepcopy(tiny_model)
    seq, ovl = overlap_pair(model)
    ovl = SpecCoTrainer(copy.deepcopy(ovl.draft), dataclasses.replace(
        ovl.config, scheduler=dataclasses.replace(ovl.config.scheduler, overlap_until="rollout",
                                                  rollout_threads=1))).attach(EmbeddedEngine(model))
    ovl.draft.set_target_embedding(model.embed_tokens)
    engine_draft(ovl.engine).set_target_embedding(model.embed_tokens)
    _fill(ovl, model)
    threads = torch.get_num_threads()
    seq.begin_step()
    seq.end_step()
    ovl.begin_step()
    ovl.end_step()  # the boundary starts the burst
    assert ovl._overlap.busy and torch.get_num_threads() == 1
    ovl._overlap._thread.join()  # the burst ends under the (here empty) rollout, as a long rollout would
    ovl.begin_step()
    ovl.on_rollout([])  # the rollout ended: collect the burst
    assert not ovl._overlap.busy and torch.get_num_threads() == threads
    assert ovl.scheduler.spent_s > 0  # the wait for it is charged to the step
    m = ovl.end_step()
    assert m["train/draft_steps"] == 3 and m["perf/draft_overlap_s"] > 0
    assert _same(_weights(engine_draft(ovl.engine)), _weights(seq.draft))
    ovl.wait_for_draft()
    assert torch.get_num_threads() == threads


def test_overlap_until_and_rollout_threads_are_checked():
    with pytest.raises(ValueError, match="overlap_until"):
        SchedulerConfig(mode="overlap", overlap_until="forever")
    with pytest.raises(ValueError, match="rollout_threads"):
        SchedulerConfig(mode="overlap", rollout_threads=0)
