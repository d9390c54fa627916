"""A fake of PFN's `mlsdk`, for testing the MLSDK backend on machines without MN-Core.

It has the public surface that /work/shared/reference/mlsdk.md and PFN's examples
(pfnet/mncore, sdk/examples) document, and checks it strictly: every function has an explicit
signature (an unknown keyword is a TypeError), argument types are checked, and names must be
given before registration. Every call is recorded in `call_log` as `Call(name, args)`.
Underneath, everything runs on this repository's emulator (`mncore_device`, "pfvm:cpu").

How the fake models what MLSDK does (where the reference leaves it open, the assumption is
marked "fake:"):

* names live in the fake's own table: `set_tensor_name`, `set_tensor_name_in_module`,
  `set_buffer_name_in_optimizer`. `register_param`/`register_buffer` refuse an unnamed
  tensor; `register_optimizer_buffers` refuses an optimizer without a buffer name prefix.
* fake: `register_optimizer_buffers` takes only MLSDK optimizers (`MNCoreOptimizer`s).
* `Context.compile(function, inputs, codegen_dir, options=None, cache_options=None)`.
  With $FAKE_MLSDK_COMPILE_KEYWORD=codegen_base_dir at import, the older SDKs' keyword
  `codegen_base_dir` replaces `codegen_dir`. codegen_dir must be a `storage.path(...)`;
  options may hold "option_json" (the path of an existing preset JSON file; the fake's files
  name the emulator preset to run) and "float_dtype" (a str); cache_options a `CacheOptions`.
  fake: compile needs its context to be the current one (PFN's examples always switch first).
* Compiled calls return `TensorProxy`s: `.cpu()` (a host copy; recorded as
  "TensorProxy.cpu"), `.item()`, `.load_from(tensor, clone=True)`. A proxy is not a tensor:
  arithmetic on it, or logging it, fails.
* Optimizers `MNCoreSGD(params, lr, momentum, dampening, weight_decay)` and
  `MNCoreAdam` / `MNCoreAdamW(params, *, lr, betas, eps, weight_decay)` (keyword-only: fake)
  run mncore_lightning's update. Their hyperparameters live on the device: registration
  copies them there, and a host-side change (`group["lr"] = x`, a torch scheduler) does NOT
  reach the device until `MNCoreLRScheduler(torch_scheduler, context).step()` runs: it steps
  the torch scheduler, then copies the optimizer's hyperparameters to the device.
* `synchronize()` copies parameters, buffers and optimizer state back to the host.

Test-only hooks (not MLSDK API): `call_log`, `record_event(name, **args)` (put an outside
event, e.g. "checkpoint written", on the same timeline), `Context._device_value(tensor)`
(a registered tensor's device value).
"""

from __future__ import annotations

import json
import os
import types
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

import mncore_device as _emu
from mncore_device.naming import name_optimizer_state as _emu_optimizer_state
from mncore_lightning.optimizers import MNCoreAdam as _Adam
from mncore_lightning.optimizers import MNCoreAdamW as _AdamW
from mncore_lightning.optimizers import MNCoreSGD as _SGD

COMPILE_KEYWORD = os.environ.get("FAKE_MLSDK_COMPILE_KEYWORD", "codegen_dir")
if COMPILE_KEYWORD not in ("codegen_dir", "codegen_base_dir"):
    raise ImportError(f"fake mlsdk: unknown FAKE_MLSDK_COMPILE_KEYWORD {COMPILE_KEYWORD!r}")

_DEVICES = ("mncore2:auto", *(f"mncore2:{i}" for i in range(8)), "pfvm:cpu", "pfvm:cuda", "emu2")
_COMPILE_OPTIONS = ("option_json", "float_dtype")


# --- the call log ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    name: str
    args: dict[str, Any] = field(default_factory=dict)


call_log: list[Call] = []


def record_event(event: str, /, **args: Any) -> None:
    """Test hook: put an event on the call log's timeline."""
    call_log.append(Call(event, args))


def _expect(value: Any, kinds: type | tuple[type, ...], what: str) -> None:
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in _tuple(kinds)):
        names = " or ".join(k.__name__ for k in _tuple(kinds))
        raise TypeError(f"mlsdk: {what} must be {names}, got {type(value).__name__}")


