"""`Context.compile(...)`: an MLSDK-style step captured by TorchDynamo (the default).

The step is written as PFN's MLSDK scripts write it (zero_grad, forward, `loss.backward()`,
`optimizer.step()` of torch.optim optimizers), compiled once, and compared with the same step
run eagerly: bit for bit. Python values the step reads (a global, a closure cell, an
optimizer's learning rate) are not frozen: a change re-compiles (reported, bounded) or reaches
the device as an input. The backend, MLSDK's included, is handed a replay of the captured
graph, never the user's function.
"""

from __future__ import annotations

import math
import runpy
import textwrap
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mncore_device
from mncore_device import Context, MNDevice, StaticGraphError, storage
from mncore_device.capture.compiled_step import CapturedFunction, RecompileWarning, is_replay
from tests.device.device_testing import (
    classification_batches,
    clone_state,
    line_of,
    make_sgd,
    register,
    twin,
)

O0 = {"option_json": "O0"}
SCALE = 1.0  # a global the step reads (changed by a test)
OFFSET = torch.zeros(2)  # a global tensor the step reads (replaced by a test)


def small_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def mlsdk_step(model: nn.Module, optimizer: torch.optim.Optimizer):
    def step(inputs):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs["x"]), inputs["t"]) * SCALE
        loss.backward()
        optimizer.step()
        return {"loss": loss, "logits_sum": model(inputs["x"]).detach().sum()}

    return step


def compile_dynamo(context: Context, step, sample, **kwargs) -> CapturedFunction:
    compiled = context.compile(step, sample, options=O0, **kwargs)  # the default: Dynamo
    assert isinstance(compiled, CapturedFunction)
    return compiled


def assert_same_state(model: nn.Module, reference: nn.Module) -> None:
    theirs = reference.state_dict()
    for name, ours in model.state_dict().items():
        assert torch.equal(ours, theirs[name]), name


def train_both(context, compiled, step, model, reference, batches):
    """Run the compiled step and the eager step on the same batches; compare each output."""
    for batch in batches:
        ours = context.to_host(compiled(batch))
        theirs = step(batch)
        assert ours.keys() == theirs.keys()
        for key in ours:
            assert torch.equal(ours[key], theirs[key].detach()), key
    context.synchronize()
    assert_same_state(model, reference)


# --- training steps with torch.optim optimizers -----------------------------------------------


