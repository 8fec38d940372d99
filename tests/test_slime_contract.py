"""slime contract: the custom generate function and the Megatron hooks, against a stand-in Sample
with exactly slime's fields and a small torch module shaped like Megatron's GPTModel.

Sample fields copied (names, defaults, nesting) from THUDM/slime `slime/utils/types.py` at commit
0d234f3e3a83c81b7d37209994e0b994deacbb24; the hook signatures from slime's
docs/en/get_started/customization.md (section 17) at the same time.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn as nn
from test_sglang_engine import FakeSGLang, json_serializer, load_fixture

import specrl.integrations.slime as sl
from draft_models.checkpoint import draft_state_dict_for_sglang, save_draft
from draft_models.config import Eagle3Config
from draft_models.vocab import build_draft_vocab
from rollout.sglang_engine import SGLangEngine, SGLangEngineConfig
from specrl.online_trainer import OnlineDraftConfig

pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass
class Sample:  # slime's Sample (fields only; methods not needed by the contract)
    group_index: int | None = None
    index: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_routed_experts: list[list[int]] | None = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None
    mopd_teacher_log_probs: dict[str, list[float]] | None = None

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    generate_function_path: str | None = None
    train_metadata: dict | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0

    @dataclass
    class SpecInfo:
        spec_accept_token_num: int = 0
        spec_draft_token_num: int = 0
        spec_verify_ct: int = 0
        completion_token_num: int = 0

    spec_info: SpecInfo = field(default_factory=SpecInfo)

    @dataclass
    class PrefixCacheInfo:
        cached_tokens: int = 0
        total_prompt_tokens: int = 0

    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)


def test_spec_info_field_names_match_slime():
    assert tuple(f.name for f in fields(Sample.SpecInfo)) == sl.SPEC_INFO_FIELDS


# ------------------------------------------------------------------ custom generate function
@pytest.fixture
def router():
    reply = load_fixture("generate_batch.json")[0]
    reply["meta_info"]["weight_version"] = "7"
    server = FakeSGLang({}, {}, generate_reply=reply)
    yield server
    server.close()


def args_for(server, **kw):
    host, port = server.url.removeprefix("http://").split(":")
    return SimpleNamespace(sglang_router_ip=host, sglang_router_port=int(port), hf_checkpoint="unused", **kw)


def test_generate_fills_sample_and_spec_info(router):
    sample = Sample(index=0, prompt="1+2=", tokens=[1, 2, 3])
    params = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8}
    out = asyncio.run(sl.generate(args_for(router), sample, params))
    endpoint, body = router.requests[-1]
    assert endpoint == "generate" and body == {"input_ids": [1, 2, 3], "sampling_params": params, "return_logprob": True}
    assert out is sample and out.tokens == [1, 2, 3, 7, 9, 11, 2] and out.response_length == 4
    assert out.rollout_log_probs == [-0.5, -0.25, -1.5, -0.125]
    assert out.status is Sample.Status.COMPLETED and out.weight_versions == ["7"]
    assert (out.spec_info.spec_accept_token_num, out.spec_info.spec_draft_token_num, out.spec_info.spec_verify_ct,
            out.spec_info.completion_token_num) == (1, 2, 2, 4)
    # partial rollout resumed after an abort: counters add up, the token budget shrinks
    out.status = Sample.Status.ABORTED
    asyncio.run(sl.generate(args_for(router), out, params))
    assert router.requests[-1][1]["sampling_params"]["max_new_tokens"] == 4
    assert out.spec_info.spec_verify_ct == 4 and out.response_length == 8 and len(out.rollout_log_probs) == 8


def test_generate_with_text_prompt_and_no_speculation(router):
    router.generate_reply = {"text": "ok", "output_ids": [5],
                             "meta_info": {**load_fixture("meta_no_spec.json"), "completion_tokens": 1,
                                           "finish_reason": {"type": "length", "length": 1},
                                           "output_token_logprobs": [[-0.1, 5, None]]}}

    class Tok:
        def encode(self, text, add_special_tokens=False):
            return [ord(c) % 50 for c in text]

    sl.register_tokenizer(Tok())
    try:
        out = asyncio.run(sl.generate(args_for(router), Sample(prompt="ab"), {"max_new_tokens": 1}))
    finally:
        sl.register_tokenizer(None)
    assert out.tokens == [47, 48, 5] and out.status is Sample.Status.TRUNCATED and out.response == "ok"
    assert out.spec_info.spec_verify_ct == 0 and out.spec_info.completion_token_num == 1
    with pytest.raises(ValueError, match="expected PENDING or ABORTED"):
        asyncio.run(sl.generate(args_for(router), out, {"max_new_tokens": 1}))


# ------------------------------------------------------------------ Megatron stand-in and hooks
H, V, VD, L = 32, 48, 24, 4


class Layer(nn.Module):  # Megatron TransformerLayer: (seq, batch, hidden) in, (hidden, context) out
    def __init__(self, number):
        super().__init__()
        self.layer_number = number  # 1-based, as in Megatron
        self.lin = nn.Linear(H, H)

    def forward(self, hidden_states, attention_mask=None):
        return hidden_states + torch.tanh(self.lin(hidden_states)), None


class GPTModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Module()
        self.embedding.word_embeddings = nn.Embedding(V, H)
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList([Layer(i + 1) for i in range(L)])
        self.output_layer = nn.Linear(H, V, bias=False)

    def forward(self, input_ids, position_ids=None, attention_mask=None, labels=None, packed_seq_params=None):
        x = self.embedding.word_embeddings(input_ids).transpose(0, 1)  # (s, b, h)
        self.taps = []
        for layer in self.decoder.layers:
            x, _ = layer(x)
            self.taps.append(x)
        return self.output_layer(x).transpose(0, 1)


class Wrapper(nn.Module):  # DDP / Float16Module: the model under .module
    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *a, **kw):
        return self.module(*a, **kw)


@pytest.fixture
def setup(tmp_path):
    torch.manual_seed(0)
    gpt = GPTModel().eval()
    taps = sl.default_tap_layers(L)
    cfg = Eagle3Config(hidden_size=H, target_hidden_size=H, num_heads=2, num_kv_heads=1, head_dim=16,
                       intermediate_size=64, vocab_size=V, draft_vocab_size=VD, max_seq_len=64, aux_layer_ids=taps)
    draft = cfg.build(gpt.embedding.word_embeddings)
    draft.set_vocab(*build_draft_vocab(torch.randint(0, 100, (V,)), V, VD))
    save_draft(draft, tmp_path / "draft")
    server = FakeSGLang({"lm_head.weight": torch.zeros(V, H)}, draft_state_dict_for_sglang(draft))
    config = sl.SlimeSpecConfig(draft_path=str(tmp_path / "draft"), engine_urls=[server.url], min_buffer_records=2,
                                max_draft_steps=3, time_budget_s=30.0, hold_shared_draft_names=True,
                                online=OnlineDraftConfig(batch_size=2, ttt_steps=2))
    engine = SGLangEngine(SGLangEngineConfig(base_url=server.url, serializer=json_serializer,
                                             hold_shared_draft_names=True))
    args = SimpleNamespace(num_layers=L, padded_vocab_size=V)
    rt = sl.SlimeSpecRuntime(config, args, [Wrapper(gpt)], engines=[engine])
    sl.configure(config, rt)
    yield SimpleNamespace(gpt=gpt, model=[Wrapper(gpt)], args=args, rt=rt, server=server, taps=taps, config=config)
    rt.tap.remove()
    sl.configure(None)
    server.close()


def packed_forward(model, seqs):
    ids = torch.cat([torch.tensor(s) for s in seqs])[None]
    bounds = torch.tensor([0] + list(torch.tensor([len(s) for s in seqs]).cumsum(0)), dtype=torch.int32)
    with torch.no_grad():
        model[0](input_ids=ids, position_ids=None, attention_mask=None, labels=None,
                 packed_seq_params=SimpleNamespace(cu_seqlens_q=bounds, cu_seqlens_kv=bounds))


def test_default_taps_reuse_the_policy_rule():
    from target_training.config import MoEConfig

    assert sl.default_tap_layers(32) == (1, 15, 28) == MoEConfig(num_layers=32).feature_layer_ids
    assert sl.default_tap_layers(4) == (1, 2, 3)


def test_log_prob_hook_captures_fused_features_of_the_actor_pass_only(setup):
    s = setup
    seqs = [[3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14]]
    sl.before_log_prob_hook(s.args, s.model, "ref_")  # reference model pass: not captured
    packed_forward(s.model, seqs)
    assert s.rt.tap.records == []
    sl.before_log_prob_hook(s.args, s.model, "")
    packed_forward(s.model, seqs)
    recs = s.rt.tap.records
    assert [r["input_ids"].tolist() for r in recs] == seqs
    fused = torch.cat([s.gpt.taps[i] for i in s.taps], dim=-1)[:, 0]  # (total, 3H)
    assert torch.allclose(recs[0]["features"].float(), fused[:5], atol=1e-2)
    assert torch.allclose(recs[1]["features"].float(), fused[5:], atol=1e-2)
    assert recs[1]["features"].dtype == torch.float16 and recs[1]["loss_mask"].tolist() == [False] + [True] * 6
    s.rt.tap.set_response_lengths([2, 3])
    packed_forward(s.model, seqs)
    assert s.rt.tap.records[2]["loss_mask"].tolist() == [False, False, False, True, True]


def test_train_step_hook_trains_and_pushes_the_draft_once_per_rollout(setup):
    s = setup
    before = {k: v.clone() for k, v in s.server.draft.items()}
    sl.before_log_prob_hook(s.args, s.model, "")
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        packed_forward(s.model, [torch.randint(0, V, (n,), generator=g).tolist() for n in (6, 9)])
    sl.before_train_step_hook(s.args, 0, 0, s.model, None, None)
    m = s.rt.metrics
    assert not s.rt.tap.armed and m["buffer/entries"] == 4 and m["train/draft_faults"] == 0
    assert m["train/draft_version"] == m["train/draft_steps"] > 0 and m["train/draft_loss"] > 0
    assert not torch.equal(s.server.draft["model.fc.weight"], before["model.fc.weight"])
    # selector="draft" (sglang 0.5.23): the draft's lm_head goes to the draft runner only
    assert not torch.equal(s.server.draft["lm_head.weight"], before["lm_head.weight"])
    assert {b.get("selector") for e, b in s.server.requests if e == "update_weights_from_tensor"} == {"draft"}
    assert torch.equal(s.server.target["lm_head.weight"], torch.zeros(V, H))  # the policy is untouched
    n = len(s.server.requests)
    sl.before_train_step_hook(s.args, 0, 1, s.model, None, None)  # later steps of the same rollout: nothing
    assert len(s.server.requests) == n


def test_draft_failure_does_not_stop_the_rl_step(setup):
    s = setup
    s.server.close()  # engine unreachable: the push fails
    sl.before_log_prob_hook(s.args, s.model, "")
    packed_forward(s.model, [[1, 2, 3, 4], [5, 6, 7, 8, 9]])
    with pytest.warns(RuntimeWarning, match="draft step skipped"):
        sl.before_train_step_hook(s.args, 0, 0, s.model, None, None)
    assert s.rt.metrics["train/draft_faults"] == 1


def test_config_from_json_and_init(tmp_path, monkeypatch):
    path = tmp_path / "specrl.json"
    path.write_text(json.dumps({"draft_path": "/d", "engine_urls": ["http://h:1"], "online": {"lr": 0.01}}))
    monkeypatch.setenv(sl.CONFIG_ENV, str(path))
    sl.megatron_init(SimpleNamespace())
    try:
        assert sl._STATE["config"].online.lr == 0.01 and sl._STATE["config"].capture_prefixes == ("",)
    finally:
        sl.configure(None)
    path.write_text(json.dumps({"draft_path": "/d", "drafts": 1}))
    with pytest.raises(ValueError, match=r"unknown SlimeSpecConfig keys \['drafts'\]"):
        sl.megatron_init(SimpleNamespace())
    monkeypatch.delenv(sl.CONFIG_ENV)
    with pytest.raises(ValueError, match="SPECRL_SLIME_CONFIG"):
        sl.megatron_init(SimpleNamespace())
    with pytest.raises(ValueError, match="not configured"):
        sl.before_log_prob_hook(SimpleNamespace(), [Wrapper(GPTModel())], "")


def test_feature_tap_fault_never_reaches_the_host_forward(setup):
    s = setup
    seqs = [[3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14]]
    sl.before_log_prob_hook(s.args, s.model, "")

    def broken(*a, **k):
        raise RuntimeError("injected tap failure")

    s.rt.tap.layers.features = broken  # the capture fails inside Megatron's forward
    ids = torch.cat([torch.tensor(x) for x in seqs])[None]
    with pytest.warns(RuntimeWarning, match="feature tap disabled for this step: RuntimeError: injected"):
        with torch.no_grad():
            logits = s.model[0](input_ids=ids, packed_seq_params=SimpleNamespace(
                cu_seqlens_q=torch.tensor([0, 5, 12], dtype=torch.int32)))
    assert logits.shape == (1, 12, V)  # the host forward completed with its own output
    assert s.rt.tap.faults == 1 and not s.rt.tap.armed and s.rt.tap.records == []
    del s.rt.tap.layers.features  # the next step captures again
    sl.before_log_prob_hook(s.args, s.model, "")
    packed_forward(s.model, seqs)
    assert len(s.rt.tap.records) == 2


def test_draft_oom_skips_co_training_and_the_train_step_goes_on(setup):
    s = setup
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        sl.before_log_prob_hook(s.args, s.model, "")
        packed_forward(s.model, [torch.randint(0, V, (n,), generator=g).tolist() for n in (6, 9)])

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    s.rt.trainer.train_step = oom
    n = len(s.server.requests)
    with pytest.warns(RuntimeWarning, match="draft step skipped .*OutOfMemoryError"):
        sl.before_train_step_hook(s.args, 0, 0, s.model, None, None)
    m = s.rt.metrics
    assert m["train/draft_faults"] == 1 and len(s.server.requests) == n  # nothing pushed
    del s.rt.trainer.train_step
    with torch.no_grad():  # the host's next forward is unaffected
        assert s.model[0](input_ids=torch.tensor([[3, 4, 5]])).shape == (1, 3, V)


def test_captured_records_are_bounded(setup):
    s = setup
    s.rt.tap.max_records = 3
    sl.before_log_prob_hook(s.args, s.model, "")
    packed_forward(s.model, [[3, 4, 5], [6, 7, 8], [9, 10, 11], [12, 13, 14]])
    packed_forward(s.model, [[3, 4, 5]])
    assert len(s.rt.tap.records) == 3 and s.rt.tap.dropped == 2


def _dp_worker(url: str, draft_dir: str, out_dir: str) -> None:
    """One data-parallel rank of a slime job (run as a subprocess by the test below)."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    gpt = GPTModel().eval()
    config = sl.SlimeSpecConfig(draft_path=draft_dir, engine_urls=[url], min_buffer_records=2, max_draft_steps=2,
                                time_budget_s=30.0, online=OnlineDraftConfig(batch_size=2, ttt_steps=2))
    engine = SGLangEngine(SGLangEngineConfig(base_url=url, serializer=json_serializer))
    args = SimpleNamespace(num_layers=L, padded_vocab_size=V)
    model = [Wrapper(gpt)]
    sl.configure(config, sl.SlimeSpecRuntime(config, args, model, engines=[engine]))
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own share of the data
    for _ in range(2):
        sl.before_log_prob_hook(args, model, "")
        packed_forward(model, [torch.randint(0, V, (n,), generator=g).tolist() for n in (6, 9)])
    rt = sl.runtime()
    captured = len(rt.tap.records)
    sl.before_train_step_hook(args, 0, 0, model, None, None)
    torch.distributed.barrier()
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(
        {"captured": captured, "version": rt.trainer.version, "dp_rank": rt.dp_rank, "trains": rt.trains}))
    torch.distributed.destroy_process_group()


def test_one_draft_per_job_across_two_gloo_ranks(setup, tmp_path):
    import os
    import socket
    import subprocess
    import sys

    s = setup
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")])}
    procs = [subprocess.Popen([sys.executable, __file__, s.server.url, s.config.draft_path, str(tmp_path)],
                              env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(2)]
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0, out.decode()[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["dp_rank"] for r in ranks] == [0, 1] and [r["trains"] for r in ranks] == [True, False]
    assert ranks[0]["captured"] == 4 and ranks[0]["version"] > 0
    assert ranks[1]["captured"] == 0 and ranks[1]["version"] == 0
    pushes = [b for e, b in s.server.requests if e == "begin_weight_update"]
    assert pushes == [{"selector": "draft"}]  # one push, from rank 0, for the whole job


if __name__ == "__main__":
    import sys

    _dp_worker(*sys.argv[1:4])
