import pytest
import torch


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(1234)
