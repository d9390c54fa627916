"""The same plugin for the standalone `pytorch_lightning` package (`import pytorch_lightning`).

Lightning ships its code twice, as `lightning.pytorch` and as `pytorch_lightning`, built from
one source by rewriting the imports; a Trainer of one refuses the other's classes. This module
does the same for the plugin: the modules that name Lightning are loaded a second time with
`lightning.pytorch` read as `pytorch_lightning` (and `lightning.fabric` as `lightning_fabric`),
as the package `mncore_lightning.pl`; everything else (optimizers, carried state, guards, the
device layer) is shared. `import mncore_lightning` does it when `pytorch_lightning` is installed,
so `pl.Trainer(accelerator="mncore")` works as `lightning.Trainer(accelerator="mncore")` does.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

PACKAGE = "mncore_lightning.pl"
# In dependency order; each names Lightning, so each is loaded again for pytorch_lightning.
_MIRRORED = (
    "accelerator",
    "precision",
    "data",
    "host_sync",
    "compiled_hooks",
    "strategy",
    "lightning_patch",
)
# Free of Lightning: the same modules serve both packages.
_SHARED = (
    "carried_state",
    "device_selection",
    "guards",
    "optimizers",
    "optimizers._convert",
    "side_effects",
    "step_counters",
)
_RENAMES = (("lightning.pytorch", "pytorch_lightning"), ("lightning.fabric", "lightning_fabric"))


def install() -> types.ModuleType | None:
    """Build and register `mncore_lightning.pl` if `pytorch_lightning` is installed."""
    if PACKAGE in sys.modules:
        return sys.modules[PACKAGE]
    if importlib.util.find_spec("pytorch_lightning") is None:
        return None
    package = types.ModuleType(PACKAGE, __doc__)
    package.__path__ = []
    package.__package__ = PACKAGE
    sys.modules[PACKAGE] = package
    for name in _SHARED:
        sys.modules[f"{PACKAGE}.{name}"] = importlib.import_module(f"mncore_lightning.{name}")
    here = Path(__file__).parent
    for name in _MIRRORED:
        path = here / f"{name}.py"
        source = path.read_text()
        for old, new in _RENAMES:
            source = source.replace(old, new)
        module = types.ModuleType(f"{PACKAGE}.{name}")
        module.__file__ = str(path)
        module.__package__ = PACKAGE
        sys.modules[module.__name__] = module
        exec(compile(source, str(path), "exec"), module.__dict__)
        setattr(package, name, module)
    package.MNCoreAccelerator = package.accelerator.MNCoreAccelerator
    package.MNCorePrecision = package.precision.MNCorePrecision
    package.MNCoreStrategy = package.strategy.MNCoreStrategy
    package.lightning_patch.install()
    sys.modules["mncore_lightning"].pl = package
    return package
