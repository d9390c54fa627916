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


@pytest.fixture
def make_fx_capture(monkeypatch):
    """The make_fx tracer (compiled_hooks.py) for the steps, instead of TorchDynamo: the tests
    of its hand-written interceptions (step counters, Python values, replayed side effects,
    batch values) pin it, since manual optimization and the hooks the Dynamo path hands
    back (captured_hooks.UseTracer) still run on it; test_dynamo_capture.py and
    test_captured_groups.py test the Dynamo path."""
    monkeypatch.setenv("MNCORE_CAPTURE", "trace")
