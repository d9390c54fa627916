"""Fixtures for the device-layer tests."""

from __future__ import annotations

import pytest
import torch

from mncore_device import Context
from tests.device.device_testing import new_context


@pytest.fixture(autouse=True)
def _seeded_single_threaded():
    """Every test starts from the same RNG state, and runs torch on one thread.

    One intra-op thread keeps these small models fast and steady on a shared 2-core
    machine, where OpenMP threads of concurrent processes slow each other down badly.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def context() -> Context:
    """A fresh emulated device (pfvm:cpu) context, made current."""
    return new_context()
