"""`Context`: the device's memory and the steps compiled against it (MLSDK's programming model).

Registering a tensor copies it into device memory. Compiled steps read and update only that
memory; `synchronize()` writes it back into the host tensors.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch

from . import artifacts
from .artifacts import CacheOptions
from .compiled import CompiledFunction, DeviceSlot
from .device import EMULATOR_BACKEND, MLSDK_BACKEND, MNDevice, resolve_backend
from .errors import RegistrationError
from .executors import build_executor
from .naming import get_tensor_name, name_optimizer_state
from .presets import Preset, load_preset
from .tracing import CONSTANT, REGISTERED, TracedStep, trace_step

StepFunction = Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]]


class RegisteredValueProxy:
    """A handle on one registered tensor in device memory (explicit transfers)."""

    def __init__(self, slot: DeviceSlot) -> None:
        self._slot = slot

    @property
    def name(self) -> str:
        return self._slot.name

    @property
    def shape(self) -> torch.Size:
        return self._slot.value.shape

    def load_from(self, tensor: torch.Tensor, clone: bool = True) -> None:
        """Push a host value to the device (e.g. after loading a checkpoint on the host)."""
        del clone  # device memory is always a copy of the host value
        current = self._slot.value
        if tuple(tensor.shape) != tuple(current.shape):
            raise ValueError(
                f"load_from: {self.name} has shape {list(current.shape)} on the device, "
                f"got a tensor of shape {list(tensor.shape)}"
            )
        self._slot.value = tensor.detach().to(current.device, current.dtype, copy=True)

    def cpu(self) -> torch.Tensor:
        """A host copy of the device value (a snapshot: later calls do not change it)."""
        return self._slot.value.detach().to("cpu", copy=True)


class Context:
    """Device memory plus the functions compiled against it.

    `Context(device, backend=None)`: the device string picks the backend ("mncore2:*" runs on
    PFN's MLSDK, "pfvm:*" on this package's emulator; backend="mlsdk" runs "pfvm:*" on MLSDK's
    own virtual machine). On MLSDK the result is an `MLSDKContext`, with the same methods.
    """

    _current: Context | None = None

    def __new__(cls, device: MNDevice | str = "pfvm:cpu", backend: str | None = None) -> Context:
        if cls is Context and resolve_backend(device, backend) == MLSDK_BACKEND:
            from .mlsdk_backend import MLSDKContext

            return super().__new__(MLSDKContext)
        return super().__new__(cls)

    def __init__(self, device: MNDevice | str = "pfvm:cpu", backend: str | None = None) -> None:
        self.device = device if isinstance(device, MNDevice) else MNDevice(device)
        self.backend = EMULATOR_BACKEND
        self._slots: dict[str, DeviceSlot] = {}
        self._by_id: dict[int, DeviceSlot] = {}
        self._optimizers: list[torch.optim.Optimizer] = []

    # --- the current context -----------------------------------------------------------

    @staticmethod
    def switch_context(context: Context) -> None:
        """Make `context` the current one (on MLSDK, MLSDK's current context too)."""
        Context._current = context
        context._made_current()

    def _made_current(self) -> None:
        """Called by switch_context: a backend with its own current context follows it."""

    @staticmethod
    def get_current_context() -> Context:
        if Context._current is None:
            raise RuntimeError("no current Context: call Context.switch_context(context) first")
        return Context._current

    # --- registration --------------------------------------------------------------------

    def register_param(self, param: torch.Tensor) -> None:
        """Copy a parameter into device memory; compiled steps then train the device copy."""
        self._register(param, "param")

    def register_buffer(self, buffer: torch.Tensor) -> None:
        """Copy a buffer (e.g. BatchNorm running stats) into device memory."""
        self._register(buffer, "buffer")

    def register_optimizer_buffers(self, optimizer: torch.optim.Optimizer) -> None:
        """Copy every tensor of `optimizer.state` into device memory (any optimizer)."""
        for _, tensor in name_optimizer_state(optimizer):
            self._register(tensor, "optimizer")
        if optimizer not in self._optimizers:
            self._optimizers.append(optimizer)

    def _register(self, tensor: torch.Tensor, kind: str) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"register_{kind} expects a tensor, got {type(tensor).__name__}")
        name = get_tensor_name(tensor)
        if name is None:
            raise RegistrationError(
                f"register_{kind}: a tensor of shape {list(tensor.shape)} has no name. Name it "
                "first: set_tensor_name_in_module(model, 'model'), "
                "set_buffer_name_in_optimizer(optimizer, 'optimizer') or set_tensor_name(t, name)."
            )
        existing = self._slots.get(name)
        if existing is not None:
            if existing.host is tensor:
                return
            raise RegistrationError(
                f"register_{kind}: the name {name!r} is already registered for another tensor; "
                "give each model its own prefix in set_tensor_name_in_module"
            )
        value = tensor.detach().to(self.device.torch_device, copy=True)
        slot = DeviceSlot(name, tensor, value, REGISTERED)
        self._slots[name] = slot
        self._by_id[id(tensor)] = slot

    def is_registered(self, tensor: torch.Tensor) -> bool:
        slot = self._by_id.get(id(tensor))
        return slot is not None and slot.host is tensor

    @property
    def registered_names(self) -> list[str]:
        return list(self._slots)

    def device_values(self) -> list[torch.Tensor]:
        """The registered tensors as they are in device memory now."""
        return [slot.value for slot in self._slots.values()]

    def get_registered_value_proxy(self, tensor: torch.Tensor) -> RegisteredValueProxy:
        """The device-side value of a registered tensor, for explicit transfers."""
        return RegisteredValueProxy(self._slot_of(tensor))

    def _slot_of(self, tensor: torch.Tensor) -> DeviceSlot:
        if not self.is_registered(tensor):
            name = get_tensor_name(tensor)
            raise RegistrationError(
                f"tensor {name or list(tensor.shape)} is not registered in this Context"
            )
        return self._by_id[id(tensor)]

    def _slots_of(self, tensors: Iterable[torch.Tensor] | None) -> Iterable[DeviceSlot]:
        return self._slots.values() if tensors is None else [self._slot_of(t) for t in tensors]

    # --- host <-> device ------------------------------------------------------------------

    def synchronize(self, tensors: Iterable[torch.Tensor] | None = None) -> None:
        """Write registered device values back into their host tensors (all, or `tensors`)."""
        slots = self._slots_of(tensors)
        with torch.no_grad():
            for slot in slots:
                slot.host.copy_(slot.value)

    def load_from_host(self, tensors: Iterable[torch.Tensor] | None = None) -> None:
        """Push host values of registered tensors to the device (all, or `tensors`)."""
        for slot in self._slots_of(tensors):
            RegisteredValueProxy(slot).load_from(slot.host)

    # --- compilation ------------------------------------------------------------------------

    def compile(
        self,
        function: StepFunction,
        inputs: Mapping[str, torch.Tensor],
        codegen_dir: str | os.PathLike[str] | None = None,
        options: Mapping[str, object] | None = None,
        cache_options: CacheOptions | None = None,
    ) -> CompiledFunction:
        """Trace `function` once with the sample `inputs` into one static graph and compile it.

        options: {"option_json": preset name or file (debug, O0 ... O4; default O1)}.
        """
        start = time.perf_counter()
        preset = load_preset((options or {}).get("option_json"))
        registered = {name: slot.host for name, slot in self._slots.items()}
        traced = trace_step(function, inputs, registered, self._optimizers)
        slots = self._bind(traced)
        specs = artifacts.describe(traced)
        if codegen_dir is not None:
            artifacts.save(Path(os.fspath(codegen_dir)), traced, specs, preset)
        return self._finish(traced, slots, specs, preset, cache_options, start)

    def load_codegen_dir(self, path: str | os.PathLike[str]) -> CompiledFunction:
        """Rebuild a function compiled earlier (possibly in another process), without tracing."""
        start = time.perf_counter()
        traced, specs = artifacts.load(Path(os.fspath(path)))
        slots = self._bind(traced)
        return self._finish(traced, slots, specs, Preset(**specs["preset"]), None, start)

    def _bind(self, traced: TracedStep) -> list[DeviceSlot]:
        """Device slots for the graph's state inputs: shared for registered tensors."""
        slots = []
        device = self.device.torch_device
        for binding in traced.state:
            if binding.kind == REGISTERED:
                slot = self._slots.get(binding.name)
                if slot is None:
                    raise RegistrationError(
                        f"the compiled step needs tensor {binding.name!r}, which is not registered "
                        "in this Context: name and register the model and optimizer as when it "
                        "was compiled"
                    )
                if slot.value.shape != binding.tensor.shape:
                    raise RegistrationError(
                        f"tensor {binding.name!r} has shape {list(slot.value.shape)} here but "
                        f"{list(binding.tensor.shape)} in the compiled step"
                    )
            else:
                value = binding.tensor.detach().to(device, copy=True)
                host = (
                    binding.tensor
                    if binding.kind == CONSTANT and value.device.type != "meta"
                    else None
                )
                slot = DeviceSlot(binding.name, host, value, binding.kind)
            slots.append(slot)
        return slots

    def _finish(self, traced, slots, specs, preset, cache_options, start):
        device = self.device.torch_device
        example_args = [slot.value for slot in slots] + [
            torch.zeros(spec.shape, dtype=spec.dtype, device=device)
            for spec in traced.input_specs.values()
        ]
        hit = False
        if cache_options is not None:
            key = artifacts.cache_key(traced, specs, preset, self.device.torch_device)
            hit = artifacts.cache_contains(cache_options, key)
        executor = build_executor(
            traced.graph_module,
            preset,
            self.device.torch_device,
            example_args,
            cache_options.path if cache_options is not None else None,
        )
        if cache_options is not None:
            artifacts.cache_record(cache_options, key)
        mutated = [slots[i] for i in traced.mutated_state]
        return CompiledFunction(
            executor,
            slots,
            mutated,
            traced.input_specs,
            traced.output_specs,
            self.device.torch_device,
            compile_seconds=time.perf_counter() - start,
            cache_hit=hit,
        )
