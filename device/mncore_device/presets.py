"""Compile presets (debug, O0 ... O4): JSON files shipped next to this module.

`options={"option_json": ...}` takes a preset file path or a plain preset name.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PRESET_DIR = Path(__file__).with_name("presets")
PRESET_NAMES = ("debug", "O0", "O1", "O2", "O3", "O4")
DEFAULT_PRESET = "O1"
RANDOM_STREAMS = ("eager", "inductor")


@dataclass(frozen=True)
class Preset:
    name: str
    executor: str  # "interpreter" or "inductor"
    check_finite: bool = False
    inductor_mode: str = "default"
    inductor_options: dict[str, Any] = field(default_factory=dict)
    # On the CPU, graphs of at most this many operations get Inductor's C++ wrapper, built
    # with all their kernels as one library: one compiler run instead of one per kernel.
    # Larger graphs keep the Python wrapper, whose kernels compile in parallel (that one
    # library is a single, serial compiler run). None: as inductor_options say.
    cpp_wrapper_max_ops: int | None = None
    # Turn Inductor's layout optimization (convolutions in channels_last, and their weights
    # held so on the device: see state_layout) on for a graph whose convolutions, timed at
    # compile time on this machine (forward and backward), ran faster in channels_last: see
    # convolution_layout.
    channels_last_where_faster: bool = False
    # Store a linear layer's weight (and its optimizer state) transposed where the graph reads
    # it only as `W.t()` (a layer on the batch, as an MLP's first) and its matmuls, timed at
    # compile time on this machine, ran faster so: see matmul_layout.
    transposed_weights_where_faster: bool = False
    # A convolution on feature maps of at most this many pixels (a network's last stages on
    # small images) runs as matrix multiplications: a 1x1 kernel over the pixels as rows, a
    # dense kxk kernel as the linear map between the input's and the output's pixels.
    # oneDNN's convolution was measured far slower on such maps (convolution_rewrites).
    # 0: never.
    matmul_max_pixels: int = 4
    # Which stream random ops (dropout, torch.randn, torch.distributions' rsample) draw from
    # under Inductor. "eager": torch's own generator, in the step's order, the numbers eager
    # draws with the same seed (Inductor's fallback_random). "inductor": Inductor's in-kernel
    # generator, fused into the kernels: other numbers than eager's (same distribution).
    random: str = "eager"
    description: str = ""

    def __post_init__(self) -> None:
        if self.random not in RANDOM_STREAMS:
            raise ValueError(
                f"preset {self.name}: random={self.random!r}; use one of {', '.join(RANDOM_STREAMS)}"
            )

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def preset_path(name: str) -> Path:
    """The shipped JSON file of preset `name`."""
    return PRESET_DIR / f"{name}.json"


def load_preset(option_json: str | os.PathLike[str] | None) -> Preset:
    """A preset from a name ("O1"), a shipped file name ("O1.json") or a JSON file path."""
    if option_json is None:
        option_json = DEFAULT_PRESET
    text = os.fspath(option_json)
    stem = Path(text).stem if text.endswith(".json") else text
    path = Path(text) if Path(text).is_file() else preset_path(stem)
    if not path.is_file():
        raise ValueError(
            f"unknown compile preset {text!r}: use one of {', '.join(PRESET_NAMES)} "
            "or the path of a preset JSON file"
        )
    data = json.loads(path.read_text())
    if data.get("executor") not in ("interpreter", "inductor"):
        raise ValueError(f"preset {path}: 'executor' must be 'interpreter' or 'inductor'")
    return Preset(**data)
