"""What `Trainer(accelerator="mncore")` would do on this machine, and why: `python -m mncore_lightning`.

The device and preset come from the same functions the strategy calls (`device_selection`),
so the report cannot disagree with a run; only the reasons are worded here.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import sys
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from mncore_device import (
    DEFAULT_PRESET,
    PRESET_NAMES,
    MLSDKNotInstalledError,
    MNDevice,
    load_preset,
)
from mncore_device.device import resolve_backend

from . import device_selection
from .device_selection import DEVICE_ENV, PRESET_ENV, resolve_device, resolve_preset

EXAMPLE_COMMANDS = (
    ("examples/mnist.py", "the MN-Core MNIST tutorial (~40 s, 2 cores)"),
    ("examples/mnist.py --accelerator cpu", "the same on Lightning's cpu accelerator"),
    ("examples/mnist_cnn.py --resume", "a CNN; checkpoints, resume"),
    ("examples/autoencoder.py", "DataModule, reload, ONNX/TorchScript export"),
    ("examples/mlsdk_mnist.py", "the tutorial on the device layer alone"),
)


@dataclass(frozen=True)
class Choice:
    """A value the plugin picks, and the sentence that says why."""

    value: str
    reason: str


def device_choice(environ: Mapping[str, str] | None = None) -> Choice:
    """The device `MNCoreStrategy()` (no `device=`) picks, as `resolve_device` decides."""
    environ = os.environ if environ is None else environ
    value = resolve_device(None)
    if environ.get(DEVICE_ENV):
        try:  # the user's string: check it as a run would, and say so if it would fail
            backend = resolve_backend(MNDevice(value))
            runs_on = "PFN's MLSDK" if backend == "mlsdk" else "this package's emulator"
            return Choice(value, f"${DEVICE_ENV} is set; runs on {runs_on}")
        except (ValueError, MLSDKNotInstalledError) as error:
            return Choice(value, f"${DEVICE_ENV} is set; a run would fail: {error}")
    if device_selection.mlsdk_available():
        reason = "MLSDK is installed: real hardware, on PFN's MLSDK"
    elif torch.cuda.is_available():
        reason = "no MLSDK, CUDA is available: this package's emulator on the GPU"
    else:
        reason = "no MLSDK, no CUDA: this package's emulator on the CPU"
    return Choice(value, f"${DEVICE_ENV} is unset, {reason}")


def preset_choice(environ: Mapping[str, str] | None = None) -> Choice:
    """The preset `MNCoreStrategy()` (no `preset=`) compiles with, and what it does."""
    environ = os.environ if environ is None else environ
    value = resolve_preset(None)
    if environ.get(PRESET_ENV):
        reason = f"${PRESET_ENV} is set"
    else:
        reason = f"${PRESET_ENV} is unset: the default, {DEFAULT_PRESET}"
    try:
        description = load_preset(value).description.split(". ")[0].rstrip(".")
    except ValueError as error:  # a run would fail: say so here
        description = f"a run would fail: {error}"
    return Choice(value, f"{reason}; {description}")


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _own_version() -> str:
    """This package's version: installed metadata, else the checkout's setup.cfg."""
    version = _version("mncore-lightning")
    setup_cfg = Path(__file__).resolve().parents[1] / "setup.cfg"
    if version == "not installed" and setup_cfg.is_file():
        for line in setup_cfg.read_text().splitlines():
            if line.replace(" ", "").startswith("version="):
                return f"{line.split('=', 1)[1].strip()} (source checkout)"
    return version


def _inductor_cache_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    # Importing Lightning already set $TORCHINDUCTOR_CACHE_DIR (to torch's default if unset).
    return f"{cache_dir()} ($TORCHINDUCTOR_CACHE_DIR; MNCoreStrategy(cache_dir=D): D/inductor)"


def _mlsdk_line() -> str:
    if not device_selection.mlsdk_available():
        return (
            "not installed (module 'mlsdk' not importable): 'mncore2:*' devices need the MN-Core "
            "SDK's Python environment; 'pfvm:cpu' / 'pfvm:cuda' run on the emulator"
        )
    from mncore_device.mlsdk_backend import DEFAULT_MLSDK_PRESET_DIR, PRESET_DIR_ENV

    spec = importlib.util.find_spec("mlsdk")
    origin = spec.origin if spec is not None else "?"
    presets = os.environ.get(PRESET_DIR_ENV) or DEFAULT_MLSDK_PRESET_DIR
    return f"installed ({origin}); preset files from {presets} (${PRESET_DIR_ENV})"


def collect() -> dict[str, str]:
    """The report's fields, in order: name -> one line."""
    device, preset = device_choice(), preset_choice()
    cuda = (
        f"available ({torch.cuda.get_device_name(0)})"
        if torch.cuda.is_available()
        else "not available"
    )
    return {
        "mncore-lightning": f"{_own_version()} ({Path(__file__).parent})",
        "python": f"{platform.python_version()} ({sys.executable})",
        "torch": f"{torch.__version__}, {torch.get_num_threads()} threads, "
        f"{os.cpu_count()} CPU cores; CUDA {cuda}",
        "lightning": f"{_version('lightning')}; pytorch_lightning {_version('pytorch_lightning')}"
        f"; torchmetrics {_version('torchmetrics')}",
        "MLSDK": _mlsdk_line(),
        "device": f"{device.value} ({device.reason})",
        "preset": f"{preset.value} ({preset.reason}; choices: {', '.join(PRESET_NAMES)})",
        "strategy": "MNCoreStrategy ('mncore') for devices=1; MNCoreDDPStrategy ('mncore_ddp') "
        "for devices=N or num_nodes=M",
        "inductor cache": _inductor_cache_dir(),
        "codegen dirs": "none unless MNCoreStrategy(codegen_dir=D): each compiled step's graph "
        "under D/<stage>_<n>; the examples use <outdir>/codegen",
    }


def _python_command() -> str:
    """How to call this interpreter: `.venv/bin/python` from the repository root, else python."""
    executable = Path(os.path.abspath(sys.executable))
    if executable.is_relative_to(Path.cwd()):
        return str(executable.relative_to(Path.cwd()))
    return "python"


def report(width: int = 100) -> str:
    """The environment in one screen: versions, what a run would pick and why, where things go."""
    fields = collect()
    indent = max(map(len, fields)) + 2
    lines = ["mncore-lightning environment", ""]
    for name, value in fields.items():
        lines += textwrap.wrap(
            value,
            width,
            initial_indent=f"{name + ':':<{indent}}",
            subsequent_indent=" " * indent,
            break_on_hyphens=False,
        )
    lines += [
        "",
        f"Override with MNCoreStrategy(device=..., preset=...) or ${DEVICE_ENV} / ${PRESET_ENV}.",
    ]
    examples = Path(__file__).resolve().parents[1] / "examples"
    if examples.is_dir():
        python = _python_command()
        lines.append(f"Examples (in {examples}; --help lists their options):")
        pad = max(len(command) for command, _ in EXAMPLE_COMMANDS)
        lines += [f"  {python} {command:<{pad}} # {what}" for command, what in EXAMPLE_COMMANDS]
    else:
        lines.append("Examples: examples/ in the repository (not installed with the package).")
    return "\n".join(lines)