def _tuple(kinds: type | tuple[type, ...]) -> tuple[type, ...]:
    return kinds if isinstance(kinds, tuple) else (kinds,)


def _number(value: Any, what: str) -> float:
    _expect(value, (int, float), what)
    return float(value)


# --- devices and storage ----------------------------------------------------------------------


class MNDevice:
    def __init__(self, device_str: str) -> None:
        _expect(device_str, str, "MNDevice(device_str)")
        if device_str not in _DEVICES:
            raise ValueError(f"mlsdk: unknown device {device_str!r}")
        record_event("MNDevice", device=device_str)
        self.device_str = device_str
        self._emulated = "pfvm:cuda" if device_str == "pfvm:cuda" else "pfvm:cpu"

    def __repr__(self) -> str:
        return f"MNDevice({self.device_str!r})"


class _StoragePath(os.PathLike):
    """What `storage.path` returns: path-like, `/` joins, works with torch.save."""

    def __init__(self, location: str) -> None:
        self._location = location

    def __truediv__(self, other: str) -> _StoragePath:
        _expect(other, str, "storage path / name")
        return _StoragePath(os.path.join(self._location, other))

    def __fspath__(self) -> str:
        return self._location

    def __str__(self) -> str:
        return self._location

    def __repr__(self) -> str:
        return f"storage.path({self._location!r})"


def _storage_path(location: str) -> _StoragePath:
    _expect(location, str, "storage.path(location)")
    record_event("storage.path", location=location)
    return _StoragePath(location)


storage = types.SimpleNamespace(path=_storage_path)


class CacheOptions:
    def __init__(
        self,
        cache_dir: str,
        *,
        enable_app_cache: bool = True,
        enable_onnx_cache: bool = True,
        enable_codegen_cache: bool = True,
        enable_gpfn2obj_cache: bool = True,
    ) -> None:
        _expect(cache_dir, str, "CacheOptions(cache_dir)")
        for flag in (enable_app_cache, enable_onnx_cache, enable_codegen_cache):
            _expect(flag, bool, "a CacheOptions flag")
        _expect(enable_gpfn2obj_cache, bool, "a CacheOptions flag")
        record_event("CacheOptions", cache_dir=cache_dir)
        self.cache_dir = cache_dir


# --- names ----------------------------------------------------------------------------------------

_names: WeakIdKeyDictionary = WeakIdKeyDictionary()
_optimizer_prefixes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def set_tensor_name(tensor: torch.Tensor, name: str) -> None:
    _expect(tensor, torch.Tensor, "set_tensor_name(tensor)")
    _expect(name, str, "set_tensor_name(name)")
    record_event("set_tensor_name", name=name)
    _names[tensor] = name


def get_tensor_name(tensor: torch.Tensor) -> str | None:
    _expect(tensor, torch.Tensor, "get_tensor_name(tensor)")
    record_event("get_tensor_name", name=_names.get(tensor))
    return _names.get(tensor)


def set_tensor_name_in_module(module: torch.nn.Module, prefix: str) -> None:
    _expect(module, torch.nn.Module, "set_tensor_name_in_module(module)")
    _expect(prefix, str, "set_tensor_name_in_module(prefix)")
    record_event("set_tensor_name_in_module", prefix=prefix)
    tensors = [*module.named_parameters(), *module.named_buffers()]
    for path, tensor in tensors:
        _names[tensor] = f"{prefix}@{path.replace('.', '/')}"


def set_buffer_name_in_optimizer(optimizer: torch.optim.Optimizer, prefix: str) -> None:
    _expect(optimizer, torch.optim.Optimizer, "set_buffer_name_in_optimizer(optimizer)")
    _expect(prefix, str, "set_buffer_name_in_optimizer(prefix)")
    record_event("set_buffer_name_in_optimizer", prefix=prefix)
    _optimizer_prefixes[optimizer] = prefix


# --- optimizers ---------------------------------------------------------------------------------


class MNCoreOptimizer:
    """Base class of MLSDK's optimizers."""


class MNCoreSGD(MNCoreOptimizer, _SGD):
    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
    ) -> None:
        values = {"lr": lr, "momentum": momentum, "dampening": dampening}
        values["weight_decay"] = weight_decay
        for name, value in values.items():
            _number(value, f"MNCoreSGD({name})")
        record_event("MNCoreSGD", **values)
        _SGD.__init__(self, params, lr, momentum, dampening, weight_decay)


