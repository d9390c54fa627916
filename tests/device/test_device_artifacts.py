"""Codegen directories (`load_codegen_dir`) and the compile cache (`CacheOptions`).

The round trips run in fresh Python processes, as a deployment would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

from mncore_device import CacheOptions, InputSpecError, RegistrationError, storage
from tests.device.device_testing import (
    classification_batches,
    compile_o0,
    cross_entropy,
    device_train,
    eager_train,
    make_sgd,
    new_context,
    register,
    training_step,
    twin,
)


def run_python(script: str, *args: object, env: dict[str, str] | None = None) -> str:
    """Run `script` in a fresh interpreter; return its stdout (fail with its stderr)."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )
    assert result.returncode == 0, f"subprocess failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def bn_model() -> nn.Module:
    # The subprocess scripts below build this same model.
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


# --- load_codegen_dir ---------------------------------------------------------------------

LOAD_AND_TRAIN = """
    import sys
    from pathlib import Path

    import torch
    import torch.nn as nn

    from mncore_device import (
        Context, MNDevice, set_buffer_name_in_optimizer, set_tensor_name_in_module, storage,
    )

    torch.set_num_threads(1)  # as the test process: bit-identical matmuls
    tmp = Path(sys.argv[1])
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    model.load_state_dict(torch.load(tmp / "init.pt"))
    optimizer = torch.optim.SGD(model.parameters(), 0.1, 0.9, 0.0)
    for p in model.parameters():
        optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)

    context = Context(MNDevice("pfvm:cpu"))
    Context.switch_context(context)
    set_tensor_name_in_module(model, "model")
    for p in model.parameters():
        context.register_param(p)
    for b in model.buffers():
        context.register_buffer(b)
    set_buffer_name_in_optimizer(optimizer, "optimizer")
    context.register_optimizer_buffers(optimizer)

    compiled = context.load_codegen_dir(storage.path(tmp / "codegen"))
    losses = [compiled(batch)["loss"].item() for batch in torch.load(tmp / "batches.pt")]
    context.synchronize()
    momentum = [optimizer.state[p]["momentum_buffer"] for p in model.parameters()]
    torch.save(
        {"losses": losses, "model": model.state_dict(), "momentum": momentum}, tmp / "out.pt"
    )
"""


def test_training_step_round_trip_through_a_codegen_dir(context, tmp_path):
    model = bn_model()
    torch.save(model.state_dict(), tmp_path / "init.pt")
    optimizer = make_sgd(model.parameters(), 0.1, 0.9, 0.0)
    register(context, model, optimizer)
    batches = classification_batches(5, 8, 6, 3)
    torch.save(batches, tmp_path / "batches.pt")
    step = training_step(model, optimizer, cross_entropy)
    compiled = compile_o0(context, step, batches[0], codegen_dir=storage.path(tmp_path / "codegen"))
    losses = device_train(compiled, batches)
    context.synchronize()

    run_python(LOAD_AND_TRAIN, tmp_path)
    out = torch.load(tmp_path / "out.pt")
    assert out["losses"] == losses
    for key, value in model.state_dict().items():
        assert torch.equal(out["model"][key], value), key
    for theirs, p in zip(out["momentum"], model.parameters(), strict=True):
        assert torch.equal(theirs, optimizer.state[p]["momentum_buffer"])
    assert out["model"]["3.bias"].ne(bn_model().state_dict()["3.bias"]).any()


LOAD_AND_ADD = """
    import json
    import sys
    from pathlib import Path

    import torch

    from mncore_device import Context, InputSpecError, MNDevice, storage

    tmp = Path(sys.argv[1])
    context = Context(MNDevice("pfvm:cpu"))
    Context.switch_context(context)
    try:  # a bare process: nothing but torch and mncore_device imported so far
        add = context.load_codegen_dir(storage.path(tmp / "codegen"))
        first_try = "ok"
    except Exception as error:
        first_try = f"{type(error).__name__}: {error}"
        import torch._higher_order_ops.triton_kernel_wrap  # noqa: F401  (the workaround)

        add = context.load_codegen_dir(storage.path(tmp / "codegen"))
    torch.save(add(torch.load(tmp / "inputs.pt"))["out"], tmp / "out.pt")
    try:
        add({"x": torch.zeros(2, 3), "y": torch.zeros(2, 3)})
        rejected = False
    except InputSpecError:
        rejected = True
    specs = {k: [list(s.shape), str(s.dtype)] for k, s in add.input_specs.items()}
    outputs = list(add.output_specs)
    print(json.dumps({"first_try": first_try, "specs": specs, "outputs": outputs, "rejected": rejected}))
"""


