"""Find the line of user code behind a traced op, for error messages."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
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
    return _is_library_in(filename, _LIBRARY_DIRS)


@functools.lru_cache(maxsize=4096)
def _is_library_in(filename: str, library_dirs: tuple[str, ...]) -> bool:
    """Cached: tracing asks this for every frame of every op, and resolving paths is slow."""
    if filename.startswith("<"):  # generated code (fx, make_fx wrappers), not a notebook cell
        return not filename.startswith(("<stdin>", "<ipython"))
    return str(Path(filename).resolve()).startswith(library_dirs)


def called_from_user_code() -> bool:
    """Whether the function calling this one was called from user code, not a library's."""
    return not _is_library(sys._getframe(2).f_code.co_filename)


def user_frame_summary(
    frames: list[traceback.FrameSummary] | None = None,
) -> traceback.FrameSummary | None:
    """The innermost frame outside torch, Lightning and this package.

    Without `frames`, the live stack is walked from the innermost frame out and only the
    frame found is summarized (tracing asks this for every op: extracting the whole stack
    each time was a large share of trace time)."""
    if frames is not None:
        return next((f for f in reversed(frames) if not _is_library(f.filename)), None)
    if _replayed and _replayed[-1]:  # an op of a captured graph's replay: its node's line
        found = _replayed_frame(_replayed[-1])
        if found is not None:
            return found
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if not _is_library(code.co_filename):
            return traceback.FrameSummary(code.co_filename, frame.f_lineno, code.co_name)
        frame = frame.f_back
    return None


# The stack traces TorchDynamo recorded on the graph nodes being replayed (innermost last):
# while a captured graph is traced into a device graph, the live stack is the replay's, and
# the user's line of an op is the one Dynamo recorded for its node.
_replayed: list[str | None] = []


@contextlib.contextmanager
def replaying(stack_trace: str | None):
    """Ops run inside are named by `stack_trace`'s user frame (a captured node's)."""
    _replayed.append(stack_trace)
    try:
        yield
    finally:
        _replayed.pop()


@functools.lru_cache(maxsize=1024)
def _replayed_frame(stack_trace: str) -> traceback.FrameSummary | None:
    return user_frame_summary(frames_of(stack_trace))


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
    return user_frame(frames_of(stack_trace))


def frames_of(stack_trace: str) -> list[traceback.FrameSummary]:
    """The frames of a formatted stack (`traceback.format_stack()` text)."""
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
    return frames


def backward_frame_summary() -> traceback.FrameSummary | None:
    """Inside a backward pass, the user frame of the forward op whose gradient is being
    computed, where anomaly mode recorded it (`torch.autograd.set_detect_anomaly(True)`
    during the forward); else None. The live stack of a backward op is the backward call's,
    so without this an op of the backward would be named by the line that called backward."""
    node = torch._C._current_autograd_node()
    if node is None:
        return None
    stack = node.metadata.get("traceback_")
    return user_frame_summary(frames_of("".join(stack))) if stack else None
