"""Contract of the co-training plug-in inside a real RL loop (CI preset, a few steps)."""
import dataclasses
import json

import pytest
import torch

from helpers import PerRunEngine, engine_draft, rows_held_as
from rollout.drafters import SpecConfig
from rollout.engine import EmbeddedEngine, EngineConfig
from rollout.protocol import SamplingParams
from specrl.config import CoTrainConfig
from specrl.cotrain import SpecCoTrainer
from specrl.train_rl import train_rl


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same seeded 3-step run with speculation off, frozen and online."""
    cache = tmp_path_factory.mktemp("cache")
    out = {}
    for mode in ("off", "frozen", "online"):
        d = tmp_path_factory.mktemp(mode)
        summary = train_rl("arith", "ci", d, seed=3, steps=3, cache_dir=cache, progress=False, spec=mode,
                           log=lambda *a: None)
        out[mode] = (summary, _rows(d), d)
    return out


def test_speculation_is_lossless_end_to_end(runs):
    """Same seed: identical rewards and identical policy updates with speculation off, frozen or online."""
    base = [(r["reward"], r["loss"], r["response_len"]) for r in runs["off"][1]]
    for mode in ("frozen", "online"):
        assert [(r["reward"], r["loss"], r["response_len"]) for r in runs[mode][1]] == base
        assert runs[mode][0]["reward_end"] == runs["off"][0]["reward_end"]


def test_metrics_reported(runs):
    online = runs["online"][1]
    for key in ("rollout/spec_accept_length", "rollout/spec_accept_rate", "rollout/spec_accept_rate_per_pos",
                "train/draft_loss", "perf/draft_train_s", "perf/draft_sync_s"):
        assert key in online[-1]
    assert all(r["rollout/spec_accept_length"] > 1.0 for r in online)
    assert online[-1]["train/draft_version"] >= 1  # the online draft was trained and swapped in
    assert "rollout/spec_accept_length" not in runs["off"][1][0]  # off adds nothing
    assert runs["frozen"][1][-1].get("train/draft_steps") is None


def test_resume_restores_cotraining_state(runs, tmp_path):
    _, rows, d = runs["online"]
    state = torch.load(d / "ckpt" / "state.pt", weights_only=False)
    assert state["cotrain"]["mode"] == "online"
    assert state["cotrain"]["policy_version"] == 3
    assert state["cotrain"]["draft_trainer"]["version"] == rows[-1]["train/draft_version"]


def test_train_rl_tells_the_cotrainer_the_steps_left(sft_policy, tmp_path, monkeypatch):
    """Each RL step opens with the steps still to run, that one included (the run choice starts no
    re-check the run cannot pay back, RunChoice.calls_left)."""
    seen = []
    begin = SpecCoTrainer.begin_step

    def spy(self, steps_left=None):
        seen.append(steps_left)
        return begin(self, steps_left)

    monkeypatch.setattr(SpecCoTrainer, "begin_step", spy)
    train_rl("arith", "ci", tmp_path / "run", seed=3, steps=3, cache_dir=sft_policy[3], progress=False, spec="frozen",
             log=lambda *a: None)
    assert seen == [3, 2, 1]


def test_disabled_plugin_leaves_engine_and_trainer_untouched(tiny_model):
    from target_training.grpo import GRPOConfig, GRPOTrainer

    engine = EmbeddedEngine(tiny_model)
    trainer = GRPOTrainer(tiny_model, GRPOConfig())
    cot = SpecCoTrainer(None, CoTrainConfig(mode="off")).attach(engine, trainer)
    cot.begin_step()
    assert engine.draft_version is None and engine.step_hooks == [] and trainer.logprob_hooks == []
    assert cot.on_rollout([]) == {} and cot.end_step() == {}


def test_draft_failure_falls_back_to_plain(sft_policy, offline_draft):
    """A crashing or NaN draft never stops generation: outputs equal plain decoding, the fault is counted."""
    tokenizer, task, policy, _ = sft_policy
    from specrl.rl_setup import encode_prompts

    prompts = encode_prompts(tokenizer, task.examples("heldout", 12, 4))
    params = SamplingParams(temperature=1.0, max_new_tokens=30, stop_token_ids=(tokenizer.eos_id,), seed=2)
    ids = range(len(prompts))  # the same samples in every call
    plain = EmbeddedEngine(policy, EngineConfig(max_batch=4)).generate(prompts, params, request_ids=ids)
    cot = SpecCoTrainer(offline_draft, CoTrainConfig(mode="frozen", spec=SpecConfig(gamma=3)))
    engine = EmbeddedEngine(policy, EngineConfig(max_batch=4))
    cot.attach(engine)
    with torch.no_grad():
        engine_draft(engine).fc.weight.fill_(float("nan"))
    with pytest.warns(RuntimeWarning, match="speculation disabled"):
        out = engine.generate(prompts, params, request_ids=ids)
    assert [t.token_ids for t in out] == [t.token_ids for t in plain]
    assert engine.draft_faults and "NaN" in engine.draft_faults[0]
    assert out.stats.spec_faults == 1
    m = cot.on_rollout(out)  # counted in the metrics, per rollout and in total
    assert m["rollout/spec_faults"] == 1 and m["rollout/spec_faults_total"] == 1

    def boom(*a, **k):
        raise RuntimeError("CUDA out of memory (simulated)")

    with torch.no_grad():
        engine_draft(engine).fc.weight.copy_(offline_draft.fc.weight)
    engine_draft(engine).forward = boom
    with pytest.warns(RuntimeWarning, match="out of memory"):
        out = engine.generate(prompts, params, request_ids=ids)
    assert [t.token_ids for t in out] == [t.token_ids for t in plain]
    m = cot.on_rollout(out)
    assert m["rollout/spec_faults"] == 1 and m["rollout/spec_faults_total"] == 2
    del engine_draft(engine).forward  # a healthy draft again: the next rollout counts no fault
    out = engine.generate(prompts, params, request_ids=ids)
    assert out.stats.spec_faults == 0
    assert cot.on_rollout(out)["rollout/spec_faults"] == 0 and sum(t.spec.verify_steps for t in out) > 0


def test_draft_trainer_failure_does_not_stop_training(sft_policy, offline_draft, monkeypatch):
    import copy

    cot = SpecCoTrainer(copy.deepcopy(offline_draft), CoTrainConfig(mode="online", min_buffer_records=1))
    _, _, policy, _ = sft_policy
    ids = torch.randint(3, 60, (2, 12))
    out = policy(ids, tap_layers=policy.cfg.feature_layer_ids)
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[:, 6:] = True
    cot.buffer.add_from_trainer_forward(ids, out.features(policy.cfg.feature_layer_ids), out.logits, mask,
                                        cot.draft.d2t, 0)
    monkeypatch.setattr(cot.draft_trainer, "train_for", lambda *a, **k: (_ for _ in ()).throw(MemoryError("OOM")))
    cot.begin_step()
    with pytest.warns(RuntimeWarning, match="OOM"):
        m = cot.end_step()
    assert m["train/draft_faults"] == 1


# ---------------------------------------------------------------- draft faults and recovery
class _InjectNaN:
    """An RLCallback that writes NaN into the trainer's draft after step `at`."""

    def __init__(self, at):
        self.at = at

    def on_start(self, run):
        pass

    def on_end(self, run, summary):
        pass

    def on_step_end(self, run, step, row):
        if step == self.at:
            with torch.no_grad():
                run.cotrain.draft.fc.weight[0, 0] = float("nan")


