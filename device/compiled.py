"""`CompiledFunction`: one static graph bound to device memory, called with a dict of tensors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .errors import InputSpecError
from .executors import Executor
from .specs import TensorSpec


class DeviceSlot:
    """One tensor in device memory. Compiled calls replace `value` with the updated tensor."""

    __slots__ = ("name", "host", "value", "kind", "host_version")

    def __init__(self, name: str, host: torch.Tensor | None, value: torch.Tensor, kind: str):
        self.name = name
        self.host = host
        self.value = value
        self.kind = kind
        self.host_version = host._version if host is not None else None

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
        _check_spec(self.name, self.spec, tensor)
        if not clone and tensor.device == self.tensor.device:
            self.tensor = tensor  # borrowed: never written into
            self._owned = False
        elif self._owned:
            self.tensor.copy_(tensor)
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
    ) -> None:
        self._executor = executor
        self._state = list(state)
        self._mutated = list(mutated)
        self._constants = [s for s in self._state if s.kind == "constant" and s.host is not None]
        self.input_specs = dict(input_specs)
        self.output_specs = dict(output_specs)
        self._input_items = list(self.input_specs.items())
        self._output_keys = list(self.output_specs)
        self.device = device
        self.compile_seconds = compile_seconds
        self.cache_hit = cache_hit

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
        args = self._arguments(inputs)
        outputs = self._executor(args)
        n = len(self._output_keys)
        for slot, value in zip(self._mutated, outputs[n:]):
            slot.value = value
        return dict(zip(self._output_keys, outputs[:n]))

    def _arguments(self, inputs) -> list[torch.Tensor]:
        if not isinstance(inputs, Mapping):
            raise TypeError(
                f"a compiled function takes a dict of tensors, got {type(inputs).__name__}"
            )
        if len(inputs) != len(self._input_items) or any(
            k not in inputs for k, _ in self._input_items
        ):
            expected = sorted(self.input_specs)
            raise InputSpecError(
                f"compiled function called with inputs {sorted(inputs)}, but it was compiled "
                f"for {expected}: the keys must be those of the sample"
            )
        for slot in self._constants:
            slot.refresh_from_host()
        args = [slot.value for slot in self._state]
        device = self.device
        for key, spec in self._input_items:
            value = inputs[key]
            if isinstance(value, InputProxy):
                value = value.tensor
            elif not isinstance(value, torch.Tensor):
                raise TypeError(f"input {key!r} must be a tensor, got {type(value).__name__}")
            if value.shape != spec.shape or value.dtype != spec.dtype:
                _check_spec(key, spec, value)
            if value.device != device:
                value = value.to(device, non_blocking=True)
            args.append(value if value.is_contiguous() else value.contiguous())
        return args


def _check_spec(key: str, spec: TensorSpec, value: torch.Tensor) -> None:
    if tuple(value.shape) != spec.shape or value.dtype != spec.dtype:
        got = TensorSpec.of(value)
        hint = ""
        if value.dim() and spec.shape and tuple(value.shape[1:]) == spec.shape[1:]:
            hint = (
                f" The batch size differs ({value.shape[0]} vs {spec.shape[0]}): use "
                "drop_last=True in the training DataLoader, or pad the last batch to "
                f"{spec.shape[0]} samples."
            )
        raise InputSpecError(
            f"input {key!r}: expected shape {spec}, got {got}. A compiled function has static "
            f"shapes fixed by its sample, and nothing is recompiled silently.{hint}"
        )