def test_sgd_momentum_step_with_backward_is_one_device_call(context):
    model = small_model()
    reference = twin(model)
    optimizer = make_sgd(model.parameters(), lr=0.1, momentum=0.9)
    eager = mlsdk_step(reference, make_sgd(reference.parameters(), lr=0.1, momentum=0.9))
    register(context, model, optimizer)
    batches = classification_batches(5, 8, 4, 2)
    before = clone_state(model)
    compiled = compile_dynamo(context, mlsdk_step(model, optimizer), batches[0])
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing ran
    assert all(p.grad is None for p in model.parameters())
    (graph,) = compiled.frontend.graphs  # ONE graph: backward and update inside
    assert compiled.frontend.device_calls == 1
    targets = [str(n.target) for n in graph.graph_module.graph.nodes if n.op == "call_function"]
    assert any("mncore_backward" in t for t in targets)
    assert any("mncore_SGD_step" in t for t in targets)
    train_both(context, compiled, eager, model, reference, batches)
    assert compiled.functions[0].calls == len(batches)  # one device call per step
    assert compiled.retraces == []
    assert not any(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_adam_registered_by_name_trains_as_eager_and_follows_its_learning_rate(context):
    import mncore_lightning.optimizers  # noqa: F401 - installs the registry's converter

    model = small_model()
    reference = twin(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    eager_optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    context.registry.register("model", model)
    context.registry.register("adam", optimizer)  # its state now exists, on the device
    batches = classification_batches(6, 8, 4, 2)
    compiled = compile_dynamo(context, mlsdk_step(model, optimizer), batches[0])
    eager = mlsdk_step(reference, eager_optimizer)
    train_both(context, compiled, eager, model, reference, batches[:3])
    for group in (*optimizer.param_groups, *eager_optimizer.param_groups):
        group["lr"] = 0.03  # a scheduler, say: a live value of the device, no re-compile
    train_both(context, compiled, eager, model, reference, batches[3:])
    assert compiled.retraces == [] and len(compiled.functions) == 1


def test_a_subclass_of_a_torch_optimizer_runs_its_own_step(context):
    class ClippedSGD(torch.optim.SGD):
        """A user's optimizer: clamps every update to +-0.05."""

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for param in group["params"]:
                    param.add_((-group["lr"] * param.grad).clamp(-0.05, 0.05))

    model = small_model()
    reference = twin(model)
    optimizer = ClippedSGD(model.parameters(), lr=0.5)
    register(context, model, optimizer)
    batches = classification_batches(4, 8, 4, 2)
    compiled = compile_dynamo(context, mlsdk_step(model, optimizer), batches[0])
    eager = mlsdk_step(reference, ClippedSGD(reference.parameters(), lr=0.5))
    train_both(context, compiled, eager, model, reference, batches)
    targets = [str(n.target) for n in compiled.frontend.graphs[0].graph_module.graph.nodes]
    assert any("mncore_ClippedSGD_step" in t for t in targets)


def test_a_changed_torch_optim_learning_rate_recompiles_instead_of_freezing(context):
    """torch.optim.SGD's step reads lr as a Python float: it is guarded, never frozen."""
    model = small_model()
    reference = twin(model)
    optimizer = make_sgd(model.parameters(), lr=0.1, momentum=0.9)
    eager_optimizer = make_sgd(reference.parameters(), lr=0.1, momentum=0.9)
    register(context, model, optimizer)
    batches = classification_batches(4, 8, 4, 2)
    compiled = compile_dynamo(context, mlsdk_step(model, optimizer), batches[0])
    eager = mlsdk_step(reference, eager_optimizer)
    train_both(context, compiled, eager, model, reference, batches[:2])
    optimizer.param_groups[0]["lr"] = eager_optimizer.param_groups[0]["lr"] = 0.05
    with pytest.warns(RecompileWarning, match=r"param_groups.*\['lr'\]"):
        train_both(context, compiled, eager, model, reference, batches[2:])
    assert len(compiled.retraces) == 1 and len(compiled.functions) == 2


# --- Python values the step reads ----------------------------------------------------------


def test_a_changed_global_recompiles_with_a_report_and_is_not_frozen(context):
    global SCALE
    model = small_model()
    reference = twin(model)
    optimizer = make_sgd(model.parameters(), momentum=0.0)
    register(context, model, optimizer)
    batches = classification_batches(5, 8, 4, 2)
    compiled = compile_dynamo(context, mlsdk_step(model, optimizer), batches[0])
    eager = mlsdk_step(reference, make_sgd(reference.parameters(), momentum=0.0))
    try:
        train_both(context, compiled, eager, model, reference, batches[:2])
        SCALE = 2.0
        with pytest.warns(RecompileWarning, match="SCALE") as reports:
            train_both(context, compiled, eager, model, reference, batches[2:3])
        assert "test_capture_compile.py" in str(reports[0].message)  # the user's line
        SCALE = 0.5  # a number that changed twice: a graph input from now on
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RecompileWarning)
            train_both(context, compiled, eager, model, reference, batches[3:])
    finally:
        SCALE = 1.0
    assert 1 <= len(compiled.retraces) <= 2


def test_a_changed_closure_cell_is_not_frozen(context):
    model = small_model()
    reference = twin(model)
    optimizer = make_sgd(model.parameters(), momentum=0.0)
    register(context, model, optimizer)
    shift = 0.0

    def make_step(model, optimizer):
        def step(inputs):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(inputs["x"] + shift), inputs["t"])
            loss.backward()
            optimizer.step()
            return {"loss": loss}

        return step

    batches = classification_batches(3, 8, 4, 2)
    compiled = compile_dynamo(context, make_step(model, optimizer), batches[0])
    eager = make_step(reference, make_sgd(reference.parameters(), momentum=0.0))
    train_both(context, compiled, eager, model, reference, batches[:1])
    shift = 0.25
    with pytest.warns(RecompileWarning, match="shift"):
        train_both(context, compiled, eager, model, reference, batches[1:])