def test_nan_in_the_trainers_draft_is_rolled_back_and_training_resumes(sft_policy, tmp_path):
    """Before the fix one NaN froze draft training for the rest of the run with 0 faults."""
    cache = sft_policy[3]
    with pytest.warns(RuntimeWarning, match="rolled back"):
        train_rl("arith", "ci", tmp_path / "r", seed=3, steps=5, cache_dir=cache, progress=False, spec="online",
                 callbacks=(_InjectNaN(1),), log=lambda *a: None)
    rows = _rows(tmp_path / "r")
    assert [r["train/draft_faults"] for r in rows] == [0, 0, 1, 1, 1]
    versions = [r["train/draft_version"] for r in rows]
    assert versions[4] > versions[3] > versions[2] > versions[1]  # training goes on after the rollback
    assert all(r["rollout/spec_accept_length"] > 1.0 for r in rows)  # speculation never stopped
    assert all(r["train/draft_loss"] is None or r["train/draft_loss"] == r["train/draft_loss"] for r in rows)


def test_nan_in_a_resumed_state_is_repaired(sft_policy, tmp_path):
    """A checkpoint whose engine draft and trained draft are NaN: the resumed run speculates and
    trains from its first step, and counts both faults."""
    from target_training.checkpoint import load_checkpoint, save_checkpoint

    cache, out = sft_policy[3], tmp_path / "r"
    train_rl("arith", "ci", out, seed=3, steps=2, cache_dir=cache, progress=False, spec="online",
             log=lambda *a: None)
    model, cfg, _, state = load_checkpoint(out / "ckpt")
    nan = lambda sd: {k: (v.clone().fill_(float("nan")) if v.is_floating_point() else v) for k, v in sd.items()}
    state["cotrain"]["engine_draft"] = nan(state["cotrain"]["engine_draft"])
    state["cotrain"]["draft_trainer"]["draft"] = nan(state["cotrain"]["draft_trainer"]["draft"])
    save_checkpoint(out / "ckpt", model, cfg, state=state)
    with pytest.warns(RuntimeWarning, match="unusable"):
        train_rl("arith", "ci", out, seed=3, steps=4, cache_dir=cache, progress=False, spec="online",
                 resume=True, log=lambda *a: None)
    rows = _rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[2]["train/draft_faults"] == 2 and rows[2]["rollout/spec_accept_length"] > 1.0
    assert rows[3]["train/draft_version"] > rows[2]["train/draft_version"] > rows[1]["train/draft_version"]
    assert all(json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines())


def _online_cotrainer(sft_policy, offline_draft, **config):
    import copy

    cot = SpecCoTrainer(copy.deepcopy(offline_draft), CoTrainConfig(mode="online", min_buffer_records=1, **config))
    _, _, policy, _ = sft_policy
    ids = torch.randint(3, 60, (4, 12), generator=torch.Generator().manual_seed(0))
    out = policy(ids, tap_layers=policy.cfg.feature_layer_ids)
    mask = torch.zeros(4, 12, dtype=torch.bool)
    mask[:, 6:] = True
    cot.buffer.add_from_trainer_forward(ids, out.features(policy.cfg.feature_layer_ids), out.logits, mask,
                                        cot.draft.d2t, 0)
    cot.scheduler.config.budget_fraction = 1.0
    cot.scheduler.config.min_budget_s = 60.0
    return cot.attach(EmbeddedEngine(policy, EngineConfig(max_batch=4)))  # the engine holds its own draft copy


def test_failed_hot_swap_is_logged_as_such(sft_policy, offline_draft, monkeypatch):
    cot = _online_cotrainer(sft_policy, offline_draft)
    before = {k: v.clone() for k, v in engine_draft(cot.engine).state_dict().items()}

    def broken(weights, version):
        raise RuntimeError("device lost")

    monkeypatch.setattr(cot.engine, "push_draft", broken)
    cot.begin_step()
    with pytest.warns(RuntimeWarning, match=r"hot swap to version \d+ failed .*device lost.*keeps draft version 0"):
        m = cot.end_step()
    assert m["train/draft_faults"] == 1 and m["train/draft_version"] >= 1 and cot.engine.draft_version == 0
    assert all(torch.equal(before[k], v) for k, v in engine_draft(cot.engine).state_dict().items())


def test_pushed_weights_are_checked_before_use(sft_policy, offline_draft, monkeypatch):
    cot = _online_cotrainer(sft_policy, offline_draft)
    before = {k: v.clone() for k, v in engine_draft(cot.engine).state_dict().items()}
    real = cot.draft_trainer.export_weights
    monkeypatch.setattr(cot.draft_trainer, "export_weights",
                        lambda: {k: (v.fill_(float("nan")) if k == "fc.weight" else v) for k, v in real().items()})
    cot.begin_step()
    with pytest.warns(RuntimeWarning, match="weights refused: fc.weight has non-finite values"):
        m = cot.end_step()
    assert m["train/draft_faults"] == 1 and cot.engine.draft_version == 0
    assert all(torch.equal(before[k], v) for k, v in engine_draft(cot.engine).state_dict().items())
    monkeypatch.setattr(cot.draft_trainer, "export_weights", real)
    cot.begin_step()
    cot.end_step()  # the next good push goes through
    assert cot.engine.draft_version == cot.draft_trainer.version


