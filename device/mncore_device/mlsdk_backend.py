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
* optimizers must be MLSDK's (`mlsdk.MNCoreSGD`, `MNCoreAdam`, `MNCoreAdamW`), as on MLSDK
  itself (the MN-Core optimizers package converts others). A learning rate changed
  on the host (a scheduler, a callback, `group["lr"] = x`) reaches the device before the next
  compiled call, through MLSDK's `MNCoreLRScheduler`;
* compiled calls return MLSDK's tensor proxies (`.cpu()`, `.item()`), as on MLSDK;
  `Context.to_host(outputs)` turns one call's outputs into host tensors in one pass.

`mlsdk` is imported when a backend object is created, never when this module is imported.
"""

from __future__ import annotations

import importlib
import inspect
import os
import shutil
import tempfile
import time
import warnings
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePath
from types import ModuleType
from typing import Any

import torch
from typing_extensions import override

from .compile_keywords import CompileKeywords, warn_unhonoured
from .context import Context, Role, StepFunction
from .device import Backend, MNDevice, mlsdk_available, mlsdk_missing_message
from .errors import MLSDKNotInstalledError, MNCoreError, RegistrationError
from .naming import optimizer_name_prefix, set_tensor_name
from .presets import PRESET_DIR
from .registry import device_optimizer_for
from .runtime.artifacts import CacheOptions
from .runtime.compiled import TensorProxy
from .runtime.specs import TensorSpec, check_input_keys, conform_input

# Where MLSDK's compile presets (debug.json, O0.json ... O4.json) live on SDK images; PFN's
# examples read $PRESET_OPTIONS_DIR first.
PRESET_DIR_ENV = "PRESET_OPTIONS_DIR"
DEFAULT_MLSDK_PRESET_DIR = "/opt/pfn/pfcomp/codegen/preset_options"

# mlsdk.Context.compile's codegen keyword, newest first.
CODEGEN_KEYWORDS = ("codegen_dir", "codegen_base_dir")

MLSDK_OPTIMIZERS = ("MNCoreSGD", "MNCoreAdam", "MNCoreAdamW")


def import_mlsdk() -> ModuleType:
    """PFN's `mlsdk` module, or an error that says what to install or fix."""
    if not mlsdk_available():  # not even the stand-in `mlsdk` counts
        raise MLSDKNotInstalledError(mlsdk_missing_message("The MLSDK backend"))
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


