"""The same plugin for the standalone `pytorch_lightning` package (`import pytorch_lightning`).

Lightning ships its code twice, as `lightning.pytorch` and as `pytorch_lightning`, built from
one source by rewriting the imports; a Trainer of one refuses the other's classes. This module
does the same for the plugin: the modules that name Lightning are loaded a second time with
`lightning.pytorch` read as `pytorch_lightning` (and `lightning.fabric` as `lightning_fabric`),
as the package `mncore_lightning.pl`; everything else (optimizers, the update, the module's structure, the
device layer) is shared. It is done when `pytorch_lightning` is imported, before or after
`mncore_lightning` (never eagerly: importing the second package changes process-wide state, such
as which logger Lightning's rank-zero messages go to), so `pl.Trainer(accelerator="mncore")`
works as `lightning.Trainer(accelerator="mncore")` does.
"""

from __future__ import annotations

import importlib
import importlib.abc
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
    "steps.logs",
    "steps.update_logs",  # no Lightning name, but it loads steps.manual, which is mirrored
    "steps.hooks",
    "steps.groups",
    "steps.manual_host",
    "steps.manual",
    "strategy",
    "parallel.ddp",
    "lightning_patch",
)
# Free of Lightning: the same modules serve both packages.
_SHARED = (
    "device_selection",
    "optimizers",
    "optimizers._convert",
    "parallel.sync_batchnorm",
    "steps.manual_gradients",
    "steps.patches",
    "steps.update",
    "structure",
)
_SUBPACKAGES = ("steps", "parallel")
_RENAMES = (("lightning.pytorch", "pytorch_lightning"), ("lightning.fabric", "lightning_fabric"))


def install_when_imported() -> None:
    """Build `mncore_lightning.pl` now if pytorch_lightning is imported, else once it is."""
    if "pytorch_lightning" in sys.modules:
        install()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


class _AfterImport(importlib.abc.MetaPathFinder):
    """Lets `import pytorch_lightning` load as usual, then calls install()."""

    def find_spec(self, fullname: str, path: object = None, target: object = None):
        if fullname != "pytorch_lightning":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenInstall(spec.loader)
        return spec


class _ThenInstall(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.loader.exec_module(module)
        install()

    def __getattr__(self, name: str):  # resource readers and the like
        return getattr(self.loader, name)


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
    for name in _SUBPACKAGES:
        subpackage = types.ModuleType(f"{PACKAGE}.{name}")
        subpackage.__path__ = []
        subpackage.__package__ = subpackage.__name__
        sys.modules[subpackage.__name__] = subpackage
        setattr(package, name, subpackage)
    for name in _SHARED:
        _place(name, importlib.import_module(f"mncore_lightning.{name}"))
    here = Path(__file__).parent
    for name in _MIRRORED:
        path = here / f"{name.replace('.', '/')}.py"
        source = path.read_text()
        for old, new in _RENAMES:
            source = source.replace(old, new)
        module = types.ModuleType(f"{PACKAGE}.{name}")
        module.__file__ = str(path)
        module.__package__ = module.__name__.rpartition(".")[0]
        sys.modules[module.__name__] = module
        exec(compile(source, str(path), "exec"), module.__dict__)
        _place(name, module)
    package.MNCoreAccelerator = package.accelerator.MNCoreAccelerator
    package.MNCorePrecision = package.precision.MNCorePrecision
    package.MNCoreStrategy = package.strategy.MNCoreStrategy
    package.MNCoreDDPStrategy = package.parallel.ddp.MNCoreDDPStrategy
    package.lightning_patch.install()
    sys.modules["mncore_lightning"].pl = package
    return package


def _place(name: str, module: types.ModuleType) -> None:
    """`module` as `mncore_lightning.pl.<name>` (dotted: in its subpackage)."""
    sys.modules[f"{PACKAGE}.{name}"] = module
    parent, _, leaf = f"{PACKAGE}.{name}".rpartition(".")
    setattr(sys.modules[parent], leaf, module)
