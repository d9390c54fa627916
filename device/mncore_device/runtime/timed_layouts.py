"""Layout decisions timed on this machine, made once and remembered.

Which memory layout runs a graph's convolutions (`convolution_layout`) or a linear layer's
matmuls (`matmul_layout`) faster depends on shapes, libraries and the machine in ways no
rule predicts, so both are timed at compile time. A decision is kept per description of
what was timed, thread count, device and torch version, in this process and in Inductor's
cache directory: a warm compile, in this process or another, does not time again."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

FILE_NAME = "mncore_layout_decisions.json"  # in Inductor's cache directory
_DECIDED: dict[str, bool] = {}  # this process's decisions, by key


def other_layout_is_faster(
    described: object,
    device: torch.device,
    time_both: Callable[[], tuple[float, float]],
    cache_dir: Path | None = None,
) -> bool:
    """Whether `time_both()` (seconds in the stored layout, then in the other) found the
    other layout faster, for what `described` (JSON-able, naming what is timed) describes."""
    text = json.dumps(
        [described, device.type, torch.get_num_threads(), torch.__version__], default=str
    )
    key = hashlib.sha256(text.encode()).hexdigest()[:32]
    if key in _DECIDED:
        return _DECIDED[key]
    path = (cache_dir or _inductor_cache_dir()) / FILE_NAME
    remembered = _read(path)
    if key not in remembered:
        stored, other = time_both()
        remembered = {**_read(path), key: other < stored}
        _write(path, remembered)
    _DECIDED[key] = bool(remembered[key])
    return _DECIDED[key]


def _inductor_cache_dir() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


def _read(path: Path) -> dict[str, bool]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, decisions: dict[str, bool]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{path.name}.{os.getpid()}")
        staging.write_text(json.dumps(decisions))
        os.replace(staging, path)
    except OSError:  # a read-only cache: the decision stays in this process
        pass