class _Knobs:
    """Values a step reads from a plain object: a tuple and a NumPy scalar."""

    def __init__(self) -> None:
        self.pair = (1.0, 2.0)
        self.np_scale = np.float64(0.5)


def _knob_step(model, optimizer, knobs):
    def step(inputs):
        optimizer.zero_grad()
        group = optimizer.param_groups[0]
        logits = model(inputs["x"]) * knobs.pair[1] * float(knobs.np_scale)
        loss = F.cross_entropy(logits, inputs["t"]) * math.sqrt(group["lr"] * 10)
        loss.backward()
        optimizer.step()
        return {"loss": loss}

    return step


def test_tuple_numpy_and_learning_rate_reads_follow_their_values(context):
    """A tuple attribute, a NumPy scalar and `math.sqrt(group["lr"])`: after each change the
    compiled step computes what eager does (re-compiled, reported at the user's line, or
    the value is a device input)."""
    model = small_model()
    reference = twin(model)
    optimizer = make_sgd(model.parameters(), lr=0.1, momentum=0.9)
    eager_optimizer = make_sgd(reference.parameters(), lr=0.1, momentum=0.9)
    register(context, model, optimizer)
    knobs, eager_knobs = _Knobs(), _Knobs()
    batches = classification_batches(7, 8, 4, 2)
    compiled = compile_dynamo(context, _knob_step(model, optimizer, knobs), batches[0])
    eager = _knob_step(reference, eager_optimizer, eager_knobs)
    changes = [
        lambda k, o: setattr(k, "pair", (1.0, 3.0)),
        lambda k, o: setattr(k, "np_scale", np.float64(0.25)),
        lambda k, o: o.param_groups[0].update(lr=0.05),
        lambda k, o: setattr(k, "pair", (1.0, 0.5)),
        lambda k, o: setattr(k, "np_scale", np.float64(2.0)),
        lambda k, o: o.param_groups[0].update(lr=0.02),
    ]
    train_both(context, compiled, eager, model, reference, batches[:1])
    for change, batch in zip(changes, batches[1:], strict=True):
        change(knobs, optimizer)
        change(eager_knobs, eager_optimizer)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RecompileWarning)
            train_both(context, compiled, eager, model, reference, [batch])
        for warning in caught:
            if issubclass(warning.category, RecompileWarning):
                assert "test_capture_compile.py" in str(warning.message)
    assert 1 <= len(compiled.retraces) <= len(changes)


def test_a_tensor_the_step_reads_that_is_replaced_becomes_an_input_naming_it(context):
    """A tensor the step reads besides its inputs is device memory: changed in place it is
    uploaded again; replaced by another tensor, it is an input of every call from then on
    (one re-compile, reported, naming it), as a number that changes is."""
    global OFFSET
    model = small_model()
    register(context, model)
    batch = classification_batches(1, 8, 4, 2)[0]

    def step(inputs):
        return {"y": model(inputs["x"]) + OFFSET}

    def expected():
        with torch.no_grad():
            return step(batch)["y"]

    try:
        compiled = compile_dynamo(context, step, batch)
        assert torch.equal(compiled(batch)["y"], expected())
        OFFSET.add_(1.0)  # in place: the device constant follows, no re-compile
        assert torch.equal(compiled(batch)["y"], expected()) and compiled.retraces == []
        OFFSET = torch.full((2,), -3.0)
        with pytest.warns(RecompileWarning, match=r"OFFSET is another tensor.*every call"):
            assert torch.equal(compiled(batch)["y"], expected())
        for value in range(3):
            OFFSET = torch.full((2,), float(value))
            assert torch.equal(compiled(batch)["y"], expected())
        assert len(compiled.retraces) == 1 and len(compiled.functions) == 2
    finally:
        OFFSET = torch.zeros(2)


