"""Losslessness of speculative decoding in the engine: exact for greedy and coupled sampling,
statistical (with a power check) for rejection sampling, and log-probs equal to plain decoding."""
import inspect
import sys

import pytest
import torch

import rollout.acceptance as acceptance
from draft_models.checkpoint import DraftCheckpointError
from rollout.engine import EmbeddedEngine, EngineConfig
from rollout.protocol import SamplingParams
from rollout.drafters import DrafterSpec, SpecConfig
from rollout.speculative import Speculator
from specrl.rl_setup import encode_prompts
from helpers import break_draft, chi2_pvalue

SPEC_CONFIGS = {"chain": SpecConfig(mode="chain", gamma=4), "tree": SpecConfig(mode="tree", gamma=3, tree_topk=3, tree_budget=10)}


def _prompts(tokenizer, task, n):
    """Task prompts (high acceptance) mixed with random token strings (low acceptance)."""
    real = encode_prompts(tokenizer, task.examples("heldout", n - n // 5, 3))
    g = torch.Generator().manual_seed(0)
    noise = [[tokenizer.bos_id] + torch.randint(3, tokenizer.vocab_size, (int(k),), generator=g).tolist()
             for k in torch.randint(1, 12, (n // 5,), generator=g)]
    return real + noise


def _engine(policy, batch, draft=None, mode="chain", sampling="coupled", moe_dispatch="exact"):
    spec = DrafterSpec(draft=draft, spec=SPEC_CONFIGS[mode]) if draft is not None else None
    return EmbeddedEngine(policy, EngineConfig(max_batch=batch, sampling_mode=sampling, moe_dispatch=moe_dispatch),
                          drafter=spec)


@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("batch, n", [(16, 500), (1, 100), pytest.param(1, 500, marks=pytest.mark.slow)])
def test_greedy_identical_on_many_prompts(sft_policy, offline_draft, mode, batch, n):
    """Greedy speculation emits plain decoding's tokens and log-probs on n prompts (batch 1 on
    100 of the 500 in CI: one at a time costs 5x the time of the batch of 16; all 500 with -m slow)."""
    tokenizer, task, policy, _ = sft_policy
    prompts = _prompts(tokenizer, task, n)
    params = SamplingParams(temperature=0.0, max_new_tokens=40, stop_token_ids=(tokenizer.eos_id,))
    plain = _engine(policy, 64).generate(prompts, params)
    engine = _engine(policy, batch, offline_draft, mode)
    spec = engine.generate(prompts, params)
    # speculation ran the whole rollout: a fault would fall back to plain decoding and still match
    assert engine.draft_faults == [] and spec.stats.spec_faults == 0
    assert [t.token_ids for t in spec] == [t.token_ids for t in plain]
    assert [t.finish_reason for t in spec] == [t.finish_reason for t in plain]
    diff = max((a.logprobs - b.logprobs).abs().max().item() for a, b in zip(spec, plain))
    assert diff <= 1e-5
    accepted = sum(t.spec.accepted for t in spec)
    verify = sum(t.spec.verify_steps for t in spec)
    assert accepted / verify > 1.0  # the draft really is accepted: the test exercises long paths


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_coupled_sampling_identical_to_plain(sft_policy, offline_draft, mode):
    tokenizer, task, policy, _ = sft_policy
    prompts = _prompts(tokenizer, task, 120)
    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=40, stop_token_ids=(tokenizer.eos_id,), seed=11)
    plain = _engine(policy, 16).generate(prompts, params, capture_features=True)
    spec = _engine(policy, 8, offline_draft, mode).generate(prompts, params, capture_features=True)
    assert [t.token_ids for t in spec] == [t.token_ids for t in plain]
    for a, b in zip(spec, plain):
        assert (a.logprobs - b.logprobs).abs().max().item() <= 1e-5
        assert a.features.shape == b.features.shape
        assert torch.allclose(a.features.float(), b.features.float(), atol=2e-2, rtol=2e-2)
    assert sum(t.spec.accepted for t in spec) > 0


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_steady_state_draft_block_drafts_what_the_padded_block_drafts(sft_policy, offline_draft, mode, monkeypatch):
    """Between admissions a step feeds the draft the previous step's padded features and tokens
    as they are (`_Commit.block`, no copy) instead of re-padding each slot's run with zeros. Every
    drafted and accepted count is the same either way, and the shortcut is really taken."""
    from rollout.drafters.eagle3 import _Commit

    tokenizer, task, policy, _ = sft_policy
    prompts = _prompts(tokenizer, task, 40)
    params = SamplingParams(temperature=1.0, max_new_tokens=40, stop_token_ids=(tokenizer.eos_id,), seed=4)
    block, taken = _Commit.block, []

    def counted(self, *args):
        out = block(self, *args)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(_Commit, "block", counted)
    steady = _engine(policy, 4, offline_draft, mode).generate(prompts, params)
    monkeypatch.setattr(_Commit, "block", lambda self, *args: None)
    padded = _engine(policy, 4, offline_draft, mode).generate(prompts, params)
    assert [t.token_ids for t in steady] == [t.token_ids for t in padded]
    assert [t.spec.drafted_per_pos for t in steady] == [t.spec.drafted_per_pos for t in padded]
    assert [t.spec.accepted_per_pos for t in steady] == [t.spec.accepted_per_pos for t in padded]
    assert sum(t.spec.accepted for t in steady) > len(steady)  # the draft is good enough for the counts to matter
    assert sum(taken) > len(taken) / 2 and not all(taken)  # the shortcut, and admissions that skip it


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_dense_moe_dispatch_decodes_what_exact_decodes(sft_policy, offline_draft, temperature, monkeypatch):
    """EngineConfig(moe_dispatch="dense") changes how small blocks compute the MoE, not what the
    policy generates: plain, chain and tree decoding with it give the exact dispatch's plain
    tokens, and log-probs within 1e-5 (the dispatches differ by rounding), greedy and coupled.
    Batches 16 / 4 / 2 keep decode and verify blocks within the dense size, batch 8 chains mix
    dense steps with exact ones (40-token verify blocks)."""
    from target_training.model import MoE

    tokenizer, task, policy, _ = sft_policy
    prompts = _prompts(tokenizer, task, 60)
    params = SamplingParams(temperature=temperature, max_new_tokens=40, stop_token_ids=(tokenizer.eos_id,), seed=5)
    exact = _engine(policy, 16).generate(prompts, params)
    dense_calls, dense = [], MoE._experts_dense
    monkeypatch.setattr(MoE, "_experts_dense", lambda self, *a: dense_calls.append(a[0].shape[0]) or dense(self, *a))
    for batch, mode in ((16, None), (4, "chain"), (8, "chain"), (2, "tree")):
        dense_calls.clear()
        draft = offline_draft if mode else None
        trajs = _engine(policy, batch, draft, mode or "chain", moe_dispatch="dense").generate(prompts, params)
        assert dense_calls and max(dense_calls) <= MoE.DENSE_DISPATCH_MAX_TOKENS, (batch, mode)
        assert [t.token_ids for t in trajs] == [t.token_ids for t in exact], (batch, mode)
        diff = max((a.logprobs - b.logprobs).abs().max().item() for a, b in zip(trajs, exact))
        assert diff <= 1e-5, (batch, mode, diff)
        if mode:
            assert sum(t.spec.accepted for t in trajs) > 0


# Samples of the first two tokens per law check. With 4000 the check against an always-accepting
# rule gave p = 7e-5 on one build of the test draft and p > 1e-3 (no detection) on another: the
# check had too little power to fail reliably. 8000 doubles its statistic under that bug.
N_LAW = 8000


def _first_two_counts(policy, draft, mode, prompt, n, vocab, temperature):
    engine = _engine(policy, 64, draft, mode, sampling="rng")
    params = SamplingParams(temperature=temperature, max_new_tokens=2, seed=5)
    trajs = engine.generate([prompt] * n, params)
    counts = torch.zeros(vocab, vocab)
    for t in trajs:
        counts[t.token_ids[0], t.token_ids[1]] += 1
    return counts, trajs


def _exact_first_two(policy, prompt, temperature):
    with torch.no_grad():
        V = policy.cfg.vocab_size
        p1 = (policy(torch.tensor([prompt])).logits[0, -1] / temperature).softmax(-1)  # (V,)
        seqs = torch.tensor([prompt + [a] for a in range(V)])
        p2 = (policy(seqs).logits[:, -1] / temperature).softmax(-1)  # (V, V)
    return p1[:, None] * p2


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_rejection_sampling_matches_target_distribution(sft_policy, offline_draft, mode):
    """Chi-square of the first two tokens against the exact target law; threshold p > 1e-3."""
    tokenizer, task, policy, _ = sft_policy
    prompt = encode_prompts(tokenizer, task.examples("heldout", 1, 9))[0]
    counts, trajs = _first_two_counts(policy, offline_draft, mode, prompt, N_LAW, tokenizer.vocab_size, 1.5)
    assert sum(t.spec.accepted for t in trajs) > 1000  # the draft's proposals are accepted often
    stat, df, pval = chi2_pvalue(counts, _exact_first_two(policy, prompt, 1.5))
    assert pval > 1e-3, f"chi2={stat:.1f} df={df} p={pval:.2e}"


def test_rejection_check_has_power(sft_policy, offline_draft, monkeypatch):
    """The same check fails when the acceptance rule is broken (always accept the draft)."""
    tokenizer, task, policy, _ = sft_policy
    prompt = encode_prompts(tokenizer, task.examples("heldout", 1, 9))[0]
    monkeypatch.setattr(acceptance, "accept_test", lambda px, qx, u: torch.ones_like(px, dtype=torch.bool))
    counts, _ = _first_two_counts(policy, offline_draft, "chain", prompt, N_LAW, tokenizer.vocab_size, 1.5)
    _, _, pval = chi2_pvalue(counts, _exact_first_two(policy, prompt, 1.5))
    assert pval < 1e-3


def test_mismatched_draft_is_rejected(sft_policy, offline_draft):
    from target_training.config import model_config_for

    _, _, policy, _ = sft_policy
    other = model_config_for("quick", policy.cfg.vocab_size).build()
    with pytest.raises(DraftCheckpointError, match="hidden_size"):
        EmbeddedEngine(other, drafter=DrafterSpec(draft=offline_draft))


def test_speculation_flag_off_is_plain(sft_policy, offline_draft):
    tokenizer, task, policy, _ = sft_policy
    prompts = _prompts(tokenizer, task, 20)
    params = SamplingParams(temperature=0.0, max_new_tokens=30, stop_token_ids=(tokenizer.eos_id,))
    engine = EmbeddedEngine(policy, EngineConfig(max_batch=8), drafter=DrafterSpec(draft=offline_draft))
    engine.set_speculation(False)
    trajs = engine.generate(prompts, params)
    assert all(t.spec.verify_steps == 0 for t in trajs)
    assert [t.token_ids for t in trajs] == [t.token_ids for t in _engine(policy, 8).generate(prompts, params)]


def test_tree_explores_siblings(tiny_model):
    """With a weak (random) draft, a tree that verifies several children per node accepts far
    more than a chain that only tries the draft's top-1, and stays identical to plain greedy."""
    from specrl.config import DraftTrainConfig
    from specrl.drafts import new_draft

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 64, (int(n),), generator=g).tolist() for n in torch.randint(2, 10, (24,), generator=g)]
    draft = new_draft(tiny_model, prompts, DraftTrainConfig(draft_vocab_size=64))
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    plain = EmbeddedEngine(tiny_model, EngineConfig(max_batch=8)).generate(prompts, params)
    accepted = {}
    for name, cfg in {"chain": SpecConfig(mode="chain", gamma=3),
                      "tree": SpecConfig(mode="tree", gamma=3, tree_topk=8, tree_budget=40)}.items():
        out = EmbeddedEngine(tiny_model, EngineConfig(max_batch=8), drafter=DrafterSpec(draft=draft, spec=cfg)).generate(prompts, params)
        assert [t.token_ids for t in out] == [t.token_ids for t in plain]
        accepted[name] = sum(t.spec.accepted for t in out)
    assert accepted["tree"] > 2 * accepted["chain"]


@pytest.mark.parametrize("mode", [None, "chain", "tree"])
def test_prefill_fused_into_the_step_changes_nothing(sft_policy, offline_draft, mode, monkeypatch):
    """Admitted prompts ride along in the step's forward (EmbeddedEngine.forward) unless a slot
    lacks the room; fused or not, tokens, log-probs and captured features are the same."""
    tokenizer, task, policy, _ = sft_policy
    prompts = _prompts(tokenizer, task, 24)
    params = SamplingParams(temperature=1.0, max_new_tokens=40, stop_token_ids=(tokenizer.eos_id,), seed=5)
    draft = offline_draft if mode else None
    fused_calls, refused = [], []
    can_fuse = EmbeddedEngine._can_fuse

    def spy(self, cache, active, prefill, slack, width=1):
        ok = can_fuse(self, cache, active, prefill, slack, width)
        (fused_calls if ok else refused).append(len(active))
        return ok

    monkeypatch.setattr(EmbeddedEngine, "_can_fuse", spy)
    # a short context window, so late in a request the slot lacks room and fusion is refused
    cfg = EngineConfig(max_batch=4, max_len=len(max(prompts, key=len)) + 30)
    spec = DrafterSpec(draft=draft, spec=SPEC_CONFIGS[mode]) if draft is not None else None
    fused = EmbeddedEngine(policy, cfg, drafter=spec).generate(prompts, params, capture_features=True)
    assert fused_calls
    if mode != "tree":  # a tree's cache slack (every drafted candidate) always leaves room for a prompt
        assert any(refused)  # both paths ran (refusals with nothing active do not count)
    monkeypatch.setattr(EmbeddedEngine, "_can_fuse", lambda *a: False)
    apart = EmbeddedEngine(policy, cfg, drafter=spec).generate(prompts, params, capture_features=True)
    assert [t.token_ids for t in fused] == [t.token_ids for t in apart]
    for a, b in zip(fused, apart):
        assert (a.logprobs - b.logprobs).abs().max().item() <= 1e-5
        assert a.features.shape == b.features.shape
        assert torch.allclose(a.features.float(), b.features.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("mode", [None, "chain"])
def test_prompts_fuse_only_within_the_padding_budget(sft_policy, offline_draft, mode, monkeypatch):
    """A prompt rides along a step only if padding the step's rows to its width (and it to the
    verify block's) adds at most EngineConfig.fuse_max_padding tokens; past that it is
    prefilled on its own, with the same tokens and log-probs. The budget is checked on the
    padding the engine really builds: every fused step's forward carries at most that many."""
    tokenizer, task, policy, _ = sft_policy
    prompts = _prompts(tokenizer, task, 24)
    params = SamplingParams(temperature=1.0, max_new_tokens=30, stop_token_ids=(tokenizer.eos_id,), seed=5)
    spec_cfg = SPEC_CONFIGS[mode] if mode else None
    width = Speculator(DrafterSpec(draft=offline_draft, spec=spec_cfg)).verify_width() if mode else 1
    forward = EmbeddedEngine.forward
    out, paddings = {}, {}
    for budget in (0, 20, 1000):
        seen = paddings[budget] = []

        def spy(self, run, slots, ids, prefill=None, **kw):
            if prefill is not None:  # the padding this fused forward adds over the two it replaces
                B, T = ids.shape
                n, W = prefill.ids.shape
                seen.append(B * max(W - T, 0) + n * max(T - W, 0))
            return forward(self, run, slots, ids, prefill, **kw)

        monkeypatch.setattr(EmbeddedEngine, "forward", spy)
        spec = DrafterSpec(draft=offline_draft, spec=spec_cfg) if mode else None
        engine = EmbeddedEngine(policy, EngineConfig(max_batch=8, fuse_max_padding=budget), drafter=spec)
        out[budget] = engine.generate(prompts, params)
        assert all(p <= budget for p in seen), (budget, seen)
    widths = {len(p) for p in prompts}
    assert max(widths) - width > 0  # the prompts are wider than the step's blocks: fusing pads
    assert paddings[1000] and max(paddings[1000]) > 20 and len(paddings[20]) < len(paddings[1000])
    for budget in (0, 20):
        assert [t.token_ids for t in out[budget]] == [t.token_ids for t in out[1000]]
        for a, b in zip(out[budget], out[1000]):
            assert (a.logprobs - b.logprobs).abs().max().item() <= 1e-5
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="EngineConfig.fuse_max_padding must be None or an integer >= 0"):
            EngineConfig(fuse_max_padding=bad)


def test_the_default_padding_budget_is_the_measured_one_on_cpu(sft_policy, monkeypatch):
    """EngineConfig.fuse_max_padding=None: the CPU default (measured there), no limit elsewhere."""
    from rollout import engine as engine_module

    tokenizer, task, policy, _ = sft_policy
    engine = EmbeddedEngine(policy, EngineConfig(max_batch=8))
    assert EngineConfig().fuse_max_padding is None and engine.device.type == "cpu"
    monkeypatch.setattr(engine_module, "CPU_FUSE_MAX_PADDING", 7)
    decisions = []
    can_fuse = EmbeddedEngine._can_fuse

    def spy(self, cache, states, prefill, slack, width=1):
        padding = len(states) * max(prefill.ids.shape[1] - width, 0)
        decisions.append((padding, can_fuse(self, cache, states, prefill, slack, width)))
        return decisions[-1][1]

    monkeypatch.setattr(EmbeddedEngine, "_can_fuse", spy)
    params = SamplingParams(temperature=1.0, max_new_tokens=30, stop_token_ids=(tokenizer.eos_id,), seed=5)
    engine.generate(_prompts(tokenizer, task, 24), params)
    assert all(fused == (0 < padding <= 7) for padding, fused in decisions if padding), decisions
    assert any(p > 7 for p, _ in decisions)  # the budget was tested, not just met


@pytest.mark.parametrize("mode", [None, "chain"])
def test_prefill_ahead_changes_only_the_step_count(sft_policy, offline_draft, mode):
    """A request prefilled ahead of a free decode slot (EngineConfig.prefill_ahead) decodes the
    same tokens with the same log-probs; no step decodes more than max_batch sequences, the step
    hooks see max_batch as the slot count, and speculation saves steps (the joining request
    speculates from its first step instead of spending it on its prefill)."""
    tokenizer, task, policy, _ = sft_policy
    prompts = _prompts(tokenizer, task, 24)
    params = SamplingParams(temperature=1.0, max_new_tokens=40, stop_token_ids=(tokenizer.eos_id,), seed=5)
    out, steps = {}, {}
    for ahead in (0, 1, 2):
        spec = DrafterSpec(draft=offline_draft, spec=SPEC_CONFIGS[mode]) if mode else None
        engine = EmbeddedEngine(policy, EngineConfig(max_batch=4, prefill_ahead=ahead), drafter=spec)
        seen = []
        engine.step_hooks.append(lambda n_active, n_slots: seen.append((n_active, n_slots)))
        out[ahead] = engine.generate(prompts, params, capture_features=True)
        steps[ahead] = out[ahead].stats.engine_steps
        assert seen and all(0 < n <= 4 and slots == 4 for n, slots in seen)
    for ahead in (1, 2):
        assert [t.token_ids for t in out[ahead]] == [t.token_ids for t in out[0]]
        for a, b in zip(out[ahead], out[0]):
            assert (a.logprobs - b.logprobs).abs().max().item() <= 1e-5
            assert torch.allclose(a.features.float(), b.features.float(), atol=2e-2, rtol=2e-2)
        assert steps[ahead] <= steps[0]
    if mode:
        assert steps[1] < steps[0]


class _FixedPolicy:
    """A step policy that always speculates a chain of 2 and reads plain steps at fixed times."""

    def should_speculate(self, n_active):
        return True

    def gamma_for_step(self):
        return 2

    def exploited(self, n_active):
        return 2

    def max_depth(self):
        return 2

    def plain_seconds(self, n_active):
        return 0.002 + 0.001 * n_active

    def observe(self, stats):
        pass


def test_the_saving_is_priced_on_the_steps_plain_decoding_takes(sft_policy, offline_draft):
    """plain_batch_sizes gives the batch size of every step plain decoding takes (the engine's
    own, through the step hooks, with prompts prefilled ahead: rows joining as slots free, more
    prompts than slots), and a speculating call's spec_saved_s is those steps at the policy's
    plain times less its own."""
    from rollout.speculative import plain_batch_sizes

    tokenizer, task, policy, _ = sft_policy
    prompts = _prompts(tokenizer, task, 12)
    params = SamplingParams(temperature=1.0, max_new_tokens=40, stop_token_ids=(tokenizer.eos_id,), seed=5)
    config = EngineConfig(max_batch=4, prefill_ahead=2)  # with 1, two rows ending at once leave one step a row short
    plain = EmbeddedEngine(policy, config)
    sizes = []
    plain.step_hooks.append(lambda n_active, n_slots: sizes.append(n_active))
    out = plain.generate(prompts, params)
    lengths = [len(t.token_ids) for t in out]
    assert len(set(lengths)) > 2 and sizes == plain_batch_sizes(lengths, 4)
    engine = EmbeddedEngine(policy, config, drafter=DrafterSpec(draft=offline_draft, spec=SPEC_CONFIGS["chain"]),
                            policy=_FixedPolicy())
    spec = engine.generate(prompts, params)
    assert [t.token_ids for t in spec] == [t.token_ids for t in out]  # coupled sampling: the same tokens
    priced = sum(_FixedPolicy().plain_seconds(n) for n in sizes)
    assert spec.stats.spec_steps > 0
    assert spec.stats.spec_saved_s == pytest.approx(priced - spec.stats.full_batch_s - spec.stats.tail_s)


@pytest.mark.parametrize("value", [-1, 5, True, 1.0])
def test_bad_prefill_ahead(value):
    with pytest.raises(ValueError, match="prefill_ahead"):
        EngineConfig(max_batch=4, prefill_ahead=value)


TRANSFER_MODULE = "rollout/transfer.py"  # the one place a step copies between host and device


class _DeviceReads:
    """Counts a step's host-device traffic by kind; on an accelerator each one costs a copy, and
    the reads a wait for the device.

    n: reads of tensor values into Python (tolist, item, int, bool, float, index) and ops whose
       output shape depends on tensor values (nonzero and kin). (Indexing with a boolean mask is
       one too, and is not counted.)
    up: tensors built from host data (torch.tensor, as_tensor, from_numpy of non-tensors): each
       one a copy to the device; `rollout.transfer.upload` is one, however many lists it packs.
    moves: copies between devices (`.to(device)`, `.cpu()`, `.cuda()`, `.numpy()`); on the CPU every
       device is the host, so every call that names a device is counted.
    stray: uploads and moves made outside `rollout.transfer`, whose copies are the pinned,
       non-blocking ones."""

    READS = {"tolist", "item", "__int__", "__bool__", "__float__", "__index__", "nonzero", "masked_select", "unique",
             "argwhere"}
    UPLOADS = {"tensor", "as_tensor", "from_numpy"}
    MOVES = {"cpu", "cuda", "numpy"}

    def __init__(self):
        from torch.overrides import TorchFunctionMode

        counter = self

        def names_a_device(args, kwargs):
            return "device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args[1:])

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                name, kwargs = getattr(func, "__name__", ""), kwargs or {}
                counter.n += name in counter.READS
                up = name in counter.UPLOADS and not (args and isinstance(args[0], torch.Tensor))
                move = name in counter.MOVES or (name == "to" and names_a_device(args, kwargs))
                counter.up, counter.moves = counter.up + up, counter.moves + move
                if (up or move) and not sys._getframe(1).f_code.co_filename.endswith(TRANSFER_MODULE):
                    counter.stray.append(f"{name} in {sys._getframe(1).f_code.co_name}")
                return func(*args, **kwargs)

        self.n = self.up = self.moves = 0
        self.stray: list[str] = []  # copies made elsewhere than rollout/transfer.py (unpinned, blocking)
        self.mode = Mode()


@pytest.mark.parametrize("sampling_mode", ["coupled", "rng"])
@pytest.mark.parametrize("dispatch", ["exact", "dense"])
@pytest.mark.parametrize("mode, gamma", [("chain", 2), ("chain", 4), ("tree", 2), ("tree", 4)])
def test_a_speculative_step_reads_the_device_only_where_documented(tiny_model, mode, gamma, dispatch, sampling_mode,
                                                                   monkeypatch):
    """The reads left in a speculative step without admissions, chain or tree: one per MoE layer
    of the verify forward (the exact dispatch's group sizes; none with the dense dispatch, here
    on every block size) and the hand-back of tokens, counts and log-probs in one transfer.
    Every cache block's key length comes from the host (which also vouches for a draft tree's
    windowed masks), and a tree's walk takes its depth and fan-out bounds from the drafted
    depth and top-k. In rng mode (rejection sampling) a tree reads one more value: the width of
    its verify block, which grows by the pruned siblings that must stay in the recursion. A new
    read fails here."""
    from specrl.config import DraftTrainConfig
    from specrl.drafts import new_draft
    from target_training.model import MoE

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (5, 9, 3, 12, 7, 4, 10, 6)]
    draft = new_draft(tiny_model, prompts, DraftTrainConfig(draft_vocab_size=64))
    n_moe = sum(isinstance(layer.mlp, MoE) for layer in tiny_model.layers)
    counts, step = [], EmbeddedEngine._spec_step

    def counted(self, run, active, states, prefill=None):
        reads = _DeviceReads()
        with reads.mode:
            out = step(self, run, active, states, prefill)
        if prefill is None:
            counts.append(reads.n)
        return out

    monkeypatch.setattr(EmbeddedEngine, "_spec_step", counted)
    monkeypatch.setattr(MoE, "DENSE_DISPATCH_MAX_TOKENS", 10**6)
    engine = EmbeddedEngine(tiny_model, EngineConfig(max_batch=3, moe_dispatch=dispatch, sampling_mode=sampling_mode),
                            drafter=DrafterSpec(draft=draft, spec=SpecConfig(mode, gamma)))
    engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=16, seed=2))
    assert not engine.draft_faults and len(counts) >= 5
    block_width = mode == "tree" and sampling_mode == "rng"
    assert set(counts) == {(n_moe if dispatch == "exact" else 0) + 1 + block_width}


