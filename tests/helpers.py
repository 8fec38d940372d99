"""Helpers shared by several test files."""
import torch


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value) of observed counts against exact probs."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    n = counts.sum()
    if counts[probs <= 0].sum() > 0:  # emitted something the target can never emit
        return float("inf"), 0, 0.0
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big & (probs > 0)].sum()[None]])
    exp = torch.cat([expected[big], expected[~big & (probs > 0)].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = int(keep.sum()) - 1
    pval = torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2)
    return float(stat), df, float(pval)


# The tensor names SGLang's LlamaForCausalLMEagle3 loader expects (embeddings left out).
SGLANG_KEYS = {
    "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
    "norm.weight", "lm_head.weight", "d2t", "t2d",
}


# ---- tiny HuggingFace models and tokenizers, built offline (test_hf_target, test_trl_integration)
def tiny_hf_config(family: str, vocab_size: int = 96, **overrides):
    """A few-thousand-parameter config of an HF family the adapter supports (no download)."""
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=128, intermediate_size=48,
                  rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)
    kinds = {
        "qwen3_moe": (transformers.Qwen3MoeConfig, dict(moe, norm_topk_prob=True, mlp_only_layers=[0])),
        "qwen2_moe": (transformers.Qwen2MoeConfig, dict(moe, norm_topk_prob=False, decoder_sparse_step=2,
                                                         shared_expert_intermediate_size=40)),
        "mixtral": (transformers.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2)),
        "llama": (transformers.LlamaConfig, dict(attention_bias=True, tie_word_embeddings=True)),
        "qwen2": (transformers.Qwen2Config, {}),
        "qwen3": (transformers.Qwen3Config, {}),
    }
    cls, extra = kinds[family]
    return cls(**{**common, **extra, **overrides})


def tiny_hf_model(family: str, seed: int = 0, scale: float = 0.08, **overrides):
    """A random HF causal LM of `family` in fp32; every tensor (norms and biases too) perturbed so
    that no weight sits at a special value that would hide a conversion mistake."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_hf_config(family, **overrides))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model.float().eval()


def tiny_hf_tokenizer(vocab_size: int = 96):
    """A WordLevel tokenizer over "<pad> <bos> <eos> <unk> w4 .. w{V-1}", split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range(len(specials), vocab_size)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>")


# ---- the real pretrained target, SmolLM2-135M-Instruct (test_real_model, test_vllm_real_model)
REAL_QUESTIONS = ["What is 17 + 25?", "Name a colour of the sky.", "Write one word: hello"]
REAL_MAX_LEN = 128  # KV cache per slot: the model's own context (8192) would be attended over in full


def real_target(cache_dir=None):
    """(specrl model in fp32, HF tokenizer, chat prompts of REAL_QUESTIONS) of the real model,
    converted from its installed GGUF file (cached under `cache_dir`, else in memory)."""
    from target_training.real_models import load_real_target

    torch.set_num_threads(2)
    model, tok = load_real_target("smollm2-135m", cache_dir, log=lambda *a: None)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"]
               for q in REAL_QUESTIONS]
    return model, tok, prompts


def real_drafts(model, prompts, answers) -> dict:
    """{"random": an untrained EAGLE-3 draft, "fitted": one briefly trained on `answers` (the
    model's own greedy tokens after `prompts`)}, both over a draft vocabulary of those tokens."""
    from draft_models.train import capture_features, train_offline
    from specrl.config import DraftTrainConfig
    from specrl.drafts import new_draft

    seqs = [list(p) + list(a) for p, a in zip(prompts, answers)]
    masks = [[0] * len(p) + [1] * len(a) for p, a in zip(prompts, answers)]
    cfg = DraftTrainConfig(draft_vocab_size=1024, ttt_steps=2)  # the draft's vocabulary: the answers' tokens
    random_draft, fitted = new_draft(model, seqs, cfg), new_draft(model, seqs, cfg)
    data = capture_features(model, seqs, masks, batch_size=4, d2t=fitted.d2t, feature_dtype=torch.float32)
    train_offline(fitted, data, steps=40, lr=3e-3, batch_size=4, seed=0, ttt_steps=2, warmup=4)
    return {"random": random_draft, "fitted": fitted}


