"""`CompiledFunction`: one static graph bound to device memory, called with a dict of tensors."""

from __future__ import annotations

from abc import ABC
from collections.abc import Mapping, Sequence

import torch

from .. import trace_events
from ..errors import ContextInvalidatedError
from .executors import Executor
from .signature import GraphSignature
from .specs import TensorSpec, check_input_keys, check_real, conform_input
from .state_layout import restrided
from .tracing import StateKind


class DeviceSlot:
    """One tensor in device memory. Compiled calls replace `value` with the updated tensor."""

    __slots__ = ("name", "host", "value", "state_kind", "host_version", "source")

    def __init__(
        self,
        name: str,
        host: torch.Tensor | None,
        value: torch.Tensor,
        state_kind: StateKind,
        source: torch.Tensor | None = None,
    ) -> None:
        self.name = name
        self.host = host
        self.value = value
        self.state_kind = state_kind
        self.host_version = host._version if host is not None else None
        # the host tensor that a compile captured as unregistered state (private or constant)
        self.source = source

    def refresh_from_host(self) -> None:
        """Re-upload a read-only constant whose host tensor was changed in place."""
        host = self.host
        if host is not None and host._version != self.host_version:
            self.value = host.detach().to(self.value.device, copy=True)
            self.host_version = host._version


class InputProxy:
    """A device-side input buffer (`CompiledFunction.allocate_input_proxy`)."""

    def __init__(self, name: str, spec: TensorSpec, device: torch.device) -> None:
        self.name = name
        self.spec = spec
        self.tensor = torch.empty(spec.shape, dtype=spec.dtype, device=device)
        self._owned = True

    def load_from(self, tensor: torch.Tensor, clone: bool = True) -> None:
        """Copy `tensor` into the buffer; with clone=False a same-device tensor is used as is."""
        tensor = conform_input(self.name, self.spec, tensor)
        with trace_events.span("load_from", "transfer", name=self.name):
            self._load(tensor, clone)

    def _load(self, tensor: torch.Tensor, clone: bool) -> None:
        if not clone and tensor.device == self.tensor.device:
            self.tensor = tensor  # borrowed: never written into
            self._owned = False
        elif self._owned:
            self.tensor.copy_(tensor.detach())
        else:
            self.tensor = tensor.detach().to(self.tensor.device, copy=True)
            self._owned = True

    def cpu(self) -> torch.Tensor:
        return self.tensor.cpu()