def test_the_wait_window_trains_one_update_at_a_time_while_the_batch_is_pending(sft_policy, offline_draft):
    """train_while (an asynchronous loop's "wait" window): one update per check of `waiting`,
    each pushed to the engine, never past the step's update count, and nothing when the window
    is not enabled."""
    from specrl.config import DraftBudgetConfig, SchedulerConfig

    sched = SchedulerConfig(windows=("wait", "between"), draft_steps=DraftBudgetConfig(base_steps=3))
    cot = _online_cotrainer(sft_policy, offline_draft, scheduler=sched, max_draft_steps=3)
    checks = []
    cot.begin_step()
    assert cot.train_while(lambda: checks.append(cot.draft_trainer.version) or len(checks) <= 2) == 2
    assert checks == [0, 1, 2]  # the batch became ready at the third check: two updates
    assert cot.engine.draft_version == cot.draft_trainer.version == 2  # each update reached the engine
    assert cot.train_while(lambda: True) == 1  # the step's third and last update
    assert cot.train_while(lambda: True) == 0
    assert cot.end_step()["train/draft_steps"] == 3  # nothing left for "between" either
    off = _online_cotrainer(sft_policy, offline_draft, scheduler=SchedulerConfig(windows=("between",)))
    off.begin_step()
    assert off.train_while(lambda: True) == 0 and off.draft_trainer.version == 0


@pytest.mark.parametrize("budget_s, trained_at", [(30.0, [0, 4, 5]), (1e-6, [0, 4, 11])])
def test_one_slow_update_does_not_stop_the_draft_for_the_rest_of_the_run(sft_policy, offline_draft, budget_s,
                                                                        trained_at):
    """The trainer starts no update its estimate says would overrun the step's budget, and only
    an update that runs refreshes the estimate. As if one update had taken 100 s: three steps
    train nothing, then the estimate is dropped and the fourth measures it again. Where that
    probe fits the budget the draft trains at every step after it; where no update can fit (a
    budget of 1 us), the next probe waits 6 steps, then 12."""
    cot = _online_cotrainer(sft_policy, offline_draft)
    cot.scheduler.config.min_budget_s = cot.scheduler.config.max_budget_s = budget_s
    trained = []
    for step in range(12 if budget_s < 1 else 6):
        cot.begin_step()
        if cot.end_step()["train/draft_steps"]:
            trained.append(step)
        if step == 0:
            cot.draft_trainer.step_seconds = 100.0
    assert trained == trained_at
    assert cot.metrics()["sched/step_time_probes"] == (2 if budget_s < 1 else 1)


def test_the_one_cotraining_configuration_measures_gates_and_buys_updates_in_an_rl_run(sft_policy, tmp_path):
    """The RL presets' co-training (presets.cotrained, on the CI model for speed): the steps whose
    boundary trains (every train_every-th) report the serving draft's held-out expected accept
    length once a held-out prompt has come by (one prompt in 8; the CI preset's 4 a step may
    bring none at first), the others train and measure nothing; every trained draft went through
    the gate, and the value budget's count is what ran, within the cap of the steps since the
    last burst."""
    import dataclasses

    from specrl.presets import cotrained, get_preset

    cotrain = get_preset("quick").cotrain
    assert cotrain == cotrained(cotrain.spec) and cotrain.scheduler.draft_steps.rule == "value"
    every = cotrain.train_every
    assert every > 1
    preset = dataclasses.replace(get_preset("ci"), cotrain=cotrain)
    train_rl("arith", preset, tmp_path / "r", seed=3, steps=every + 1, cache_dir=sft_policy[3], progress=False,
             spec="online", log=lambda *a: None)
    rows = _rows(tmp_path / "r")
    steps = [r["train/draft_steps"] for r in rows]
    bursts = [r["step"] % every == 0 for r in rows]
    measured = [r["sched/heldout_accept_length"] is not None for r in rows]
    assert measured[-1] and bursts[-1] and all(b for m, b in zip(measured, bursts) if m)
    assert all(r["sched/heldout_accept_length"] > 1.0 and r["perf/draft_heldout_s"] > 0
               for r, m in zip(rows, measured) if m)
    assert steps[0] == cotrain.scheduler.draft_steps.base_steps  # the gain is unknown: a probe
    assert all(k == 0 for k, b in zip(steps, bursts) if not b)
    assert all(0 <= k <= every * cotrain.max_draft_steps for k in steps)
    assert rows[-1]["train/draft_gated_total"] >= sum(k > 0 for k in steps)  # every burst was gated


def test_adaptive_budget_reads_acceptance_at_the_configured_chain(tiny_model):
    """Under the adaptive controller a rollout that speculated with short chains emits fewer
    tokens per verify step with the same draft: the acceptance-driven budget must not read that
    as a falling draft. With per-token acceptance a = 0.8, chains of 2 and of 6 give the same signal,
    E(a, gamma) at the configured gamma; without the controller the raw accept length is read."""
    from types import SimpleNamespace

    from rollout.protocol import SpecStats
    from rollout.drafters import SpecConfig
    from specrl.config import CoTrainConfig, DraftBudgetConfig, DraftTrainConfig, SchedulerConfig
    from specrl.controller import expected_accept_length
    from specrl.cotrain import SpecCoTrainer
    from specrl.drafts import new_draft
    from rollout.engine import EmbeddedEngine

    def rollout(gamma: int, a: float = 0.8, steps: int = 4096):
        # expected counts of a chain with iid acceptance a: accepted drafts E(a, g) - 1 per verify step
        acc = (expected_accept_length(a, gamma) - 1.0) * steps
        return [SimpleNamespace(spec=SpecStats(verify_steps=steps, drafted=gamma * steps, accepted=round(acc)))]

    draft = new_draft(tiny_model, [[3, 4, 5, 6]], DraftTrainConfig(draft_vocab_size=64))
    signals = {}
    for adaptive in (True, False):
        cfg = CoTrainConfig(mode="frozen", spec=SpecConfig(gamma=6), adaptive=adaptive,
                            scheduler=SchedulerConfig(draft_steps=DraftBudgetConfig(rule="acceptance")))
        for gamma in (2, 6):
            cot = SpecCoTrainer(draft, cfg).attach(EmbeddedEngine(tiny_model))
            cot.on_rollout(rollout(gamma))
            signals[adaptive, gamma] = cot.budget.last
    assert signals[True, 2] == pytest.approx(signals[True, 6], rel=1e-3)
    assert signals[True, 6] == pytest.approx(expected_accept_length(0.8, 6), rel=1e-3)
    assert signals[False, 2] < 0.7 * signals[False, 6]  # the raw accept length follows the chain length


