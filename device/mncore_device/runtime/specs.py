"""`TensorSpec`: the shape and dtype of one input, output or state tensor."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..errors import InputSpecError


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one input or output of a compiled function."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(tuple(tensor.shape), tensor.dtype)

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "dtype": str(self.dtype).removeprefix("torch.")}

    @classmethod
    def from_json(cls, data: Mapping) -> TensorSpec:
        dtype = getattr(torch, str(data["dtype"]), None)
        shape = data["shape"]
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{data['dtype']!r} is not a torch dtype")
        if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
            raise ValueError(f"{shape!r} is not a tensor shape")
        return cls(tuple(shape), dtype)

    def __str__(self) -> str:
        return f"{list(self.shape)} {str(self.dtype).removeprefix('torch.')}"

    def is_memcopyable_to(self, other: TensorSpec) -> bool:
        """Whether a tensor of this spec can be used as one of `other` without conversion
        (MLSDK's IOSpec; the emulator has one layout, so: same shape and dtype)."""
        return (
            isinstance(other, TensorSpec)
            and self.shape == other.shape
            and self.dtype == other.dtype
        )


IOSpec = TensorSpec  # MLSDK's name for the specs in input_specs / output_specs


def check_input_keys(inputs: object, specs: Mapping[str, TensorSpec]) -> None:
    """A compiled function's call takes a dict holding every key of the sample.

    Keys the function was not compiled with are ignored, as MLSDK ignores them: PFN's
    examples fill one dict of inputs as they go and hand it to every compiled function
    (stable_diffusion_eval.py passes the text encoder's `input_ids` to the UNet)."""
    if not isinstance(inputs, Mapping):
        raise TypeError(f"a compiled function takes a dict of tensors, got {type(inputs).__name__}")
    missing = [k for k in specs if k not in inputs]
    if missing:
        raise InputSpecError(
            f"compiled function called without input(s) {missing}: it was compiled for "
            f"{sorted(specs)}, got {sorted(inputs)}; the keys must be those of the sample"
        )


def check_real(key: str, value: torch.Tensor, where: str = "a compiled function's input") -> None:
    """A meta tensor has a shape but no values: it cannot be copied to the device, so it is
    refused by name (else torch fails deep inside with "Cannot copy out of meta tensor")."""
    if value.device.type == "meta":
        raise InputSpecError(
            f"input {key!r} is a tensor on the meta device (shape {list(value.shape)}, no "
            f"values), but {where} must be a real tensor with values, on the host (cpu) or on "
            "the device: create it with values (e.g. model.to_empty(device='cpu') and load a "
            "state dict for meta-initialized modules, or pass the real batch)"
        )


def conform_input(key: str, spec: TensorSpec, value: torch.Tensor) -> torch.Tensor:
    """`value` as an input of `spec`: itself, or reshaped where the two shapes differ only in
    dimensions of size 1 (a 0-d timestep for a compiled [1], a [4] for a [4, 1]), which
    holds the same numbers in the same order. Anything else raises `check_input`'s error."""
    check_real(key, value)
    if tuple(value.shape) == spec.shape and value.dtype == spec.dtype:
        return value
    if value.dtype == spec.dtype and _squeezed(value.shape) == _squeezed(spec.shape):
        return value.reshape(spec.shape)
    check_input(key, spec, value)
    return value


def _squeezed(shape) -> tuple[int, ...]:
    return tuple(n for n in shape if n != 1)


def check_input(key: str, spec: TensorSpec, value: torch.Tensor) -> None:
    """One input of a call has the sample's shape and dtype, and values (not the meta
    device), else a named InputSpecError."""
    check_real(key, value)
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