class MLSDKContext(Context, backend=Backend.MLSDK):
    """A device-layer Context backed by PFN's MLSDK (`mlsdk.Context`).

    Made by `Context(device)` for "mncore2:*" devices or with backend="mlsdk". The wrapped
    MLSDK objects are `sdk` (the module) and `sdk_context`, for what the device layer does not
    cover.
    """

    def __init__(self, device: MNDevice | str = "mncore2:auto", backend: str | None = None) -> None:
        super().__init__(device, backend)
        self.sdk = import_mlsdk()
        self.sdk_context = self.sdk.Context(self.sdk.MNDevice(str(self.device)))
        self._compile_keyword = compile_keyword(self.sdk)
        self._learning_rates: list[_DeviceLearningRates] = []
        sdk_proxy = getattr(self.sdk, "TensorProxy", None)
        if isinstance(sdk_proxy, type):  # isinstance(out, TensorProxy) holds for MLSDK's too
            TensorProxy.register(sdk_proxy)

    @override
    def _made_current(self) -> None:
        self.sdk.Context.switch_context(self.sdk_context)

    @override
    def _release(self) -> None:
        """`mlsdk.Context.invalidate()`, where this MLSDK has it."""
        invalidate = getattr(self.sdk_context, "invalidate", None)
        if invalidate is None:
            warn_unhonoured(
                "Context.invalidate()",
                "this MLSDK's Context has no invalidate(); its memory is freed when the "
                "Context is garbage-collected",
            )
            return
        invalidate()

    # --- registration --------------------------------------------------------------------

    @override
    def _backend_name(self, tensor: torch.Tensor) -> str | None:
        """The name MLSDK's own naming functions gave `tensor` (taken over as ours)."""
        get_sdk_name = getattr(self.sdk, "get_tensor_name", None)
        name = get_sdk_name(tensor) if get_sdk_name is not None else None
        if name is not None:
            set_tensor_name(tensor, name)
        return name

    @override
    def _add_tensor(self, name: str, tensor: torch.Tensor, role: Role) -> None:
        """Name `tensor` for MLSDK and register it (`mlsdk.Context.register_<role>`)."""
        get_sdk_name = getattr(self.sdk, "get_tensor_name", None)
        if get_sdk_name is None or get_sdk_name(tensor) != name:
            self.sdk.set_tensor_name(tensor, name)
        getattr(self.sdk_context, f"register_{role}")(tensor)

    @override
    def _add_optimizer(
        self, optimizer: torch.optim.Optimizer, new: list[tuple[str, torch.Tensor]]
    ) -> None:
        """Hand the prefix given to set_buffer_name_in_optimizer to MLSDK's function of that
        name, and register the optimizer's state with MLSDK (all of it, in one call)."""
        self.sdk.set_buffer_name_in_optimizer(optimizer, optimizer_name_prefix(optimizer))
        self.sdk_context.register_optimizer_buffers(optimizer)
        if optimizer not in self._optimizers:
            self._learning_rates.append(_DeviceLearningRates(optimizer))

    @override
    def _check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        base = getattr(self.sdk, "MNCoreOptimizer", None)
        kinds = (base,) if isinstance(base, type) else ()
        kinds += mlsdk_optimizer_classes(self.sdk)
        if not isinstance(optimizer, kinds):
            raise RegistrationError(
                f"register_optimizer_buffers: {type(optimizer).__module__}."
                f"{type(optimizer).__qualname__} is not an MLSDK optimizer. On the MLSDK backend "
                "the update runs in MLSDK's own optimizers (mlsdk.MNCoreSGD, MNCoreAdam, "
                "MNCoreAdamW), whose learning rate MLSDK can change on the device; convert it "
                "before the step function uses it (the MN-Core optimizers package's "
                "device_optimizer(context, optimizer) does)."
            )

    @override
    def device_values(self) -> list[torch.Tensor]:
        """The registered host tensors: MLSDK owns device memory; sizes and dtypes are equal."""
        return list(self._registered.values())

    @override
    def get_registered_value_proxy(self, tensor: torch.Tensor) -> Any:
        """MLSDK's proxy of a registered tensor's device value (`load_from`, explicit transfers)."""
        self._check_valid("get_registered_value_proxy")
        (tensor,) = self._require_registered([tensor])
        return self.sdk_context.get_registered_value_proxy(tensor)

    # --- host <-> device ------------------------------------------------------------------

    @override
    def synchronize(self, tensors: Iterable[torch.Tensor] | None = None) -> None:
        """Write the device's registered state into the host tensors.

        MLSDK synchronizes everything registered, so `tensors` only names what must be fresh.
        """
        self._check_valid("synchronize")
        self._require_registered(tensors or ())
        self.sdk_context.synchronize()

    # --- compilation ------------------------------------------------------------------------

    @override
    def _compile(
        self,
        function: StepFunction,
        inputs: Mapping[str, torch.Tensor],
        codegen_dir: str | os.PathLike[str] | None,
        options: Mapping[str, object] | None,
        cache_options: CacheOptions | Any,
        keywords: CompileKeywords,
    ) -> MLSDKCompiledFunction:
        """`mlsdk.Context.compile`, with this package's argument forms.

        codegen_dir: default, a new temporary directory (MLSDK always writes one), removed
            when the compiled function is garbage-collected.
        options: {"option_json": preset name or MLSDK preset file, other MLSDK options as is}.
        cache_options: mncore_device.CacheOptions or MLSDK's own.
        keywords: passed to MLSDK as given, where its compile takes them (else a warning).
        """
        start = time.perf_counter()
        temporary = tempfile.mkdtemp(prefix="mncore-codegen-") if codegen_dir is None else None
        path = self._storage_path(temporary or codegen_dir)
        kwargs: dict[str, Any] = self._sdk_keywords(keywords)
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
        result = MLSDKCompiledFunction(self, compiled, specs, time.perf_counter() - start)
        if temporary is not None:
            weakref.finalize(result, shutil.rmtree, temporary, ignore_errors=True)
        return result

    @override
    def load_codegen_dir(
        self, path: str | os.PathLike[str], *, trust_compiled_code: bool = False
    ) -> MLSDKCompiledFunction:
        """`mlsdk.Context.load_codegen_dir`: a function compiled earlier, without recompiling.

        trust_compiled_code concerns the emulator's codegen dirs; MLSDK loads its own."""
        del trust_compiled_code
        self._check_valid("load_codegen_dir")
        start = time.perf_counter()
        compiled = self.sdk_context.load_codegen_dir(self._storage_path(path))
        specs = _tensor_specs(getattr(compiled, "input_specs", None))
        return MLSDKCompiledFunction(self, compiled, specs, time.perf_counter() - start)

    def _sdk_keywords(self, keywords: CompileKeywords) -> dict[str, Any]:
        """The compile keywords this MLSDK's compile accepts; a warning for the others."""
        try:
            parameters = inspect.signature(self.sdk.Context.compile).parameters
        except (TypeError, ValueError):  # no signature: pass them all
            parameters = {}
            takes_any = True
        else:
            takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        result = {}
        for key, value in keywords.given().items():
            if key == "optimizers":  # the optimizers MLSDK runs (registry may have converted)
                value = [device_optimizer_for(o) for o in value]
            if takes_any or key in parameters:
                result[key] = value
            else:
                warn_unhonoured(
                    f"compile({key}=...)", "this MLSDK's Context.compile has no such keyword"
                )
        return result

    def _storage_path(self, path: Any) -> Any:
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
            return self.sdk.CacheOptions(
                str(cache_options.path),
                enable_app_cache=cache_options.enable_app_cache,
                enable_onnx_cache=cache_options.enable_onnx_cache,
                enable_codegen_cache=cache_options.enable_codegen_cache,
                enable_gpfn2obj_cache=cache_options.enable_gpfn2obj_cache,
            )
        return cache_options

    @override
    def push_learning_rates(self) -> None:
        self._push_learning_rates()

    def _push_learning_rates(self) -> None:
        """Before a compiled call: learning rates changed on the host go to the device."""
        for entry in self._learning_rates:
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
        if self.input_specs:
            check_input_keys(inputs, self.input_specs)
            inputs = {k: inputs[k] for k in self.input_specs}  # extra keys are ignored
            for key, spec in self.input_specs.items():
                value = inputs[key]
                if isinstance(value, torch.Tensor):
                    inputs[key] = conform_input(key, spec, value)
        elif not isinstance(inputs, Mapping):
            check_input_keys(inputs, {})
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


def mlsdk_optimizer_classes(sdk: ModuleType) -> tuple[type, ...]:
    """MLSDK's optimizer classes (those this `mlsdk` has)."""
    classes = (getattr(sdk, name, None) for name in MLSDK_OPTIMIZERS)
    return tuple(cls for cls in classes if isinstance(cls, type))
