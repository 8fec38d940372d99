import pytest
import torch

from rollout.engine import EmbeddedEngine, EngineConfig, PromptTooLongError
from rollout.protocol import RolloutEngine, SamplingParams
from rollout.sampling import policy_logprobs, process_logits


def _reference_greedy(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_engine_implements_protocol(tiny_model):
    assert isinstance(EmbeddedEngine(tiny_model), RolloutEngine)


def test_greedy_matches_uncached_reference(tiny_model, prompts):
    engine = EmbeddedEngine(tiny_model, EngineConfig(max_batch=3))
    trajs = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12))
    for p, t in zip(prompts, trajs):
        assert t.token_ids == _reference_greedy(tiny_model, p, 12)
        assert t.finish_reason == "length"


@pytest.mark.parametrize("mode", ["coupled", "rng"])
def test_logprobs_and_features_match_full_forward(tiny_model, tiny_cfg, prompts, mode):
    engine = EmbeddedEngine(tiny_model, EngineConfig(max_batch=4, sampling_mode=mode))
    params = SamplingParams(temperature=0.8, top_k=20, max_new_tokens=15, stop_token_ids=(2,))
    for t in engine.generate(prompts, params, capture_features=True):
        out = tiny_model(torch.tensor([t.full_ids]), tap_layers=tiny_cfg.feature_layer_ids)
        P = len(t.prompt_ids)
        lp = policy_logprobs(out.logits[0, P - 1 : -1], 0.8).gather(-1, torch.tensor(t.token_ids)[:, None])[:, 0]
        assert (lp - t.logprobs).abs().max() <= 1e-5
        feats = out.features(tiny_cfg.feature_layer_ids)[0, :-1]
        assert t.features.shape == feats.shape and t.features.dtype == torch.float16
        assert torch.allclose(t.features.float(), feats, atol=2e-3, rtol=1e-2)
        # every sampled token lies inside the top-k set the policy sampled from
        allowed = process_logits(out.logits[0, P - 1 : -1], 0.8, top_k=20) > float("-inf")
        assert allowed.gather(-1, torch.tensor(t.token_ids)[:, None]).all()


def test_coupled_sampling_independent_of_batching(tiny_model, prompts):
    params = SamplingParams(temperature=1.0, max_new_tokens=20, stop_token_ids=(2,), seed=7)
    a = EmbeddedEngine(tiny_model, EngineConfig(max_batch=1)).generate(prompts, params, request_ids=range(100, 108))
    b = EmbeddedEngine(tiny_model, EngineConfig(max_batch=5)).generate(prompts[::-1], params,
                                                                       request_ids=range(107, 99, -1))
    assert [t.token_ids for t in a] == [t.token_ids for t in b[::-1]]
    c = EmbeddedEngine(tiny_model, EngineConfig(max_batch=5)).generate(
        prompts, SamplingParams(temperature=1.0, max_new_tokens=20, stop_token_ids=(2,), seed=8), request_ids=range(100, 108))
    assert [t.token_ids for t in a] != [t.token_ids for t in c]  # the seed matters


def test_rng_sampling_fresh_per_call_and_reproducible(tiny_model, prompts, one_thread):
    """rng mode keys each call's stream on the seed and the call's request ids: a constant seed
    with fresh ids (an RL loop's next step) draws fresh samples; the same seed and ids replay."""
    params = SamplingParams(temperature=1.0, max_new_tokens=20, seed=3)
    n = len(prompts)

    def tokens(engine, ids):
        return [t.token_ids for t in engine.generate(prompts, params, request_ids=ids)]

    engine = EmbeddedEngine(tiny_model, EngineConfig(max_batch=4, sampling_mode="rng"))
    first, again, later = tokens(engine, range(n)), tokens(engine, range(n)), tokens(engine, range(n, 2 * n))
    assert first == again
    assert later != first
    assert tokens(EmbeddedEngine(tiny_model, EngineConfig(max_batch=4, sampling_mode="rng")), range(n, 2 * n)) == later


def test_continuous_batching_refills_slots(tiny_model, prompts):
    """Stopping on a frequent token makes lengths uneven; all requests still finish correctly."""
    engine = EmbeddedEngine(tiny_model, EngineConfig(max_batch=2))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10)
    base = engine.generate(prompts, greedy)
    stop = base[0].token_ids[3]
    params = SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=(stop,))
    trajs = engine.generate(prompts, params)
    for b, t in zip(base, trajs):
        expect = b.token_ids[: b.token_ids.index(stop) + 1] if stop in b.token_ids else b.token_ids
        assert t.token_ids == expect
        assert t.finish_reason == ("stop" if stop in b.token_ids else "length")
    assert trajs.stats.engine_steps < sum(len(t.token_ids) for t in trajs)


def test_context_window_limits(tiny_model, tiny_cfg):
    engine = EmbeddedEngine(tiny_model)
    with pytest.raises(PromptTooLongError, match="context window"):
        engine.generate([[5] * tiny_cfg.max_seq_len], SamplingParams(max_new_tokens=4))
    t = engine.generate([[5] * (tiny_cfg.max_seq_len - 3)], SamplingParams(temperature=0.0, max_new_tokens=10))[0]
    assert len(t.token_ids) == 3 and t.finish_reason == "length"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[70]], SamplingParams())


@pytest.mark.parametrize("kw, match", [(dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
                                       (dict(max_new_tokens=0), "max_new_tokens"), (dict(top_k=-2), "top_k")])
def test_bad_sampling_params(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


@pytest.mark.parametrize("sampling_mode", ["coupled", "rng"])
def test_calls_without_request_ids_draw_fresh_samples_and_a_fresh_engine_replays_them(tiny_model, prompts,
                                                                                      sampling_mode):
    """Sampling is keyed by (seed, request id, token index): a call that passes no ids gets fresh
    ones from the engine's counter, so calling again on the same prompts draws fresh samples (an
    RL loop that passes no ids gets new answers every epoch), while a fresh engine replays the
    same sequence of calls, and pinned ids give the same samples again."""
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=3)

    def tokens(out):
        return [t.token_ids for t in out]

    engine = EmbeddedEngine(tiny_model, EngineConfig(max_batch=4, sampling_mode=sampling_mode))
    first, second = tokens(engine.generate(prompts, params)), tokens(engine.generate(prompts, params))
    assert first != second
    again = EmbeddedEngine(tiny_model, EngineConfig(max_batch=4, sampling_mode=sampling_mode))
    assert tokens(again.generate(prompts, params)) == first and tokens(again.generate(prompts, params)) == second
    pinned = [tokens(engine.generate(prompts, params, request_ids=range(len(prompts)))) for _ in range(2)]
    assert pinned[0] == pinned[1] == first  # ids 0..n-1: the first call's
