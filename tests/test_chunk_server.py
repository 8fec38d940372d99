"""specrl.integrations.areal.ChunkServer, the engine side of the AReaL integration (no AReaL
needed): many concurrent requests decoded in chunks on one generation thread, policy updates
and draft pushes between chunks, every token tagged with the policy version that produced it.
The AReaL side runs in the areal lane (tests/test_upstream_areal.py). fp32 on CPU."""
from __future__ import annotations

import asyncio
import copy
import threading

import pytest
import torch

from rollout.engine import EmbeddedEngine, EngineConfig
from rollout.protocol import SamplingParams
from rollout.drafters import DrafterSpec, SpecConfig
from specrl.integrations.areal import ChunkServer, merge_spec
from specrl.rl_setup import encode_prompts


def _run_all(server, prompts, params, rids):
    params = params if isinstance(params, list) else [params] * len(prompts)

    async def main():
        return await asyncio.gather(*[server.generate(r, p, q) for r, p, q in zip(rids, prompts, params)])
    return asyncio.run(main())


@pytest.fixture
def setup(sft_policy, offline_draft):
    tokenizer, task, policy, _ = sft_policy
    prompts = encode_prompts(tokenizer, task.examples("heldout", 6, 3))
    return tokenizer, policy, offline_draft, prompts