def test_a_parameter_replaced_at_every_call_stops_at_max_retraces_naming_it(context):
    """A replaced parameter stays device state (it trains), compiled again on the new one."""
    model = small_model()
    optimizer = make_sgd(model.parameters(), momentum=0.0)
    register(context, model, optimizer)
    batch = classification_batches(1, 8, 4, 2)[0]
    compiled = compile_dynamo(context, mlsdk_step(model, optimizer), batch, max_retraces=2)
    compiled(batch)
    with pytest.raises(StaticGraphError, match=r"max_retraces=2.*'bias'.*another tensor"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the re-compiles, the unregistered parameter
            for _ in range(3):
                model[2].bias = nn.Parameter(torch.zeros(2))
                optimizer.param_groups[0]["params"][-1] = model[2].bias
                compiled(batch)


def test_other_strides_or_requires_grad_of_an_input_do_not_recompile(context):
    """The device takes contiguous inputs without autograd history: so does the capture."""
    model = small_model()
    register(context, model)
    batch = classification_batches(1, 8, 4, 2)[0]
    compiled = compile_dynamo(context, lambda b: {"y": model(b["x"])}, {"x": batch["x"]})
    with torch.no_grad():
        expected = model(batch["x"])
    for x in (batch["x"].t().contiguous().t(), batch["x"].clone().requires_grad_()):
        assert torch.equal(compiled({"x": x})["y"], expected)
    assert compiled.retraces == [] and len(compiled.functions) == 1


def test_a_read_that_changes_at_every_call_stops_at_max_retraces_naming_it(context):
    mode = {"activation": "relu"}
    model = small_model()

    def step(inputs):
        hidden = model[0](inputs["x"])
        hidden = getattr(torch, mode["activation"])(hidden)
        return {"out": model[2](hidden)}

    register(context, model)
    batch = classification_batches(1, 8, 4, 2)[0]
    compiled = compile_dynamo(context, step, batch, max_retraces=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecompileWarning)
        for name in ("tanh", "sigmoid", "relu"):  # relu: the first graph, no re-compile
            mode["activation"] = name
            with torch.no_grad():
                expected = step(batch)["out"]
            assert torch.equal(compiled(batch)["out"], expected)
        assert len(compiled.retraces) == 2
        mode["activation"] = "selu"
        with pytest.raises(StaticGraphError, match=r"max_retraces=2.*activation"):
            compiled(batch)


# --- what cannot be one device call ---------------------------------------------------------


def clipping_step(model: nn.Module, optimizer: torch.optim.Optimizer):
    """PFN-style step that reads and changes the gradients between backward and step: clips
    them by norm, then halves the first layer's in place."""

    def step(inputs):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs["x"]), inputs["t"])
        loss.backward()
        norm = nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        first = next(iter(model.parameters()))
        first.grad.mul_(0.5)
        optimizer.step()
        return {"loss": loss.detach(), "norm": norm}

    return step


def test_gradients_read_and_changed_after_backward_are_in_the_graph_as_eager(context):
    """`.grad` after loss.backward() is a graph node giving the gradient the backward
    computed: clipping by hand and an in-place change run in the one device call, before
    the update, bit-identical to eager at O0."""
    model = small_model()
    reference = twin(model)
    optimizer = make_sgd(model.parameters(), momentum=0.9)
    register(context, model, optimizer)
    batches = classification_batches(4, 8, 4, 2)
    compiled = compile_dynamo(context, clipping_step(model, optimizer), batches[0])
    eager = clipping_step(reference, make_sgd(reference.parameters(), momentum=0.9))
    train_both(context, compiled, eager, model, reference, batches)
    assert compiled.retraces == [] and len(compiled.functions) == 1


def test_reading_a_gradient_the_backward_did_not_compute_names_it(context):
    model = small_model()
    unused = nn.Parameter(torch.zeros(3))
    optimizer = make_sgd(model.parameters(), momentum=0.0)
    register(context, model, optimizer)

    def step(inputs):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs["x"]), inputs["t"])
        loss.backward()
        return {"loss": loss.detach(), "g": unused.grad * 2}

    batch = classification_batches(1, 8, 4, 2)[0]
    with pytest.raises(StaticGraphError, match=r"gradient of a tensor of shape \[3\]"):
        compile_dynamo(context, step, batch)


