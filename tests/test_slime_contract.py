"""slime contract: the custom generate function and the Megatron hooks, against a stand-in Sample
with exactly slime's fields and a small torch module shaped like Megatron's GPTModel.

`Sample` is a HAND COPY of slime's (tests/slime_sample.py says from where, and why slime's own
class cannot be installed here; the miles lane checks the copy against Miles' real `Sample`). The
hook signatures come from slime's docs/en/get_started/customization.md (section 17) at the same
commit, and match Miles' `megatron_utils` (miles-rl 0.0.2).
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from dataclasses import astuple, fields
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from slime_sample import Sample
from test_sglang_engine import FakeSGLang, json_serializer, load_fixture

import specrl.integrations.slime as sl
from draft_models.checkpoint import draft_state_dict_for_sglang, save_draft
from draft_models.config import Eagle3Config
from draft_models.vocab import build_draft_vocab
from rollout.sglang_engine import SGLangEngine, SGLangEngineConfig
from specrl.config import OnlineDraftConfig

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")


def test_spec_info_counters_fill_slime_spec_info():
    """What specrl writes into `sample.spec_info` (`spec_info_delta`, `add_spec_info`) is exactly
    slime's `Sample.SpecInfo`: its field names, with the counters of the SGLang reply, speculating
    or not. `Sample` here is a hand-written copy of the upstream interface (tests/slime_sample.py);
    the miles lane test tests/test_upstream_miles.py::test_generate_fills_miles_sample checks the
    real one (Miles' `Sample`)."""
    names = {f.name for f in fields(Sample.SpecInfo)}
    spec = load_fixture("generate_batch.json")[0]["meta_info"]  # 1 of 2 drafts accepted, 2 verify steps, 4 tokens
    no_spec = load_fixture("meta_no_spec.json")  # 5 tokens, no speculation
    for meta, want in ((spec, (1, 2, 2, 4)), (no_spec, (0, 0, 0, 5))):
        delta = sl.spec_info_delta(meta)
        assert delta.keys() == names
        assert astuple(Sample.SpecInfo(**delta)) == want  # want: slime's field order
        sample = Sample()
        sl.add_spec_info(sample, meta)
        sl.add_spec_info(sample, meta)  # a resumed partial rollout adds to the counters
        assert vars(sample.spec_info).keys() == names and astuple(sample.spec_info) == tuple(2 * w for w in want)


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


def make_config(draft_dir, url, **kw) -> sl.SlimeSpecConfig:
    kw = {"min_buffer_records": 2, "max_draft_steps": 3, "time_budget_s": 30.0, "hold_shared_draft_names": True,
          "online": OnlineDraftConfig(batch_size=2, ttt_steps=2)} | kw
    return sl.SlimeSpecConfig(draft_path=str(draft_dir), engine_urls=[url], **kw)


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
    config = make_config(tmp_path / "draft", server.url)
    engine = SGLangEngine(SGLangEngineConfig(base_url=server.url, serializer=json_serializer,
                                             hold_shared_draft_names=True))
    args = SimpleNamespace(num_layers=L, padded_vocab_size=V)
    model = [Wrapper(gpt)]
    ad = sl.SlimeAdapter(config, args, model, engines=[engine])
    sl.configure(config, ad)
    yield SimpleNamespace(gpt=gpt, model=model, args=args, ad=ad, server=server, taps=taps, config=config)
    sl.configure(None)
    server.close()


def packed_forward(model, seqs):
    ids = torch.cat([torch.tensor(s) for s in seqs])[None]
    bounds = torch.tensor([0] + list(torch.tensor([len(s) for s in seqs]).cumsum(0)), dtype=torch.int32)
    with torch.no_grad():
        return model[0](input_ids=ids, position_ids=None, attention_mask=None, labels=None,
                        packed_seq_params=SimpleNamespace(cu_seqlens_q=bounds, cu_seqlens_kv=bounds))


def capture_rollout(s, n_forwards=2, seed=1):
    """The actor's log-prob pass of one rollout: two packed forwards of two random sequences."""
    g = torch.Generator().manual_seed(seed)
    sl.before_log_prob_hook(s.args, s.model, "")
    for _ in range(n_forwards):
        packed_forward(s.model, [torch.randint(0, V, (n,), generator=g).tolist() for n in (6, 9)])


def buffered(ad) -> list[dict]:
    return ad.cotrain.buffer.state_dict(include_tensors=True)["entries"]


def draft_pushes(server) -> list[str]:
    """weight_version of every draft tensor update the server received, in order."""
    return [b["weight_version"] for e, b in server.requests
            if e == "update_weights_from_tensor" and b.get("selector") == "draft"]


def test_default_taps_reuse_the_policy_rule():
    from target_training.config import MoEConfig

    assert sl.default_tap_layers(32) == (1, 15, 28) == MoEConfig(num_layers=32).feature_layer_ids
    assert sl.default_tap_layers(4) == (1, 2, 3)


def test_the_adapter_is_a_spec_cotrainer_wired_through_the_protocols(setup):
    from rollout.protocol import DraftReceiver, FeatureSource
    from specrl.cotrain import SpecCoTrainer

    ad = setup.ad
    assert isinstance(ad.cotrain, SpecCoTrainer) and ad.cotrain.engine is ad.engines and ad.cotrain.trainer is ad.tap
    assert isinstance(ad.engines, DraftReceiver) and isinstance(ad.tap, FeatureSource)
    assert ad.tap.layer_ids == tuple(ad.cotrain.draft.cfg.aux_layer_ids) == setup.taps
    assert draft_pushes(setup.server) == ["draft-0"]  # install_draft: the engines start from the trainer's weights


def test_log_prob_hook_captures_fused_features_of_the_actor_pass_only(setup):
    s = setup
    seqs = [[3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14]]
    sl.before_log_prob_hook(s.args, s.model, "ref_")  # reference model pass: not captured
    packed_forward(s.model, seqs)
    assert len(s.ad.cotrain.buffer) == 0
    sl.before_log_prob_hook(s.args, s.model, "")
    packed_forward(s.model, seqs)
    recs = buffered(s.ad)
    assert [r["input_ids"].tolist() for r in recs] == seqs
    fused = torch.cat([s.gpt.taps[i] for i in s.taps], dim=-1)[:, 0]  # (total, 3H)
    assert torch.allclose(recs[0]["features"].float(), fused[:5], atol=1e-2)
    assert torch.allclose(recs[1]["features"].float(), fused[5:], atol=1e-2)
    assert recs[1]["features"].dtype == torch.float16 and recs[1]["loss_mask"].tolist() == [False] + [True] * 6
    assert recs[0]["target_logp"] is None  # Megatron's logits are vocabulary-parallel: hard labels
    s.ad.tap.set_response_lengths([2, 3])
    packed_forward(s.model, seqs)
    assert buffered(s.ad)[2]["loss_mask"].tolist() == [False, False, False, True, True]


def test_train_step_hook_trains_and_pushes_the_draft_once_per_rollout(setup):
    s = setup
    before = {k: v.clone() for k, v in s.server.draft.items()}
    capture_rollout(s)
    sl.before_train_step_hook(s.args, 0, 0, s.model, None, None)
    m = s.ad.metrics
    assert not s.ad.tap.armed and m["buffer/entries"] == 4 and m["train/draft_faults"] == 0
    assert m["train/draft_version"] == m["train/draft_steps"] > 0 and m["train/draft_loss"] > 0
    assert m["train/feature_tap_faults"] == 0 and s.ad.cotrain.policy_version == 1
    assert not torch.equal(s.server.draft["model.fc.weight"], before["model.fc.weight"])
    # selector="draft" (sglang 0.5.23): the draft's lm_head goes to the draft runner only
    assert not torch.equal(s.server.draft["lm_head.weight"], before["lm_head.weight"])
    assert {b.get("selector") for e, b in s.server.requests if e == "update_weights_from_tensor"} == {"draft"}
    assert torch.equal(s.server.target["lm_head.weight"], torch.zeros(V, H))  # the policy is untouched
    assert draft_pushes(s.server) == ["draft-0", f"draft-{m['train/draft_version']}"]
    n = len(s.server.requests)
    sl.before_train_step_hook(s.args, 0, 1, s.model, None, None)  # later steps of the same rollout: nothing
    assert len(s.server.requests) == n


def test_failed_push_does_not_stop_the_rl_step(setup):
    s = setup
    capture_rollout(s)
    s.server.close()  # engine unreachable: the push fails
    with pytest.warns(RuntimeWarning, match="draft hot swap to version .* failed .*1 of 1 engines"):
        sl.before_train_step_hook(s.args, 0, 0, s.model, None, None)
    assert s.ad.metrics["train/draft_faults"] == 1


def test_config_from_json_and_init(tmp_path, monkeypatch):
    path = tmp_path / "specrl.json"
    path.write_text(json.dumps({"draft_path": "/d", "engine_urls": ["http://h:1"], "online": {"lr": 0.01}}))
    monkeypatch.setenv(sl.CONFIG_ENV, str(path))
    sl.megatron_init(SimpleNamespace())
    try:
        config = sl._STATE["config"]
        assert config.online.lr == 0.01 and config.capture_prefixes == ("",)
        cot = config.cotrain_config()
        assert cot.mode == "online" and cot.feature_source == "trainer" and cot.online.lr == 0.01
        assert cot.scheduler.windows == ("between",) and cot.scheduler.max_budget_s == config.time_budget_s
    finally:
        sl.configure(None)
    path.write_text(json.dumps({"draft_path": "/d", "drafts": 1}))
    with pytest.raises(ValueError, match=r"unknown SlimeSpecConfig keys \['drafts'\]"):
        sl.megatron_init(SimpleNamespace())
    path.write_text(json.dumps({"draft_path": "/d", "buffer_bytes": 0}))
    with pytest.raises(ValueError, match="buffer_bytes"):
        sl.megatron_init(SimpleNamespace())
    monkeypatch.delenv(sl.CONFIG_ENV)
    with pytest.raises(ValueError, match="SPECRL_SLIME_CONFIG"):
        sl.megatron_init(SimpleNamespace())
    with pytest.raises(ValueError, match="not configured"):
        sl.before_log_prob_hook(SimpleNamespace(), [Wrapper(GPTModel())], "")


def test_tensor_parallel_shard_is_refused_in_one_line(setup):
    s = setup
    with pytest.raises(ValueError, match="needs tensor parallel 1: this rank's embedding holds 48 of 96 rows"):
        sl.SlimeAdapter(s.config, SimpleNamespace(num_layers=L, padded_vocab_size=2 * V), s.model, engines=[object()])


def test_a_draft_rank_outside_the_job_is_refused(setup):
    config = make_config(setup.config.draft_path, setup.server.url, draft_rank=1)
    with pytest.raises(ValueError, match=r"draft_rank 1 is not a data-parallel rank of this job \(0..0\)"):
        sl.SlimeAdapter(config, setup.args, setup.model, engines=[object()])


def _raise(err):
    def broken(*a, **k):
        raise err
    return broken


@pytest.mark.parametrize("where, err", [
    ("features", RuntimeError("injected tap failure")),  # reading the taps inside Megatron's forward
    ("store", torch.OutOfMemoryError("CUDA out of memory (injected)")),  # storing the record
], ids=["tap-exception", "tap-oom"])
def test_feature_tap_fault_never_reaches_the_host_forward(setup, where, err):
    s = setup
    seqs = [[3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14]]
    target = s.ad.tap.layers if where == "features" else s.ad.cotrain.buffer
    name = "features" if where == "features" else "add"
    setattr(target, name, _raise(err))  # the capture fails inside Megatron's forward
    sl.before_log_prob_hook(s.args, s.model, "")
    with pytest.warns(RuntimeWarning, match=f"feature tap disabled for this step: {type(err).__name__}: "):
        logits = packed_forward(s.model, seqs)
    with torch.no_grad():
        assert torch.equal(logits, s.model[0](input_ids=torch.tensor([sum(seqs, [])])))  # the host's own output
    assert s.ad.tap.faults == 1 and not s.ad.tap.armed and len(s.ad.cotrain.buffer) == 0
    delattr(target, name)
    n = len(s.server.requests)
    sl.before_train_step_hook(s.args, 0, 0, s.model, None, None)  # co-training skips this rollout
    assert s.ad.metrics["train/feature_tap_faults"] == 1 and s.ad.metrics["train/draft_steps"] == 0
    assert len(s.server.requests) == n
    capture_rollout(s)  # the next rollout captures and trains again
    sl.before_train_step_hook(s.args, 1, 0, s.model, None, None)
    assert len(s.ad.cotrain.buffer) == 4 and s.ad.metrics["train/draft_steps"] > 0


def test_draft_oom_skips_co_training_and_the_train_step_goes_on(setup):
    s = setup
    capture_rollout(s)
    s.ad.cotrain.draft_trainer.train_step = _raise(torch.OutOfMemoryError("CUDA out of memory (injected)"))
    n = len(s.server.requests)
    with pytest.warns(RuntimeWarning, match=r"draft training step failed and was skipped \(OutOfMemoryError"):
        sl.before_train_step_hook(s.args, 0, 0, s.model, None, None)
    assert s.ad.metrics["train/draft_faults"] == 1 and len(s.server.requests) == n  # nothing pushed
    del s.ad.cotrain.draft_trainer.train_step
    with torch.no_grad():  # the host's next forward is unaffected
        assert s.model[0](input_ids=torch.tensor([[3, 4, 5]])).shape == (1, 3, V)
    capture_rollout(s, seed=2)  # and the next rollout trains and pushes again
    sl.before_train_step_hook(s.args, 1, 0, s.model, None, None)
    assert s.ad.metrics["train/draft_version"] > 0 and len(draft_pushes(s.server)) == 2


def test_captured_records_live_in_the_byte_budgeted_buffer(setup, tmp_path):
    s = setup
    sl.configure(None)
    budget = 4 * 9 * (3 * H * 2 + 8 + 1)  # four 9-token records: fp16 features, int64 ids, bool mask
    engine = SGLangEngine(SGLangEngineConfig(base_url=s.server.url, serializer=json_serializer,
                                             hold_shared_draft_names=True))
    ad = sl.SlimeAdapter(make_config(s.config.draft_path, s.server.url, buffer_bytes=budget), s.args, s.model,
                         engines=[engine])
    sl.configure(s.config, ad)
    s.ad = ad
    for seed in range(3):
        capture_rollout(s, n_forwards=3, seed=seed)
    buf = ad.cotrain.buffer
    assert buf.nbytes <= budget and len(buf) < 18 and buf.counters["evicted"] > 0


# ------------------------------------------------------------------ data parallel: two gloo processes
def _dp_worker(url: str, draft_dir: str, out_dir: str, rank: str) -> None:
    """One data-parallel rank of a slime job (run as a subprocess by the test below)."""
    torch.set_num_threads(1)
    rank = int(rank)
    torch.distributed.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", world_size=2, rank=rank)
    torch.manual_seed(0)
    s = SimpleNamespace(gpt=GPTModel().eval(), args=SimpleNamespace(num_layers=L, padded_vocab_size=V))
    s.model = [Wrapper(s.gpt)]
    config = make_config(draft_dir, url, max_draft_steps=2, hold_shared_draft_names=False)
    engine = SGLangEngine(SGLangEngineConfig(base_url=url, serializer=json_serializer))
    sl.configure(config, sl.SlimeAdapter(config, s.args, s.model, engines=[engine]))
    for rollout in range(2):
        capture_rollout(s, seed=10 + 2 * rollout + rank)  # each rank its own share of the data
        sl.before_train_step_hook(s.args, rollout, 0, s.model, None, None)
        torch.distributed.barrier()
    ad = sl.adapter()
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(
        {"dp_rank": ad.dp_rank, "trains": ad.trains, "has_cotrainer": ad.cotrain is not None,
         "version": None if ad.cotrain is None else ad.cotrain.draft_trainer.version,
         "buffer": None if ad.cotrain is None else len(ad.cotrain.buffer)}))
    torch.distributed.destroy_process_group()


def test_one_draft_per_job_across_two_gloo_ranks(setup, tmp_path):
    s = setup
    n0 = len(draft_pushes(s.server))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    procs = [subprocess.Popen([sys.executable, __file__, s.server.url, s.config.draft_path, str(tmp_path), str(r)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0, out.decode()[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["dp_rank"] for r in ranks] == [0, 1] and [r["trains"] for r in ranks] == [True, False]
    assert ranks[0]["has_cotrainer"] and ranks[0]["buffer"] == 8 and ranks[0]["version"] == 4
    assert not ranks[1]["has_cotrainer"]  # rank 1 holds no draft: nothing to diverge, nothing to push
    # one writer: rank 0's install (version 0), then exactly one push per update window
    assert draft_pushes(s.server)[n0:] == ["draft-0", "draft-2", "draft-4"]


if __name__ == "__main__":
    _dp_worker(*sys.argv[1:5])