@pytest.mark.parametrize("dispatch", ["exact", "dense"])
@pytest.mark.parametrize("speculate", [False, True])
def test_admissions_and_plain_steps_read_the_device_only_where_documented(tiny_model, speculate, dispatch,
                                                                          monkeypatch):
    """Per engine step, the reads are one per MoE layer of its one forward (none with the dense
    dispatch, here on every block size) plus one hand-back per group of requests given tokens:
    a plain decode step n_moe + 1; a step that carries newly admitted prompts (fused prefill)
    n_moe + 2, the prompts' first tokens being the second hand-back; a prefill on its own
    n_moe + 1. Planning an admission (`_plan_prefill`, `_can_fuse`) reads nothing: prompt and
    cache lengths are known on the host."""
    from specrl.config import DraftTrainConfig
    from specrl.drafts import new_draft
    from target_training.model import MoE

    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (5, 9, 3, 12, 7, 4, 10, 6, 8, 5)]
    n_moe = sum(isinstance(layer.mlp, MoE) for layer in tiny_model.layers)
    seen: dict[str, list[int]] = {}

    def counting(name, fn, key):
        def wrapped(*args, **kwargs):
            reads = _DeviceReads()
            with reads.mode:
                out = fn(*args, **kwargs)
            seen.setdefault(key(*args, **kwargs), []).append(reads.n)
            return out
        monkeypatch.setattr(*name, wrapped)

    def fused(fn):  # "fused" where the step's `prefill` argument carries newly admitted prompts
        sig = inspect.signature(fn)
        return lambda *a, **k: "fused" if sig.bind(*a, **k).arguments.get("prefill") is not None else "alone"

    plain_kind, spec_kind = fused(EmbeddedEngine._decode_step), fused(EmbeddedEngine._spec_step)
    counting((EmbeddedEngine, "_decode_step"), EmbeddedEngine._decode_step, lambda *a, **k: "plain " + plain_kind(*a, **k))
    counting((EmbeddedEngine, "_spec_step"), EmbeddedEngine._spec_step, lambda *a, **k: "spec " + spec_kind(*a, **k))
    counting((EmbeddedEngine, "_run_prefill"), EmbeddedEngine._run_prefill, lambda *a, **k: "prefill alone")
    counting((EmbeddedEngine, "_plan_prefill"), EmbeddedEngine._plan_prefill, lambda *a, **k: "plan")
    counting((EmbeddedEngine, "_can_fuse"), EmbeddedEngine._can_fuse, lambda *a, **k: "plan")
    spec = None
    if speculate:
        draft = new_draft(tiny_model, prompts, DraftTrainConfig(draft_vocab_size=64))
        spec = DrafterSpec(draft=draft, spec=SpecConfig("chain", 3))
    monkeypatch.setattr(MoE, "DENSE_DISPATCH_MAX_TOKENS", 10**6)
    engine = EmbeddedEngine(tiny_model, EngineConfig(max_batch=3, moe_dispatch=dispatch), drafter=spec)
    engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=12, seed=2))
    kind = "spec" if speculate else "plain"
    moe = n_moe if dispatch == "exact" else 0
    expected = {"plan": 0, "prefill alone": moe + 1, f"{kind} alone": moe + 1, f"{kind} fused": moe + 2}
    assert set(seen) == set(expected), seen.keys()  # every kind of step ran
    assert {k: set(v) for k, v in seen.items()} == {k: {n} for k, n in expected.items()}


