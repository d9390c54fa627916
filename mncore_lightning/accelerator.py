"""`MNCoreAccelerator`: the "mncore" accelerator of Lightning's Trainer.

The LightningModule stays in host memory; device memory is managed by `MNCoreStrategy`
through a device-layer Context. So the accelerator's own work is small: it describes the
MN-Core devices and reports its statistics, read from the trainer's strategy.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.accelerators.cpu import get_cpu_stats
from typing_extensions import override


class MNCoreAccelerator(Accelerator):
    """MN-Core 2 devices (real, or emulated on CPU/CUDA); several run data parallel."""

    def __init__(self) -> None:
        super().__init__()
        self._trainer: Any = None  # set by setup(trainer), cleared at teardown

    @override
    def setup(self, trainer: Any) -> None:
        """Called from the strategy's setup: MN-Core steps are built by MNCoreStrategy only."""
        strategy = trainer.strategy
        if not hasattr(strategy, "device_stats"):  # the MN-Core strategies' interface
            raise ValueError(
                f"accelerator='mncore' needs strategy='mncore' or 'mncore_ddp' (MNCoreStrategy, "
                f"MNCoreDDPStrategy), got "
                f"{type(strategy).__name__}: MN-Core runs each training step as one compiled "
                "graph, which only the MN-Core strategies build."
            )
        self._trainer = trainer

    @override
    def setup_device(self, device: torch.device) -> None:
        """Device memory is set up by the strategy's Context; nothing to do on the host."""

    @override
    def teardown(self) -> None:
        self._trainer = None

    @property
    def stats_source(self) -> Any:
        """The strategy whose device counters `get_device_stats` reports (None outside fit)."""
        return self._trainer.strategy if self._trainer is not None else None

    @override
    @staticmethod
    def parse_devices(devices: Any) -> int:
        """How many MN-Core devices (one process each): an int, "N", or a list of indices."""
        if devices in ("auto", None):
            return 1
        if isinstance(devices, str) and devices.strip().isdigit():
            devices = int(devices)
        if isinstance(devices, (list, tuple)) and devices:
            if list(devices) != list(range(len(devices))):
                raise ValueError(
                    f"accelerator='mncore' got devices={devices!r}: local rank r drives device "
                    f"r, so a list must be [0, 1, ..., N-1]; pass devices={len(devices)}."
                )
            return len(devices)
        if isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1:
            return devices
        raise ValueError(
            f"accelerator='mncore' got devices={devices!r}: use a number of MN-Core devices "
            "(devices=2 runs one process per device, data parallel), a list of indices, or 'auto'."
        )

    @override
    @staticmethod
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        # The Trainer's root device is the host: the model and batches live there, and the
        # strategy moves them into MN-Core memory. One entry per device (per process).
        return [torch.device("cpu")] * MNCoreAccelerator.parse_devices(devices)

    @override
    @staticmethod
    def auto_device_count() -> int:
        return 1

    @override
    @staticmethod
    def is_available() -> bool:
        # The emulated device is always available; real hardware is chosen by the device string.
        return True

    @override
    @staticmethod
    def name() -> str:
        return "mncore"

    @override
    def get_device_stats(self, device: Any) -> dict[str, Any]:
        """Host CPU stats plus the MN-Core device's memory and call counters."""
        stats: dict[str, Any] = dict(get_cpu_stats())
        if self.stats_source is not None:
            stats.update(self.stats_source.device_stats())
        return stats

    @override
    @classmethod
    def register_accelerators(cls, accelerator_registry: Any) -> None:
        if "mncore" not in accelerator_registry:
            accelerator_registry.register(
                "mncore", cls, description="MN-Core 2 (real, or emulated on CPU/CUDA)"
            )
