"""EngineConfig(compile_forwards=True): the target's compiled blocks (rollout.compiled) give eager
decoding's tokens and log-probs, follow policy syncs, and fall back to eager on failure.

Compiling costs seconds per graph on this CPU, so the engines compile few shapes: a batch of 2
with chains of 2 (decode blocks (1..2, 1), verify blocks (1..2, 3))."""
import copy
import dataclasses

import pytest
import torch

from rollout.engine import EmbeddedEngine, EngineConfig
from rollout.protocol import SamplingParams
from rollout.drafters import DrafterSpec, SpecConfig
from specrl.rl_setup import encode_prompts


SPEC = {"chain": SpecConfig("chain", 2), "tree": SpecConfig("tree", gamma=2, tree_topk=2, tree_budget=6)}


def _run(policy, draft, compile_forwards: bool, prompts, params, mode: str = "chain"):
    spec = DrafterSpec(draft=draft, spec=SPEC[mode]) if draft is not None else None
    engine = EmbeddedEngine(policy, EngineConfig(max_batch=2, compile_forwards=compile_forwards), drafter=spec)
    return engine, engine.generate(prompts, params)


def _same(a, b):
    assert [t.token_ids for t in a] == [t.token_ids for t in b]
    assert max((x.logprobs - y.logprobs).abs().max().item() for x, y in zip(a, b)) <= 1e-5


@pytest.fixture(scope="module")
def setup(sft_policy, offline_draft):
    tokenizer, task, policy, _ = sft_policy
    prompts = encode_prompts(tokenizer, task.examples("heldout", 6, 3))
    params = SamplingParams(temperature=0.0, max_new_tokens=24, stop_token_ids=(tokenizer.eos_id,))
    return policy, offline_draft, prompts, params


@pytest.mark.parametrize("mode, temperature", [(None, 0.0), ("chain", 0.0), ("chain", 1.0), ("tree", 1.0)])
def test_compiled_forwards_decode_what_eager_decodes(setup, mode, temperature):
    """Plain decode blocks, chain verify blocks and tree verify blocks (with their mask), greedy
    and coupled sampling: the compiled engine decodes eager's tokens, log-probs within 1e-5."""
    policy, draft, prompts, params = setup
    params = dataclasses.replace(params, temperature=temperature, seed=3)
    draft = draft if mode else None
    _, eager = _run(policy, draft, False, prompts, params, mode or "chain")
    engine, compiled = _run(policy, draft, True, prompts, params, mode or "chain")
    _same(compiled, eager)
    assert engine.compiled.shapes and not engine.compiled.failures  # the target's blocks really ran compiled
    block = {None: 1, "chain": 3, "tree": 7}[mode]  # tokens per row: decode, chain of 2 + 1, tree of 6 + root
    assert {shape[0][1] for shape in engine.compiled.shapes} == {(1, block), (2, block)}
    if mode:
        assert sum(t.spec.accepted for t in compiled) > 0


def test_compiled_graphs_follow_policy_syncs(setup):
    """Weights are graph inputs: a policy sync (in place, with a draft hot swap beside it) changes
    what the compiled engine decodes exactly as it changes the eager one."""
    policy, draft, prompts, params = setup
    policy, draft = copy.deepcopy(policy), copy.deepcopy(draft)
    compiled_engine, before = _run(policy, draft, True, prompts, params)
    g = torch.Generator().manual_seed(0)
    new_policy = {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in policy.state_dict().items()}
    new_draft = {k: v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
                 for k, v in compiled_engine.draft_weights()[0].items()}
    compiled_engine.load_policy_weights(new_policy)
    compiled_engine.push_draft(new_draft, version=1)
    after = compiled_engine.generate(prompts, params)
    assert [t.token_ids for t in after] != [t.token_ids for t in before]  # the update changed the policy's answers
    eager_engine, _ = _run(copy.deepcopy(policy), copy.deepcopy(draft), False, prompts[:1], params)
    eager_engine.load_policy_weights(new_policy)
    eager_engine.push_draft(new_draft, version=1)
    eager = eager_engine.generate(prompts, params)
    _same(after, eager)
    assert [(t.spec.drafted, t.spec.accepted) for t in after] == [(t.spec.drafted, t.spec.accepted) for t in eager]


def test_a_failing_compiled_graph_falls_back_to_eager(setup, monkeypatch):
    """A shape whose compiled call raises runs eagerly from then on, the error recorded and
    warned about once per shape; the rollout is eager decoding's, token for token."""
    import warnings

    policy, draft, prompts, params = setup
    _, eager = _run(policy, draft, False, prompts, params)
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("inductor failed\nsecond line")

    monkeypatch.setattr(torch, "compile", lambda fn, **options: broken)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        engine, out = _run(policy, draft, True, prompts, params)
    _same(out, eager)
    assert engine.compiled.failures and not engine.compiled.shapes
    assert set(engine.compiled.failures.values()) == {"RuntimeError: inductor failed"}
    assert len(calls) == len(engine.compiled.failures)  # each shape tried once, then eager
    warned = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning) and "compiled" in str(w.message)]
    assert len(warned) == len(engine.compiled.failures)  # one warning per shape sent to eager
    for shape, msg in zip(engine.compiled.failures, warned):
        assert str(shape) in msg and "RuntimeError: inductor failed" in msg
    assert not engine.draft_faults  # a compile failure is not a draft fault: speculation went on


def test_compiled_blocks_are_small_ones(tiny_model):
    """Only blocks the compiled path measured faster on take it: at most MAX_ROWS rows and
    DENSE_DISPATCH_MAX_TOKENS tokens (the dense dispatch keeps the graph whole)."""
    from rollout.compiled import MAX_ROWS, CompiledForwards
    from target_training.model import MoE

    compiled = CompiledForwards(tiny_model)
    assert compiled.takes(torch.zeros(1, 1, dtype=torch.long))
    assert compiled.takes(torch.zeros(4, MoE.DENSE_DISPATCH_MAX_TOKENS // 4, dtype=torch.long))
    assert not compiled.takes(torch.zeros(4, MoE.DENSE_DISPATCH_MAX_TOKENS // 4 + 1, dtype=torch.long))
    assert not compiled.takes(torch.zeros(MAX_ROWS + 1, 1, dtype=torch.long))


def test_compile_forwards_is_checked():
    with pytest.raises(ValueError, match="EngineConfig.compile_forwards must be True or False"):
        EngineConfig(compile_forwards="yes")
