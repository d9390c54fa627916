"""`import mlsdk` where PFN's MLSDK is not installed: MLSDK's names on the emulated device.

PFN's example scripts (pfnet/mncore, sdk/examples) run unchanged but for the device string
("mncore2:auto" -> "pfvm:cpu"): `from mlsdk import Context, MNDevice, storage, ...` and
`from mlsdk.experimental.llm.kv_cache import ...` resolve to mncore-lightning's emulator.

This package never shadows the real MLSDK. It is installed (setup.cfg maps `mlsdk` to
compat/mlsdk) behind every sys.path entry: an editable install's finder comes after the
path finders, and PFN's SDK puts MLSDK on PYTHONPATH, ahead of site-packages. Should it be
found first all the same, importing it looks for PFN's MLSDK on the rest of sys.path and, if
there is one, imports that in its place: `import mlsdk` then gives the real module.
"""

import importlib.util as _util
import sys as _sys

from mncore_device.device import real_mlsdk_spec as _real_mlsdk_spec

_real = _real_mlsdk_spec()
if _real is not None and _real.loader is not None:  # PFN's MLSDK is installed: use it
    _module = _util.module_from_spec(_real)
    _sys.modules[__name__] = _module
    _real.loader.exec_module(_module)
else:
    from mncore_lightning.mlsdk import *  # noqa: F403 (MLSDK's names, listed there)
    from mncore_lightning.mlsdk import __all__  # noqa: F401
