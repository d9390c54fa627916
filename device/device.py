"""`MNDevice`: which device a Context runs on, parsed from an MLSDK device string."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from .errors import MLSDKNotInstalledError

EMULATED = "pfvm"
HARDWARE = "mncore2"


def mlsdk_available() -> bool:
    """True when PFN's MLSDK can be imported on this machine."""
    return importlib.util.find_spec("mlsdk") is not None


@dataclass(frozen=True, init=False)
class MNDevice:
    """A device string such as "pfvm:cpu", "pfvm:cuda", "mncore2:auto" or "mncore2:3".

    "pfvm:*" is the emulated MN-Core of this package: device memory is host memory
    (cpu) or the memory of a CUDA GPU (cuda). "mncore2:*" is real hardware and needs MLSDK.
    """

    kind: str
    index: str
    torch_device: torch.device

    def __init__(self, spec: str = "pfvm:cpu") -> None:
        kind, _, index = str(spec).partition(":")
        if kind == HARDWARE:
            if not (index == "auto" or index.isdigit()):
                raise ValueError(f"MNDevice({spec!r}): use 'mncore2:auto' or 'mncore2:N'")
            if not mlsdk_available():
                raise MLSDKNotInstalledError(
                    f"MNDevice({spec!r}) needs PFN's MLSDK (Python module 'mlsdk'), which is not "
                    "installed here. Run on an MN-Core machine with the MN-Core SDK, or use the "
                    "emulator: 'pfvm:cpu' or 'pfvm:cuda'."
                )
            torch_device = torch.device("cpu")
        elif kind == EMULATED:
            torch_device = _emulated_torch_device(spec, index)
        else:
            raise ValueError(
                f"unknown MN-Core device {spec!r}: expected 'pfvm:cpu', 'pfvm:cuda', "
                "'mncore2:auto' or 'mncore2:N'"
            )
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "index", index)
        object.__setattr__(self, "torch_device", torch_device)

    @property
    def is_emulated(self) -> bool:
        return self.kind == EMULATED

    def __str__(self) -> str:
        return f"{self.kind}:{self.index}"


def _emulated_torch_device(spec: str, index: str) -> torch.device:
    backend, _, number = index.partition(":")
    if backend == "cpu" and not number:
        return torch.device("cpu")
    if backend == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"MNDevice({spec!r}): CUDA is not available; use 'pfvm:cpu'")
        return torch.device("cuda", int(number) if number else torch.cuda.current_device())
    raise ValueError(f"unknown emulated device {spec!r}: expected 'pfvm:cpu' or 'pfvm:cuda[:N]'")
