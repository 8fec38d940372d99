import pytest
import torch

from target_training.config import model_config_for


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
