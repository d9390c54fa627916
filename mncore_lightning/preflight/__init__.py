"""Preflight: what a LightningModule's compiled steps will be, before hardware time is spent.

`MNCorePreflight()` (a Trainer callback) and `python -m mncore_lightning.preflight
module.py:ClassName` run one batch of each stage through the strategy's TorchDynamo capture on
the emulator at O0, on copies, and report per hook what Dynamo captured: device calls per
step and graph breaks, guarded values, live inputs, tensor attributes read, what is replayed
on the host, re-compiles, op counts by kind, the device-memory peak, the static batch shapes,
what drop_last drops, and trace + compile time per preset. See docs/preflight.md.
"""

from .callback import MNCorePreflight, PreflightError
from .report import DataReport, GraphBreak, GuardedValue, HookReport, Memory, PreflightReport
from .run import run_preflight

__all__ = [
    "DataReport",
    "GraphBreak",
    "GuardedValue",
    "HookReport",
    "MNCorePreflight",
    "Memory",
    "PreflightError",
    "PreflightReport",
    "run_preflight",
]