def test_greedy_chunks_with_speculation_equal_one_plain_call(setup, one_thread):
    tokenizer, policy, draft, prompts = setup
    # two answer budgets in one chunk round: the shorter requests must stop at their own
    budgets = [40 if i % 2 else 17 for i in range(len(prompts))]
    params = [SamplingParams(temperature=0.0, max_new_tokens=n, stop_token_ids=(tokenizer.eos_id,)) for n in budgets]
    plain_engine = EmbeddedEngine(copy.deepcopy(policy), EngineConfig(max_batch=8))
    plain = [plain_engine.generate([p], q)[0] for p, q in zip(prompts, params)]
    engine = EmbeddedEngine(copy.deepcopy(policy), EngineConfig(max_batch=8))
    server = ChunkServer(engine, chunk_tokens=7)
    try:
        server.install_draft(DrafterSpec(draft=draft, spec=SpecConfig(mode="chain", gamma=3)))
        out = _run_all(server, prompts, params, [f"r{i}" for i in range(len(prompts))])
    finally:
        server.close()
    longest = max(len(tokens) for tokens, *_ in out)
    assert longest > 2 * 7 and server.rounds >= -(-longest // 7)  # answers really were decoded in several chunks
    for (tokens, logprobs, versions, reason, spec), ref in zip(out, plain):
        assert tokens == ref.token_ids
        assert reason == ref.finish_reason
        torch.testing.assert_close(torch.tensor(logprobs), ref.logprobs, atol=1e-5, rtol=0)
        assert versions == [0] * len(tokens)
        assert spec.verify_steps > 0
    assert sum(s.accepted for *_, s in out) > 0  # the draft did propose and get accepted


def test_a_policy_update_lands_between_chunks_and_tags_later_tokens(setup, one_thread):
    """Requests in flight when the weights change finish under the new version: every token
    carries the version of the weights that produced it, and its log-prob is that version's."""
    tokenizer, policy, draft, prompts = setup
    params = SamplingParams(temperature=1.0, max_new_tokens=40, stop_token_ids=(tokenizer.eos_id,), seed=3)
    new_policy = copy.deepcopy(policy)
    with torch.no_grad():
        for p in new_policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine = EmbeddedEngine(copy.deepcopy(policy), EngineConfig(max_batch=8))
    server = ChunkServer(engine, chunk_tokens=4)
    first_round = threading.Event()
    orig = server._run_round

    def run_round(batch, version):
        orig(batch, version)
        first_round.set()

    server._run_round = run_round
    updater = threading.Thread(target=lambda: (first_round.wait(), server.load_policy_weights(new_policy.state_dict(), 1)))
    updater.start()
    try:
        out = _run_all(server, prompts, params, [f"q{i}" for i in range(len(prompts))])
    finally:
        updater.join()
        server.close()
    mixed = 0
    models = {0: policy, 1: new_policy}
    for prompt, (tokens, logprobs, versions, _, _) in zip(prompts, out):
        assert versions == sorted(versions) and set(versions) <= {0, 1}
        mixed += len(set(versions)) == 2
        ids = torch.tensor([prompt + tokens])
        for v in set(versions):
            with torch.no_grad():
                logp = models[v](ids).logits[0, len(prompt) - 1: -1].float().log_softmax(-1)
            want = logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
            for j, vj in enumerate(versions):
                if vj == v:
                    assert abs(logprobs[j] - want[j].item()) < 1e-4, (v, j)
    assert mixed > 0  # some requests were in flight across the update


def test_a_draft_push_waits_for_the_chunk_in_flight(setup):
    tokenizer, policy, draft, prompts = setup
    engine = EmbeddedEngine(copy.deepcopy(policy), EngineConfig(max_batch=8))
    server = ChunkServer(engine, chunk_tokens=30)
    try:
        server.install_draft(DrafterSpec(draft=draft, spec=SpecConfig(mode="chain", gamma=3)))
        w, _ = server.draft_weights()
        started, in_generate, seen = threading.Event(), [False], []
        generate, push = engine.generate, engine.push_draft

        def watched_generate(*a, **k):
            in_generate[0] = True
            started.set()
            try:
                return generate(*a, **k)
            finally:
                in_generate[0] = False

        def watched_push(weights, version):
            seen.append(in_generate[0])
            push(weights, version)

        engine.generate, engine.push_draft = watched_generate, watched_push
        fut = server.submit("x", prompts[0], 0, 30, SamplingParams(temperature=0.0, max_new_tokens=30))
        assert started.wait(30)
        server.push_draft(w, 5)  # called while the chunk decodes
        fut.result(timeout=60)
    finally:
        server.close()
    assert seen == [False] and server.draft_version == 5


def test_merge_spec_adds_chunks():
    from rollout.protocol import SpecStats

    a, b = SpecStats(), SpecStats()
    a.record(3, 2)
    b.record(4, 4)
    b.record(2, 0)
    total = merge_spec(merge_spec(None, a), b)
    assert (total.verify_steps, total.drafted, total.accepted) == (3, 9, 6)
    assert total.drafted_per_pos == [3, 3, 2, 1] and total.accepted_per_pos == [2, 2, 1, 1]


def test_the_saving_speculation_reports_reaches_the_co_trainer(setup):
    """A priced draft budget pays from the engine's estimated saving: `take_finished` hands over
    the finished requests with the sum over the chunk rounds since the last call (their seconds,
    tokens and estimated saving), and no saving when no round ran."""
    tokenizer, policy, draft, prompts = setup
    engine = EmbeddedEngine(copy.deepcopy(policy), EngineConfig(max_batch=8))
    generate, calls = engine.generate, []

    def reporting(*a, **k):
        out = generate(*a, **k)
        calls.append(out.stats.tokens)
        out.stats.spec_saved_s = 0.25
        return out

    engine.generate = reporting
    server = ChunkServer(engine, chunk_tokens=6)
    try:
        params = SamplingParams(temperature=0.0, max_new_tokens=20, stop_token_ids=(tokenizer.eos_id,))
        _run_all(server, prompts[:3], params, ["a", "b", "c"])
        finished = server.take_finished()
        assert len(finished) == 3 and len(calls) >= 2
        assert finished.stats.spec_saved_s == pytest.approx(0.25 * len(calls))
        assert finished.stats.tokens == sum(calls) and finished.stats.wall_s > 0
        assert server.take_finished().stats.spec_saved_s is None
    finally:
        server.close()


def test_groups_staler_than_the_bound_are_dropped_at_consumption():
    """specrl.async_rl.fresh_groups: AReaL admits rollouts by version, but one that finishes out
    of order can be consumed later than the bound allows; it is dropped, and unused groups wait."""
    from specrl.async_rl import fresh_groups

    def group(head):  # one row: a prompt token, then two generated tokens at versions head, head + 1
        return {"versions": torch.tensor([[-1, head, head + 1]]), "loss_mask": torch.tensor([[0, 1, 1]])}

    batches = iter([[group(3), group(1), group(4)], [group(2), group(5)]])
    got, left, dropped = fresh_groups([], 4, 2, 2, lambda: next(batches))  # trainer at version 4, η = 2
    assert [int(g["versions"][0, 1]) for g in got] == [3, 4] and dropped == 1 and left == []
    got, left, dropped = fresh_groups(left, 4, 2, 1, lambda: next(batches))
    assert [int(g["versions"][0, 1]) for g in got] == [2] and len(left) == 1 and dropped == 0
