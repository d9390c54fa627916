"""Which MN-Core device a run uses: the strategy argument, then $MNCORE_DEVICE, then a default."""

from __future__ import annotations

import os

import torch

from mncore_device import DEFAULT_PRESET, mlsdk_available

DEVICE_ENV = "MNCORE_DEVICE"
PRESET_ENV = "MNCORE_PRESET"


def default_device() -> str:
    """Real hardware when MLSDK is installed, else the emulator on CUDA, else on the CPU."""
    if mlsdk_available():
        return "mncore2:auto"
    if torch.cuda.is_available():
        return "pfvm:cuda"
    return "pfvm:cpu"


def resolve_device(device: str | None) -> str:
    """The device string to use: explicit argument > $MNCORE_DEVICE > `default_device()`.

    "auto" (or None) means: whatever $MNCORE_DEVICE says, else the default.
    """
    if device and device != "auto":
        return device
    return os.environ.get(DEVICE_ENV) or default_device()


def resolve_preset(preset: str | None) -> str:
    """The compile preset: explicit argument > $MNCORE_PRESET > mncore_device.DEFAULT_PRESET."""
    return preset or os.environ.get(PRESET_ENV) or DEFAULT_PRESET


def rank_device(device: str, local_rank: int) -> str:
    """The device of one data-parallel rank: "pfvm:cuda" and "mncore2:auto" become the rank's
    own ("pfvm:cuda:<local_rank>", "mncore2:<local_rank>"); "pfvm:cpu" is shared by all
    ranks; a numbered device is used as given (the user placed the rank)."""
    if device == "pfvm:cuda":
        return f"pfvm:cuda:{local_rank}"
    if device == "mncore2:auto":
        return f"mncore2:{local_rank}"
    return device
