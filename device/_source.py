"""Find the line of user code behind a traced op, for error messages."""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import torch

_LIBRARY_DIRS = tuple(
    str(Path(p).resolve().parent) + os.sep
    for p in (torch.__file__, __file__, Path(__file__).parent.parent / "mncore_lightning" / "x")
)
_EXTRA_LIBRARY_MARKERS = (
    f"{os.sep}lightning{os.sep}",
    f"{os.sep}pytorch_lightning{os.sep}",
    f"{os.sep}lightning_fabric{os.sep}",
    f"{os.sep}torchmetrics{os.sep}",
    "<frozen ",
    f"{os.sep}contextlib.py",
)


def _is_library(filename: str) -> bool:
    if filename.startswith("<"):  # generated code (fx, make_fx wrappers), not a notebook cell
        return not filename.startswith(("<stdin>", "<ipython"))
    path = str(Path(filename).resolve())
    return path.startswith(_LIBRARY_DIRS) or any(m in path for m in _EXTRA_LIBRARY_MARKERS)


def user_frame(frames: list[traceback.FrameSummary] | None = None) -> str | None:
    """`file:line in function: code` of the innermost frame outside torch and this package."""
    frames = traceback.extract_stack() if frames is None else frames
    for frame in reversed(frames):
        if not _is_library(frame.filename):
            code = (frame.line or "").strip()
            return f"{frame.filename}:{frame.lineno} in {frame.name}: {code}"
    return None


def user_frame_from_stack_trace(stack_trace: str | None) -> str | None:
    """The user frame of an FX node's recorded `stack_trace` text."""
    if not stack_trace:
        return None
    frames = []
    lines = stack_trace.splitlines()
    for i, line in enumerate(lines):
        line = line.strip()
        if line.startswith('File "'):
            filename, _, rest = line[len('File "') :].partition('", line ')
            lineno, _, name = rest.partition(", in ")
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            if lineno.isdigit():
                frames.append(traceback.FrameSummary(filename, int(lineno), name, line=code))
    return user_frame(frames)
