"""Compiling on one roomy chunk of CPython's frame stack.

CPython (3.11 on) keeps the frames of Python calls in chunks of 16 KiB, each mapped from the
OS when a call needs one and unmapped as soon as the call that opened it returns. A loop
that calls a function lying across a chunk's end maps and unmaps a chunk per call, each
with its page faults. Where that happens is a matter of depth, and a compile goes deep:
Dynamo's backend, AOTAutograd's trace and Inductor's lowering and scheduling all loop over
graph nodes from 100-200 frames down. Measured (ResNet-50 at batch 32, O1, 1 thread, fresh
processes, three compiles each way): on one roomy chunk the compile took 40.0-40.3 s against
41.2-43.2 s, with 174,000-191,000 minor page faults against 358,000-377,000. Called from
other depths in trials, the same compile took up to 1.5 million faults more and 8 s longer.

`on_a_roomy_frame_stack` calls a function in a frame whose code claims a value stack of
1 MiB that it does not use: CPython maps a chunk of 2 MiB for that frame, and the 1 MiB left
over holds the thousands of frames below it, so no call under it crosses a chunk's end.
The unused stack is never written, so its pages are never faulted in; the chunk is mapped
and unmapped once per call of `on_a_roomy_frame_stack`: for compiles, not for steps."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, TypeVar

_T = TypeVar("_T")
_SLOTS = 128 * 1024  # 1 MiB of 8-byte slots: CPython maps a chunk of 2 MiB for the frame


def _roomy_caller() -> Callable[..., Any]:
    def call(function, *args, **kwargs):
        return function(*args, **kwargs)

    # The frame's size is its locals plus its value stack's depth, as the code object says;
    # the bytecode uses a few slots of that stack, and the rest is never touched.
    code = call.__code__.replace(co_stacksize=_SLOTS)
    return types.FunctionType(code, call.__globals__, "on_a_roomy_frame_stack")


_CALL = _roomy_caller()


def on_a_roomy_frame_stack(function: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """`function(*args, **kwargs)`, with 1 MiB of CPython's frame stack free below it in
    one chunk (see the module's docstring)."""
    return _CALL(function, *args, **kwargs)
