"""Compiles run on one roomy chunk of CPython's frame stack (runtime/frame_stack.py)."""

from __future__ import annotations

import resource

import pytest
import torch

from mncore_device.runtime import frame_stack
from mncore_device.runtime.frame_stack import on_a_roomy_frame_stack
from tests.device.device_testing import compile_o0


def _depth(n: int) -> int:
    return 0 if n == 0 else _depth(n - 1) + 1


def _worst_page_faults(calls: int = 300, depths: range = range(0, 240)) -> int:
    """The most minor page faults that `calls` calls of a recursion to one depth caused,
    over `depths`: a call whose frames reach across the end of a frame-stack chunk maps and
    unmaps a chunk each time."""
    worst = 0
    for depth in depths:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(calls):
            _depth(depth)
        worst = max(worst, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return worst


def test_calls_under_a_roomy_frame_stack_cross_no_chunk_end():
    plain = _worst_page_faults()
    if plain < 300:
        pytest.skip(f"this CPython kept its frame-stack chunks ({plain} page faults)")
    roomy = on_a_roomy_frame_stack(_worst_page_faults)
    assert roomy < 50, (plain, roomy)


def test_a_roomy_frame_stack_passes_arguments_results_and_errors_through():
    assert on_a_roomy_frame_stack(divmod, 7, 2) == (3, 1)
    assert on_a_roomy_frame_stack(int, "ff", base=16) == 255
    with pytest.raises(ZeroDivisionError):
        on_a_roomy_frame_stack(divmod, 1, 0)


def test_the_capture_compiles_on_a_roomy_frame_stack_and_steps_without_it(context, monkeypatch):
    """Dynamo's backend (the capture's passes and the device's compile) runs there, once per
    compile; the compiled step's calls do not pay for the roomy frame."""
    entered = []
    call = frame_stack._CALL

    def recording(function, *args, **kwargs):
        entered.append(getattr(function, "__name__", function))
        return call(function, *args, **kwargs)

    monkeypatch.setattr(frame_stack, "_CALL", recording)

    def scale(batch):
        return {"out": batch["x"] * 2 + 1}

    batch = {"x": torch.randn(4, 3)}
    compiled = compile_o0(context, scale, batch)
    compiled(batch)
    assert entered == ["_backend"]
    for _ in range(3):
        torch.testing.assert_close(compiled(batch)["out"], batch["x"] * 2 + 1)
    assert entered == ["_backend"]
