"""The embedded engine on CUDA: plain, chain and tree decoding under greedy, coupled and rng
sampling, with feature capture; the policy trainer's feature capture and the overlapped draft
training on its own CUDA stream. Skipped without a GPU.

The CI policy and its offline draft are trained on the CPU (the session fixtures) and copied
onto the GPU. Greedy and coupled speculation must give plain decoding's tokens there too (fp32,
log-probs to 1e-4: GPU kernels of different block widths reorder float sums); rng sampling must
run without a draft fault, with its generator on the GPU, and replay from its seed and ids."""
import copy
import json

import pytest
import torch

from rollout.engine import EmbeddedEngine, EngineConfig
from rollout.protocol import SamplingParams
from rollout.drafters import DrafterSpec, SpecConfig
from specrl.rl_setup import encode_prompts

DEVICE = "cuda"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SPEC_CONFIGS = {"chain": SpecConfig(mode="chain", gamma=4),
                "tree": SpecConfig(mode="tree", gamma=3, tree_topk=3, tree_budget=10)}
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def cuda_setup(sft_policy, offline_draft):
    """The policy and its draft on the GPU (copies: the session's CPU modules stay as they are),
    and task prompts mixed with random token strings (high and low acceptance)."""
    tokenizer, task, policy, _ = sft_policy
    target = copy.deepcopy(policy).to("cuda").eval()
    draft = copy.deepcopy(offline_draft).to("cuda")
    draft.set_target_embedding(target.embed_tokens)
    prompts = encode_prompts(tokenizer, task.examples("heldout", 40, 3))
    g = torch.Generator().manual_seed(0)
    prompts += [[tokenizer.bos_id] + torch.randint(3, tokenizer.vocab_size, (int(k),), generator=g).tolist()
                for k in torch.randint(1, 12, (8,), generator=g)]
    return tokenizer, target, draft, prompts


def _engine(target, draft=None, mode="chain", sampling="coupled", batch=8):
    spec = DrafterSpec(draft=draft, spec=SPEC_CONFIGS[mode]) if draft is not None else None
    engine = EmbeddedEngine(target, EngineConfig(max_batch=batch, sampling_mode=sampling), drafter=spec)
    assert engine.device.type == "cuda"
    return engine


def _check_features(trajs, target):
    width = 3 * target.cfg.hidden_size
    for t in trajs:
        assert t.features.device.type == "cpu" and t.features.dtype == torch.float16
        assert t.features.shape == (len(t.prompt_ids) + len(t.token_ids) - 1, width)
        assert torch.isfinite(t.features).all()


def _same_rollout(spec, plain):
    assert [t.token_ids for t in spec] == [t.token_ids for t in plain]
    assert [t.finish_reason for t in spec] == [t.finish_reason for t in plain]
    for a, b in zip(spec, plain):
        assert (a.logprobs - b.logprobs).abs().max().item() <= LOGPROB_TOL
        assert a.features.shape == b.features.shape
        assert torch.allclose(a.features.float(), b.features.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_greedy_speculation_gives_plain_tokens_on_cuda(cuda_setup, mode):
    tokenizer, target, draft, prompts = cuda_setup
    params = SamplingParams(temperature=0.0, max_new_tokens=40, stop_token_ids=(tokenizer.eos_id,))
    plain = _engine(target, batch=16).generate(prompts, params, capture_features=True)
    engine = _engine(target, draft, mode)
    spec = engine.generate(prompts, params, capture_features=True)
    assert engine.draft_faults == [] and spec.stats.spec_faults == 0
    _check_features(plain, target)
    _same_rollout(spec, plain)
    verify = sum(t.spec.verify_steps for t in spec)
    assert verify > 0 and sum(t.spec.accepted for t in spec) / verify > 1.0  # the draft is really accepted


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_coupled_speculation_gives_plain_tokens_on_cuda(cuda_setup, mode):
    tokenizer, target, draft, prompts = cuda_setup
    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=40, stop_token_ids=(tokenizer.eos_id,),
                            seed=11)
    plain = _engine(target, batch=16).generate(prompts, params, capture_features=True)
    engine = _engine(target, draft, mode)
    spec = engine.generate(prompts, params, capture_features=True)
    assert engine.draft_faults == [] and spec.stats.spec_faults == 0
    _same_rollout(spec, plain)
    assert sum(t.spec.accepted for t in spec) > 0


