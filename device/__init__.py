"""mncore_device: an MLSDK-style device layer for MN-Core 2, with an emulated device.

A script written for PFN's MLSDK runs here after changing its import line and device
string: `MNDevice("pfvm:cpu")` (or "pfvm:cuda") is an emulated MN-Core whose compiled steps
are real static graphs, run by an interpreter or TorchInductor depending on the preset.
"""

from . import storage
from .artifacts import CacheOptions
from .compiled import CompiledFunction, InputProxy
from .context import Context, RegisteredValueProxy
from .device import BACKENDS, MNDevice, mlsdk_available, resolve_backend
from .errors import (
    InputSpecError,
    MLSDKNotInstalledError,
    MNCoreError,
    NonFiniteError,
    RegistrationError,
    StaticGraphError,
)
from .mlsdk_backend import (
    MLSDKCompiledFunction,
    MLSDKContext,
    device_optimizer,
    to_mlsdk_optimizer,
)
from .naming import (
    get_tensor_name,
    set_buffer_name_in_optimizer,
    set_tensor_name,
    set_tensor_name_in_module,
)
from .presets import PRESET_NAMES, load_preset, preset_path
from .specs import TensorSpec

__all__ = [
    "BACKENDS",
    "PRESET_NAMES",
    "CacheOptions",
    "CompiledFunction",
    "Context",
    "InputProxy",
    "InputSpecError",
    "MLSDKCompiledFunction",
    "MLSDKContext",
    "MLSDKNotInstalledError",
    "MNCoreError",
    "MNDevice",
    "NonFiniteError",
    "RegisteredValueProxy",
    "RegistrationError",
    "StaticGraphError",
    "TensorSpec",
    "device_optimizer",
    "get_tensor_name",
    "load_preset",
    "mlsdk_available",
    "preset_path",
    "resolve_backend",
    "set_buffer_name_in_optimizer",
    "set_tensor_name",
    "set_tensor_name_in_module",
    "storage",
    "to_mlsdk_optimizer",
]
