import pytest
import torch

from logitless.models import qwen_tokenizer, tiny_qwen2


@pytest.fixture(scope="session")
def tokenizer():
    return qwen_tokenizer()


@pytest.fixture(scope="session")
def tiny_model():
    return tiny_qwen2(seed=0)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
