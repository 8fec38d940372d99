"""The offline draft's stages show a progress bar with the time left on stderr when asked, none
when the caller passes progress=False, and none by default where stderr is not a terminal."""
from draft_models.train import train_offline
from specrl.config import DraftTrainConfig
from specrl.drafts import cached_offline_draft, new_draft
from specrl.rl_setup import encode_prompts

CFG = DraftTrainConfig(n_sequences=16, steps=6, batch_size=8, max_new_tokens=12, draft_vocab_size=32, ttt_steps=2)


def _inputs(sft_policy):
    tokenizer, task, policy, _ = sft_policy
    return policy, encode_prompts(tokenizer, task.examples("train", CFG.n_sequences, 7)), (tokenizer.eos_id,)


def test_each_offline_draft_stage_shows_its_progress_and_time_left(sft_policy, tmp_path, capsys):
    policy, prompts, stop = _inputs(sft_policy)
    cached_offline_draft(policy, prompts, CFG, stop, tmp_path, log=lambda *a: None, progress=True)
    err = capsys.readouterr().err
    for bar in ("draft rollouts: 100%", "draft features: 100%|", "16/16 [", "draft training: 100%|", "6/6 ["):
        assert bar in err
    assert "<00:00" in err  # elapsed<left


def test_no_bar_when_switched_off_or_not_on_a_terminal(sft_policy, tmp_path, capsys):
    policy, prompts, stop = _inputs(sft_policy)
    cached_offline_draft(policy, prompts, CFG, stop, tmp_path / "off", log=lambda *a: None, progress=False)
    cached_offline_draft(policy, prompts, CFG, stop, tmp_path / "auto", log=lambda *a: None)  # captured: no terminal
    assert capsys.readouterr().err == ""


def test_offline_training_is_silent_by_default(sft_policy, capsys):
    """A library call (the experiments' own loops) draws no bar unless asked."""
    from draft_models.train import capture_features

    policy, prompts, _ = _inputs(sft_policy)
    draft = new_draft(policy, prompts, CFG)
    data = capture_features(policy, prompts, None, batch_size=8, d2t=draft.d2t)
    assert len(train_offline(draft, data, steps=2, lr=1e-3, batch_size=4)) == 2
    assert capsys.readouterr().err == ""


def test_the_rl_steps_time_left_is_the_mean_step_so_far():
    """A drift run evaluates every 20 steps inside a step's callbacks: with an estimate from the
    last few steps (tqdm's default smoothing) the bar jumped to several times the run's length
    after each evaluation; the mean time per step so far counts the evaluations once each."""
    from specrl.train_rl import step_bar

    bar = step_bar(3, 100, progress=True)  # on stderr, which pytest captures
    assert bar.smoothing == 0 and bar.n == 3 and bar.total == 100
    bar.close()
