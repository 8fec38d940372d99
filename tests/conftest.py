import os

import pytest
import torch

from target_training.config import model_config_for

# Under pytest-xdist (tests/run.sh: one worker per core) each worker gets its share of the cores:
# the tests' models are tiny, and two workers of two intra-op threads each on 2 cores only contend.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture
def one_thread():
    """Tiny models: intra-op threads only add contention (much slower on a busy 2-core box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def tiny_cfg():
    return model_config_for("tiny", 64)


@pytest.fixture
def tiny_model(tiny_cfg):
    torch.manual_seed(0)
    return tiny_cfg.build().eval()


@pytest.fixture
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 64, (n,), generator=g).tolist() for n in (5, 9, 3, 12, 7, 4, 10, 6)]


@pytest.fixture(scope="session")
def sft_policy(tmp_path_factory):
    """The CI-preset SFT policy on the arith task (trained once per session, a few seconds)."""
    from specrl.presets import get_preset
    from specrl.rl_setup import build_task_and_policy

    cache = tmp_path_factory.mktemp("cache")
    tokenizer, task, policy, _ = build_task_and_policy("arith", get_preset("ci"), cache, log=lambda *a: None)
    return tokenizer, task, policy, cache


@pytest.fixture(scope="session")
def offline_draft(sft_policy):
    """A draft trained offline on the SFT policy's rollouts, so speculation accepts tokens."""
    from specrl.config import DraftTrainConfig
    from specrl.drafts import cached_offline_draft
    from specrl.rl_setup import encode_prompts

    tokenizer, task, policy, cache = sft_policy
    prompts = encode_prompts(tokenizer, task.examples("train", 256, 5))
    cfg = DraftTrainConfig(n_sequences=256, steps=120, batch_size=32, max_new_tokens=48)
    draft, _ = cached_offline_draft(policy, prompts, cfg, (tokenizer.eos_id,), cache, log=lambda *a: None)
    return draft