@pytest.mark.parametrize("mode", [None, "chain", "tree"])
def test_every_cache_block_gets_its_exact_key_length_from_the_host(sft_policy, offline_draft, mode, monkeypatch):
    """The engine and the speculative step pass each cache block its key length from the host's
    lengths (KVCache.begin_block's key_len); it must equal the longest row's length + T (a
    shorter one would drop keys, a longer one waste attention), through admissions, fused
    prefills, drafting and verification."""
    from target_training.model import KVCache

    tokenizer, task, policy, _ = sft_policy
    prompts = _prompts(tokenizer, task, 12)
    begin, seen = KVCache.begin_block, []

    def checked(self, slots, T, attn_mask=None, key_len=None):
        start = self.lengths[slots if slots is not None else self.all_slots()]
        seen.append(key_len)
        assert key_len == int(start.max()) + T
        return begin(self, slots, T, attn_mask, key_len)

    monkeypatch.setattr(KVCache, "begin_block", checked)
    spec = DrafterSpec(draft=offline_draft, spec=SPEC_CONFIGS[mode]) if mode else None
    params = SamplingParams(temperature=1.0, max_new_tokens=30, stop_token_ids=(tokenizer.eos_id,), seed=1)
    EmbeddedEngine(policy, EngineConfig(max_batch=3), drafter=spec).generate(prompts, params)
    assert len(seen) > 20


