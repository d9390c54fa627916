"""The changes this package makes inside Lightning's Trainer flags.

`accelerator="mncore"` picks MNCoreStrategy (MNCoreDDPStrategy for several devices or nodes):
Lightning gives an accelerator it does not know a CPU SingleDeviceStrategy
(`_AcceleratorConnector._choose_strategy`) and has no public hook for this choice, so that
method is wrapped. The connector's check of the flags is wrapped too, for what it would refuse
or silently ignore in an MN-Core strategy instance: one built for the other Lightning package
(`mncore_lightning.MNCoreStrategy()` given to `pytorch_lightning.Trainer`, as tutorials write
it) is rebuilt from its arguments for this one (an MNCoreAccelerator instance too), and a `precision=` flag next to an instance
whose precision plugin the Trainer chose before (the instance reused) applies, where Lightning
would keep the instance's plugin. Everything else goes through public hooks: the registries,
the strategy's `accelerator` setter and `setup`, the accelerator's `setup`.
tests/lightning/test_selection.py fails loudly if the wrapped methods change.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.connector import _convert_precision_to_unified_args
from lightning.pytorch.accelerators import Accelerator, AcceleratorRegistry
from lightning.pytorch.strategies import Strategy, StrategyRegistry
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from .accelerator import MNCoreAccelerator
from .parallel.ddp import MNCoreDDPStrategy
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
    check_flags = _AcceleratorConnector._check_config_and_set_final_flags

    def _check_config_and_set_final_flags(
        self: _AcceleratorConnector, strategy: Any, *args: Any, **kwargs: Any
    ) -> Any:
        strategy = for_this_lightning(strategy)
        accelerator = kwargs.get("accelerator")
        if type(accelerator).__name__ == "MNCoreAccelerator" and not isinstance(
            accelerator, Accelerator
        ):  # the other Lightning package's: it holds no state until setup
            kwargs["accelerator"] = MNCoreAccelerator()
        precision = kwargs.get("precision", args[1] if len(args) > 1 else None)
        if precision is not None and isinstance(strategy, (MNCoreStrategy, MNCoreDDPStrategy)):
            _reconcile_precision(strategy, _convert_precision_to_unified_args(precision))
        return check_flags(self, strategy, *args, **kwargs)

    _AcceleratorConnector._check_config_and_set_final_flags = _check_config_and_set_final_flags
    setattr(_AcceleratorConnector, _PATCHED, True)


def for_this_lightning(strategy: Any) -> Any:
    """An MN-Core strategy built for the other Lightning package (`lightning.pytorch` or
    `pytorch_lightning`, which refuse each other's classes) rebuilt, from the arguments it
    was made with, as this package's class of the same name; anything else as it is."""
    if isinstance(strategy, Strategy) or not hasattr(strategy, "_init_args"):
        return strategy
    ours = {cls.__name__: cls for cls in (MNCoreStrategy, MNCoreDDPStrategy)}
    cls = ours.get(type(strategy).__name__)
    args, kwargs = strategy._init_args
    foreign = [
        value
        for value in (*args, *kwargs.values())
        if type(value).__module__.split(".")[0]
        in ("lightning", "pytorch_lightning", "lightning_fabric")
    ]
    if cls is None or foreign:
        package = Strategy.__module__.split(".")[0]
        mirror = "mncore_lightning.pl" if package == "pytorch_lightning" else "mncore_lightning"
        raise ValueError(
            f"strategy={strategy!r} is a class of the {type(strategy).__module__} package, "
            f"built for the other Lightning package than this Trainer's ({package}); use "
            f"{mirror}.{type(strategy).__name__}(...) with this Trainer."
        )
    return cls(*args, **kwargs)


def _reconcile_precision(strategy: Any, flag: str) -> None:
    """The `precision=` flag next to a strategy instance that holds a precision plugin:
    Lightning keeps the instance's plugin and ignores the flag. A plugin the Trainer chose
    before (an instance reused) gives way to the flag; one passed to the strategy's
    constructor that disagrees with it is refused."""
    plugin = strategy._precision_plugin
    if plugin is None or plugin.precision == flag:
        return
    if not strategy._precision_given:
        strategy._precision_plugin = None  # the flag decides, through the setter
        return
    raise MisconfigurationException(
        f"Trainer(precision={flag!r}) disagrees with the precision plugin given to "
        f"{type(strategy).__name__}(precision_plugin={type(plugin).__name__}(...)), which "
        f"runs {plugin.precision!r}: pass one of them."
    )
