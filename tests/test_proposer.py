"""The proposer protocol: a drafter without a model or features plugs into the engine as it is,
and speculation flows one way (the engine imports the speculation modules' contract, never the
reverse)."""
import subprocess
import sys

import pytest
import torch

from rollout.engine import EmbeddedEngine, EngineConfig
from rollout.proposer import ChainProposal, Proposer, SpecStep
from rollout.protocol import SamplingParams
from rollout.drafters import DrafterSpec, SpecConfig


class ListProposer:
    """A deterministic drafter: row b proposes the next `depth` tokens of `known[request id]`
    from where the request stands (0 past its end), a point mass, no model, no features."""

    uses_features = False

    def __init__(self, known: dict[int, list[int]]):
        self.known = known
        self.seen = {"prefilled": 0, "decoded": 0, "accepted": 0}

    def prefilled(self, slots, feats, lens):
        assert feats is None  # nothing tapped for a proposer that uses no features
        self.seen["prefilled"] += len(slots)

    def decoded(self, slots, out):
        self.seen["decoded"] += len(slots)

    def propose(self, step: SpecStep) -> ChainProposal:
        rows = []
        for st in step.states:
            known, n = self.known.get(st.request_id, []), len(st.tokens)
            rows.append((known[n:n + step.depth] + [0] * step.depth)[:step.depth])
        return ChainProposal(torch.tensor(rows, device=step.slots.device), None)

    def accepted(self, active, verdict, counts):
        assert verdict.features is None
        self.seen["accepted"] += sum(counts)


def _run(model, prompts, params, known=None, batch=3, sampling_mode="coupled"):
    proposers = []

    def make(n_slots, max_len):
        proposers.append(ListProposer(known))
        return proposers[-1]

    spec = None if known is None else DrafterSpec("custom", spec=SpecConfig("chain", 3), proposer=make)
    engine = EmbeddedEngine(model, EngineConfig(max_batch=batch, sampling_mode=sampling_mode), drafter=spec)
    return engine.generate(prompts, params), proposers


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_deterministic_proposer_decodes_what_plain_decoding_does(tiny_model, prompts, temperature):
    """Greedy and coupled sampling: a perfect list (plain decoding's own tokens) and a wrong one
    both give plain decoding's tokens and log-probs; the perfect one is accepted in full."""
    params = SamplingParams(temperature=temperature, max_new_tokens=12, seed=5)
    plain, _ = _run(tiny_model, prompts, params)
    oracle = {t.request_id: t.token_ids for t in plain}
    wrong = {t.request_id: [(x + 1) % 64 for x in t.token_ids] for t in plain}
    for known, good in ((oracle, True), (wrong, False)):
        out, proposers = _run(tiny_model, prompts, params, known)
        assert isinstance(proposers[0], Proposer)
        assert [t.token_ids for t in out] == [t.token_ids for t in plain]
        for a, b in zip(out, plain):
            assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5)
        verify_steps = sum(t.spec.verify_steps for t in out)
        accepted = sum(t.spec.accepted for t in out)
        assert verify_steps > 0 and proposers[0].seen["accepted"] > 0 and proposers[0].seen["prefilled"] == len(prompts)
        if good:
            assert accepted > 2 * verify_steps  # most drafts accepted: far fewer verify steps than tokens
        else:
            assert accepted == 0


def test_a_deterministic_proposer_samples_in_rng_mode(tiny_model, prompts, one_thread):
    """Rejection sampling reads the draft's distribution: a point mass stands in for None. The
    tiny random model is near uniform, so a proposal of plain decoding's token is accepted only
    now and then over the full vocabulary; under top_k=1 all the target's mass is on it, so the
    proposals are accepted and the rollout is plain decoding's."""
    for top_k in (0, 1):
        params = SamplingParams(temperature=1.0, top_k=top_k, max_new_tokens=12, seed=5)
        plain, _ = _run(tiny_model, prompts, params, sampling_mode="rng")
        out, _ = _run(tiny_model, prompts, params, {t.request_id: t.token_ids for t in plain}, sampling_mode="rng")
        assert [len(t.token_ids) for t in out] == [len(t.token_ids) for t in plain]
        assert sum(t.spec.verify_steps for t in out) > 0
    assert [t.token_ids for t in out] == [t.token_ids for t in plain]
    assert sum(t.spec.accepted for t in out) > 2 * sum(t.spec.verify_steps for t in out)


def _modules_after_import(module: str) -> set[str]:
    code = f"import sys, {module}; print(' '.join(m for m in sys.modules if m.startswith('rollout.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_speculation_flows_one_way():
    """The speculation modules never import the engine, and the engine loads the EAGLE-3
    speculator only when one is installed: no import circle."""
    for module in ("rollout.speculative", "rollout.proposer", "rollout.verify"):
        assert "rollout.engine" not in _modules_after_import(module), module
    assert "rollout.speculative" not in _modules_after_import("rollout.engine")