# ---- the context end: pending features of slots at very different depths ----------------------------
def _context_end_setup(tiny_model, lengths, seed=1):
    from specrl.config import DraftTrainConfig
    from specrl.drafts import new_draft

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in lengths]
    return prompts, new_draft(tiny_model, prompts, DraftTrainConfig(draft_vocab_size=64))


def test_context_end_reproduction(tiny_model, one_thread, monkeypatch):
    """max_len 64, batch 2, prompts of 2/40/50 tokens, chain gamma 4: the 50-token prompt is
    admitted beside the 2-token request deep into its context. Padding both rows' pending
    features to the longest overflowed the draft cache (74 > 69 positions) and turned speculation
    off for the call; now the feed is split and speculation stays on, output unchanged."""
    import rollout.drafters.eagle3 as eagle3

    prompts, draft = _context_end_setup(tiny_model, (2, 40, 50))
    split = []
    fit = eagle3.fit_groups
    monkeypatch.setattr(eagle3, "fit_groups", lambda *a: split.append(len(fit(*a))) or fit(*a))
    params = SamplingParams(temperature=0.0, max_new_tokens=64)
    engine = EmbeddedEngine(tiny_model, EngineConfig(max_batch=2, max_len=64),
                            drafter=DrafterSpec(draft=draft, spec=SpecConfig(mode="chain", gamma=4)))
    out = engine.generate(prompts, params)
    plain = EmbeddedEngine(tiny_model, EngineConfig(max_batch=2, max_len=64)).generate(prompts, params)
    assert engine.draft_faults == []
    assert max(split) == 2  # the mix that used to overflow did occur, and was fed in two groups
    assert [t.token_ids for t in out] == [t.token_ids for t in plain]
    assert [len(t.token_ids) for t in out] == [64 - n for n in (2, 40, 50)]  # every request ran to the context end
    assert all(t.spec.verify_steps > 0 for t in out)  # the late request was speculated too


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_context_end_sweep(tiny_model, one_thread, mode):
    """Prompt-length mixes from 1 token to one short of the context end, two and three slots,
    greedy and coupled sampling: no draft fault, tokens and log-probs identical to plain."""
    cfg = SpecConfig(mode="chain", gamma=4) if mode == "chain" else SpecConfig(mode="tree", gamma=3, tree_topk=3,
                                                                                tree_budget=8)
    mixes = [(2, 40, 50), (1, 63, 30), (60, 5, 62, 12), (33, 1, 58), (10, 55, 55, 3), (62, 2, 1, 61)]
    for i, lengths in enumerate(mixes):
        prompts, draft = _context_end_setup(tiny_model, lengths, seed=i)
        for batch in (2, 3):
            for temp in (0.0, 1.0):
                params = SamplingParams(temperature=temp, max_new_tokens=64, seed=i)
                engine = EmbeddedEngine(tiny_model, EngineConfig(max_batch=batch, max_len=64),
                                        drafter=DrafterSpec(draft=draft, spec=cfg))
                out = engine.generate(prompts, params)
                plain = EmbeddedEngine(tiny_model, EngineConfig(max_batch=batch, max_len=64)).generate(prompts, params)
                assert engine.draft_faults == [], (lengths, batch, temp, engine.draft_faults)
                assert [t.token_ids for t in out] == [t.token_ids for t in plain], (lengths, batch, temp)
                for a, b in zip(out, plain):
                    assert (a.logprobs - b.logprobs).abs().max().item() <= 1e-5