def test_a_rollout_that_hardly_speculated_raises_no_collapse_alarm(tiny_model):
    """Under the adaptive controller a rollout may speculate in one re-measuring step only: one
    sequence drafting a few rejected tokens is no sign of a collapsed draft. Rollouts that drafted
    enough tokens and accepted none still raise the alarm."""
    import warnings
    from types import SimpleNamespace

    from rollout.engine import EmbeddedEngine
    from rollout.protocol import SpecStats
    from rollout.drafters import SpecConfig
    from specrl.config import CoTrainConfig, DraftBudgetConfig, DraftTrainConfig, SchedulerConfig
    from specrl.cotrain import MIN_DRAFTED_TOKENS, SpecCoTrainer
    from specrl.drafts import new_draft

    draft = new_draft(tiny_model, [[3, 4, 5, 6]], DraftTrainConfig(draft_vocab_size=64))
    cfg = CoTrainConfig(mode="frozen", spec=SpecConfig(gamma=6), adaptive=True,
                        scheduler=SchedulerConfig(draft_steps=DraftBudgetConfig(rule="acceptance", collapse_patience=2)))
    for steps, alarmed in ((1, False), (MIN_DRAFTED_TOKENS, True)):
        cot = SpecCoTrainer(draft, cfg).attach(EmbeddedEngine(tiny_model))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for _ in range(4):
                cot.on_rollout([SimpleNamespace(spec=SpecStats(verify_steps=steps, drafted=steps, accepted=0))])
        assert cot.budget.alarm is alarmed and bool(w) is alarmed, steps


def test_hot_swap_keeps_the_controllers_measurements(sft_policy, offline_draft):
    """A draft update must not send the adaptive controller back to exploring: it keeps its
    acceptance and step-time estimates across the swap (they follow the new draft by their EMAs)."""
    from specrl.config import ControllerConfig

    cot = _online_cotrainer(sft_policy, offline_draft, adaptive=True, controller=ControllerConfig(gammas=(1, 2)))
    ctrl = cot.controller
    for _ in range(4):
        ctrl.observe_plain(4, 0.01)
        ctrl.observe_spec(4, 2, 0.02, 2.5, 6, 8)
    before = ctrl.state_dict()
    cot.begin_step()
    cot.end_step()
    assert cot.engine.draft_version == cot.draft_trainer.version > 0  # the swap happened
    assert ctrl.state_dict() == before


class _FreeSwitchEngine(PerRunEngine):
    """PerRunEngine whose switch is free (the embedded engine's), recording pushed drafts."""

    from rollout.protocol import EngineCapabilities

    capabilities = EngineCapabilities(drafters=("eagle3",), switch="free")

    def __init__(self):
        super().__init__()
        self.pushed = []

    def push_draft(self, weights, version):
        self.pushed.append(version)


def _heldout_cotrainer(tiny_model, budget, **kw):
    """An online co-trainer on a free-switch engine, its buffer and held-out slice filled from a
    trainer-forward hook on random sequences."""
    import torch

    from specrl.config import CoTrainConfig, DraftTrainConfig, SchedulerConfig
    from specrl.cotrain import SpecCoTrainer
    from specrl.drafts import new_draft

    class Trainer:
        def __init__(self):
            self.hooks = []

        def add_feature_hook(self, layer_ids, hook):
            self.hooks.append(hook)

    draft = new_draft(tiny_model, [[3, 4, 5, 6]], DraftTrainConfig(draft_vocab_size=64))
    engine, trainer = _FreeSwitchEngine(), Trainer()
    kw = {"max_draft_steps": 4} | kw
    cfg = CoTrainConfig(mode="online", adaptive=True, min_buffer_records=4, heldout_every=2,
                        scheduler=SchedulerConfig(budget_fraction=1.0, min_budget_s=3600.0, windows=("between",),
                                                  draft_steps=budget), **kw)
    cot = SpecCoTrainer(draft, cfg).attach(engine, trainer)
    gen = torch.Generator().manual_seed(0)
    ids = rows_held_as([True, False] * 4, cot.buffer.heldout_prompt, 16, 6, gen)
    out = tiny_model(ids, tap_layers=draft.cfg.aux_layer_ids)
    mask = torch.zeros(8, 16, dtype=torch.bool)
    mask[:, 6:] = True
    trainer.hooks[0](ids, out, mask)
    assert len(cot.buffer) == 4 and len(cot.buffer.heldout) == 4
    cot.test_capture = trainer.hooks[0]  # the trainer-forward hook: a test adds sequences through it
    return cot, engine


def test_the_swap_gate_refuses_a_worse_draft_and_training_goes_on_from_the_serving_one(tiny_model, monkeypatch):
    """A burst that makes the draft worse on the held-out sequences (planted: its weights are
    scrambled) is refused: nothing is pushed, the refusal is counted, and the trainer's weights are
    the serving draft's again. A burst that does not make it worse serves."""
    import torch

    from specrl.config import DraftBudgetConfig

    cot, engine = _heldout_cotrainer(tiny_model, DraftBudgetConfig(rule="fixed"), max_draft_steps=1)
    serving = {k: v.clone() for k, v in cot._serving.state_dict().items()}

    def scramble(*a, **k):
        with torch.no_grad():
            for p in cot.draft_trainer.draft.parameters():
                if p.requires_grad:
                    p.copy_(torch.randn_like(p) * 3.0)
        cot.draft_trainer.version += 1
        return {"steps": 1, "seconds": 0.01}

    monkeypatch.setattr(cot.draft_trainer, "train_for", scramble)
    cot.begin_step()
    m = cot.end_step()
    assert m["train/draft_refused"] == 1 and m["train/draft_refused_total"] == 1 and engine.pushed == []
    assert m["sched/candidate_accept_length"] < m["sched/gate_serving_accept_length"]
    assert m["sched/candidate_gain_se"] > 0  # the 4 held-out sequences disagree on how much worse it is
    assert all(torch.equal(v, serving[k]) for k, v in cot.draft_trainer.draft.state_dict().items())

    def nudge(*a, **k):  # an update that leaves the draft as it was (no worse on any data)
        cot.draft_trainer.version += 1
        return {"steps": 1, "seconds": 0.01}

    monkeypatch.setattr(cot.draft_trainer, "train_for", nudge)
    cot.begin_step()
    m = cot.end_step()
    assert "train/draft_refused" not in m and engine.pushed == [cot.draft_trainer.version]
    assert m["sched/candidate_gain_se"] == 0.0  # the same weights: the same sums on every sequence