def test_host_control_flow_on_a_value_names_the_line(context):
    model = small_model()
    register(context, model)

    def step(inputs):
        out = model(inputs["x"])
        if out.sum().item() > 0:
            out = out * 2
        return {"out": out}

    with pytest.raises(StaticGraphError) as info:
        compile_dynamo(context, step, classification_batches(1, 8, 4, 2)[0])
    assert f"test_capture_compile.py:{line_of(step, 'if out.sum()')}" in str(info.value)


def test_dynamo_is_the_default_trace_the_option_and_replays_are_traced(context, monkeypatch):
    model = small_model()
    register(context, model)
    batch = classification_batches(1, 8, 4, 2)[0]

    def forward(inputs):
        return {"y": model(inputs["x"])}

    monkeypatch.delenv("MNCORE_DEVICE_CAPTURE", raising=False)
    captured = context.compile(forward, batch, options=O0)
    assert isinstance(captured, CapturedFunction)
    (function,) = captured.functions  # what the backend compiled: the replay, traced
    assert not isinstance(function, CapturedFunction)
    traced = context.compile(forward, batch, options=O0, capture="trace")
    assert not isinstance(traced, CapturedFunction)
    monkeypatch.setenv("MNCORE_DEVICE_CAPTURE", "trace")  # before/after measurements
    assert not isinstance(context.compile(forward, batch, options=O0), CapturedFunction)
    explicit = context.compile(forward, batch, options=O0, capture="dynamo")
    assert isinstance(explicit, CapturedFunction)
    with torch.no_grad():
        expected = model(batch["x"])
    for compiled in (captured, traced, explicit):
        assert torch.equal(compiled(batch)["y"], expected)
    with pytest.raises(ValueError, match="capture"):
        context.compile(lambda inputs: inputs, batch, capture="jit")


# --- scripts run one after another in one process ----------------------------------------------

_SCRIPT = """
    import copy

    import torch
    import torch.nn.functional as F
    from torch import nn

    from mncore_device import (
        Context, MNDevice, set_buffer_name_in_optimizer, set_tensor_name_in_module,
    )

    torch.manual_seed({seed})
    {name} = nn.Sequential(nn.Linear(4, {hidden}), nn.ReLU(), nn.Linear({hidden}, 2))
    reference = copy.deepcopy({name})
    optimizer = torch.optim.SGD({name}.parameters(), lr=0.1)
    context = Context(MNDevice("pfvm:cpu"))
    Context.switch_context(context)
    set_tensor_name_in_module({name}, "{name}")
    for p in {name}.parameters():
        context.register_param(p)

    def train_step(inp):
        optimizer.zero_grad()
        loss = F.cross_entropy({name}(inp["x"]), inp["t"])
        loss.backward()
        optimizer.step()
        return {{"loss": loss}}

    batch = {{"x": torch.randn(8, 4), "t": torch.randint(0, 2, (8,))}}
    compiled = context.compile(train_step, batch, options={{"option_json": "O0"}})
    losses = [compiled(batch)["loss"].item() for _ in range(3)]
    context.synchronize()
    {name}, trained = reference, {name}  # the eager step reads the global {name}
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    assert losses == [train_step(batch)["loss"].item() for _ in range(3)], losses
    assert all(torch.equal(a, b) for a, b in zip(trained.parameters(), reference.parameters()))
"""


def test_two_scripts_run_one_after_another_in_one_process(tmp_path):
    """runpy (as tests, notebooks and `python -m` do) runs each script as a new module named
    `__main__`: the second script's step reads its own globals, not the first's (Dynamo once
    looked the module up through a cache that kept the first `__main__` it found)."""
    for index, (name, hidden) in enumerate([("net", 3), ("model", 5)]):
        script = tmp_path / f"script_{index}.py"
        code = _SCRIPT.format(seed=index, name=name, hidden=hidden)
        script.write_text(textwrap.dedent(code))
        names = runpy.run_path(str(script), run_name="__main__")
        assert isinstance(names["compiled"], CapturedFunction)
        assert names["compiled"].retraces == []


