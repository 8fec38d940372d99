"""specrl's slime adapter against Miles' real `Sample` (miles-rl 0.0.2; the miles lane, tests/lanes/miles.sh).

Why Miles: slime's own package cannot be installed (THUDM/slime is not on PyPI); Miles, slime's
fork, keeps slime's hook names and its `Sample` class and is on PyPI. What is real here:
`miles.utils.types.Sample` (its Status, SpecInfo and field defaults). What is a stand-in: the SGLang
router (test_sglang_engine.FakeSGLang, replying with the hand-written payloads of tests/data/sglang).
The base lane's slime tests use the hand copy in tests/slime_sample.py; the first test below says
exactly how that copy and Miles' class differ.
"""
from __future__ import annotations

import asyncio
import dataclasses
from enum import Enum
from types import SimpleNamespace

import pytest
from slime_sample import Sample as HandCopy
from test_sglang_engine import FakeSGLang, load_fixture
from upstream import import_miles

from specrl.integrations.slime_generate import SPEC_INFO_FIELDS, generate

pytestmark = pytest.mark.miles


@pytest.fixture(scope="module")
def Sample():
    return import_miles("miles.utils.types").Sample


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def test_hand_copy_agrees_with_miles_sample(Sample):
    real = {f.name: f for f in dataclasses.fields(Sample)}
    copy = {f.name: f for f in dataclasses.fields(HandCopy)}
    # slime at the copied commit has two teacher-distillation fields Miles 0.0.2 does not; every
    # other field, with its default, is the same
    assert set(copy) - set(real) == {"teacher_log_probs", "mopd_teacher_log_probs"} and set(real) <= set(copy)
    for name in real:
        got, want = _default(real[name]), _default(copy[name])
        if isinstance(got, Enum):
            assert got.name == want.name, name
        elif dataclasses.is_dataclass(got):
            assert dataclasses.asdict(got) == dataclasses.asdict(want), name
        else:
            assert got == want, name
    assert tuple(f.name for f in dataclasses.fields(Sample.SpecInfo)) == SPEC_INFO_FIELDS
    assert [s.name for s in Sample.Status] == [s.name for s in HandCopy.Status]


def test_generate_fills_miles_sample(Sample):
    reply = load_fixture("generate_batch.json")[0]
    reply["meta_info"]["weight_version"] = "7"
    server = FakeSGLang({}, {}, generate_reply=reply)
    try:
        host, port = server.url.removeprefix("http://").split(":")
        args = SimpleNamespace(sglang_router_ip=host, sglang_router_port=int(port), hf_checkpoint="unused")
        sample = Sample(index=0, prompt="1+2=", tokens=[1, 2, 3])
        out = asyncio.run(generate(args, sample, {"temperature": 1.0, "max_new_tokens": 8}))
    finally:
        server.close()
    assert out is sample and out.tokens == [1, 2, 3, 7, 9, 11, 2] and out.response_length == 4
    assert out.status is Sample.Status.COMPLETED and out.weight_versions == ["7"]
    info = out.spec_info
    assert (info.spec_accept_token_num, info.spec_draft_token_num, info.spec_verify_ct,
            info.completion_token_num) == (1, 2, 2, 4)
    # Miles' own reductions read the counters specrl filled (its accept length: tokens per verify step)
    assert info.spec_accept_rate == 0.5 and info.spec_accept_length == 2.0
    assert Sample.from_dict(out.to_dict()).spec_info == info  # round trip through Miles' serialisation