class CompiledFunction:
    """A traced step: callable with a dict of tensors, returning a dict of device tensors.

    Every call reads and updates device memory only; host tensors change at
    `Context.synchronize()`. Calls must match the sample's keys, shapes and dtypes.
    """

    def __init__(
        self,
        executor: Executor,
        state: Sequence[DeviceSlot],
        mutated: Sequence[DeviceSlot],
        input_specs: Mapping[str, TensorSpec],
        output_specs: Mapping[str, TensorSpec],
        device: torch.device,
        compile_seconds: float = 0.0,
        cache_hit: bool = False,
        copied_outputs: Sequence[int] = (),
        name: str = "function",
        signature: GraphSignature | None = None,
    ) -> None:
        self.name = name
        # what each input and output of its graph is (parameter, batch, log value, ...)
        self.signature = signature
        self._executor = executor
        self._state = list(state)
        # the strides its executor needs of each state input (StateLayout): a slot that
        # another function's graph laid out otherwise is laid out again, in device memory
        self._state_strides = sorted(getattr(executor, "state_strides", {}).items())
        self._mutated = list(mutated)
        self._constants = [
            s for s in self._state if s.state_kind is StateKind.CONSTANT and s.host is not None
        ]
        self.input_specs = dict(input_specs)
        self.output_specs = dict(output_specs)
        self._input_items = list(self.input_specs.items())
        self._output_keys = list(self.output_specs)
        self._copied_outputs = list(copied_outputs)  # outputs sharing memory with state
        self.device = device
        self.compile_seconds = compile_seconds
        self.cache_hit = cache_hit
        self.calls = 0
        self._lay_out_state()  # now: its calls then train in memory that stays put

    def _lay_out_state(self) -> None:
        """Each state slot in the strides this function's graph was compiled for, a copy
        where another function's graph (or a `load_from`) left it otherwise."""
        state = self._state
        for i, strides in self._state_strides:
            value = state[i].value
            if value.stride() != strides:
                state[i].value = restrided(value, strides)

    def captured_unregistered(self, tensor: torch.Tensor) -> list[DeviceSlot]:
        """The slots this function captured from host `tensor` as unregistered state."""
        return [s for s in self._state if s.source is tensor]

    def rebind(self, tensor: torch.Tensor, slot: DeviceSlot) -> None:
        """Use `slot` (the device copy of `tensor`, registered after this compile) wherever
        this function captured `tensor` as unregistered state: it then reads and trains the
        registered copy, which synchronize() writes back."""
        replace = {id(s) for s in self.captured_unregistered(tensor)}
        if not replace:
            return
        self._state = [slot if id(s) in replace else s for s in self._state]
        self._mutated = [slot if id(s) in replace else s for s in self._mutated]
        self._constants = [s for s in self._constants if id(s) not in replace]

    @property
    def state_names(self) -> list[str]:
        """Names of the device tensors this function reads, in graph-input order."""
        return [s.name for s in self._state]

    @property
    def updated_state_names(self) -> list[str]:
        """Names of the device tensors this function updates."""
        return [s.name for s in self._mutated]

    def allocate_input_proxy(self) -> dict[str, InputProxy]:
        """Device buffers for every input, to fill with `load_from` and pass to a call."""
        return {k: InputProxy(k, spec, self.device) for k, spec in self._input_items}

    def __call__(self, inputs: Mapping[str, torch.Tensor | InputProxy]) -> dict[str, torch.Tensor]:
        if trace_events.recording():
            with trace_events.span(self.name, "call"):
                return self._call(inputs)
        return self._call(inputs)

    def invalidate(self, reason: str) -> None:
        """Drop the executor and device memory; later calls raise `reason`."""
        self._invalidated = reason
        self._executor = None
        self._state, self._mutated, self._constants = [], [], []

    def _call(self, inputs: Mapping[str, torch.Tensor | InputProxy]) -> dict[str, torch.Tensor]:
        if self._executor is None:
            raise ContextInvalidatedError(f"compiled function {self.name!r}: {self._invalidated}")
        args = self._arguments(inputs)
        self.calls += 1
        outputs = self._executor(args)
        n = len(self._output_keys)
        for slot, value in zip(self._mutated, outputs[n:], strict=True):
            slot.value = value
        results = list(outputs[:n])
        for i in self._copied_outputs:  # the caller may edit them in place: never state
            results[i] = results[i].clone()
        return dict(zip(self._output_keys, results, strict=True))

    def _arguments(self, inputs) -> list[torch.Tensor]:
        check_input_keys(inputs, self.input_specs)
        for slot in self._constants:
            slot.refresh_from_host()
        self._lay_out_state()
        args = [slot.value for slot in self._state]
        device = self.device
        for key, spec in self._input_items:
            value = inputs[key]
            if isinstance(value, InputProxy):
                value = value.tensor
            elif not isinstance(value, torch.Tensor):
                raise TypeError(f"input {key!r} must be a tensor, got {type(value).__name__}")
            if value.shape != spec.shape or value.dtype != spec.dtype:
                value = conform_input(key, spec, value)
            if value.requires_grad:  # outputs and new state are data, with no autograd
                value = value.detach()  # history (nor the memory one would hold)
            if value.device != device:
                check_real(key, value)
                value = value.to(device, non_blocking=True)
            args.append(value if value.is_contiguous() else value.contiguous())
        return args


class TensorProxy(ABC):  # noqa: B024 (an abstract type with no methods of its own)
    """MLSDK's type of a device value: what a compiled call returns, an input buffer, a
    registered tensor's device value. Each has `.cpu()` (a host copy). On the emulator a
    compiled call returns torch tensors in device memory, so `isinstance(out, TensorProxy)`
    holds for them too, and code written for MLSDK's proxies runs unchanged."""


TensorProxy.register(torch.Tensor)
TensorProxy.register(InputProxy)

TensorLike = torch.Tensor | TensorProxy  # MLSDK's type hint for "a tensor or a device value"