def _adam_arguments(cls: str, lr: Any, betas: Any, eps: Any, weight_decay: Any) -> dict:
    _number(lr, f"{cls}(lr)")
    _expect(betas, tuple, f"{cls}(betas)")
    if len(betas) != 2:
        raise ValueError(f"mlsdk: {cls}(betas) must hold two numbers")
    for beta in betas:
        _number(beta, f"{cls}(betas[i])")
    _number(eps, f"{cls}(eps)")
    _number(weight_decay, f"{cls}(weight_decay)")
    values = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
    record_event(cls, **values)
    return values


class MNCoreAdam(MNCoreOptimizer, _Adam):
    def __init__(
        self,
        params: Any,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        _Adam.__init__(self, params, **_adam_arguments("MNCoreAdam", lr, betas, eps, weight_decay))


class MNCoreAdamW(MNCoreOptimizer, _AdamW):
    def __init__(
        self,
        params: Any,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        values = _adam_arguments("MNCoreAdamW", lr, betas, eps, weight_decay)
        _AdamW.__init__(self, params, **values)


class MNCoreLRScheduler:
    """Steps a torch scheduler, then copies its optimizer's hyperparameters to the device."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler, context: Context) -> None:
        _expect(scheduler, torch.optim.lr_scheduler.LRScheduler, "MNCoreLRScheduler(scheduler)")
        _expect(context, _ContextBase, "MNCoreLRScheduler(context)")
        if scheduler.optimizer not in context._coefficients:
            raise ValueError(
                "mlsdk: MNCoreLRScheduler: the scheduler's optimizer is not registered in this "
                "context (register_optimizer_buffers)"
            )
        record_event("MNCoreLRScheduler", scheduler=type(scheduler).__name__)
        self.scheduler = scheduler
        self.context = context

    def step(self, *args: Any, **kwargs: Any) -> None:
        self.scheduler.step(*args, **kwargs)
        optimizer = self.scheduler.optimizer
        record_event("MNCoreLRScheduler.step", lrs=[g["lr"] for g in optimizer.param_groups])
        self.context._push_hyperparameters(optimizer)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)


# --- tensor proxies ---------------------------------------------------------------------------------


class TensorProxy:
    """A device tensor: `.cpu()`, `.item()`, `.load_from(tensor, clone=True)`; not a tensor."""

    def __init__(self, name: str, backing: Any, device: str) -> None:
        self._name = name
        self._backing = backing  # a tensor, an emulator InputProxy or RegisteredValueProxy
        self._device = device

    def _value(self) -> torch.Tensor:
        backing = self._backing
        if isinstance(backing, torch.Tensor):
            return backing
        if isinstance(backing, _emu.InputProxy):
            return backing.tensor
        return backing.cpu()

    def cpu(self) -> torch.Tensor:
        record_event("TensorProxy.cpu", name=self._name)
        value = self._value().detach().clone()
        # As on MLSDK, on "pfvm:cuda" the "host" copy can still be a CUDA tensor.
        return value if self._device == "pfvm:cuda" else value.cpu()

    def item(self) -> Any:
        record_event("TensorProxy.item", name=self._name)
        return self._value().item()

    def load_from(self, tensor: torch.Tensor | TensorProxy, clone: bool = True) -> None:
        _expect(tensor, (torch.Tensor, TensorProxy), "load_from(tensor)")
        _expect(clone, bool, "load_from(clone)")
        record_event("TensorProxy.load_from", name=self._name, clone=clone)
        value = tensor._value() if isinstance(tensor, TensorProxy) else tensor
        if isinstance(self._backing, torch.Tensor):
            self._backing = value.detach().clone() if clone else value
        else:
            self._backing.load_from(value, clone=clone)

    def __repr__(self) -> str:
        return f"TensorProxy({self._name!r})"


@dataclass(frozen=True)
class IOSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


class CompiledFunction:
    def __init__(self, context: _ContextBase, emulated: Any) -> None:
        self._context = context
        self._emulated = emulated
        self.input_specs = {k: IOSpec(s.shape, s.dtype) for k, s in emulated.input_specs.items()}
        self.output_specs = {k: IOSpec(s.shape, s.dtype) for k, s in emulated.output_specs.items()}

    def allocate_input_proxy(self) -> dict[str, TensorProxy]:
        record_event("CompiledFunction.allocate_input_proxy")
        device = self._context.device.device_str
        return {
            key: TensorProxy(f"input/{key}", proxy, device)
            for key, proxy in self._emulated.allocate_input_proxy().items()
        }

    def __call__(self, inputs: Mapping[str, torch.Tensor | TensorProxy]) -> dict[str, TensorProxy]:
        _expect(inputs, Mapping, "a compiled function's inputs")
        arguments = {}
        for key, value in inputs.items():
            _expect(key, str, "an input name")
            _expect(value, (torch.Tensor, TensorProxy), f"input {key!r}")
            if isinstance(value, TensorProxy):
                value = (
                    value._backing
                    if isinstance(value._backing, _emu.InputProxy)
                    else value._value()
                )
            arguments[key] = value
        record_event(
            "CompiledFunction.__call__",
            inputs=sorted(inputs),
            updates_state=bool(self._emulated.updated_state_names),
        )
        device = self._context.device.device_str
        outputs = self._emulated(arguments)
        return {key: TensorProxy(f"output/{key}", value, device) for key, value in outputs.items()}


# --- contexts ----------------------------------------------------------------------------------------


class _ContextBase:
    _current: _ContextBase | None = None

    def __init__(self, device: MNDevice) -> None:
        _expect(device, MNDevice, "Context(device)")
        record_event("Context", device=device.device_str)
        self.device = device
        self._emulator = _emu.Context(_emu.MNDevice(device._emulated))
        self._synchronized: dict[int, torch.Tensor] = {}
        self._coefficients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @staticmethod
    def switch_context(context: _ContextBase) -> None:
        _expect(context, _ContextBase, "Context.switch_context(context)")
        record_event("Context.switch_context", device=context.device.device_str)
        _ContextBase._current = context

    @staticmethod
    def get_current_context() -> _ContextBase | None:
        return _ContextBase._current

    # registration

    def register_param(self, param: torch.Tensor) -> None:
        self._register(param, "param")

    def register_buffer(self, buffer: torch.Tensor) -> None:
        self._register(buffer, "buffer")

    def _register(self, tensor: torch.Tensor, kind: str) -> None:
        _expect(tensor, torch.Tensor, f"register_{kind}(tensor)")
        name = _names.get(tensor)
        if name is None:
            raise ValueError(
                f"mlsdk: register_{kind}: the tensor (shape {list(tensor.shape)}) has no name; "
                "call mlsdk.set_tensor_name_in_module or mlsdk.set_tensor_name first"
            )
        record_event(f"Context.register_{kind}", name=name)
        self._to_emulator(tensor, name, kind)
        self._synchronized[id(tensor)] = tensor

    def _to_emulator(self, tensor: torch.Tensor, name: str, kind: str) -> None:
        if _emu.get_tensor_name(tensor) != name:
            _emu.set_tensor_name(tensor, name)
        getattr(self._emulator, f"register_{kind}")(tensor)

    def register_optimizer_buffers(self, optimizer: MNCoreOptimizer) -> None:
        _expect(optimizer, MNCoreOptimizer, "register_optimizer_buffers(optimizer)")
        prefix = _optimizer_prefixes.get(optimizer)
        if prefix is None:
            raise ValueError(
                "mlsdk: register_optimizer_buffers: call "
                "mlsdk.set_buffer_name_in_optimizer(optimizer, prefix) first"
            )
        _emu.set_buffer_name_in_optimizer(optimizer, prefix)
        state = _emu_optimizer_state(optimizer)
        record_event(
            "Context.register_optimizer_buffers", prefix=prefix, names=[n for n, _ in state]
        )
        for name, tensor in state:
            _names[tensor] = name
        self._emulator.register_optimizer_buffers(optimizer)
        for _, tensor in state:
            self._synchronized[id(tensor)] = tensor
        coefficients = []
        for index, group in enumerate(optimizer.param_groups):
            for key, tensor in group.tensors.items():
                self._to_emulator(tensor, f"{prefix}@group{index}/{key}", "buffer")
                coefficients.append(tensor)
        self._coefficients[optimizer] = coefficients

    def _push_hyperparameters(self, optimizer: torch.optim.Optimizer) -> None:
        for tensor in self._coefficients[optimizer]:
            self._emulator.get_registered_value_proxy(tensor).load_from(tensor)

    def get_registered_value_proxy(self, tensor: torch.Tensor) -> TensorProxy:
        _expect(tensor, torch.Tensor, "get_registered_value_proxy(tensor)")
        record_event("Context.get_registered_value_proxy", name=_names.get(tensor))
        proxy = self._emulator.get_registered_value_proxy(tensor)
        return TensorProxy(f"registered/{proxy.name}", proxy, self.device.device_str)

    def synchronize(self) -> None:
        record_event("Context.synchronize")
        self._emulator.synchronize(list(self._synchronized.values()))

    # compilation

    def _compile(
        self,
        keyword: str,
        function: Any,
        inputs: Any,
        codegen: Any,
        options: Any,
        cache_options: Any,
    ) -> CompiledFunction:
        if not callable(function):
            raise TypeError(f"mlsdk: compile(function) must be callable, got {function!r}")
        _expect(inputs, Mapping, "compile(inputs)")
        for key, value in inputs.items():
            _expect(key, str, "an input name")
            _expect(value, torch.Tensor, f"sample input {key!r}")
        _expect(codegen, _StoragePath, f"compile({keyword}) (use mlsdk.storage.path(...))")
        emulator_options = {}
        if options is not None:
            _expect(options, dict, "compile(options)")
            for key, value in options.items():
                if key not in _COMPILE_OPTIONS:
                    raise ValueError(f"mlsdk: unknown compile option {key!r}")
                _expect(value, str, f"compile option {key!r}")
            if "option_json" in options:
                preset = Path(options["option_json"])
                if not preset.is_file() or preset.suffix != ".json":
                    raise FileNotFoundError(f"mlsdk: option_json {preset} is not a JSON file")
                emulator_options["option_json"] = json.loads(preset.read_text())["emulator_preset"]
        if cache_options is not None:
            _expect(cache_options, CacheOptions, "compile(cache_options)")
        if _ContextBase._current is not self:
            raise RuntimeError("mlsdk (fake): call Context.switch_context(context) before compile")
        record_event(
            "Context.compile",
            keyword=keyword,
            codegen_dir=str(codegen),
            options=dict(options or {}),
            cache_dir=cache_options.cache_dir if cache_options is not None else None,
            inputs={k: tuple(v.shape) for k, v in inputs.items()},
            # the device layer's replay of a graph it captured, or (capture="trace") the
            # user's function itself
            replay=getattr(function, "_mncore_replay", False),
        )
        emulated = self._emulator.compile(  # MLSDK traces the function it is given
            function,
            inputs,
            Path(os.fspath(codegen)),
            options=emulator_options or None,
            cache_options=_emu.CacheOptions(cache_options.cache_dir) if cache_options else None,
            capture="trace",
        )
        return CompiledFunction(self, emulated)

    def load_codegen_dir(self, path: _StoragePath) -> CompiledFunction:
        _expect(path, _StoragePath, "load_codegen_dir(path) (use mlsdk.storage.path(...))")
        record_event("Context.load_codegen_dir", path=str(path))
        return CompiledFunction(self, self._emulator.load_codegen_dir(Path(os.fspath(path))))

    def invalidate(self) -> None:
        """fake: frees the device memory; the context and its functions are unusable after."""
        record_event("Context.invalidate")
        self._emulator.invalidate()

    # test hook

    def _device_value(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._emulator.get_registered_value_proxy(tensor).cpu()


if COMPILE_KEYWORD == "codegen_base_dir":

    class Context(_ContextBase):
        """An older SDK: compile's codegen keyword is `codegen_base_dir`."""

        def compile(
            self,
            function: Any,
            inputs: Mapping[str, torch.Tensor],
            codegen_base_dir: _StoragePath,
            options: dict[str, str] | None = None,
            cache_options: CacheOptions | None = None,
        ) -> CompiledFunction:
            return self._compile(
                "codegen_base_dir", function, inputs, codegen_base_dir, options, cache_options
            )

else:

    class Context(_ContextBase):
        def compile(
            self,
            function: Any,
            inputs: Mapping[str, torch.Tensor],
            codegen_dir: _StoragePath,
            options: dict[str, str] | None = None,
            cache_options: CacheOptions | None = None,
        ) -> CompiledFunction:
            return self._compile(
                "codegen_dir", function, inputs, codegen_dir, options, cache_options
            )