def test_fit_groups():
    from rollout.drafters.eagle3 import fit_groups

    assert fit_groups([0, 10, 20], [5, 3, 2], 69) == [[0, 1, 2]]  # everything fits: one forward
    assert fit_groups([60, 0], [4, 50], 69) == [[1], [0]]  # a deep slot beside a new long prompt
    groups = fit_groups([60, 0, 0, 55, 30], [4, 50, 10, 3, 30], 69)
    assert sorted(r for g in groups for r in g) == [0, 1, 2, 3, 4]
    for g in groups:
        assert max([60, 0, 0, 55, 30][r] for r in g) + max([4, 50, 10, 3, 30][r] for r in g) <= 69
    with pytest.raises(ValueError, match="overflow"):
        fit_groups([66], [4], 69)


# ---- failures inside a speculative step: the draft's fall back, the target's propagate --------------
def test_a_target_failure_is_raised_and_a_draft_failure_falls_back(tiny_model, one_thread, monkeypatch):
    """A verify forward of the target that raises is the target's failure, not a draft fault:
    generate raises it and no fault is recorded. A draft that raises still turns speculation off
    for the call, with the fault recorded and plain decoding's tokens."""
    prompts, draft = _context_end_setup(tiny_model, (5, 9, 3, 12))
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    plain = EmbeddedEngine(tiny_model, EngineConfig(max_batch=2)).generate(prompts, params)

    spec = DrafterSpec(draft=draft, spec=SpecConfig(mode="chain", gamma=3))
    engine = EmbeddedEngine(tiny_model, EngineConfig(max_batch=2), drafter=spec)
    forward = engine.forward

    def failing_verify(run, slots, ids, *args, **kwargs):
        if ids.shape[1] > 1:  # a verify block; plain decode blocks are one token wide
            raise RuntimeError("target forward failed")
        return forward(run, slots, ids, *args, **kwargs)

    monkeypatch.setattr(engine, "forward", failing_verify)
    with pytest.raises(RuntimeError, match="target forward failed"):
        engine.generate(prompts, params)
    assert engine.draft_faults == []
    monkeypatch.undo()

    engine = EmbeddedEngine(tiny_model, EngineConfig(max_batch=2), drafter=spec)
    break_draft(engine, monkeypatch)
    with pytest.warns(RuntimeWarning, match="draft failure"):
        out = engine.generate(prompts, params)
    assert engine.draft_faults == ["RuntimeError: draft forward failed"] and out.stats.spec_faults == 1
    assert [t.token_ids for t in out] == [t.token_ids for t in plain]


