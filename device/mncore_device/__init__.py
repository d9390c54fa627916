"""mncore_device: an MLSDK-style device layer for MN-Core 2, with an emulated device.

A script written for PFN's MLSDK runs here after changing its import line and device
string: `MNDevice("pfvm:cpu")` (or "pfvm:cuda") is an emulated MN-Core whose compiled steps
are real static graphs, run by an interpreter or TorchInductor depending on the preset.
`Context(device)` returns the backend that runs the device: `EmulatorContext`, or
`MLSDKContext` on PFN's MLSDK.
"""

from . import storage
from ._source import add_library_dirs
from .automap import AutomapFunction, register_pytree_dataclass, register_pytree_namedtuple
from .compile_keywords import CompileKeywords
from .context import Context, Role
from .device import BACKENDS, Backend, MNDevice, mlsdk_available, resolve_backend
from .emulator import EmulatorContext, RegisteredValueProxy
from .errors import (
    CodegenDirError,
    ContextInvalidatedError,
    InductorFallbackWarning,
    InputSpecError,
    MLSDKNotInstalledError,
    MNCoreError,
    NonFiniteError,
    RegistrationError,
    StaticGraphError,
)
from .mlsdk_backend import MLSDKCompiledFunction, MLSDKContext
from .naming import (
    get_tensor_name,
    set_buffer_name_in_optimizer,
    set_tensor_name,
    set_tensor_name_in_module,
)
from .presets import DEFAULT_PRESET, PRESET_NAMES, load_preset, preset_path
from .registry import Registry, set_optimizer_converter
from .runtime.artifacts import CacheOptions
from .runtime.compiled import CompiledFunction, InputProxy, TensorLike, TensorProxy
from .runtime.specs import IOSpec, TensorSpec
from .scheduler import MNCoreLRScheduler
from .trace_events import trace_event, trace_scope

__all__ = [
    "AutomapFunction",
    "CompileKeywords",
    "IOSpec",
    "MNCoreLRScheduler",
    "Registry",
    "TensorLike",
    "TensorProxy",
    "register_pytree_dataclass",
    "register_pytree_namedtuple",
    "set_optimizer_converter",
    "trace_event",
    "trace_scope",
    "CodegenDirError",
    "ContextInvalidatedError",
    "BACKENDS",
    "DEFAULT_PRESET",
    "PRESET_NAMES",
    "Backend",
    "CacheOptions",
    "CompiledFunction",
    "Context",
    "EmulatorContext",
    "InductorFallbackWarning",
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
    "Role",
    "StaticGraphError",
    "TensorSpec",
    "add_library_dirs",
    "get_tensor_name",
    "load_preset",
    "mlsdk_available",
    "preset_path",
    "resolve_backend",
    "set_buffer_name_in_optimizer",
    "set_tensor_name",
    "set_tensor_name_in_module",
    "storage",
]
