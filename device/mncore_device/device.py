"""`MNDevice`: which device a Context runs on, parsed from an MLSDK device string."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from dataclasses import dataclass
from enum import StrEnum

import torch

from .errors import MLSDKNotInstalledError

EMULATED = "pfvm"
HARDWARE = "mncore2"


class Backend(StrEnum):
    """Which implementation runs a device (a str: `Backend.MLSDK == "mlsdk"`)."""

    EMULATOR = "emulator"  # this package's emulated MN-Core
    MLSDK = "mlsdk"  # PFN's MLSDK: real hardware, or MLSDK's own virtual machine (pfvm)


BACKENDS = tuple(Backend)


# A file in the `mlsdk` package that mncore-lightning installs where PFN's MLSDK is absent
# (compat/mlsdk): it marks that package as the emulator's stand-in, never the real MLSDK.
STAND_IN_MARKER = "_mncore_stand_in.py"


def is_stand_in(spec: importlib.machinery.ModuleSpec | None) -> bool:
    """Whether `spec` is mncore-lightning's stand-in `mlsdk` package."""
    locations = (spec.submodule_search_locations or []) if spec is not None else []
    return any(os.path.isfile(os.path.join(loc, STAND_IN_MARKER)) for loc in locations)


def real_mlsdk_spec() -> importlib.machinery.ModuleSpec | None:
    """The spec of PFN's MLSDK (module `mlsdk`) if one is importable, else None.

    The stand-in `mlsdk` this package installs does not count: where it is found first (it
    was imported already, or sits earlier on sys.path), the rest of sys.path is searched."""
    try:
        spec = importlib.util.find_spec("mlsdk")
    except ValueError:  # sys.modules["mlsdk"] without a __spec__
        return None
    if spec is None or not is_stand_in(spec):
        return spec
    own = {os.path.realpath(os.path.dirname(loc)) for loc in spec.submodule_search_locations}
    path = [p for p in sys.path if os.path.realpath(p or os.curdir) not in own]
    spec = importlib.machinery.PathFinder.find_spec("mlsdk", path)
    return None if spec is None or is_stand_in(spec) else spec


def mlsdk_available() -> bool:
    """True when PFN's MLSDK can be imported on this machine (the stand-in is not MLSDK)."""
    return real_mlsdk_spec() is not None


def mlsdk_missing_message(what: str) -> str:
    """What to do when `what` needs MLSDK and it is not importable."""
    return (
        f"{what} needs PFN's MLSDK (Python module 'mlsdk'), which is not importable here. "
        "MLSDK ships with the MN-Core SDK and is not on PyPI: on an MN-Core machine, run in the "
        "SDK's Python environment (PFN's examples source codegen_pythonpath.sh from the SDK's "
        "build directory, /opt/pfn/pfcomp/codegen/build on SDK images; see "
        "https://dev.mn-core.com). Without MN-Core, use the emulator: 'pfvm:cpu' or 'pfvm:cuda'."
    )


def resolve_backend(device: MNDevice | str, backend: str | None = None) -> Backend:
    """Which implementation runs `device`: "mlsdk" (PFN's SDK) or "emulator" (this package).

    The device string decides unless `backend` is given: "mncore2:*" is real hardware and runs
    on MLSDK; "pfvm:*" runs on the emulator, or on MLSDK's own virtual machine with
    backend="mlsdk". Choosing MLSDK without MLSDK installed raises MLSDKNotInstalledError.
    """
    platform = device.platform if isinstance(device, MNDevice) else str(device).partition(":")[0]
    if backend is None:
        backend = Backend.MLSDK if platform == HARDWARE else Backend.EMULATOR
    elif backend not in BACKENDS:
        raise ValueError(f"unknown MN-Core backend {backend!r}: use 'emulator' or 'mlsdk'")
    backend = Backend(backend)
    if backend is Backend.EMULATOR and platform == HARDWARE:
        raise ValueError(
            f"device {str(device)!r} is real MN-Core hardware, which runs on MLSDK: the emulator "
            "backend runs 'pfvm:cpu' or 'pfvm:cuda'"
        )
    if backend is Backend.MLSDK and not mlsdk_available():
        raise MLSDKNotInstalledError(mlsdk_missing_message(f"MN-Core device {str(device)!r}"))
    return backend


@dataclass(frozen=True, init=False)
class MNDevice:
    """A device string such as "pfvm:cpu", "pfvm:cuda", "mncore2:auto" or "mncore2:3".

    "pfvm:*" is the emulated MN-Core of this package: device memory is host memory
    (cpu) or the memory of a CUDA GPU (cuda). "mncore2:*" is real hardware and needs MLSDK.
    `platform` is the part before the first colon ("pfvm", "mncore2"), `target` the rest
    ("cpu", "cuda:1", "auto", "3").
    """

    platform: str
    target: str
    torch_device: torch.device

    def __init__(self, spec: str = "pfvm:cpu") -> None:
        platform, _, target = str(spec).partition(":")
        if platform == HARDWARE:
            if not (target == "auto" or target.isdigit()):
                raise ValueError(f"MNDevice({spec!r}): use 'mncore2:auto' or 'mncore2:N'")
            if not mlsdk_available():
                raise MLSDKNotInstalledError(mlsdk_missing_message(f"MNDevice({spec!r})"))
            torch_device = torch.device("cpu")
        elif platform == EMULATED:
            torch_device = _emulated_torch_device(spec, target)
        else:
            raise ValueError(
                f"unknown MN-Core device {spec!r}: expected 'pfvm:cpu', 'pfvm:cuda', "
                "'mncore2:auto' or 'mncore2:N'"
            )
        object.__setattr__(self, "platform", platform)
        object.__setattr__(self, "target", target)
        object.__setattr__(self, "torch_device", torch_device)

    @property
    def is_emulated(self) -> bool:
        return self.platform == EMULATED

    def __str__(self) -> str:
        return f"{self.platform}:{self.target}"


def _emulated_torch_device(spec: str, target: str) -> torch.device:
    backend, _, number = target.partition(":")
    if backend == "cpu" and not number:
        return torch.device("cpu")
    if backend == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"MNDevice({spec!r}): CUDA is not available; use 'pfvm:cpu'")
        return torch.device("cuda", int(number) if number else torch.cuda.current_device())
    raise ValueError(f"unknown emulated device {spec!r}: expected 'pfvm:cpu' or 'pfvm:cuda[:N]'")
