"""MLSDK's names in one place: `from mncore_lightning.mlsdk import ...` replaces `from mlsdk import ...`.

A script written for PFN's MLSDK runs on the emulator after changing its import line and
its device string ("mncore2:auto" -> "pfvm:cpu").
"""

from mncore_device import (
    CacheOptions,
    CompiledFunction,
    Context,
    MNDevice,
    get_tensor_name,
    set_buffer_name_in_optimizer,
    set_tensor_name,
    set_tensor_name_in_module,
    storage,
)

from .optimizers import MNCoreAdam, MNCoreAdamW, MNCoreSGD, device_optimizer

__all__ = [
    "CacheOptions",
    "CompiledFunction",
    "Context",
    "MNCoreAdam",
    "MNCoreAdamW",
    "MNCoreSGD",
    "MNDevice",
    "device_optimizer",
    "get_tensor_name",
    "set_buffer_name_in_optimizer",
    "set_tensor_name",
    "set_tensor_name_in_module",
    "storage",
]