@pytest.fixture(scope="module")
def add_round_trip(tmp_path_factory):
    """Compile `x + y` into a codegen dir here; load and call it in a fresh process."""
    tmp_path = tmp_path_factory.mktemp("add")
    inputs = {"x": torch.randn(4, 3), "y": torch.randn(4, 3, dtype=torch.float64)}
    torch.save(inputs, tmp_path / "inputs.pt")
    new_context().compile(
        lambda b: {"out": b["x"] + b["y"]},
        inputs,
        storage.path(tmp_path) / "codegen",
        options={"option_json": "O0"},
    )
    report = json.loads(run_python(LOAD_AND_ADD, tmp_path))
    return inputs, torch.load(tmp_path / "out.pt"), report


def test_stateless_add_round_trip_through_a_codegen_dir(add_round_trip):
    inputs, out, report = add_round_trip
    assert report["specs"] == {"x": [[4, 3], "torch.float32"], "y": [[4, 3], "torch.float64"]}
    assert report["outputs"] == ["out"]
    assert report["rejected"] is True
    assert out.dtype == torch.float64
    assert torch.equal(out, inputs["x"] + inputs["y"])


def test_load_codegen_dir_works_in_a_bare_process(add_round_trip):
    assert add_round_trip[2]["first_try"] == "ok"


def test_codegen_dir_loads_into_a_second_context_in_process(context, tmp_path):
    """Same names in another Context: the loaded step trains that context's tensors."""
    model = bn_model()
    optimizer = make_sgd(model.parameters(), 0.1, 0.9)
    register(context, model, optimizer)
    batches = classification_batches(3, 8, 6, 3)
    step = training_step(model, optimizer, cross_entropy)
    compile_o0(context, step, batches[0], codegen_dir=tmp_path / "codegen")

    other = twin(model)
    other_optimizer = make_sgd(other.parameters(), 0.1, 0.9)
    second = new_context()
    register(second, other, other_optimizer)
    loaded = second.load_codegen_dir(tmp_path / "codegen")
    losses = device_train(loaded, batches)
    second.synchronize()

    expected = eager_train(model, make_sgd(model.parameters(), 0.1, 0.9), cross_entropy, batches)
    torch.testing.assert_close(losses, expected, rtol=1e-6, atol=1e-6)


def test_loading_without_registering_names_the_missing_tensor(context, tmp_path):
    model = nn.Linear(3, 2)
    register(context, model)
    compile_o0(
        context, lambda b: {"y": model(b["x"])}, {"x": torch.randn(2, 3)}, codegen_dir=tmp_path
    )
    with pytest.raises(RegistrationError, match="model@weight"):
        new_context().load_codegen_dir(tmp_path)


def test_loading_a_directory_that_is_not_a_codegen_dir_fails(context, tmp_path):
    with pytest.raises(FileNotFoundError, match="not a codegen directory"):
        context.load_codegen_dir(tmp_path)


def test_a_loaded_function_checks_its_inputs(context, tmp_path):
    compile_o0(context, lambda b: {"y": b["x"] * 2}, {"x": torch.randn(4, 2)}, codegen_dir=tmp_path)
    loaded = new_context().load_codegen_dir(tmp_path)
    with pytest.raises(InputSpecError, match="drop_last"):
        loaded({"x": torch.randn(3, 2)})


# --- CacheOptions ------------------------------------------------------------------------

COMPILE_WITH_CACHE = """
    import json
    import sys

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from mncore_device import (
        CacheOptions, Context, MNDevice, set_buffer_name_in_optimizer,
        set_tensor_name_in_module,
    )

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), 0.1, 0.9)
    for p in model.parameters():
        optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    context = Context(MNDevice("pfvm:cpu"))
    Context.switch_context(context)
    set_tensor_name_in_module(model, "model")
    for p in model.parameters():
        context.register_param(p)
    set_buffer_name_in_optimizer(optimizer, "optimizer")
    context.register_optimizer_buffers(optimizer)

    def step(batch):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(batch["x"]), batch["t"])
        loss.backward()
        optimizer.step()
        return {"loss": loss}

    generator = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(8, 4, generator=generator), "t": torch.tensor([0, 1] * 4)}
    compiled = context.compile(
        step, batch, options={"option_json": "O1"}, cache_options=CacheOptions(sys.argv[1])
    )
    losses = [compiled(batch)["loss"].item() for _ in range(3)]
    context.synchronize()
    weight = model.weight.tolist()
    try:  # same shape and dtype, other strides (a transposed copy, as from a permute)
        compiled({"x": batch["x"].t().contiguous().t(), "t": batch["t"]})
        non_contiguous = "ok"
    except Exception as error:
        non_contiguous = f"{type(error).__name__}: {error}"
    print(json.dumps({
        "cache_hit": compiled.cache_hit,
        "compile_seconds": compiled.compile_seconds,
        "losses": losses,
        "weight": weight,
        "non_contiguous": non_contiguous,
    }))
"""


