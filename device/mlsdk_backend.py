"""The MLSDK backend: the device layer's interface on top of PFN's installed `mlsdk`.

On an MN-Core machine, `Context("mncore2:auto")` (or `Context("pfvm:cpu", backend="mlsdk")`,
MLSDK's own virtual machine) returns an `MLSDKContext`. It has the emulator Context's methods
and follows MLSDK's programming model underneath:

* names: the device layer's names (`set_tensor_name_in_module(model, "model")`, ...) are
  handed to MLSDK's own naming functions when a tensor is registered, so a script names its
  tensors once, with either package's functions, and MLSDK sees the same names;
* registration, `synchronize()` and `get_registered_value_proxy(t).load_from(t)` forward to
  `mlsdk.Context`;
* `compile(function, inputs, codegen_dir, options=..., cache_options=...)` forwards to
  `mlsdk.Context.compile`, whose codegen keyword (`codegen_dir`, or `codegen_base_dir` in
  older SDKs) is read from its signature. Preset names ("O1") become MLSDK's preset files
  ($PRESET_OPTIONS_DIR, else /opt/pfn/pfcomp/codegen/preset_options);
* optimizers must be MLSDK's (`mlsdk.MNCoreSGD`, `MNCoreAdam`, `MNCoreAdamW`):
  `to_mlsdk_optimizer` converts torch.optim's and mncore_lightning's. A learning rate changed
  on the host (a scheduler, a callback, `group["lr"] = x`) reaches the device before the next
  compiled call, through MLSDK's `MNCoreLRScheduler`;
* compiled calls return MLSDK's tensor proxies (`.cpu()`, `.item()`), as on MLSDK;
  `MLSDKContext.to_host(outputs)` turns one call's outputs into host tensors in one pass.

`mlsdk` is imported when a backend object is created, never when this module is imported.
"""

from __future__ import annotations

import importlib
import inspect
import os
import tempfile
import time
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePath
from types import ModuleType
from typing import Any

import torch

from .artifacts import CacheOptions
from .compiled import _check_spec
from .context import Context, StepFunction
from .device import MLSDK_BACKEND, MNDevice, mlsdk_missing_message, resolve_backend
from .errors import InputSpecError, MLSDKNotInstalledError, MNCoreError, RegistrationError
from .naming import _optimizer_prefixes, get_tensor_name, name_optimizer_state, set_tensor_name
from .presets import PRESET_DIR
from .specs import TensorSpec

# Where MLSDK's compile presets (debug.json, O0.json ... O4.json) live on SDK images; PFN's
# examples read $PRESET_OPTIONS_DIR first.
PRESET_DIR_ENV = "PRESET_OPTIONS_DIR"
DEFAULT_MLSDK_PRESET_DIR = "/opt/pfn/pfcomp/codegen/preset_options"

# mlsdk.Context.compile's codegen keyword, newest first.
CODEGEN_KEYWORDS = ("codegen_dir", "codegen_base_dir")

_MLSDK_OPTIMIZERS = ("MNCoreSGD", "MNCoreAdam", "MNCoreAdamW")


def import_mlsdk() -> ModuleType:
    """PFN's `mlsdk` module, or an error that says what to install or fix."""
    try:
        return importlib.import_module("mlsdk")
    except ModuleNotFoundError as error:
        if error.name != "mlsdk":
            raise _broken_install(error) from error
        raise MLSDKNotInstalledError(mlsdk_missing_message("The MLSDK backend")) from error
    except ImportError as error:
        raise _broken_install(error) from error


def _broken_install(error: ImportError) -> MLSDKNotInstalledError:
    return MLSDKNotInstalledError(
        f"PFN's MLSDK is installed but could not be imported ({error}). MLSDK is built against "
        "the torch of its SDK image: run in the SDK's Python environment, with that torch."
    )


def compile_keyword(sdk: ModuleType) -> str | None:
    """The codegen keyword `mlsdk.Context.compile` takes; None: pass it positionally."""
    try:
        parameters = inspect.signature(sdk.Context.compile).parameters
    except (TypeError, ValueError):  # a compiled extension without a signature
        return None
    for keyword in CODEGEN_KEYWORDS:
        if keyword in parameters:
            return keyword
    return None