def test_held_out_sequences_measure_drafts_at_the_rollouts_temperature(tiny_model, prompts):
    """The engine reports its rollout's temperature, the co-trainer hands it to the buffer, and the
    held-out rows' soft targets are then the target's log-probs at that temperature: the
    distribution the engine verifies against (rollout.sampling.process_logits), over the draft
    vocabulary. Training rows keep the target's own (T = 1). A draft measured on them proposes at
    the same temperature, so its held-out value is the one the engine would see at 0.5, not at 1."""
    import torch

    from draft_models.ttt import expected_accept_length
    from draft_models.vocab import restrict_to_draft
    from rollout.engine import EmbeddedEngine
    from rollout.protocol import SamplingParams
    from rollout.sampling import process_logits
    from specrl.buffer import FeatureBuffer
    from specrl.config import DraftBudgetConfig
    from specrl.cotrain import heldout_accept_length

    cot, _ = _heldout_cotrainer(tiny_model, DraftBudgetConfig(rule="fixed"))
    rollout = EmbeddedEngine(tiny_model).generate(prompts[:2], SamplingParams(temperature=0.5, max_new_tokens=4, seed=0))
    assert rollout.stats.temperature == 0.5
    cot.on_rollout(rollout)
    assert cot.buffer.heldout_temperature == 0.5

    draft, layers = cot.draft, tuple(cot.draft.cfg.aux_layer_ids)
    ids = rows_held_as([True, False] * 2, FeatureBuffer(1, heldout_every=2).heldout_prompt, 16, 6,
                       torch.Generator().manual_seed(2))
    out = tiny_model(ids, tap_layers=layers)
    mask = torch.zeros(4, 16, dtype=torch.bool)
    mask[:, 6:] = True
    bufs = {}
    for temp in (1.0, 0.5):
        bufs[temp] = FeatureBuffer(1 << 26, heldout_every=2)
        bufs[temp].heldout_temperature = temp
        bufs[temp].add_from_trainer_forward(ids, out.features(layers), out.logits, mask, draft.d2t, 0)
    held = bufs[0.5].heldout  # rows 0 and 2
    engine_p = restrict_to_draft(process_logits(out.logits, 0.5), draft.d2t).clamp_min(-30.0)
    assert [r["temperature"] for r in held] == [0.5, 0.5]
    assert torch.allclose(held[1]["target_logp"].float(), engine_p[2], atol=2e-2)
    assert not torch.allclose(bufs[1.0].heldout[1]["target_logp"].float(), engine_p[2], atol=2e-2)
    train = [[e["target_logp"] for e in b._entries.values()] for b in bufs.values()]
    assert all(torch.equal(a, b) for a, b in zip(*train))  # rows 1 and 3: the target's own distribution

    value = heldout_accept_length(draft, held, cot.config.spec.gamma)[0]
    rows = torch.tensor([0, 2])
    want = expected_accept_length(draft, out.features(layers)[rows].float(), ids[rows], engine_p[rows], mask[rows],
                                  cot.config.spec.gamma, temperature=0.5)[0]
    assert value == pytest.approx(want, rel=2e-3)
    assert abs(heldout_accept_length(draft, bufs[1.0].heldout, cot.config.spec.gamma)[0] - value) > 1e-2


def test_the_held_out_acceptance_is_read_under_the_engines_rule(tiny_model, monkeypatch):
    """An engine that accepts sampled drafts by rejection sampling (vLLM, SGLang, the embedded
    engine's "rng" mode) has the draft's held-out acceptance read as sum min(p, q); one that
    couples the draws (the embedded engine's default) as the probability the two draws agree,
    which is lower for the same draft on the same sequences."""
    import dataclasses

    from rollout.engine import EmbeddedEngine, EngineConfig
    from specrl.config import DraftBudgetConfig
    from specrl.cotrain import heldout_accept_length

    assert EmbeddedEngine(tiny_model).capabilities.acceptance == "coupled"
    assert EmbeddedEngine(tiny_model, EngineConfig(sampling_mode="rng")).capabilities.acceptance == "rejection"
    assert EmbeddedEngine.capabilities.acceptance == "coupled"  # the class keeps its default
    with pytest.raises(ValueError, match="acceptance"):
        dataclasses.replace(_FreeSwitchEngine.capabilities, acceptance="greedy")
    values = {}
    for rule in ("rejection", "coupled"):
        monkeypatch.setattr(_FreeSwitchEngine, "capabilities",
                            dataclasses.replace(_FreeSwitchEngine.capabilities, acceptance=rule))
        cot, _ = _heldout_cotrainer(tiny_model, DraftBudgetConfig(rule="fixed"))
        assert cot.acceptance == rule
        values[rule] = cot._heldout_value(cot.draft)
        want = heldout_accept_length(cot.draft, cot.buffer.heldout, cot.config.spec.gamma, coupled=rule == "coupled")
        assert values[rule] == pytest.approx(want[0], rel=1e-6)
        other = heldout_accept_length(cot.draft, cot.buffer.heldout, cot.config.spec.gamma, coupled=rule != "coupled")
        coupled, rejection = (values[rule], other[0]) if rule == "coupled" else (other[0], values[rule])
        assert 1.0 < coupled < rejection - 1e-3  # the same draft and sequences: coupling agrees less often


