"""The typed signature of a compiled function's device graph: every backend's artifact says
what each input and output is (parameter, buffer, optimizer state, batch, scalar; user
output, input mutation, state mutation) and which Python values it was captured under."""

from __future__ import annotations

import json
import warnings

import torch
import torch.nn as nn

from mncore_device import storage
from mncore_device.capture.compiled_step import RecompileWarning
from mncore_device.runtime.signature import GraphSignature, InputKind, OutputKind
from tests.device.device_testing import compile_o0, make_sgd, register

SETTINGS = {"scale": 2.0}  # a module-level dict the step reads


def _model_and_step(context):
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    optimizer = make_sgd(model.parameters())
    register(context, model, optimizer)

    def step(inputs):
        optimizer.zero_grad()
        out = model(inputs["x"]) * SETTINGS["scale"]
        loss = out.square().mean()
        loss.backward()
        optimizer.step()
        inputs["total"].add_(loss.detach())  # an input changed in place
        return {"loss": loss}

    return model, optimizer, step


def _sample():
    return {"x": torch.randn(8, 4), "total": torch.zeros(())}


def test_inputs_and_outputs_are_typed(context):
    model, _, step = _model_and_step(context)
    compiled = compile_o0(context, step, _sample())
    signature = compiled.signature
    assert isinstance(signature, GraphSignature)
    kinds = {s.name: s.kind for s in signature.inputs}
    for name, _ in model.named_parameters():
        assert kinds["model@" + name.replace(".", "/")] is InputKind.PARAMETER
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert kinds[f"model@1/{name}"] is InputKind.BUFFER
    optimizer_state = signature.inputs_of(InputKind.OPTIMIZER_STATE)
    assert len(optimizer_state) == 4 and all("momentum_buffer" in n for n in optimizer_state)
    batch = [s for s in signature.inputs if s.kind is InputKind.BATCH]
    assert [s.name for s in batch] == ["x", "total"]
    assert batch[0].source == "L['args'][0]['x']"  # where the step read it
    # the graph's order: state first, then the call's inputs
    assert [s.kind for s in signature.inputs[-2:]] == [InputKind.BATCH, InputKind.BATCH]

    outputs = {s.name: s for s in signature.outputs}
    assert outputs["loss"].kind is OutputKind.USER_OUTPUT
    mutation = [s for s in signature.outputs if s.kind is OutputKind.INPUT_MUTATION]
    assert len(mutation) == 1 and mutation[0].target == "L['args'][0]['total']"
    updated = set(signature.outputs_of(OutputKind.STATE_MUTATION))
    assert set(kinds) - set(signature.inputs_of(InputKind.BATCH)) == updated  # all trained
    # the Python values the graph was captured under, by source
    assert any(g.endswith(".SETTINGS['scale'] == 2.0") for g in signature.guards)
    assert any("param_groups[0]['lr'] == 0.1" in g for g in signature.guards)


def test_a_number_that_changes_is_a_scalar_input(context):
    """A Python number guarded at the first compile is, after it changed once, a scalar input
    of the re-compiled graph (Dynamo's automatic dynamic), no longer a guard; a torch.optim
    hyperparameter stays a guard (its update is traced with the number)."""
    _, optimizer, step = _model_and_step(context)
    compiled = compile_o0(context, step, _sample())
    assert not compiled.signature.inputs_of(InputKind.SCALAR)
    SETTINGS["scale"] = 3.0
    optimizer.param_groups[0]["lr"] = 0.05
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled(_sample())
    finally:
        SETTINGS["scale"] = 2.0
    assert [w.category for w in caught if issubclass(w.category, RecompileWarning)] == [
        RecompileWarning
    ]
    signature = compiled.signature
    scalars = [s for s in signature.inputs if s.kind is InputKind.SCALAR]
    assert len(scalars) == 1 and scalars[0].source.endswith(".SETTINGS['scale']")
    assert not any("SETTINGS['scale'] ==" in g for g in signature.guards)
    assert any(g.endswith("param_groups[0]['lr'] == 0.05") for g in signature.guards)


def test_the_signature_is_in_the_codegen_dir(context, tmp_path):
    _, _, step = _model_and_step(context)
    directory = tmp_path / "codegen"
    compiled = compile_o0(context, step, _sample(), codegen_dir=storage.path(directory))
    specs = json.loads((directory / "specs.json").read_text())
    assert GraphSignature.from_json(specs["signature"]) == compiled.signature
    loaded = context.load_codegen_dir(storage.path(directory))
    assert loaded.signature == compiled.signature


def test_a_traced_function_has_untagged_inputs_as_batch(context):
    """capture="trace" (a function that is already a graph): no Dynamo, no sources or guards;
    state is still typed by its registration."""
    model, _, step = _model_and_step(context)
    compiled = compile_o0(context, step, _sample(), capture="trace")
    signature = compiled.signature
    assert signature.inputs_of(InputKind.BATCH) == ["x", "total"]
    assert all(s.source is None for s in signature.inputs)
    assert signature.guards == ()
    assert len(signature.inputs_of(InputKind.PARAMETER)) == len(list(model.parameters()))
