"""Find the line of user code behind a traced op, for error messages."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import traceback
from pathlib import Path

import torch


def _package_dirs(*names: str) -> list[str]:
    """Directories of installed packages, found without importing them."""
    dirs = []
    for name in names:
        spec = importlib.util.find_spec(name)
        for location in (spec.submodule_search_locations or []) if spec else []:
            dirs.append(str(Path(location).resolve()) + os.sep)
    return dirs


# Frames in these directories are library code; an error names the first frame outside them.
_LIBRARY_DIRS: tuple[str, ...] = (
    str(Path(torch.__file__).resolve().parent) + os.sep,
    str(Path(__file__).resolve().parent) + os.sep,
    str(Path(contextlib.__file__).resolve()),
)


def add_library_dirs(*packages: str) -> None:
    """Treat the code of these installed packages (by import name) as library code.

    A framework built on this layer names itself and the libraries it drives here, so that
    errors point at the user's line rather than at the framework's own frames.
    """
    global _LIBRARY_DIRS
    new = [d for d in _package_dirs(*packages) if d not in _LIBRARY_DIRS]
    _LIBRARY_DIRS = _LIBRARY_DIRS + tuple(new)


def _is_library(filename: str) -> bool:
    if filename.startswith("<"):  # generated code (fx, make_fx wrappers), not a notebook cell
        return not filename.startswith(("<stdin>", "<ipython"))
    return _resolved(filename).startswith(_LIBRARY_DIRS)


@functools.lru_cache(maxsize=4096)
def _resolved(filename: str) -> str:
    """A frame's file, symlinks resolved: asked for every frame of every traced op, and each
    resolution is a series of system calls, so it is done once per file."""
    return str(Path(filename).resolve())


def user_frame_summary(
    frames: list[traceback.FrameSummary] | None = None,
) -> traceback.FrameSummary | None:
    """The innermost frame outside torch, Lightning and this package."""
    frames = traceback.extract_stack() if frames is None else frames
    for frame in reversed(frames):
        if not _is_library(frame.filename):
            return frame
    return None


def user_frame(frames: list[traceback.FrameSummary] | None = None) -> str | None:
    """`file:line in function: code` of the innermost frame outside torch and this package."""
    frame = user_frame_summary(frames)
    if frame is None:
        return None
    return f"{frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"


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
