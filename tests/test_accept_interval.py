"""The paired bootstrap interval of two drafts' accept-length ratio (rollout.protocol), which the
drift experiment reports at every evaluation point as the noise of "online below frozen"."""
import math
import random

from rollout.protocol import SpecStats, accept_length, accept_length_ratio_interval


def _seq(accepted: int, verify: int) -> SpecStats:
    return SpecStats(verify_steps=verify, drafted=4 * verify, accepted=accepted)


def _draw(rng: random.Random, rate: float, verify: int) -> SpecStats:
    """A sequence of `verify` verify steps whose 4 draft tokens are each accepted with `rate`
    until the first rejection."""
    acc = 0
    for _ in range(verify):
        for _ in range(4):
            if rng.random() >= rate:
                break
            acc += 1
    return _seq(acc, verify)


def test_the_ratio_is_the_ratio_of_the_pooled_accept_lengths():
    a = [_seq(30, 10), _seq(5, 5), _seq(0, 3)]
    b = [_seq(20, 10), _seq(6, 5), _seq(1, 3)]
    ratio, lo, hi = accept_length_ratio_interval(a, b)
    assert ratio == accept_length(35, 18) / accept_length(27, 18)
    assert lo <= ratio <= hi and lo < hi
    same = accept_length_ratio_interval(a, a)
    assert same == (1.0, 1.0, 1.0)
    assert all(math.isnan(x) for x in accept_length_ratio_interval([], []))
    assert all(math.isnan(x) for x in accept_length_ratio_interval([_seq(0, 0)], [_seq(0, 0)]))


def test_the_interval_covers_a_tie_about_as_often_as_its_level():
    """Two drafts of one law on 32 sequences: the 95% interval holds 1.0 in about 95% of draws
    (a planted interval made of the percentile 40-60 band covers it far less often, see below)."""
    rng = random.Random(0)
    covered = narrow = 0
    trials = 200
    for t in range(trials):
        lengths = [rng.randint(3, 30) for _ in range(32)]
        a = [_draw(rng, 0.6, n) for n in lengths]
        b = [_draw(rng, 0.6, n) for n in lengths]
        _, lo, hi = accept_length_ratio_interval(a, b, n_boot=1000, seed=t)
        covered += lo <= 1.0 <= hi
        _, lo, hi = accept_length_ratio_interval(a, b, level=0.2, n_boot=1000, seed=t)
        narrow += lo <= 1.0 <= hi
    assert 0.88 <= covered / trials <= 0.995, covered
    assert narrow / trials < 0.5, narrow  # the test can tell a too-narrow interval


def test_the_interval_excludes_a_real_gap():
    """A draft accepting 0.7 per token against 0.6, on 32 sequences: the interval lies above 1
    in nearly every draw (the power the drift experiment's per-point check has at that gap)."""
    rng = random.Random(1)
    above = 0
    for t in range(50):
        lengths = [rng.randint(10, 40) for _ in range(32)]
        a = [_draw(rng, 0.7, n) for n in lengths]
        b = [_draw(rng, 0.6, n) for n in lengths]
        ratio, lo, _ = accept_length_ratio_interval(a, b, n_boot=1000, seed=t)
        assert ratio > 1.0
        above += lo > 1.0
    assert above >= 45, above
