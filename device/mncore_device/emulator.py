"""`EmulatorContext`: the emulated MN-Core ("pfvm:cpu", "pfvm:cuda") behind the Context interface.

Registering a tensor copies it into device memory (host memory, or a CUDA GPU's). Compiled
steps are traced into one functional graph, run by an interpreter or TorchInductor as the
preset says, and read and update only that memory; `synchronize()` writes it back into the
host tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import warnings
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from typing_extensions import override

from . import trace_events
from .backprop import backprop_step
from .compile_keywords import CompileKeywords, warn_unhonoured
from .context import Context, Role, StepFunction
from .device import Backend
from .errors import ContextInvalidatedError, InputSpecError, RegistrationError
from .presets import Preset, load_preset
from .runtime import artifacts
from .runtime.artifacts import CacheOptions
from .runtime.compiled import CompiledFunction, DeviceSlot, TensorProxy
from .runtime.executors import CompiledCode, build_executor
from .runtime.specs import TensorSpec
from .runtime.state_layout import laid_out_as_traced
from .runtime.tracing import StateKind, TracedStep, trace_step


class RegisteredValueProxy:
    """A handle on one registered tensor in device memory (explicit transfers)."""

    def __init__(self, slot: DeviceSlot) -> None:
        self._slot = slot

    @property
    def name(self) -> str:
        return self._slot.name

    @property
    def shape(self) -> torch.Size:
        return self._value().shape

    def load_from(self, tensor: torch.Tensor, clone: bool = True) -> None:
        """Push a host value to the device (e.g. after loading a checkpoint on the host)."""
        del clone  # device memory is always a copy of the host value
        with trace_events.span("load_from", "transfer", name=self.name):
            self._load(tensor)

    def _value(self) -> torch.Tensor:
        if self._slot.value is None:
            raise ContextInvalidatedError(
                f"the device value of {self.name!r} was released by Context.invalidate()"
            )
        return self._slot.value

    def _load(self, tensor: torch.Tensor) -> None:
        current = self._value()
        if tuple(tensor.shape) != tuple(current.shape):
            raise ValueError(
                f"load_from: {self.name} has shape {list(current.shape)} on the device, "
                f"got a tensor of shape {list(tensor.shape)}"
            )
        self._slot.value = tensor.detach().to(current.device, current.dtype, copy=True)

    def cpu(self) -> torch.Tensor:
        """A host copy of the device value (a snapshot: later calls do not change it)."""
        with trace_events.span("cpu", "transfer", name=self.name):
            return self._value().detach().to("cpu", copy=True)


TensorProxy.register(RegisteredValueProxy)


class EmulatorContext(Context, backend=Backend.EMULATOR):
    """This package's emulated MN-Core: device memory is host or CUDA memory."""

    def __init__(self, device="pfvm:cpu", backend: str | None = None) -> None:
        super().__init__(device, backend)
        self._slots: dict[str, DeviceSlot] = {}
        self._functions: weakref.WeakSet[CompiledFunction] = weakref.WeakSet()

    @override
    def _release(self) -> None:
        reason = f"its {self!r} was invalidated (Context.invalidate())"
        for function in list(self._functions):
            function.invalidate(reason)
        for slot in self._slots.values():
            slot.value = None
        self._slots.clear()

    # --- registration --------------------------------------------------------------------

    @override
    def _add_tensor(self, name: str, tensor: torch.Tensor, role: Role) -> None:
        self._check_not_trained_unregistered(name, tensor, role)
        value = tensor.detach().to(self.device.torch_device, copy=True)
        slot = DeviceSlot(name, tensor, value, StateKind.REGISTERED)
        self._slots[name] = slot
        for function in list(self._functions):
            function.rebind(tensor, slot)

    @override
    def _add_optimizer(
        self, optimizer: torch.optim.Optimizer, new: list[tuple[str, torch.Tensor]]
    ) -> None:
        for name, tensor in new:
            self._check_not_trained_unregistered(name, tensor, Role.OPTIMIZER)
        for name, tensor in new:
            self._add_tensor(name, tensor, Role.OPTIMIZER)

    def _check_not_trained_unregistered(self, name: str, tensor: torch.Tensor, role: Role) -> None:
        """A tensor that a compiled function captured unregistered is registered after the
        compile: the function then uses the registered copy (see CompiledFunction.rebind),
        unless it has already run and so trained its own copy, which registering from the
        host value would silently drop."""
        for function in list(self._functions):
            trained = [
                s
                for s in function.captured_unregistered(tensor)
                if s.state_kind is StateKind.PRIVATE
            ]
            if trained and function.calls:
                raise RegistrationError(
                    f"register_{role}: tensor {name!r} was captured unregistered by the compiled "
                    f"function {function.name!r}, which has already updated its own device copy "
                    f"in {function.calls} call(s); registering it now would start the "
                    "registered copy from the host value and drop those updates. Register "
                    "every tensor the step updates before compile (or before the first call)."
                )

    @override
    def device_values(self) -> list[torch.Tensor]:
        return [slot.value for slot in self._slots.values()]

    @override
    def get_registered_value_proxy(self, tensor: torch.Tensor) -> RegisteredValueProxy:
        self._check_valid("get_registered_value_proxy")
        (tensor,) = self._require_registered([tensor])
        return RegisteredValueProxy(self._slots[self._names[id(tensor)]])

    # --- host <-> device ------------------------------------------------------------------

    @override
    def synchronize(self, tensors: Iterable[torch.Tensor] | None = None) -> None:
        self._check_valid("synchronize")
        if tensors is None:
            slots = self._slots.values()
        else:
            slots = [self._slots[self._names[id(t)]] for t in self._require_registered(tensors)]
        with trace_events.span("synchronize", "transfer"), torch.no_grad():
            for slot in slots:
                slot.host.copy_(slot.value)

    # --- compilation ------------------------------------------------------------------------

    @override
    def _compile(
        self,
        function: StepFunction,
        inputs: Mapping[str, torch.Tensor],
        codegen_dir: str | os.PathLike[str] | None,
        options: Mapping[str, object] | None,
        cache_options: CacheOptions | None,
        keywords: CompileKeywords,
    ) -> CompiledFunction:
        start = time.perf_counter()
        options = dict(options or {})
        preset = load_preset(options.pop("option_json", None))
        if "random" in options:
            preset = dataclasses.replace(preset, random=options.pop("random"))
        autocast_dtype = _float_dtype(options.pop("float_dtype", "float"))
        backprop = options.pop("backprop", False)
        for key in options:
            warn_unhonoured(
                f"compile option {key!r}",
                "it configures MLSDK's own compiler, which the emulator does not have",
            )
        if keywords.export_kwargs:
            warn_unhonoured(
                "compile(export_kwargs=...)",
                "the emulator traces the step itself and has no ONNX exporter to configure",
            )
        if keywords.optimizers or backprop:
            if not (keywords.optimizers and backprop):
                raise ValueError(
                    "compile: optimizers=[...] and options={'backprop': True} go together (the "
                    "compiler adds the backward and the optimizers' update); a function that "
                    "calls loss.backward() and optimizer.step() itself needs neither"
                )
            function, inputs = backprop_step(function, inputs, keywords.optimizers)
        traced = trace_step(
            function,
            inputs,
            dict(self._registered),
            self._optimizers,
            autocast_dtype,
            roles={n: r.value for n, r in self._roles.items()},
        )
        traced = artifacts.canonical(traced)
        _check_constraints(traced, keywords.io_spec_constraints or {})
        slots = self._bind(traced)
        specs = artifacts.describe(traced)
        prepared, compiled_code = None, None
        if codegen_dir is not None:
            values = {  # as traced: another graph may hold them in another layout
                b.name: laid_out_as_traced(slot.value, b.tensor)
                for b, slot in zip(traced.state, slots, strict=True)
                if b.kind is StateKind.REGISTERED
            }
            prepared = artifacts.prepare(traced, specs, preset, values)
            if preset.executor == "inductor":  # the dir keeps the compiled code
                compiled_code = self._compiled_code(prepared.specs, preset, cache_options)
        with compiled_code.exclusive() if compiled_code else contextlib.nullcontext():
            compiled = self._finish(
                traced,
                slots,
                specs,
                preset,
                cache_options,
                start,
                name=_function_name(function, codegen_dir),
                compile_threads=keywords.num_compiler_threads,
                compiled_code=compiled_code,
            )
            if prepared is not None:
                artifacts.save(
                    Path(os.fspath(codegen_dir)),
                    prepared,
                    compiled_code.cache_dir if compiled_code is not None else None,
                    compiled_code.files() if compiled_code is not None else [],
                    compiled_code.runnable_entry() if compiled_code is not None else None,
                    compiled_code.dim_orders if compiled_code is not None else {},
                )
        return compiled

    @override
    def load_codegen_dir(
        self, path: str | os.PathLike[str], *, trust_compiled_code: bool = False
    ) -> CompiledFunction:
        """Rebuild a step from its codegen dir. With an Inductor preset the dir also holds
        the step's compiled host code: with trust_compiled_code=True it is checked against
        specs.json's sha256 and run (no compile); otherwise the step is compiled again from
        its graph, which is data, and a one-line note says so."""
        self._check_valid("load_codegen_dir")
        start = time.perf_counter()
        directory = Path(os.fspath(path))
        with trace_events.span("load_codegen_dir", "compile", codegen_dir=str(path)):
            traced, specs = artifacts.load(directory)
            slots = self._bind(traced, captured=False)
            preset = Preset(**specs["preset"])
            compiled_code, names = None, None
            if preset.executor == "inductor":
                names = artifacts.compiled_files(directory, specs, trust_compiled_code)
                compiled_code = self._compiled_code(specs, preset, None)
            with compiled_code.exclusive() if compiled_code else contextlib.nullcontext():
                if names is not None:
                    compiled_code.install(directory / artifacts.COMPILED_DIR, names)
                    compiled_code.entry = artifacts.compiled_entry(specs, names)
                    compiled_code.dim_orders = artifacts.compiled_dim_orders(specs)
                name = _function_name(None, path)
                return self._finish(
                    traced,
                    slots,
                    specs,
                    preset,
                    None,
                    start,
                    name=name,
                    compiled_code=compiled_code,
                )

    def _compiled_code(
        self, specs: dict, preset: Preset, cache_options: CacheOptions | None
    ) -> CompiledCode:
        """Inductor's cache directory for this step (see CompiledCode): one per graph,
        preset, device and torch, inside the CacheOptions cache or Inductor's own."""
        key = artifacts.compiled_code_key(specs, preset, self.device.torch_device)
        if cache_options is not None and cache_options.enable_codegen_cache:
            return CompiledCode(key, cache_options.path / "inductor")
        return CompiledCode(key)

    def _bind(self, traced: TracedStep, captured: bool = True) -> list[DeviceSlot]:
        """Device slots for the graph's state inputs: shared for registered tensors; a loaded
        step's registered state that this Context has not registered gets its own slot,
        holding the codegen dir's value.

        captured: the unregistered state's tensors are the host tensors the trace captured
        (a compile), not values saved in a codegen dir: registered later, they rebind."""
        slots = []
        device = self.device.torch_device
        unregistered_updates = []
        for binding in traced.state:
            if binding.kind is StateKind.REGISTERED and binding.name not in self._slots:
                if binding.tensor.device.type == "meta":  # a dir without the value
                    raise RegistrationError(
                        f"the compiled step needs tensor {binding.name!r}, which is not "
                        "registered in this Context and whose value its codegen dir does not "
                        "hold: name and register the model and optimizer as when it was compiled"
                    )
                # the value the codegen dir holds, in this device's memory only
                value = binding.tensor.detach().to(device, copy=True)
                slot = DeviceSlot(binding.name, None, value, StateKind.PRIVATE)
                if binding.mutated:
                    unregistered_updates.append(binding.name)
            elif binding.kind is StateKind.REGISTERED:
                slot = self._slots[binding.name]
                if slot.value.shape != binding.tensor.shape:
                    raise RegistrationError(
                        f"tensor {binding.name!r} has shape {list(slot.value.shape)} here but "
                        f"{list(binding.tensor.shape)} in the compiled step"
                    )
            else:
                value = binding.tensor.detach().to(device, copy=True)
                real = value.device.type != "meta"
                host = binding.tensor if binding.kind is StateKind.CONSTANT and real else None
                source = binding.tensor if real and captured else None
                slot = DeviceSlot(binding.name, host, value, binding.kind, source)
            slots.append(slot)
        if unregistered_updates:
            warnings.warn(
                f"the loaded step updates {len(unregistered_updates)} tensor(s) not registered "
                f"in this Context ({', '.join(map(repr, unregistered_updates[:5]))}"
                f"{', ...' if len(unregistered_updates) > 5 else ''}): they start from the "
                "codegen dir's values and live on the device only; synchronize() cannot write "
                "them back. Register the model and optimizer before load_codegen_dir to train "
                "your own tensors.",
                stacklevel=3,
            )
        return slots

    def _finish(
        self,
        traced,
        slots,
        specs,
        preset,
        cache_options,
        start,
        name: str,
        compile_threads: int | None = None,
        compiled_code: CompiledCode | None = None,
    ) -> CompiledFunction:
        device = self.device.torch_device
        example_args = [
            laid_out_as_traced(slot.value, binding.tensor)
            for binding, slot in zip(traced.state, slots, strict=True)
        ] + [
            torch.zeros(spec.shape, dtype=spec.dtype, device=device)
            for spec in traced.input_specs.values()
        ]
        hit = False
        if cache_options is not None and not cache_options.enable_codegen_cache:
            cache_options = None
        if cache_options is not None:
            key = artifacts.cache_key(traced, specs, preset, device)
            hit = artifacts.cache_contains(cache_options, key)
        executor = build_executor(
            traced.graph_module,
            preset,
            device,
            example_args,
            cache_options.path if cache_options is not None else None,
            compile_threads,
            traced.mutated_state,
            compiled_code,
            state_inputs=len(slots),
        )
        if cache_options is not None:
            artifacts.cache_record(cache_options, key)
        mutated = [slots[i] for i in traced.mutated_state]
        function = CompiledFunction(
            executor,
            slots,
            mutated,
            traced.input_specs,
            traced.output_specs,
            device,
            compile_seconds=time.perf_counter() - start,
            cache_hit=hit,
            copied_outputs=traced.outputs_aliasing_state,
            name=name,
            signature=traced.signature,
        )
        function._compiled_code = compiled_code  # its files stay while the function lives
        self._functions.add(function)
        return function


