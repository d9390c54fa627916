"""MLSDK's compile keywords, and the one warning about those a backend cannot honour.

PFN's scripts pass `Context.compile` keywords and options that only mean something to
MLSDK's compiler (ONNX exporter settings, layout specs, schedulers). A backend that cannot
honour one says so once per process (`warn_unhonoured`), instead of dropping it silently.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from typing import Any

import torch

_warned: set[str] = set()


@dataclass(frozen=True)
class CompileKeywords:
    """The keyword arguments of `Context.compile` beyond MLSDK's positional ones.

    optimizers: with options {"backprop": True}, the optimizers whose update the compiler
    adds after the backward (MLSDK's legacy training compile).
    num_compiler_threads: threads for the compiler (TorchInductor's compile_threads).
    quiet: MLSDK's compiler log; the emulator's compile prints nothing either way.
    export_kwargs: settings of MLSDK's ONNX exporter (no exporter on the emulator).
    training: whether the step trains; the trace records what the function does anyway.
    io_spec_constraints: {name: IOSpec} that an input or output must satisfy (the consumer's
    `input_specs[name]`, so the producer's output can be used in place).
    """

    optimizers: list[torch.optim.Optimizer] | None = None
    num_compiler_threads: int | None = None
    quiet: bool | None = None
    export_kwargs: dict[str, Any] | None = None
    training: bool | None = None
    io_spec_constraints: dict[str, Any] | None = None

    def given(self) -> dict[str, Any]:
        """The keywords the caller gave (not None)."""
        return {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None
        }


def warn_unhonoured(what: str, why: str) -> None:
    """Warn, once per process for each `what`, that the backend cannot honour it."""
    if what in _warned:
        return
    _warned.add(what)
    warnings.warn(f"{what} is not honoured here: {why}", UserWarning, stacklevel=4)