def mlsdk_preset_path(option_json: str | os.PathLike[str]) -> Path:
    """MLSDK's preset file for a preset name ("O1", "O1.json") or a preset file path.

    The emulator's own preset files (mncore_device.preset_path) are mapped by name too.
    """
    text = os.fspath(option_json)
    path = Path(text)
    if path.is_file() and path.resolve().parent != PRESET_DIR.resolve():
        return path
    directory = Path(os.environ.get(PRESET_DIR_ENV) or DEFAULT_MLSDK_PRESET_DIR)
    candidate = directory / f"{path.stem if text.endswith('.json') else text}.json"
    if not candidate.is_file():
        raise ValueError(
            f"compile preset {text!r}: MLSDK's preset file {candidate} does not exist. Give a "
            f"preset name that MLSDK ships (debug, O0 ... O4), the path of a preset JSON file, "
            f"or point ${PRESET_DIR_ENV} at MLSDK's preset_options directory."
        )
    return candidate


def outputs_to_host(outputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """One compiled call's outputs as host (CPU) tensors, converted in one pass.

    MLSDK returns tensor proxies; `.cpu()` copies one to the host (on "pfvm:cuda" it may still
    return a CUDA tensor, hence the second move). Plain tensors are moved if needed.
    """
    host = {}
    for key, value in outputs.items():
        tensor = value if isinstance(value, torch.Tensor) else value.cpu()
        host[key] = tensor if tensor.device.type == "cpu" else tensor.cpu()
    return host


class _HostLearningRates(torch.optim.lr_scheduler.LRScheduler):
    """A scheduler that keeps the learning rates the host has set.

    Wrapped in MLSDK's `MNCoreLRScheduler`, its step() changes nothing on the host, and
    MLSDK copies the optimizer's current learning rates to the device.
    """

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]


