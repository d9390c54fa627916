"""MLSDK's names in one place: `from mncore_lightning.mlsdk import ...` replaces `from mlsdk import ...`.

A script written for PFN's MLSDK runs on the emulator after changing its import line and
its device string ("mncore2:auto" -> "pfvm:cpu"). The device-level names come from
`mncore_device`; the optimizers (torch-only code) from `mncore_lightning.optimizers`.
"""

from mncore_device import (
    CacheOptions,
    CompiledFunction,
    Context,
    IOSpec,
    MNCoreLRScheduler,
    MNDevice,
    TensorLike,
    TensorProxy,
    get_tensor_name,
    register_pytree_dataclass,
    register_pytree_namedtuple,
    set_buffer_name_in_optimizer,
    set_tensor_name,
    set_tensor_name_in_module,
    storage,
    trace_event,
    trace_scope,
)

from .optimizers import MNCoreAdam, MNCoreAdamW, MNCoreOptimizer, MNCoreSGD, device_optimizer

__all__ = [
    "CacheOptions",
    "CompiledFunction",
    "Context",
    "IOSpec",
    "MNCoreAdam",
    "MNCoreAdamW",
    "MNCoreLRScheduler",
    "MNCoreOptimizer",
    "MNCoreSGD",
    "MNDevice",
    "TensorLike",
    "TensorProxy",
    "device_optimizer",
    "get_tensor_name",
    "register_pytree_dataclass",
    "register_pytree_namedtuple",
    "set_buffer_name_in_optimizer",
    "set_tensor_name",
    "set_tensor_name_in_module",
    "storage",
    "trace_event",
    "trace_scope",
]
