"""`specrl bench precision`'s comparison of speculative against plain trajectories (a pure function)."""
from types import SimpleNamespace

import pytest
import torch

from experiments.bench.precision import compare


def _t(tokens, logprobs):
    return SimpleNamespace(token_ids=list(tokens), logprobs=torch.tensor(logprobs, dtype=torch.float32))


def test_identical_sequences_and_the_logprob_gap():
    plain = [_t([1, 2, 3], [-0.1, -0.2, -0.3]), _t([4, 5], [-1.0, -2.0])]
    spec = [_t([1, 2, 3], [-0.1, -0.25, -0.3]), _t([4, 5], [-1.0, -2.0])]
    r = compare(plain, spec)
    assert r["sequences_identical"] == 1.0 and r["tokens_differing"] == 0.0 and r["flipped_sequences"] == 0
    assert r["logprob_gap_max"] == pytest.approx(0.05)


def test_a_flip_counts_from_its_position_and_the_gap_stops_there():
    plain = [_t([1, 2, 3, 4], [-0.1, -0.2, -0.3, -0.4]), _t([7, 8], [-1.0, -1.0])]
    spec = [_t([1, 2, 9, 9, 9], [-0.1, -0.2, -5.0, -5.0, -5.0]), _t([7, 8], [-1.0, -1.0])]
    r = compare(plain, spec)
    assert r["sequences_identical"] == 0.5 and r["flipped_sequences"] == 1 and r["first_flip_median"] == 2
    assert r["tokens_differing"] == pytest.approx(3 / 7)  # positions 2, 3, 4 of 5, plus none of 2
    assert r["logprob_gap_max"] == 0.0  # the flipped token's log-prob is another token's: not a gap