# --- the MLSDK backend receives a replay --------------------------------------------------------


@pytest.mark.skipif(mncore_device.mlsdk_available(), reason="MLSDK is installed here")
def test_the_mlsdk_backend_receives_a_replay_of_the_captured_graph(monkeypatch, tmp_path):
    from mncore_lightning.optimizers import MNCoreSGD, device_optimizer
    from tests.fake_mlsdk import install as fake

    def run(device: str, codegen_dir) -> tuple[list[float], nn.Module, list]:
        torch.manual_seed(0)
        context = Context(MNDevice(device))
        Context.switch_context(context)
        model = nn.Linear(10, 1)
        register(context, model)
        optimizer = device_optimizer(context, MNCoreSGD(model.parameters(), 0.1, 0.9, 0.0))
        mncore_device.set_buffer_name_in_optimizer(optimizer, "optim0")
        context.register_optimizer_buffers(optimizer)

        def train_step(inputs):
            optimizer.zero_grad()
            loss = torch.relu(model(inputs["x"])).sum()
            loss.backward()
            optimizer.step()
            return {"loss": loss}

        received = []
        sdk_context = getattr(context, "sdk_context", None)
        if sdk_context is not None:  # what MLSDK's compile is handed
            original = sdk_context.compile

            def recording(function, *args, **kwargs):
                received.append(function)
                return original(function, *args, **kwargs)

            monkeypatch.setattr(sdk_context, "compile", recording)
        sample = {"x": torch.ones(1, 10)}
        compiled = context.compile(train_step, sample, storage.path(codegen_dir), options=O0)
        losses = [compiled(sample)["loss"].item() for _ in range(5)]
        context.synchronize()
        assert received == [] or received[0] is not train_step
        return losses, model, received

    expected, emulated, _ = run("pfvm:cpu", tmp_path / "emulator")
    with fake.installed(monkeypatch):
        losses, model, received = run("mncore2:auto", tmp_path / "mlsdk")
    (function,) = received
    assert is_replay(function) and function.__code__ is not None
    assert "compiled_step.py" in function.__code__.co_filename  # the replay, not user code
    assert losses == expected
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), emulated.parameters(), strict=True)
    )


def test_a_function_compiled_in_eval_mode_stays_in_eval_mode(context):
    """PFN's scripts compile the evaluation under model.eval(), then go back to train mode:
    the mode at compile is part of the compiled function (as on MLSDK), not a re-compile."""
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    optimizer = make_sgd(model.parameters(), momentum=0.0)
    register(context, model, optimizer)
    batches = classification_batches(3, 8, 4, 2)
    train = compile_dynamo(context, mlsdk_step(model, optimizer), batches[0])
    model.eval()
    evaluate = compile_dynamo(context, lambda b: {"y": model(b["x"])}, {"x": batches[0]["x"]})
    model.train()
    for batch in batches:
        train(batch)
    logits = evaluate({"x": batches[0]["x"]})["y"]
    assert model.training and all(m.training for m in model.modules())
    context.synchronize()
    model.eval()
    with torch.no_grad():
        assert torch.equal(logits, model(batches[0]["x"]))
    assert train.retraces == [] and evaluate.retraces == []


def test_a_dropped_compiled_function_frees_its_device_function(context):
    """Dynamo keeps what it compiled in a process-wide registry: the device function (its
    device memory, an MLSDK function's codegen directory) must not stay there with it."""
    import gc
    import weakref

    model = small_model()
    register(context, model)
    batch = classification_batches(1, 8, 4, 2)[0]
    compiled = compile_dynamo(context, lambda b: {"y": model(b["x"])}, {"x": batch["x"]})
    compiled({"x": batch["x"]})
    device_function = weakref.ref(compiled.functions[0])
    del compiled
    gc.collect()
    assert device_function() is None
