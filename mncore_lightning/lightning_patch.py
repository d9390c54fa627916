"""The one change this package makes inside Lightning: `accelerator="mncore"` picks MNCoreStrategy
(MNCoreDDPStrategy for several devices or nodes).

Lightning gives an accelerator it does not know a CPU SingleDeviceStrategy
(`_AcceleratorConnector._choose_strategy`) and has no public hook for this choice, so that one
method is wrapped. Everything else goes through public hooks: the registries, the strategy's
`accelerator` setter and `setup`, the accelerator's `setup`.
tests/lightning/test_selection.py fails loudly if the wrapped method changes.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

from .accelerator import MNCoreAccelerator
from .ddp import MNCoreDDPStrategy
from .strategy import MNCoreStrategy

_PATCHED = "__mncore_patched__"


def install() -> None:
    """Register "mncore" and wrap the connector's strategy choice (idempotent)."""
    MNCoreAccelerator.register_accelerators(AcceleratorRegistry)
    MNCoreStrategy.register_strategies(StrategyRegistry)
    MNCoreDDPStrategy.register_strategies(StrategyRegistry)
    if getattr(_AcceleratorConnector, _PATCHED, False):
        return
    choose_strategy = _AcceleratorConnector._choose_strategy

    def _choose_strategy(self: _AcceleratorConnector) -> Any:
        flag = self._accelerator_flag
        if flag == "mncore" or isinstance(flag, MNCoreAccelerator):
            if self._num_nodes_flag > 1 or len(self._parallel_devices) > 1:
                return MNCoreDDPStrategy()
            return MNCoreStrategy()
        return choose_strategy(self)

    _AcceleratorConnector._choose_strategy = _choose_strategy
    setattr(_AcceleratorConnector, _PATCHED, True)