def _float_dtype(value: object) -> torch.dtype | None:
    """options["float_dtype"]: "float" computes as the host tensors are; "mixed" runs the
    step under bfloat16 autocast (matmuls and convolutions in bfloat16, reductions and
    normalizations in float32, as MLSDK's mixed precision keeps them)."""
    if value in (None, "float"):
        return None
    if value == "mixed":
        return torch.bfloat16
    raise ValueError(f"compile option float_dtype={value!r}: use 'float' or 'mixed'")


def _check_constraints(traced: TracedStep, constraints: Mapping[str, object]) -> None:
    """io_spec_constraints: each named input or output must have the constraint's spec."""
    for name, constraint in constraints.items():
        spec = traced.output_specs.get(name) or traced.input_specs.get(name)
        if spec is None:
            raise InputSpecError(
                f"io_spec_constraints names {name!r}, which is neither an input nor an output "
                f"of the step (inputs {sorted(traced.input_specs)}, outputs "
                f"{sorted(traced.output_specs)})"
            )
        if not isinstance(constraint, TensorSpec) or not spec.is_memcopyable_to(constraint):
            raise InputSpecError(
                f"io_spec_constraints[{name!r}]: the step's {name!r} is {spec}, but the "
                f"constraint asks for {constraint}"
            )


def _function_name(function: object, codegen_dir: object) -> str:
    """What trace events call a compiled function: its codegen dir's name, else its own."""
    if codegen_dir is not None:
        return Path(os.fspath(codegen_dir)).name
    return getattr(function, "__name__", "function")