@pytest.mark.parametrize("mode", [None, "chain", "tree"])
def test_rng_sampling_runs_on_cuda(cuda_setup, mode):
    """The rng stream lives on the GPU: sampling, chain and tree rejection sampling run without
    a draft fault; the same seed and request ids replay, fresh ids draw fresh samples."""
    tokenizer, target, draft, prompts = cuda_setup
    params = SamplingParams(temperature=1.0, max_new_tokens=32, stop_token_ids=(tokenizer.eos_id,), seed=5)
    engine = _engine(target, draft if mode else None, mode or "chain", sampling="rng")
    n = len(prompts)
    first = engine.generate(prompts, params, request_ids=range(n), capture_features=True)
    assert engine.generator.device.type == "cuda"
    assert engine.draft_faults == [] and first.stats.spec_faults == 0
    _check_features(first, target)
    for t in first:
        assert torch.isfinite(t.logprobs).all() and (t.logprobs <= 0).all()
        assert all(0 <= x < target.cfg.vocab_size for x in t.token_ids)
    if mode:
        assert sum(t.spec.verify_steps for t in first) > 0 and sum(t.spec.accepted for t in first) > 0
    again = engine.generate(prompts, params, request_ids=range(n))
    later = engine.generate(prompts, params, request_ids=range(n, 2 * n))
    assert engine.draft_faults == []
    assert [t.token_ids for t in again] == [t.token_ids for t in first]
    assert [t.token_ids for t in later] != [t.token_ids for t in first]


def test_trainer_forward_capture_on_cuda_gives_the_cpu_records():
    """The policy trainer's log-prob forward on the GPU (the GRPO and TRL capture path): the batch
    reaches the buffer in one copy per tensor, and the records equal those of the same tensors
    captured on the CPU (soft targets to fp16 rounding: logsumexp differs in its last bits)."""
    from specrl.buffer import FeatureBuffer

    g = torch.Generator().manual_seed(0)
    B, T, F, V = 4, 12, 24, 64
    ids = torch.randint(3, V, (B, T), generator=g)
    feats, logits = torch.randn(B, T, F, generator=g), torch.randn(B, T, V, generator=g)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[:, 5:9] = True
    mask[1] = False  # a row without a response is skipped
    d2t = torch.zeros(32, dtype=torch.long)  # the draft vocabulary: the first 32 target tokens
    records = []
    for dev in ("cpu", DEVICE):
        buf = FeatureBuffer(1 << 24)
        assert buf.add_from_trainer_forward(ids.to(dev), feats.to(dev), logits.to(dev), mask.to(dev), d2t.to(dev),
                                            0) == B - 1
        records.append(list(buf._entries.values()))
    for cpu, dev in zip(*records):
        for k in ("input_ids", "features", "loss_mask"):
            assert dev[k].device.type == "cpu" and torch.equal(cpu[k], dev[k]), k
        assert cpu["features"].shape == (9, F)  # trimmed after the last response position (index 8)
        torch.testing.assert_close(cpu["target_logp"].float(), dev["target_logp"].float(), atol=1e-2, rtol=0)


def test_overlapped_draft_training_on_a_cuda_stream(tiny_model):
    """A burst of draft updates on its own CUDA stream, beside the policy update: it trains what
    the sequential mode trains on the same batches (to float tolerance: GPU backward sums may be
    ordered differently), and the engine's draft changes only at the step boundary."""
    from helpers import engine_draft, overlap_pair

    seq, ovl = overlap_pair(copy.deepcopy(tiny_model).to(DEVICE))
    if DEVICE == "cuda":
        assert ovl._overlap._stream is not None
    start = {k: v.clone() for k, v in engine_draft(ovl.engine).state_dict().items()}
    seq.begin_step()
    assert seq.end_step()["train/draft_steps"] == 3
    ovl.begin_step()
    ovl.end_step()  # the boundary launches the burst on its stream
    ovl._overlap._thread.join()
    assert all(torch.equal(v, start[k]) for k, v in engine_draft(ovl.engine).state_dict().items())
    ovl.begin_step()
    assert ovl.end_step()["train/draft_steps"] == 3  # the boundary: collected and swapped in
    ovl._overlap._thread.join()  # the next burst trains the trainer's copy, not the engine's
    trained, want = engine_draft(ovl.engine).state_dict(), seq.draft.state_dict()
    for k, v in want.items():
        assert trained[k].device.type == DEVICE
        torch.testing.assert_close(trained[k], v, atol=1e-5, rtol=1e-4, msg=k)
    ovl.state_dict()  # collects it


def test_the_rl_loop_runs_on_cuda(sft_policy, tmp_path):
    """`train_rl(device="cuda")`: the policy, its trainer, the draft and the embedded engine on the
    GPU for a whole online run (rollout with speculation, GRPO update, feature capture, draft
    updates, swap): it ends with the policy still there, draft updates made and the device recorded."""
    from specrl.train_rl import RLCallback, train_rl

    seen = {}

    class Watch(RLCallback):
        def on_end(self, run, summary):
            seen["policy"] = next(run.policy.parameters()).device
            seen["draft"] = run.cotrain.draft.fc.weight.device

    summary = train_rl("arith", "ci", tmp_path / "r", seed=3, steps=3, cache_dir=sft_policy[3], progress=False,
                       spec="online", reproducible=True, device=DEVICE, callbacks=(Watch(),), log=lambda *a: None)
    assert summary["device"] == DEVICE
    assert seen["policy"].type == DEVICE and seen["draft"].type == DEVICE
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and sum(r["train/draft_steps"] for r in rows) > 0
    assert all(r["rollout/spec_steps"] > 0 for r in rows)