@pytest.fixture(scope="module")
def o1_runs(tmp_path_factory):
    """The slow part: the same O1 compile in two fresh processes sharing one cache dir."""
    env = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}  # no worker pool: faster on 2 cores
    cache = tmp_path_factory.mktemp("o1") / "cache"
    cold = json.loads(run_python(COMPILE_WITH_CACHE, cache, env=env))
    warm = json.loads(run_python(COMPILE_WITH_CACHE, cache, env=env))
    return cold, warm


def test_o1_compile_cache_is_hit_by_a_fresh_process(o1_runs):
    """A real (cold) Inductor compile, then the same compile from the cache."""
    cold, warm = o1_runs
    print(
        f"O1 compile: cold {cold['compile_seconds']:.2f} s, cached {warm['compile_seconds']:.2f} s"
    )

    assert cold["cache_hit"] is False
    assert warm["cache_hit"] is True
    assert warm["compile_seconds"] < cold["compile_seconds"]
    assert warm["losses"] == cold["losses"]
    assert warm["weight"] == cold["weight"]

    # and O1 trains as eager PyTorch does (Inductor may reorder float ops slightly)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    generator = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(8, 4, generator=generator), "t": torch.tensor([0, 1] * 4)}
    expected = eager_train(
        model, make_sgd(model.parameters(), 0.1, 0.9), cross_entropy, [batch] * 3
    )
    torch.testing.assert_close(cold["losses"], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        torch.tensor(cold["weight"]), model.weight.detach(), rtol=1e-5, atol=1e-5
    )


def test_o1_accepts_non_contiguous_inputs(o1_runs):
    assert o1_runs[0]["non_contiguous"] == "ok"


def test_cache_hit_is_false_for_a_different_shape(context, tmp_path):
    """Interpreter presets record cache keys too; a new shape is a new key."""
    options = CacheOptions(storage.path(tmp_path))
    add = lambda b: {"y": b["x"] + 1}  # noqa: E731
    first = context.compile(
        add, {"x": torch.zeros(2)}, options={"option_json": "O0"}, cache_options=options
    )
    same = context.compile(
        add, {"x": torch.ones(2)}, options={"option_json": "O0"}, cache_options=options
    )
    other = context.compile(
        add, {"x": torch.ones(3)}, options={"option_json": "O0"}, cache_options=options
    )
    assert (first.cache_hit, same.cache_hit, other.cache_hit) == (False, True, False)


def test_captured_hyperparameters_keep_their_values_through_a_codegen_dir(tmp_path):
    """MNCoreSGD's lr, momentum and dampening are three unnamed captured scalars: each must
    come back with its own value (they once shared one name in captured.pt)."""
    model = nn.Linear(4, 2)
    reference = twin(model)
    optimizer = make_sgd(model.parameters(), 0.05, 0.9, 0.25, kind="mncore")
    context = new_context()
    register(context, model, optimizer)
    batches = classification_batches(4, 6, 4, 2)
    compile_o0(
        context,
        training_step(model, optimizer, cross_entropy),
        batches[0],
        codegen_dir=tmp_path / "codegen",
    )

    loaded_model = twin(reference)
    loaded_optimizer = make_sgd(loaded_model.parameters(), 0.05, 0.9, 0.25, kind="mncore")
    second = new_context()
    register(second, loaded_model, loaded_optimizer)
    losses = device_train(second.load_codegen_dir(tmp_path / "codegen"), batches)

    expected = eager_train(
        reference, torch.optim.SGD(reference.parameters(), 0.05, 0.9, 0.25), cross_entropy, batches
    )
    torch.testing.assert_close(losses, expected, rtol=1e-6, atol=1e-6)