def rows_held_as(pattern, held, T: int, prompt_len: int, generator: torch.Generator, low: int = 3,
                 high: int = 64) -> torch.Tensor:
    """(len(pattern), T) random token rows whose prompts (their first `prompt_len` tokens) are held
    out exactly where `pattern` is True, as `held` (a FeatureBuffer's heldout_prompt) decides: a
    test that counts held-out and training rows gets the rows it counts on."""
    rows = []
    for want in pattern:
        while True:
            row = torch.randint(low, high, (T,), generator=generator)
            if held(row[:prompt_len]) == want:
                rows.append(row)
                break
    return torch.stack(rows)


def fill_buffer(cot, model, n: int = 8, T: int = 16, seed: int = 0, version: int = 0) -> None:
    """Put n random sequences of length T (second half as the response) into a co-trainer's
    feature buffer, through the same path as the policy trainer's log-prob forward; where the
    buffer holds prompts out, the first sequence's prompt is a held-out one and the others not."""
    g = torch.Generator().manual_seed(seed)
    device = model.embed_tokens.weight.device
    if cot.buffer.heldout_every:
        ids = rows_held_as([True] + [False] * (n - 1), cot.buffer.heldout_prompt, T, T // 2, g, high=60).to(device)
    else:
        ids = torch.randint(3, 60, (n, T), generator=g).to(device)
    with torch.no_grad():
        out = model(ids, tap_layers=model.cfg.feature_layer_ids)
    mask = torch.zeros(n, T, dtype=torch.bool, device=device)
    mask[:, T // 2:] = True
    cot.buffer.add_from_trainer_forward(ids, out.features(model.cfg.feature_layer_ids), out.logits, mask,
                                        cot.draft.d2t, version)


def overlap_pair(model):
    """Two co-trainers on the same model, draft (on the model's device) and data, sequential and
    overlapped: the same draft updates, run inline or as a burst on its own thread (CUDA stream)."""
    import copy

    from rollout.engine import EmbeddedEngine
    from rollout.drafters import SpecConfig
    from specrl.config import CoTrainConfig, DraftTrainConfig, OnlineDraftConfig, SchedulerConfig
    from specrl.cotrain import SpecCoTrainer
    from specrl.drafts import new_draft

    draft = new_draft(model, [[3, 4, 5, 6]], DraftTrainConfig(draft_vocab_size=64)).to(model.embed_tokens.weight.device)
    out = []
    for mode in ("sequential", "overlap"):
        cfg = CoTrainConfig(mode="online", spec=SpecConfig(gamma=3), min_buffer_records=1, max_draft_steps=3,
                            online=OnlineDraftConfig(batch_size=4),
                            scheduler=SchedulerConfig(budget_fraction=1.0, min_budget_s=600.0, windows=("between",),
                                                      mode=mode))
        cot = SpecCoTrainer(copy.deepcopy(draft), cfg).attach(EmbeddedEngine(model))
        cot.draft.set_target_embedding(model.embed_tokens)
        engine_draft(cot.engine).set_target_embedding(model.embed_tokens)
        fill_buffer(cot, model, n=12)
        out.append(cot)
    return out


# ---- the engine's own draft: the one place tests reach inside an engine (fault injection, probes) ---------
def engine_draft(engine):
    """The draft module an embedded engine speculates with (its own copy, made by install_draft)."""
    return engine._speculator.draft


def break_draft(engine, monkeypatch, message: str = "draft forward failed", once: bool = False) -> None:
    """Make the engine's draft raise RuntimeError(message) in its forward (a draft-side crash):
    in every forward, or in the next one only (`once`)."""
    draft = engine_draft(engine)
    forward = draft.forward

    def broken(*args, **kwargs):
        if once:
            draft.forward = forward
        raise RuntimeError(message)

    if once:
        draft.forward = broken
    else:
        monkeypatch.setattr(draft, "forward", broken)


class PerRunEngine:
    """A stand-in DraftReceiver with vLLM's capabilities (no step policy; a switch is a restart)
    that records what the co-trainer asks of it: the drafter it installs and every switch."""

    from rollout.protocol import EngineCapabilities

    capabilities = EngineCapabilities(drafters=("eagle3",), switch="restart")
    draft_version, draft_faults, speculating = 0, [], True

    def __init__(self):
        self.installed, self.switched = None, []

    def set_speculation(self, on):
        self.switched.append(on)

    def install_draft(self, drafter, policy=None):
        self.installed = (drafter, policy)

    def push_draft(self, weights, version):
        pass

    def draft_weights(self):
        return {}, 0
