"""profiler="simple": the actions a fit records (names and counts) are cpu's, although
backward, clipping and the update run inside the compiled step."""

from __future__ import annotations

import re

import lightning as L
import pytest
from lightning.pytorch.profilers import SimpleProfiler

from tests.lightning.lightning_testing import LitClassifier, loader, make_trainer


def _actions(accelerator: str, **kwargs) -> dict[str, int]:
    L.seed_everything(0, verbose=False)
    profiler = SimpleProfiler()
    trainer = make_trainer(accelerator, profiler=profiler, **kwargs)
    trainer.fit(LitClassifier(), loader(shuffle=True), loader(n=32))
    # the strategy's own class is in its actions' names: SingleDeviceStrategy / MNCoreStrategy
    return {
        re.sub(r"^\[Strategy\]\w+\.", "[Strategy].", name): len(durations)
        for name, durations in profiler.recorded_durations.items()
    }


@pytest.mark.parametrize("accumulate", [1, 2])
def test_simple_profiler_records_the_actions_cpu_records(accumulate):
    cpu = _actions("cpu", accumulate_grad_batches=accumulate)
    mn = _actions("mncore", accumulate_grad_batches=accumulate)
    assert mn == cpu
    clipping = [name for name in cpu if name.endswith(".configure_gradient_clipping")]
    assert clipping and cpu[clipping[0]] == 8 // accumulate  # 2 epochs of 4 batches
