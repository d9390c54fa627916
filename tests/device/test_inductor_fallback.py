"""A graph TorchInductor cannot compile, or whose compiled code fails on its first call, runs
op by op instead (as O0), with one warning naming the preset and the cause: never a raw
compiler error, and never state left half-updated by the failed call."""

from __future__ import annotations

import pytest
import torch

from mncore_device import InductorFallbackWarning
from tests.device.device_testing import (
    Wrapped,
    assert_state_close,
    classification_batches,
    cross_entropy,
    device_train,
    make_sgd,
    register,
    training_step,
    twin,
)


def _dropout_step(model, optimizer):
    def loss(m, batch):
        return cross_entropy(
            m, {"x": torch.nn.functional.dropout(batch["x"], 0.5), "t": batch["t"]}
        )

    return training_step(model, optimizer, loss)


def _check_trains_as_eager(context, message_pattern):
    model = Wrapped(4, 3)
    reference = twin(model)
    optimizer = make_sgd(model.parameters(), 0.1, 0.9)
    register(context, model, optimizer)
    batches = classification_batches(3, 8, 4, 3)
    with pytest.warns(InductorFallbackWarning, match=message_pattern):
        compiled = context.compile(
            _dropout_step(model, optimizer), batches[0], options={"option_json": "O1"}
        )
        torch.manual_seed(5)
        losses = device_train(compiled, batches)
    context.synchronize()
    torch.manual_seed(5)  # the failed call drew nothing from the stream the step goes on with
    step = _dropout_step(reference, make_sgd(reference.parameters(), 0.1, 0.9))
    expected = [step(batch)["loss"].item() for batch in batches]
    torch.testing.assert_close(losses, expected, rtol=0, atol=1e-6)
    assert_state_close(model, reference)


def test_a_graph_inductor_cannot_compile_runs_op_by_op(context, monkeypatch):
    def failing_compile(*args, **kwargs):
        raise RuntimeError("C++ compile failed: error: 'workspace' was not declared\nmore")

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", failing_compile)
    _check_trains_as_eager(
        context,
        r"^preset O1: TorchInductor could not compile this graph \(RuntimeError: C\+\+ "
        r"compile failed: error: 'workspace' was not declared\); it runs op by op",
    )


def test_a_graph_whose_compiled_code_fails_on_its_first_call_runs_op_by_op(context, monkeypatch):
    """The failing call wrote into the state it was given and drew random numbers before it
    failed: neither reaches the state or the stream the interpreter runs with."""

    def compile_to_failing_code(gm, example_inputs, **kwargs):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        updated = [  # the state the graph updates in place (aten.copy_ into the input)
            placeholders.index(n.args[0])
            for n in gm.graph.nodes
            if n.target is torch.ops.aten.copy_.default and n.args[0] in placeholders
        ]
        assert updated

        def call(*args):
            for i in updated:
                args[i].fill_(123.0)  # a half-run update
            torch.rand(7)
            raise RuntimeError("Expected a proper Tensor but got None for argument #22")

        return call

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", compile_to_failing_code)
    _check_trains_as_eager(context, r"could not run this graph \(RuntimeError: Expected a proper")
