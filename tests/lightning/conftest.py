"""Every test in this folder: preset O0 on the emulated device, and the same RNG state."""

import pytest
import torch

from tests.lightning.lightning_testing import mncore_env


@pytest.fixture(autouse=True)
def _mncore_env():
    """Every test: mncore_env() and the same global RNG state."""
    with mncore_env():
        torch.manual_seed(0)
        yield