@pytest.mark.parametrize("floor", [True, False])
def test_the_gate_keeps_the_starting_draft_as_a_floor(tiny_model, monkeypatch, floor):
    """A serving draft that has fallen below the starting one on the newest held-out sequences
    (planted: its weights moved far from the start), and a candidate that beats it but not the
    start (moved less far). With the floor the candidate is refused and the starting draft serves
    again: pushed to the engine, its weights the trainer's, its value the serving one. Without it
    the candidate serves, as the gate against the serving draft alone allows."""
    import torch

    from specrl.config import DraftBudgetConfig

    cot, engine = _heldout_cotrainer(tiny_model, DraftBudgetConfig(rule="fixed"), max_draft_steps=1, gate_floor=floor)
    start = {k: v.clone() for k, v in cot.draft.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    noise = {k: torch.randn(v.shape, generator=gen) for k, v in start.items() if v.is_floating_point()}

    def moved(scale):
        return {k: v + scale * noise[k] if k in noise else v for k, v in start.items()}

    with torch.no_grad():
        cot._serving.load_state_dict(moved(2.0))
        cot.draft_trainer.draft.load_state_dict(moved(2.0))

    def half_back(*a, **k):
        with torch.no_grad():
            cot.draft_trainer.draft.load_state_dict(moved(0.5))
        cot.draft_trainer.version += 1
        return {"steps": 1, "seconds": 0.01}

    monkeypatch.setattr(cot.draft_trainer, "train_for", half_back)
    cot.begin_step()
    m = cot.end_step()
    serve, cand = m["sched/gate_serving_accept_length"], m["sched/candidate_accept_length"]
    assert engine.pushed == [cot.draft_trainer.version]
    if not floor:
        assert "sched/gate_start_accept_length" not in m and "train/draft_floor_restores_total" not in m
        assert "train/draft_refused" not in m and cand > serve and m["sched/heldout_accept_length"] == cand
        return
    assert serve < cand < m["sched/gate_start_accept_length"]  # the plant: start > candidate > serving
    assert m["train/draft_refused"] == 1 and m["train/draft_floor_restores_total"] == 1
    assert all(torch.equal(v, start[k]) for k, v in cot.draft_trainer.draft.state_dict().items())
    assert all(torch.equal(v, start[k]) for k, v in cot._serving.state_dict().items())
    assert m["sched/heldout_accept_length"] == m["sched/gate_start_accept_length"]
    assert m["train/draft_gated_total"] == 1


def test_the_serving_draft_is_measured_once_per_held_out_sequence_and_again_after_a_swap(tiny_model, monkeypatch):
    """The serving draft's held-out value is kept per sequence: a step with new held-out sequences
    measures those only, and the value equals a measurement of the whole slice at once. A swap
    makes the candidate's sums the serving ones (the gate measured them); a refused candidate
    leaves the serving sums as they were."""
    import torch

    import specrl.cotrain as cotrain_mod
    from specrl.config import DraftBudgetConfig

    cot, engine = _heldout_cotrainer(tiny_model, DraftBudgetConfig(rule="fixed"), max_draft_steps=1)
    measured = []
    real = cotrain_mod.expected_accept_sums

    def counting(draft, features, *a, **k):
        measured.append(features.shape[0])
        return real(draft, features, *a, **k)

    monkeypatch.setattr(cotrain_mod, "expected_accept_sums", counting)
    assert cot._serving_heldout() > 1.0 and measured == [4]
    ids = rows_held_as([True, False] * 2, cot.buffer.heldout_prompt, 16, 6, torch.Generator().manual_seed(1))
    mask = torch.zeros(4, 16, dtype=torch.bool)
    mask[:, 6:] = True
    cot.test_capture(ids, tiny_model(ids, tap_layers=cot.draft.cfg.aux_layer_ids), mask)  # 2 of them held out
    value = cot._serving_heldout()
    assert measured == [4, 2] and len(cot.buffer.heldout) == 6
    whole = cotrain_mod.heldout_accept_length(cot._serving, cot.buffer.heldout, cot.config.spec.gamma)[0]
    assert abs(value - whole) < 1e-5 and measured[-1] == 6

    def nudge(*a, **k):  # an update that leaves the draft as it was: it serves
        cot.draft_trainer.version += 1
        return {"steps": 1, "seconds": 0.01}

    monkeypatch.setattr(cot.draft_trainer, "train_for", nudge)
    del measured[:]
    cot.begin_step()
    cot.end_step()
    # the candidate, by the gate, and the starting draft (the gate's floor) on all six; the serving value is known
    assert engine.pushed and measured == [6, 6]
    assert cot._serving_heldout() == cot.heldout and measured == [6, 6]
    cot.test_capture(ids, tiny_model(ids, tap_layers=cot.draft.cfg.aux_layer_ids), mask)  # 2 more held out
    del measured[:]
    cot.begin_step()
    cot.end_step()
    # the serving draft on the two new ones (the step's measurement), the new candidate on all
    # eight, the starting draft on the two new ones (its weights never change)
    assert len(cot.buffer.heldout) == 8 and measured == [2, 8, 2]


def test_train_every_runs_one_gated_burst_every_n_steps_with_the_updates_owed_in_between(tiny_model, monkeypatch):
    """train_every=3: the boundaries of steps 0, 3 and 6 train, each in one burst that is gated and
    pushed once; a burst runs its own step's count plus those granted to the two steps before it,
    on the policy versions since the last burst; the serving draft is measured at those boundaries
    only (None in between)."""
    import torch

    from specrl.config import DraftBudgetConfig

    cot, engine = _heldout_cotrainer(tiny_model, DraftBudgetConfig(rule="fixed"), max_draft_steps=2,
                                     train_every=3, recent_versions=1)
    bursts, measured = [], []

    def train_for(buffer, steps, remaining_s, generator, min_version=None, batch_size=None):
        bursts.append((cot.policy_version, steps, min_version))
        cot.draft_trainer.version += 1
        return {"steps": steps, "seconds": 0.01}

    def heldout(draft, sums=None):
        measured.append(cot.policy_version)
        return 2.0

    monkeypatch.setattr(cot.draft_trainer, "train_for", train_for)
    monkeypatch.setattr(cot, "_heldout_value", heldout)
    gen = torch.Generator().manual_seed(1)
    curve = []
    for _ in range(7):
        cot.begin_step()
        ids = rows_held_as([True, False] * 2, cot.buffer.heldout_prompt, 16, 6, gen)  # new answers, 2 held out
        mask = torch.zeros(4, 16, dtype=torch.bool)
        mask[:, 6:] = True
        cot.test_capture(ids, tiny_model(ids, tap_layers=cot.draft.cfg.aux_layer_ids), mask)
        curve.append(cot.end_step()["sched/heldout_accept_length"])
    # (policy version at the boundary, updates, oldest version sampled): step s's boundary is version s + 1
    assert bursts == [(1, 2, 0), (4, 6, 1), (7, 6, 4)], bursts
    assert len(engine.pushed) == 3
    assert [c is not None for c in curve] == [True, False, False] * 2 + [True]
    assert sorted(set(measured)) == [1, 4, 7]


def test_a_warmup_probe_is_read_as_the_gain_of_full_rate_updates(tiny_model, monkeypatch):
    """A probe of 2 updates in a 10-update warm-up runs at a tenth and a fifth of the learning rate:
    the held-out gain it shows is that of 0.3 full-rate updates, and the budget extrapolates the
    updates it buys (at the full rate) from that. Read per update, the probe would value a draft
    that learns 3.3 times slower than it does (on the real model this kept every update unbought)."""
    from specrl.config import DraftBudgetConfig

    cot, engine = _heldout_cotrainer(tiny_model, DraftBudgetConfig(rule="value", base_steps=2))

    def probe(*a, **k):  # what OnlineDraftTrainer.train_for reports for updates 1 and 2 of a 10-update warm-up
        cot.draft_trainer.version += 2
        return {"steps": 2, "updates": 2, "full_rate_updates": 0.1 + 0.2, "seconds": 0.01}

    monkeypatch.setattr(cot.draft_trainer, "train_for", probe)
    monkeypatch.setattr(cot, "_heldout_value", lambda draft, sums=None: 1.5 + (0.03 if draft is cot.draft_trainer.draft else 0.0))
    cot.begin_step()
    cot.end_step()
    assert engine.pushed and cot.budget.gain == pytest.approx(0.03 / 0.3)


def _choose_plain(cot, after_rollout=None) -> None:
    """Play `cot`'s run choice through its first choice (3 warm-up and 3 timed speculating
    rollouts, then 3 pairs: the configuration's) with speculation at 10 s and plain decoding at
    5 s per 1000 tokens, so that plain decoding is chosen. `after_rollout(arm)` runs between each
    rollout and its step's end."""
    from types import SimpleNamespace

    from rollout.protocol import Rollout, RolloutStats

    choice, spec = cot.run_choice, SimpleNamespace(spec=None)
    for _ in range(12):
        arm = choice.arm()
        cot.begin_step()
        cot.on_rollout(Rollout([spec], RolloutStats(10.0 if arm == "spec" else 5.0, 1000, speculated=arm == "spec")))
        if after_rollout is not None:
            after_rollout(arm)
        cot.end_step(train=False)
    assert choice.paired and choice.pairs == [0.5] * 3
    assert choice.speculate is False and not choice.queue


def test_a_stale_draft_trains_while_plain_decoding_is_chosen_and_speculation_comes_back_once_it_pays(
        tiny_model, monkeypatch):
    """Speculation was switched off for the run (the draft went stale: plain is faster). The
    trainer's forward still captures features, the value budget still buys updates (each raises
    the held-out accept length: a stand-in measurement, so the test controls the gain), and once
    the serving draft's held-out acceptance predicts that speculation pays, speculation is timed
    again at the next rollout rather than at the next periodic re-check."""
    from types import SimpleNamespace

    from rollout.protocol import Rollout, RolloutStats
    from specrl.config import DraftBudgetConfig

    cot, engine = _heldout_cotrainer(tiny_model, DraftBudgetConfig(rule="value", base_steps=2))
    value = {"serving": 1.4}

    def trained(*a, **k):
        cot.draft_trainer.version += 2
        return {"steps": 2, "seconds": 0.01}

    def heldout(draft, sums=None):  # +0.3 accept length per trained burst, for the trainer's draft
        return value["serving"] + (0.3 if draft is cot.draft_trainer.draft else 0.0)

    def push(weights, version):
        value["serving"] += 0.3
        engine.pushed.append(version)

    monkeypatch.setattr(cot.draft_trainer, "train_for", trained)
    monkeypatch.setattr(cot, "_heldout_value", heldout)
    monkeypatch.setattr(engine, "push_draft", push)
    # speculation timed at 10 s per 1000 tokens with accept length 1.4, plain at 5 s: plain is chosen
    # (a verify step costs 1.4 x 10 / 1000 s, so speculation pays from accept length 2.8 on, by the
    # run choice's margin of 1.05 from 2.94)
    _choose_plain(cot, lambda arm: cot.budget.observe_rollout(1000, 10.0, True, 1.4, None) if arm == "spec" else None)
    spec = SimpleNamespace(spec=None)
    trained_while_plain, back, pays_from = 0, None, None
    for step in range(8):  # within the periodic re-check's wait (ControllerConfig.run_recheck = 10)
        cot.begin_step()
        if engine.switched[-1]:
            back = step
            break
        cot.on_rollout(Rollout([spec], RolloutStats(5.0, 1000, speculated=False)))
        trained_while_plain += cot.end_step()["train/draft_steps"]
        if pays_from is None and value["serving"] > 2.8 * 1.05:
            pays_from = step
    assert trained_while_plain > 0 and pays_from is not None
    assert back == pays_from + 1, "speculation did not come back as soon as the draft paid"


def test_the_embedded_engine_speculates_or_not_per_rollout_as_its_run_choice_says(sft_policy, offline_draft):
    """An adaptive co-trainer keeps a RunChoice above the embedded engine's per-step controller
    (re-checked, with the controller's estimate as a shortcut) and switches the engine's
    speculation per step as it says. A plain rollout runs without the drafter; each rollout is
    reported to the choice with the controller's estimate of what speculation saved; greedy
    tokens are plain decoding's in every rollout."""
    import copy

    from specrl.config import ControllerConfig
    from specrl.rl_setup import encode_prompts
    from specrl.run_choice import RunChoice

    tokenizer, task, policy, _ = sft_policy
    engine = EmbeddedEngine(policy, EngineConfig(max_batch=8))
    cfg = CoTrainConfig(mode="frozen", adaptive=True, controller=ControllerConfig(gammas=(1, 2, 4), run_recheck=7))
    cot = SpecCoTrainer(copy.deepcopy(offline_draft), cfg).attach(engine)
    choice = cot.run_choice
    assert isinstance(choice, RunChoice) and cot.controller is not None
    assert (choice.recheck, choice.sure, choice.warmup, choice.rewarm, choice.paired) == (7, 1.25, 3, False, True)
    blocks = dataclasses.replace(cfg, controller=dataclasses.replace(cfg.controller, run_paired=False))
    assert SpecCoTrainer(copy.deepcopy(offline_draft), blocks).attach(
        EmbeddedEngine(policy, EngineConfig(max_batch=8))).run_choice.paired is False  # a free switch: as configured
    cot.run_choice = choice = RunChoice(1, warmup=0, margin=1.05, recheck=7, sure=None)  # one rollout per block
    prompts = encode_prompts(tokenizer, task.examples("heldout", 8, 2))
    params = SamplingParams(temperature=0.0, max_new_tokens=24, stop_token_ids=(tokenizer.eos_id,))
    want = [t.token_ids for t in EmbeddedEngine(policy, EngineConfig(max_batch=8)).generate(prompts, params)]
    arms = []
    for _ in range(3):
        arms.append(choice.arm())
        cot.begin_step()
        out = engine.generate(prompts, params)
        cot.on_rollout(out)
        cot.end_step()
        assert [t.token_ids for t in out] == want
        assert (out.stats.spec_steps > 0) == out.stats.speculated == (arms[-1] == "spec"), (arms, out.stats)
    assert arms[:2] == ["spec", "plain"] and choice.speculate is not None and choice.calls == 3
    assert choice.estimated and choice.estimated[0] is not None  # the controller's estimate reached it
    assert arms[2] == ("spec" if choice.speculate else "plain")


def test_the_run_choice_times_the_rollout_without_the_draft_training_in_its_tail(tiny_model):
    """Draft updates the tail window runs inside generate() belong to co-training, not to the arm
    that happened to decode that rollout: the run choice reads the rollout's own time
    (RolloutStats.rollout_s: the wall time less the step hooks'), and so does the saving it
    estimates for the priced budget."""
    from types import SimpleNamespace

    from rollout.protocol import Rollout, RolloutStats
    from specrl.config import CoTrainConfig, DraftTrainConfig
    from specrl.drafts import new_draft
    from specrl.config import DraftBudgetConfig, SchedulerConfig

    draft = new_draft(tiny_model, [[3, 4, 5, 6]], DraftTrainConfig(draft_vocab_size=64))
    priced = SchedulerConfig(draft_steps=DraftBudgetConfig(saving_share=0.15))
    cot = SpecCoTrainer(draft, CoTrainConfig(mode="online", adaptive=True, scheduler=priced)).attach(PerRunEngine())
    choice = cot.run_choice
    assert cot.config.controller.run_paired and choice.paired is False  # pairs need a free switch: blocks here
    for arm in ["spec"] * 6 + ["plain"] * 6:  # 3 warm-up and 3 timed rollouts per block
        cot.begin_step()
        cot.on_rollout(Rollout([SimpleNamespace(spec=None)], RolloutStats(10.0, 1000, speculated=arm == "spec",
                                                                          hook_s=4.0 if arm == "spec" else 0.0)))
        cot.end_step()
    assert choice.rates["spec"] == [1000 / 6.0] * 3 and choice.rates["plain"] == [100.0] * 3
    assert choice.speculate is True  # 166.7 tokens/s against 100: speculation pays once its hooks are left out
    cot.begin_step()
    cot.on_rollout(Rollout([SimpleNamespace(spec=None)], RolloutStats(10.0, 1000, speculated=True, hook_s=4.0)))
    assert cot.budget.metrics(8)["sched/spec_saving_s"] == pytest.approx(1000 / 100.0 - 6.0)


def test_a_resumed_run_speculates_and_trains_as_the_uninterrupted_one(sft_policy, tmp_path):
    """The `ci` preset fixes every decision at the start (specrl.presets.reproducible): a run
    stopped after two steps and resumed decodes, speculates and trains its draft exactly as the
    run that went on, on any machine: same accept length, draft version and loss at every step.
    With a timed decision (the per-step controller) the rollouts' speculating steps follow the
    machine's load, and so do the acceptance and the draft updates after a resume."""
    cache = sft_policy[3]
    keys = ("rollout/spec_accept_length", "rollout/spec_verify_steps", "train/draft_version", "train/draft_loss",
            "reward", "loss")
    run = dict(seed=5, cache_dir=cache, progress=False, spec="online", log=lambda *a: None)
    train_rl("arith", "ci", tmp_path / "whole", steps=4, **run)
    train_rl("arith", "ci", tmp_path / "resumed", steps=2, **run)
    train_rl("arith", "ci", tmp_path / "resumed", steps=4, resume=True, **run)
    whole, resumed = ([[r[k] for k in keys] for r in _rows(tmp_path / name)] for name in ("whole", "resumed"))
    assert len(whole) == 4 and whole == resumed


def test_a_recheck_the_measurement_contradicts_is_not_repeated_until_the_draft_moves_further(tiny_model, monkeypatch):
    """The held-out prediction says speculation pays again; the re-timed rollouts say it does
    not: plain decoding stays chosen, and no further re-timing happens while the draft stays
    where it was (each one costs a block of slower rollouts), only once it improves beyond it."""
    from types import SimpleNamespace

    from rollout.protocol import Rollout, RolloutStats
    from specrl.config import DraftBudgetConfig

    # measured every step (an idle draft's measurement interval is another test's subject)
    cot, engine = _heldout_cotrainer(tiny_model, DraftBudgetConfig(rule="fixed"), max_draft_steps=0,
                                     heldout_idle_share=1.0)
    value = {"e": 1.4}
    monkeypatch.setattr(cot, "_heldout_value", lambda draft, sums=None: value["e"])
    choice, spec = cot.run_choice, SimpleNamespace(spec=None)

    def new_answers(arm=None):
        cot.buffer._rows += 1  # new held-out answers every step (measured afresh)

    def step(arm, seconds, steps_left=None):
        cot.begin_step(steps_left)
        cot.on_rollout(Rollout([spec], RolloutStats(seconds, 1000, speculated=arm == "spec")))
        new_answers()
        return cot.end_step(train=False)

    _choose_plain(cot, new_answers)  # speculation at half plain's speed: plain chosen at E = 1.4
    assert choice.decisions == 1
    value["e"] = 3.0  # predicted 0.5 * 3.0 / 1.4 = 1.07 >= 1.05: time speculation again
    assert step("plain", 5.0).get("sched/run_recheck") == "spec" and choice.queue
    for _ in range(6):  # the re-timed block, 3 pairs: still half plain's speed
        if choice.queue:
            step(choice.arm(), 10.0 if choice.arm() == "spec" else 5.0)
    assert choice.speculate is False and choice.decisions == 2
    rechecks = [step("plain", 5.0).get("sched/run_recheck") for _ in range(5)]
    assert rechecks == [None] * 5  # the draft has not moved since: no block of slow rollouts again
    value["e"] = 6.5  # twice better than when it was last measured: predicted 0.5 * 6.5 / 3.0
    assert step("plain", 5.0, steps_left=8).get("sched/run_recheck") is None  # 7 rollouts left: too few
    assert not choice.queue and choice.skipped == 1
    assert step("plain", 5.0).get("sched/run_recheck") == "spec" and choice.queue


@pytest.mark.parametrize("share", [0.01, 1.0])
def test_an_idle_draft_is_measured_only_as_often_as_its_share_of_the_step_allows(tiny_model, monkeypatch, share):
    """Plain decoding chosen and no update granted: the serving draft's held-out measurement (25 ms
    on a 1 s step here, on a stand-in clock) runs every 3rd step under heldout_idle_share 0.01, the
    smallest interval that keeps it within 1% of the step; with the share at 1.0, every step."""
    from types import SimpleNamespace

    import torch

    import specrl.cotrain as cotrain_module
    from rollout.protocol import Rollout, RolloutStats
    from specrl.config import DraftBudgetConfig

    clock = [0.0]
    monkeypatch.setattr(cotrain_module.time, "perf_counter", lambda: clock[0])
    cot, _ = _heldout_cotrainer(tiny_model, DraftBudgetConfig(rule="fixed"), max_draft_steps=0,
                                heldout_idle_share=share)

    def heldout(draft, sums=None):
        clock[0] += 0.025
        return 2.0

    monkeypatch.setattr(cot, "_heldout_value", heldout)
    spec = SimpleNamespace(spec=None)
    _choose_plain(cot)
    gen = torch.Generator().manual_seed(1)
    measured = []
    for _ in range(12):
        cot.begin_step()
        cot.on_rollout(Rollout([spec], RolloutStats(5.0, 1000, speculated=False)))
        ids = rows_held_as([True, True], cot.buffer.heldout_prompt, 16, 6, gen)  # new held-out answers every step
        mask = torch.zeros(2, 16, dtype=torch.bool)
        mask[:, 6:] = True
        out = tiny_model(ids, tap_layers=cot.draft.cfg.aux_layer_ids)
        cot.buffer.add_from_trainer_forward(ids, out.features(cot.draft.cfg.aux_layer_ids), out.logits, mask,
                                            cot.draft.d2t, cot.policy_version)
        clock[0] += 1.0
        measured.append(cot.end_step()["sched/heldout_accept_length"] is not None)
    assert measured == ([True, False, False] * 4 if share < 1 else [True] * 12), measured
