"""`TensorSpec`: the shape and dtype of one input, output or state tensor."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


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
        return cls(tuple(data["shape"]), getattr(torch, data["dtype"]))

    def __str__(self) -> str:
        return f"{list(self.shape)} {str(self.dtype).removeprefix('torch.')}"