@pytest.mark.parametrize("capture", [False, True])
@pytest.mark.parametrize("sampling_mode", ["coupled", "rng"])
@pytest.mark.parametrize("mode", [None, "chain", "tree"])
def test_a_step_copies_to_and_from_the_device_only_where_documented(tiny_model, mode, sampling_mode, capture,
                                                                    monkeypatch):
    """A step's copies between host and device, by kind of step, all made by `rollout.transfer`
    (pinned host memory, never blocking the host): admitting prompts uploads their block once; a
    plain step uploads its host values (slots, last tokens, request ids, token counts) in one
    copy; a speculative step adds one for the draft's feed (per feed group), and a draft's
    admission of new prompts one more (its cache slots). With features captured, each forward
    downloads its rows' features once (two when prompts ride along), whatever the batch: never
    one copy per row. The hand-back of results is the step's one read (the tests above)."""
    from specrl.config import DraftTrainConfig
    from specrl.drafts import new_draft

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (5, 9, 3, 12, 7, 4, 10, 6)]
    seen: dict[str, set] = {}
    strays: list[str] = []

    def counting(name, kind):
        fn = getattr(EmbeddedEngine, name)
        sig = inspect.signature(fn)

        def wrapped(*args, **kwargs):
            traffic = _DeviceReads()
            with traffic.mode:
                out = fn(*args, **kwargs)
            fused = sig.bind(*args, **kwargs).arguments.get("prefill") is not None
            seen.setdefault(f"{kind} {'fused' if fused else 'alone'}", set()).add((traffic.up, traffic.moves))
            strays.extend(traffic.stray)
            return out
        monkeypatch.setattr(EmbeddedEngine, name, wrapped)

    counting("_decode_step", "plain")
    counting("_spec_step", "spec")
    counting("_run_prefill", "prefill")
    counting("_plan_prefill", "plan")
    spec = None
    if mode is not None:
        spec = DrafterSpec(draft=new_draft(tiny_model, prompts, DraftTrainConfig(draft_vocab_size=64)), spec=SpecConfig(mode, 3))
    engine = EmbeddedEngine(tiny_model, EngineConfig(max_batch=3, sampling_mode=sampling_mode), drafter=spec)
    engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=12, seed=2), capture_features=capture)
    draft, down = int(mode is not None), int(capture)
    step = "plain" if mode is None else "spec"
    expected = {"plan alone": (1, 0), "prefill fused": (draft, down),  # (a prefill on its own)
                f"{step} alone": (1 + draft, down), f"{step} fused": (1 + 2 * draft, 2 * down)}
    assert not strays
    assert seen == {k: {v} for k, v in expected.items()}
