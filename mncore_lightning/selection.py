"""Make `Trainer(accelerator="mncore")` choose `MNCoreStrategy` and say which device it uses.

Lightning gives an accelerator it does not know a CPU SingleDeviceStrategy, and has no
plugin hook for this choice, so we wrap three connector/setup functions. These are the only
Lightning internals the package patches; tests/lightning/test_selection.py fails loudly if
they change.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer import setup as trainer_setup
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from .accelerator import MNCoreAccelerator
from .strategy import MNCoreStrategy

_PATCHED = "__mncore_patched__"


def _is_mncore(accelerator_flag: Any) -> bool:
    return accelerator_flag == "mncore" or isinstance(accelerator_flag, MNCoreAccelerator)


def install() -> None:
    """Register "mncore" and wrap the connector (idempotent)."""
    MNCoreAccelerator.register_accelerators(AcceleratorRegistry)
    MNCoreStrategy.register_strategies(StrategyRegistry)
    if getattr(_AcceleratorConnector, _PATCHED, False):
        return

    choose_strategy = _AcceleratorConnector._choose_strategy
    lazy_init_strategy = _AcceleratorConnector._lazy_init_strategy
    log_device_info = trainer_setup._log_device_info

    def _choose_strategy(self: _AcceleratorConnector) -> Any:
        if _is_mncore(self._accelerator_flag):
            return MNCoreStrategy()
        return choose_strategy(self)

    def _lazy_init_strategy(self: _AcceleratorConnector) -> None:
        lazy_init_strategy(self)
        _check_pairing(self.accelerator, self.strategy)

    def _log_device_info(trainer: Any) -> None:
        log_device_info(trainer)
        strategy = trainer.strategy
        used = isinstance(strategy, MNCoreStrategy)
        device = strategy.mncore_device if used else None
        backend = "MLSDK" if used and strategy.backend == "mlsdk" else "emulated"
        where = f" ({device}, {backend})" if used else ""
        rank_zero_info(f"MN-Core available: True{where}, used: {used}")

    _AcceleratorConnector._choose_strategy = _choose_strategy
    _AcceleratorConnector._lazy_init_strategy = _lazy_init_strategy
    trainer_setup._log_device_info = _log_device_info
    setattr(_AcceleratorConnector, _PATCHED, True)


def _check_pairing(accelerator: Any, strategy: Any) -> None:
    mncore_accelerator = isinstance(accelerator, MNCoreAccelerator)
    mncore_strategy = isinstance(strategy, MNCoreStrategy)
    if mncore_accelerator and not mncore_strategy:
        raise ValueError(
            f"accelerator='mncore' needs strategy='mncore' (or MNCoreStrategy(...)), got "
            f"{type(strategy).__name__}: MN-Core runs each training step as one compiled graph, "
            "which only MNCoreStrategy builds."
        )
    if mncore_strategy and not mncore_accelerator:
        raise ValueError(
            f"MNCoreStrategy needs accelerator='mncore', got {type(accelerator).__name__}: pass "
            "Trainer(accelerator='mncore', strategy=MNCoreStrategy(...))."
        )