class _DeviceLearningRates:
    """The learning rates one registered optimizer has on the device."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.on_device = self.on_host()
        self.pusher: Any = None  # mlsdk.MNCoreLRScheduler, made on the first change

    def on_host(self) -> tuple[float, ...]:
        return tuple(float(group["lr"]) for group in self.optimizer.param_groups)


class MLSDKContext(Context):
    """A device-layer Context backed by PFN's MLSDK (`mlsdk.Context`).

    Made by `Context(device)` for "mncore2:*" devices or with backend="mlsdk". The wrapped
    MLSDK objects are `sdk` (the module) and `sdk_context`, for what the device layer does not
    cover.
    """

    def __init__(self, device: MNDevice | str = "mncore2:auto", backend: str | None = None) -> None:
        if resolve_backend(device, backend or MLSDK_BACKEND) != MLSDK_BACKEND:
            raise ValueError(f"MLSDKContext runs on MLSDK; use Context({str(device)!r}) instead")
        self.device = device if isinstance(device, MNDevice) else MNDevice(device)
        self.backend = MLSDK_BACKEND
        self.sdk = import_mlsdk()
        self.sdk_context = self.sdk.Context(self.sdk.MNDevice(str(self.device)))
        self._compile_keyword = compile_keyword(self.sdk)
        self._registered: dict[str, torch.Tensor] = {}
        self._names: dict[int, str] = {}
        self._optimizers: list[_DeviceLearningRates] = []

    def __repr__(self) -> str:
        return f"MLSDKContext(device={self.device})"

    def _made_current(self) -> None:
        self.sdk.Context.switch_context(self.sdk_context)

    # --- registration --------------------------------------------------------------------

    def register_param(self, param: torch.Tensor) -> None:
        """Name `param` for MLSDK and register it (`mlsdk.Context.register_param`)."""
        self._register(param, "param")

    def register_buffer(self, buffer: torch.Tensor) -> None:
        """Name `buffer` for MLSDK and register it (`mlsdk.Context.register_buffer`)."""
        self._register(buffer, "buffer")

    def register_optimizer_buffers(self, optimizer: torch.optim.Optimizer) -> None:
        """Register an MLSDK optimizer's state under the prefix given to
        set_buffer_name_in_optimizer (which is handed to MLSDK's function of that name)."""
        self._check_optimizer(optimizer)
        try:
            named = name_optimizer_state(optimizer)
        except ValueError as error:  # MLSDK's own function does not tell us the prefix
            raise ValueError(
                f"{error} (mncore_device's set_buffer_name_in_optimizer, which also names the "
                "buffers for MLSDK)"
            ) from None
        if any(entry.optimizer is optimizer for entry in self._optimizers) and all(
            self._registered.get(name) is tensor for name, tensor in named
        ):
            return
        for name, tensor in named:
            self._check_name_free(name, tensor, "optimizer")
        self.sdk.set_buffer_name_in_optimizer(optimizer, _optimizer_prefixes[optimizer])
        self.sdk_context.register_optimizer_buffers(optimizer)
        for name, tensor in named:
            self._remember(name, tensor)
        if not any(entry.optimizer is optimizer for entry in self._optimizers):
            self._optimizers.append(_DeviceLearningRates(optimizer))

    def _register(self, tensor: torch.Tensor, kind: str) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"register_{kind} expects a tensor, got {type(tensor).__name__}")
        name = self._name_of(tensor, kind)
        if self._registered.get(name) is tensor:
            return
        self._check_name_free(name, tensor, kind)
        get_sdk_name = getattr(self.sdk, "get_tensor_name", None)
        if get_sdk_name is None or get_sdk_name(tensor) != name:
            self.sdk.set_tensor_name(tensor, name)
        getattr(self.sdk_context, f"register_{kind}")(tensor)
        self._remember(name, tensor)

    def _name_of(self, tensor: torch.Tensor, kind: str) -> str:
        """The device layer's name of `tensor`, else the name MLSDK's functions gave it."""
        name = get_tensor_name(tensor)
        if name is None and hasattr(self.sdk, "get_tensor_name"):
            name = self.sdk.get_tensor_name(tensor)
            if name is not None:
                set_tensor_name(tensor, name)
        if name is None:
            raise RegistrationError(
                f"register_{kind}: a tensor of shape {list(tensor.shape)} has no name. Name it "
                "first: set_tensor_name_in_module(model, 'model'), "
                "set_buffer_name_in_optimizer(optimizer, 'optimizer') or set_tensor_name(t, name)."
            )
        return name

    def _check_name_free(self, name: str, tensor: torch.Tensor, kind: str) -> None:
        existing = self._registered.get(name)
        if existing is not None and existing is not tensor:
            raise RegistrationError(
                f"register_{kind}: the name {name!r} is already registered for another tensor; "
                "give each model its own prefix in set_tensor_name_in_module"
            )

    def _remember(self, name: str, tensor: torch.Tensor) -> None:
        self._registered[name] = tensor
        self._names[id(tensor)] = name

    def _check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        base = getattr(self.sdk, "MNCoreOptimizer", None)
        kinds = (base,) if isinstance(base, type) else ()
        kinds += tuple(
            cls
            for cls in (getattr(self.sdk, name, None) for name in _MLSDK_OPTIMIZERS)
            if isinstance(cls, type)
        )
        if not isinstance(optimizer, kinds):
            raise RegistrationError(
                f"register_optimizer_buffers: {type(optimizer).__module__}."
                f"{type(optimizer).__qualname__} is not an MLSDK optimizer. On the MLSDK backend "
                "the update runs in MLSDK's own optimizers (mlsdk.MNCoreSGD, MNCoreAdam, "
                "MNCoreAdamW), whose learning rate MLSDK can change on the device; convert with "
                "mncore_device.device_optimizer(context, optimizer) (or to_mlsdk_optimizer) "
                "before the step function uses it."
            )

    def is_registered(self, tensor: torch.Tensor) -> bool:
        name = self._names.get(id(tensor))
        return name is not None and self._registered.get(name) is tensor

    @property
    def registered_names(self) -> list[str]:
        return list(self._registered)

    def device_values(self) -> list[torch.Tensor]:
        """The registered host tensors: MLSDK owns device memory; sizes and dtypes are equal."""
        return list(self._registered.values())

    def get_registered_value_proxy(self, tensor: torch.Tensor) -> Any:
        """MLSDK's proxy of a registered tensor's device value (`load_from`, explicit transfers)."""
        if not self.is_registered(tensor):
            name = get_tensor_name(tensor)
            raise RegistrationError(
                f"tensor {name or list(tensor.shape)} is not registered in this Context"
            )
        return self.sdk_context.get_registered_value_proxy(tensor)

    # --- host <-> device ------------------------------------------------------------------

    def synchronize(self, tensors: Iterable[torch.Tensor] | None = None) -> None:
        """Write the device's registered state into the host tensors.

        MLSDK synchronizes everything registered, so `tensors` only names what must be fresh.
        """
        unknown = [t for t in tensors or () if not self.is_registered(t)]
        if unknown:
            name = get_tensor_name(unknown[0])
            raise RegistrationError(
                f"synchronize: tensor {name or list(unknown[0].shape)} is not registered in this "
                "Context"
            )
        self.sdk_context.synchronize()

    def load_from_host(self, tensors: Iterable[torch.Tensor] | None = None) -> None:
        """Push host values of registered tensors to the device (all, or `tensors`)."""
        for tensor in list(self._registered.values()) if tensors is None else tensors:
            self.get_registered_value_proxy(tensor).load_from(tensor)

    def to_host(self, outputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """One compiled call's outputs (MLSDK tensor proxies) as host tensors, in one pass."""
        return outputs_to_host(outputs)

    # --- compilation ------------------------------------------------------------------------

    def compile(
        self,
        function: StepFunction,
        inputs: Mapping[str, torch.Tensor],
        codegen_dir: str | os.PathLike[str] | None = None,
        options: Mapping[str, object] | None = None,
        cache_options: CacheOptions | Any = None,
    ) -> MLSDKCompiledFunction:
        """`mlsdk.Context.compile`, with this package's argument forms.

        codegen_dir: default, a new temporary directory (MLSDK always writes one).
        options: {"option_json": preset name or MLSDK preset file, other MLSDK options as is}.
        cache_options: mncore_device.CacheOptions or MLSDK's own.
        """
        start = time.perf_counter()
        path = self._storage_path(codegen_dir)
        kwargs: dict[str, Any] = {}
        sdk_options = self._sdk_options(options)
        if sdk_options:
            kwargs["options"] = sdk_options
        if cache_options is not None:
            kwargs["cache_options"] = self._sdk_cache_options(cache_options)
        if self._compile_keyword is None:
            compiled = self.sdk_context.compile(function, inputs, path, **kwargs)
        else:
            kwargs[self._compile_keyword] = path
            compiled = self.sdk_context.compile(function, inputs, **kwargs)
        specs = {k: TensorSpec.of(v) for k, v in inputs.items() if isinstance(v, torch.Tensor)}
        return MLSDKCompiledFunction(self, compiled, specs, time.perf_counter() - start)

    def load_codegen_dir(self, path: str | os.PathLike[str]) -> MLSDKCompiledFunction:
        """`mlsdk.Context.load_codegen_dir`: a function compiled earlier, without recompiling."""
        start = time.perf_counter()
        compiled = self.sdk_context.load_codegen_dir(self._storage_path(path))
        specs = _tensor_specs(getattr(compiled, "input_specs", None))
        return MLSDKCompiledFunction(self, compiled, specs, time.perf_counter() - start)

    def _storage_path(self, path: Any) -> Any:
        if path is None:
            path = tempfile.mkdtemp(prefix="mncore-codegen-")
        if isinstance(path, (str, PurePath)):
            return self.sdk.storage.path(str(path))
        return path  # already MLSDK's storage path

    def _sdk_options(self, options: Mapping[str, object] | None) -> dict[str, object]:
        result = dict(options or {})
        option_json = result.pop("option_json", None)
        if option_json is not None:
            result["option_json"] = str(mlsdk_preset_path(option_json))
        return result

    def _sdk_cache_options(self, cache_options: Any) -> Any:
        if isinstance(cache_options, CacheOptions):
            return self.sdk.CacheOptions(str(cache_options.path))
        return cache_options

    def _push_learning_rates(self) -> None:
        """Before a compiled call: learning rates changed on the host go to the device."""
        for entry in self._optimizers:
            on_host = entry.on_host()
            if on_host == entry.on_device:
                continue
            scheduler_class = getattr(self.sdk, "MNCoreLRScheduler", None)
            if scheduler_class is None:
                raise MNCoreError(
                    "the learning rate changed on the host, but this MLSDK has no "
                    "MNCoreLRScheduler to copy it to the device"
                )
            with warnings.catch_warnings():  # our no-op scheduler's order warnings are noise
                warnings.simplefilter("ignore", UserWarning)
                if entry.pusher is None:
                    entry.pusher = scheduler_class(
                        _HostLearningRates(entry.optimizer), self.sdk_context
                    )
                entry.pusher.step()
            entry.on_device = on_host


class MLSDKCompiledFunction:
    """An MLSDK compiled function, called as the emulator's: a dict of tensors (or MLSDK input
    proxies) in, a dict of MLSDK tensor proxies out."""

    def __init__(
        self,
        context: MLSDKContext,
        compiled: Any,
        input_specs: Mapping[str, TensorSpec],
        compile_seconds: float,
    ) -> None:
        self.sdk_function = compiled
        self._context = context
        self.input_specs = dict(input_specs)
        self.output_specs = _tensor_specs(getattr(compiled, "output_specs", None))
        self.device = context.device.torch_device
        self.compile_seconds = compile_seconds
        self.cache_hit = False

    def allocate_input_proxy(self) -> dict[str, Any]:
        """MLSDK's device-side input buffers (`proxy.load_from(tensor, clone=False)`)."""
        return self.sdk_function.allocate_input_proxy()

    def __call__(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        if not isinstance(inputs, Mapping):
            raise TypeError(
                f"a compiled function takes a dict of tensors, got {type(inputs).__name__}"
            )
        if self.input_specs:
            if set(inputs) != set(self.input_specs):
                raise InputSpecError(
                    f"compiled function called with inputs {sorted(inputs)}, but it was compiled "
                    f"for {sorted(self.input_specs)}: the keys must be those of the sample"
                )
            for key, spec in self.input_specs.items():
                value = inputs[key]
                if isinstance(value, torch.Tensor):
                    _check_spec(key, spec, value)
        self._context._push_learning_rates()
        return dict(self.sdk_function(inputs))


def _tensor_specs(specs: Any) -> dict[str, TensorSpec]:
    """MLSDK's input/output specs as TensorSpecs, where they carry a shape and a torch dtype."""
    result = {}
    for key, spec in dict(specs or {}).items():
        shape, dtype = getattr(spec, "shape", None), getattr(spec, "dtype", None)
        if shape is not None and isinstance(dtype, torch.dtype):
            result[key] = TensorSpec(tuple(int(n) for n in shape), dtype)
    return result


# --- optimizers ---------------------------------------------------------------------------

_HYPERPARAMETERS = {
    "sgd": ("lr", "momentum", "dampening", "weight_decay"),
    "adam": ("lr", "betas", "eps", "weight_decay"),
    "adamw": ("lr", "betas", "eps", "weight_decay"),
}
_UNSUPPORTED = {  # torch.optim options MLSDK's documented optimizers do not take
    "sgd": ("nesterov", "maximize", "differentiable"),
    "adam": ("amsgrad", "maximize", "differentiable"),
    "adamw": ("amsgrad", "maximize", "differentiable"),
}
_MLSDK_CLASS = {"sgd": "MNCoreSGD", "adam": "MNCoreAdam", "adamw": "MNCoreAdamW"}


def device_optimizer(context: Context, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer to register with `context` and step in its compiled functions.

    `optimizer` itself on the emulator; MLSDK's equivalent (`to_mlsdk_optimizer`) on MLSDK.
    Scripts that call it run unchanged on both backends.
    """
    if isinstance(context, MLSDKContext):
        return to_mlsdk_optimizer(optimizer, context.sdk)
    return optimizer


def to_mlsdk_optimizer(
    optimizer: torch.optim.Optimizer, sdk: ModuleType | None = None
) -> torch.optim.Optimizer:
    """MLSDK's optimizer (`mlsdk.MNCoreSGD`, `MNCoreAdam`, `MNCoreAdamW`) equivalent to a
    torch.optim SGD/Adam/AdamW or an mncore_lightning MN-Core optimizer.

    Same params, param groups and hyperparameters (extra group keys such as "initial_lr" are
    kept); state, if any, is loaded through load_state_dict. An MLSDK optimizer is returned as
    is. Options that MLSDK's optimizers do not document (nesterov, amsgrad, maximize) raise.
    """
    sdk = sdk or import_mlsdk()
    mlsdk_classes = tuple(
        cls for cls in (getattr(sdk, n, None) for n in _MLSDK_OPTIMIZERS) if isinstance(cls, type)
    )
    if mlsdk_classes and isinstance(optimizer, mlsdk_classes):
        return optimizer
    family = _family(optimizer)
    for group in optimizer.param_groups:
        for option in _UNSUPPORTED[family]:
            if group.get(option):
                raise ValueError(
                    f"cannot convert {type(optimizer).__name__}({option}=True) to "
                    f"mlsdk.{_MLSDK_CLASS[family]}: MLSDK's optimizer has no such option"
                )
    keys = _HYPERPARAMETERS[family]
    groups = [
        {"params": list(g["params"]), **{k: _number(g[k]) for k in keys}}
        for g in optimizer.param_groups
    ]
    target = getattr(sdk, _MLSDK_CLASS[family])
    if len(groups) == 1:
        converted = target(groups[0].pop("params"), **groups[0])
    else:
        converted = target(groups, **{k: _number(optimizer.defaults[k]) for k in keys})
    for new, old in zip(converted.param_groups, optimizer.param_groups):
        for key, value in old.items():
            if key not in new:
                new[key] = value
    state = optimizer.state_dict()["state"]
    if state:
        state_dict = converted.state_dict()
        state_dict["state"] = state
        converted.load_state_dict(state_dict)
    return converted


# mncore_lightning's re-implementations of torch.optim, by exact type (module, name), so that
# this layer needs no import of the Lightning package.
_OUR_EQUIVALENTS = {
    ("mncore_lightning.optimizers.sgd", "MNCoreSGD"): torch.optim.SGD,
    ("mncore_lightning.optimizers.adam", "MNCoreAdam"): torch.optim.Adam,
    ("mncore_lightning.optimizers.adam", "MNCoreAdamW"): torch.optim.AdamW,
}


def _family(optimizer: torch.optim.Optimizer) -> str:
    """ "sgd", "adam" or "adamw"; exact types only: a subclass may change the update rule."""
    kind = type(optimizer)
    torch_type = _OUR_EQUIVALENTS.get((kind.__module__, kind.__qualname__), kind)
    if torch_type is torch.optim.SGD:
        return "sgd"
    if torch_type in (torch.optim.Adam, torch.optim.AdamW):
        decoupled = torch_type is torch.optim.AdamW or optimizer.defaults.get(
            "decoupled_weight_decay", False
        )
        return "adamw" if decoupled else "adam"
    raise TypeError(
        f"cannot convert {type(optimizer).__module__}.{type(optimizer).__qualname__} to an "
        "MLSDK optimizer: supported are torch.optim.SGD, Adam, AdamW and mncore_lightning's "
        "MNCoreSGD, MNCoreAdam, MNCoreAdamW"
    )


def _number(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, (tuple, list)):
        return tuple(_number(v) for v in value)
    return value
