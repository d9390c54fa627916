"""Codegen directories (`load_codegen_dir`) and the compile cache (`CacheOptions`).

The round trips run in fresh Python processes, as a deployment would.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from mncore_device import (
    CacheOptions,
    CodegenDirError,
    InputSpecError,
    preset_path,
    storage,
)
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

REGISTERED_BN_MODEL = """
    # bn_model() with the initial weights in argv[1]/init.pt and SGD with momentum, all
    # registered in a new Context: the start of the scripts below
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

"""

LOAD_AND_TRAIN = (
    REGISTERED_BN_MODEL
    + """
    trusted = sys.argv[2:] == ["trusted"]
    compiled = context.load_codegen_dir(
        storage.path(tmp / "codegen"), trust_compiled_code=trusted
    )
    losses = [compiled(batch)["loss"].item() for batch in torch.load(tmp / "batches.pt")]
    context.synchronize()
    momentum = [optimizer.state[p]["momentum_buffer"] for p in model.parameters()]
    compiler = "torch._inductor.compile_fx" in sys.modules
    torch.save(
        {"losses": losses, "model": model.state_dict(), "momentum": momentum,
         "compiler_imported": compiler},
        tmp / "out.pt",
    )
"""
)


def _bn_training_step(context, tmp_path, n_batches):
    """A registered BatchNorm model's SGD-momentum step, its initial weights and batches saved
    for LOAD_AND_TRAIN: (model, optimizer, step, batches)."""
    model = bn_model()
    torch.save(model.state_dict(), tmp_path / "init.pt")
    optimizer = make_sgd(model.parameters(), 0.1, 0.9, 0.0)
    register(context, model, optimizer)
    batches = classification_batches(n_batches, 8, 6, 3)
    torch.save(batches, tmp_path / "batches.pt")
    return model, optimizer, training_step(model, optimizer, cross_entropy), batches


def _assert_loaded_training_as_compiled(out, losses, model, optimizer):
    """LOAD_AND_TRAIN's results equal the compiled step's, bit for bit."""
    assert out["losses"] == losses
    for key, value in model.state_dict().items():
        assert torch.equal(out["model"][key], value), key
    for theirs, p in zip(out["momentum"], model.parameters(), strict=True):
        assert torch.equal(theirs, optimizer.state[p]["momentum_buffer"])


def test_training_step_round_trip_through_a_codegen_dir(context, tmp_path):
    model, optimizer, step, batches = _bn_training_step(context, tmp_path, 5)
    compiled = compile_o0(context, step, batches[0], codegen_dir=storage.path(tmp_path / "codegen"))
    losses = device_train(compiled, batches)
    context.synchronize()

    run_python(LOAD_AND_TRAIN, tmp_path)
    out = torch.load(tmp_path / "out.pt")
    _assert_loaded_training_as_compiled(out, losses, model, optimizer)
    assert out["model"]["3.bias"].ne(bn_model().state_dict()["3.bias"]).any()


@pytest.mark.parametrize("cpp_wrapper_max_ops", [1000, 0], ids=["cpp_wrapper", "python_wrapper"])
def test_a_trusted_load_runs_the_compiled_training_step_itself(
    context, tmp_path, cpp_wrapper_max_ops
):
    """An O1 training step with BatchNorm and SGD momentum, loaded trusted by a fresh process
    with an empty Inductor cache: the dir's compiled graph runs directly (Inductor's compiler
    is never imported, so no kernel library is missing) and trains exactly as the compiled
    step did, bit for bit; with either of Inductor's wrappers (the Python one's kernels are
    built a few to a library)."""
    model, optimizer, step, batches = _bn_training_step(context, tmp_path, 3)
    preset = json.loads(preset_path("O1").read_text())
    preset["cpp_wrapper_max_ops"] = cpp_wrapper_max_ops
    (tmp_path / "O1.json").write_text(json.dumps(preset))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # Inductor's CPU code is specialized to it: as the load's process
    try:
        codegen = storage.path(tmp_path / "codegen")
        compiled = context.compile(step, batches[0], codegen, {"option_json": tmp_path / "O1.json"})
        losses = device_train(compiled, batches)
    finally:
        torch.set_num_threads(threads)
    context.synchronize()
    specs = json.loads((tmp_path / "codegen" / "specs.json").read_text())
    assert specs["compiled"]["entry"] in specs["compiled"]["sha256"]

    cache = tmp_path / "empty-inductor-cache"
    run_python(LOAD_AND_TRAIN, tmp_path, "trusted", env={"TORCHINDUCTOR_CACHE_DIR": str(cache)})
    out = torch.load(tmp_path / "out.pt")
    assert not out["compiler_imported"]
    _assert_loaded_training_as_compiled(out, losses, model, optimizer)
    assert out["model"]["1.running_mean"].ne(bn_model().state_dict()["1.running_mean"]).any()


COMPILE_AND_TRAIN = (
    REGISTERED_BN_MODEL
    + """
    def step(batch):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(batch["x"]), batch["t"])
        loss.backward()
        optimizer.step()
        return {"loss": loss.detach()}

    batches = torch.load(tmp / "batches.pt")
    compiled = context.compile(
        step, batches[0], storage.path(tmp / "codegen"), {"option_json": "O1"}
    )
    print([compiled(batch)["loss"].item() for batch in batches])
"""
)


def test_processes_compiling_the_same_step_at_once_share_the_inductor_cache(tmp_path):
    """Data-parallel ranks compile the same step at the same time, into one Inductor cache
    (each into its own codegen dir): both compile, and each dir's compiled code, loaded
    trusted by a fresh process, trains as its compile did."""
    cache = tmp_path / "shared-inductor-cache"
    model, batches = bn_model(), classification_batches(3, 8, 6, 3)
    ranks = [tmp_path / f"rank{rank}" for rank in range(2)]
    for directory in ranks:
        directory.mkdir()
        torch.save(model.state_dict(), directory / "init.pt")
        torch.save(batches, directory / "batches.pt")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(COMPILE_AND_TRAIN), str(directory)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for directory in ranks
    ]
    outputs = [process.communicate(timeout=300) for process in processes]
    for process, (stdout, stderr) in zip(processes, outputs, strict=True):
        assert process.returncode == 0, f"compile failed:\n{stdout}\n{stderr}"
    losses = [json.loads(stdout) for stdout, _ in outputs]
    assert losses[0] == losses[1]
    for directory in ranks:
        run_python(
            LOAD_AND_TRAIN, directory, "trusted", env={"TORCHINDUCTOR_CACHE_DIR": str(cache)}
        )
        out = torch.load(directory / "out.pt")
        assert not out["compiler_imported"]
        assert out["losses"] == losses[0]


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


def test_a_codegen_dir_carries_its_weights_for_a_context_that_registered_none(context, tmp_path):
    """As MLSDK's: PFN's run_pp_llama.py loads each stage without registering the model. The
    dir holds the device values at compile time (here changed on the device only)."""
    model = nn.Linear(3, 2)
    register(context, model)
    new_weight = torch.randn(2, 3)
    context.get_registered_value_proxy(model.weight).load_from(new_weight)
    x = torch.randn(2, 3)
    compile_o0(context, lambda b: {"y": model(b["x"])}, {"x": x}, codegen_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read-only weights: nothing to warn about
        loaded = new_context().load_codegen_dir(tmp_path)
    expected = x @ new_weight.T + model.bias.detach()
    torch.testing.assert_close(loaded({"x": x})["y"], expected, rtol=0, atol=0)


def test_loading_a_training_step_without_registering_warns_that_nothing_syncs(tmp_path):
    context = new_context()
    model = nn.Linear(3, 2)
    optimizer = make_sgd(model.parameters(), 0.1, 0.9)
    register(context, model, optimizer)
    batches = classification_batches(2, 4, 3, 2)
    compile_o0(
        context,
        training_step(model, optimizer, cross_entropy),
        batches[0],
        codegen_dir=tmp_path,
    )
    with pytest.warns(UserWarning, match=r"updates 4 tensor\(s\) not registered.*model@weight"):
        loaded = new_context().load_codegen_dir(tmp_path)
    reference = twin(model)
    losses = device_train(loaded, batches)
    expected = eager_train(
        reference, make_sgd(reference.parameters(), 0.1, 0.9), cross_entropy, batches
    )
    torch.testing.assert_close(losses, expected, rtol=1e-6, atol=1e-6)


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
    if sys.argv[2] == "load":  # the codegen dir a compile wrote, Inductor's cache warm
        compiled = context.load_codegen_dir(sys.argv[3])
    else:
        compiled = context.compile(
            step,
            batch,
            sys.argv[3],
            options={"option_json": "O1"},
            cache_options=CacheOptions(sys.argv[1]),
        )
    losses = [compiled(batch)["loss"].item() for _ in range(3)]
    context.synchronize()
    weight = model.weight.tolist()
    try:  # same shape and dtype, other strides (a transposed copy, as from a permute)
        compiled({"x": batch["x"].t().contiguous().t(), "t": batch["t"]})
        non_contiguous = "ok"
    except Exception as error:
        non_contiguous = f"{type(error).__name__}: {error}"
    from torch._dynamo.utils import counters

    print(json.dumps({
        "inductor": {k: v for k, v in counters["inductor"].items() if "cache" in k},
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
    codegen = cache.parent / "codegen"
    cold = json.loads(run_python(COMPILE_WITH_CACHE, cache, "compile", codegen, env=env))
    warm = json.loads(run_python(COMPILE_WITH_CACHE, cache, "compile", codegen, env=env))
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")  # where CacheOptions put it
    loaded = json.loads(run_python(COMPILE_WITH_CACHE, cache, "load", codegen, env=env))
    return cold, warm, loaded


def test_o1_compile_cache_is_hit_by_a_fresh_process(o1_runs):
    """A real (cold) Inductor compile, then the same compile from the cache."""
    cold, warm, _ = o1_runs
    print(
        f"O1 compile: cold {cold['compile_seconds']:.2f} s, cached {warm['compile_seconds']:.2f} s"
    )

    assert cold["cache_hit"] is False
    assert warm["cache_hit"] is True
    assert warm["compile_seconds"] < cold["compile_seconds"]
    assert cold["inductor"] == {"fxgraph_cache_miss": 1}
    assert warm["inductor"] == {"fxgraph_cache_hit": 1}
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


def test_loading_an_o1_codegen_dir_reuses_the_compiled_kernels(o1_runs):
    """load_codegen_dir in a fresh process finds the graph in Inductor's cache: no codegen,
    no compiler run. The kernels come from that cache, never from the codegen dir."""
    cold, _, loaded = o1_runs
    print(
        f"O1: cold compile {cold['compile_seconds']:.2f} s, load {loaded['compile_seconds']:.2f} s"
    )
    assert loaded["inductor"] == {"fxgraph_cache_hit": 1}
    assert loaded["compile_seconds"] < cold["compile_seconds"] / 2
    assert loaded["losses"] == cold["losses"]
    assert loaded["weight"] == cold["weight"]


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


# --- a codegen dir is data, consistent, or refused ----------------------------------------


def small_codegen_dir(path, scale=(2.0, 3.0)) -> Path:
    """Compile `x * scale + 1` (scale a captured host tensor) into `path`."""
    factor = torch.tensor(scale)
    new_context().compile(
        lambda b: {"y": b["x"] * factor + 1},
        {"x": torch.ones(4, 2)},
        path,
        options={"option_json": "O0"},
    )
    return path


def edit_specs(path: Path, edit) -> None:
    specs = json.loads((path / "specs.json").read_text())
    edit(specs)
    (path / "specs.json").write_text(json.dumps(specs))


class RunsCode:
    """Unpickling this creates `marker`: proof that a loader executed code from a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_codegen_dir_holds_json_and_weights_only_tensors(context, tmp_path, monkeypatch):
    path = small_codegen_dir(tmp_path / "codegen")
    assert sorted(p.name for p in path.iterdir()) == [
        "captured.pt",
        "graph.json",
        "graph.py",
        "specs.json",
    ]
    graph = json.loads((path / "graph.json").read_text())
    targets = {node.get("target") for node in graph["nodes"]} - {None}
    assert targets == {"aten::mul.Tensor", "aten::add.Tensor"}
    specs = json.loads((path / "specs.json").read_text())
    assert set(specs["sha256"]) == {"graph.json", "captured.pt"}

    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(k) or real_load(*a, **k))
    loaded = new_context().load_codegen_dir(path)
    assert loads and all(k.get("weights_only") is True for k in loads)
    assert torch.equal(loaded({"x": torch.ones(4, 2)})["y"], torch.tensor([[3.0, 4.0]] * 4))


def test_a_crafted_graph_pickle_is_never_unpickled(tmp_path):
    """An old-style graph.pt holding a payload, next to specs that pass every other check."""
    path = small_codegen_dir(tmp_path / "codegen")
    marker = tmp_path / "code-ran"
    torch.save(RunsCode(marker), path / "graph.pt")
    (path / "graph.json").unlink()
    with pytest.raises(CodegenDirError, match="graph.json is missing"):
        new_context().load_codegen_dir(path)
    assert not marker.exists()

    edit_specs(path, lambda s: s.update(format=1))  # a format-1 dir loaded graph.pt
    with pytest.raises(CodegenDirError, match=r"specs.json: codegen format 1.*compile"):
        new_context().load_codegen_dir(path)
    assert not marker.exists()

    torch.load(path / "graph.pt", weights_only=False)  # what format 1 did: the payload runs
    assert marker.exists()


def test_a_crafted_captured_pickle_is_never_unpickled(tmp_path):
    path = small_codegen_dir(tmp_path / "codegen")
    marker = tmp_path / "code-ran"
    torch.save({"<captured 0: unnamed [2] float32>": RunsCode(marker)}, path / "captured.pt")
    digest = hashlib.sha256((path / "captured.pt").read_bytes()).hexdigest()
    edit_specs(path, lambda s: s["sha256"].update({"captured.pt": digest}))  # hash matches
    with pytest.raises(CodegenDirError, match="captured.pt cannot be read as plain tensors"):
        new_context().load_codegen_dir(path)
    assert not marker.exists()


@pytest.mark.parametrize(
    "target",
    [
        "builtins.eval",
        "os.system",
        "aten::__class__.mro",
        "aten::no_such_op.default",
        "ops::load_library.x",
    ],
)
def test_a_graph_naming_anything_but_a_registered_operator_is_refused(tmp_path, target):
    path = small_codegen_dir(tmp_path / "codegen")
    graph = json.loads((path / "graph.json").read_text())
    next(n for n in graph["nodes"] if n["op"] == "call_function")["target"] = target
    (path / "graph.json").write_text(json.dumps(graph))
    digest = hashlib.sha256((path / "graph.json").read_bytes()).hexdigest()
    edit_specs(path, lambda s: s["sha256"].update({"graph.json": digest}))
    with pytest.raises(CodegenDirError, match=r"graph.json: .*(operator|not registered)"):
        new_context().load_codegen_dir(path)


def test_files_mixed_from_two_compiles_are_refused(tmp_path):
    first = small_codegen_dir(tmp_path / "first")
    second = small_codegen_dir(tmp_path / "second", scale=(5.0, 7.0))
    shutil.copy(second / "captured.pt", first / "captured.pt")
    with pytest.raises(CodegenDirError, match=r"captured.pt does not match the sha256"):
        new_context().load_codegen_dir(first)

    new_context().compile(
        lambda b: {"y": b["x"] - 1},
        {"x": torch.ones(4, 2)},
        tmp_path / "third",
        options={"option_json": "O0"},
    )
    shutil.copy(tmp_path / "third" / "graph.json", second / "graph.json")
    with pytest.raises(CodegenDirError, match=r"graph.json does not match the sha256"):
        new_context().load_codegen_dir(second)


def test_a_truncated_specs_file_is_refused(tmp_path):
    path = small_codegen_dir(tmp_path / "codegen")
    text = (path / "specs.json").read_text()
    (path / "specs.json").write_text(text[: len(text) // 2])
    with pytest.raises(CodegenDirError, match=r"specs.json is not valid JSON"):
        new_context().load_codegen_dir(path)


@pytest.mark.parametrize("key", ["inputs", "outputs", "state", "preset", "sha256"])
def test_a_specs_file_missing_a_key_is_refused(tmp_path, key):
    path = small_codegen_dir(tmp_path / "codegen")
    edit_specs(path, lambda s: s.pop(key))
    with pytest.raises(CodegenDirError, match=rf"specs.json has no key '{key}'"):
        new_context().load_codegen_dir(path)


@pytest.mark.parametrize("version", [0, 1, 3, "2", None])
def test_a_codegen_dir_of_another_format_version_is_refused(tmp_path, version):
    path = small_codegen_dir(tmp_path / "codegen")
    edit_specs(path, lambda s: s.update(format=version))
    with pytest.raises(CodegenDirError, match=r"specs.json: codegen format .* compile the step"):
        new_context().load_codegen_dir(path)


def test_a_partial_captured_file_is_refused(tmp_path):
    path = small_codegen_dir(tmp_path / "codegen")
    data = (path / "captured.pt").read_bytes()
    (path / "captured.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CodegenDirError, match=r"captured.pt does not match the sha256"):
        new_context().load_codegen_dir(path)
    (path / "captured.pt").unlink()
    with pytest.raises(CodegenDirError, match=r"captured.pt is missing"):
        new_context().load_codegen_dir(path)


def test_an_interrupted_compile_leaves_the_previous_codegen_dir_whole(tmp_path, monkeypatch):
    path = small_codegen_dir(tmp_path / "codegen")
    before = {p.name: p.read_bytes() for p in path.iterdir()}

    real_write_text = Path.write_text

    def interrupted(self, text, *args, **kwargs):
        if self.name == "specs.json":  # graph.json and captured.pt of the new compile written
            raise KeyboardInterrupt
        return real_write_text(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", interrupted)
    with pytest.raises(KeyboardInterrupt):
        small_codegen_dir(path, scale=(5.0, 7.0))
    monkeypatch.undo()

    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["codegen"]  # no staging dir left
    loaded = new_context().load_codegen_dir(path)
    assert torch.equal(loaded({"x": torch.ones(4, 2)})["y"], torch.tensor([[3.0, 4.0]] * 4))


def test_recompiling_into_a_codegen_dir_replaces_only_its_own_files(tmp_path):
    path = small_codegen_dir(tmp_path / "codegen")
    (path / "notes.txt").write_text("mine")
    (path / "graph.pt").write_bytes(b"format 1 leftover")
    small_codegen_dir(path, scale=(5.0, 7.0))
    assert (path / "notes.txt").read_text() == "mine"
    assert not (path / "graph.pt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["codegen"]
    loaded = new_context().load_codegen_dir(path)
    assert torch.equal(loaded({"x": torch.ones(4, 2)})["y"], torch.tensor([[6.0, 8.0]] * 4))


@pytest.mark.parametrize(
    "edit",
    [
        lambda s: s["inputs"]["x"].update(dtype="load"),
        lambda s: s["inputs"]["x"].update(shape="4, 2"),
        lambda s: s["state"][0].update(kind="executable"),
        lambda s: s["preset"].update(surprise=1),
    ],
)
def test_a_specs_file_with_malformed_values_is_refused(tmp_path, edit):
    path = small_codegen_dir(tmp_path / "codegen")
    edit_specs(path, edit)
    with pytest.raises(CodegenDirError, match=r"specs.json is malformed"):
        new_context().load_codegen_dir(path)


# --- compiled code in the dir (Inductor presets) -----------------------------------------------

LOAD_TRUSTED = """
    import json
    import sys
    from pathlib import Path

    import torch
    from torch._dynamo.utils import counters

    from mncore_device import Context, MNDevice, set_tensor_name_in_module

    torch.set_num_threads(1)
    tmp = Path(sys.argv[1])
    model = torch.nn.Linear(6, 3)
    model.load_state_dict(torch.load(tmp / "init.pt"))
    context = Context(MNDevice("pfvm:cpu"))
    Context.switch_context(context)
    set_tensor_name_in_module(model, "model")
    for p in model.parameters():
        context.register_param(p)
    loaded = context.load_codegen_dir(tmp / "codegen", trust_compiled_code=True)
    out = loaded({"x": torch.load(tmp / "x.pt")})["y"]
    inductor = dict(counters["inductor"])
    print(json.dumps({"out": out.tolist(), "hits": inductor.get("fxgraph_cache_hit", 0),
                      "misses": inductor.get("fxgraph_cache_miss", 0),
                      "compiler_imported": "torch._inductor.compile_fx" in sys.modules}))
"""


@pytest.fixture(scope="module")
def inductor_dir(tmp_path_factory):
    """A step compiled with O1 into a codegen dir, which then holds its compiled code."""
    tmp = tmp_path_factory.mktemp("compiled")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # Inductor's CPU code is specialized to it: as the load's process
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    torch.save(model.state_dict(), tmp / "init.pt")
    x = torch.randn(4, 6)
    torch.save(x, tmp / "x.pt")
    context = new_context()
    register(context, model)
    compiled = context.compile(
        lambda b: {"y": torch.relu(model(b["x"]))}, {"x": x}, tmp / "codegen", {"option_json": "O1"}
    )
    out = compiled({"x": x})["y"]
    torch.set_num_threads(threads)
    return tmp, model, x, out


def test_a_trusted_load_runs_the_dirs_compiled_code_on_a_cold_cache(inductor_dir):
    """A fresh process with an empty Inductor cache: the step is not compiled (the dir's
    compiled graph runs directly, without Inductor's compiler or its cache lookups) and
    computes what the compile did."""
    tmp, _, _, expected = inductor_dir
    specs = json.loads((tmp / "codegen" / "specs.json").read_text())
    files = {
        p.relative_to(tmp / "codegen" / "compiled").as_posix()
        for p in (tmp / "codegen" / "compiled").rglob("*")
        if p.is_file()
    }
    assert set(specs["compiled"]["sha256"]) == files and any(f.endswith(".so") for f in files)
    cache = tmp / "empty-inductor-cache"
    report = json.loads(run_python(LOAD_TRUSTED, tmp, env={"TORCHINDUCTOR_CACHE_DIR": str(cache)}))
    assert (report["hits"], report["misses"], report["compiler_imported"]) == (0, 0, False)
    torch.testing.assert_close(torch.tensor(report["out"]), expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    "edit",
    [
        lambda compiled: compiled.pop("entry"),
        lambda compiled: compiled.update(entry_threads=compiled["entry_threads"] + 1),
    ],
    ids=["no-entry", "other-thread-count"],
)
def test_a_trusted_load_without_a_runnable_entry_hits_inductors_cache(inductor_dir, tmp_path, edit):
    """A dir written before compiled graphs ran directly (specs.json names no entry), or
    compiled under another thread count: the load goes through Inductor's compile_fx, whose
    graph cache hits on the dir's files (the thread count the load's own, as in the compile)."""
    tmp, _, _, expected = inductor_dir
    shutil.copytree(tmp / "codegen", tmp_path / "codegen")
    for name in ("init.pt", "x.pt"):
        shutil.copy(tmp / name, tmp_path / name)
    edit_specs(tmp_path / "codegen", lambda specs: edit(specs["compiled"]))
    cache = tmp_path / "empty-inductor-cache"
    env = {"TORCHINDUCTOR_CACHE_DIR": str(cache)}
    report = json.loads(run_python(LOAD_TRUSTED, tmp_path, env=env))
    assert (report["hits"], report["misses"], report["compiler_imported"]) == (1, 0, True)
    torch.testing.assert_close(torch.tensor(report["out"]), expected, rtol=0, atol=0)


def test_an_untrusted_load_compiles_the_graph_and_says_so(inductor_dir):
    tmp, model, x, expected = inductor_dir
    context = new_context()
    register(context, model)
    with pytest.warns(UserWarning, match="compiling the step from its graph.*trust_compiled_code"):
        loaded = context.load_codegen_dir(tmp / "codegen")
    torch.testing.assert_close(loaded({"x": x})["y"], expected, rtol=0, atol=0)


def test_changed_compiled_code_is_refused_before_anything_runs(inductor_dir, tmp_path):
    tmp, model, x, expected = inductor_dir
    copy = tmp_path / "codegen"
    shutil.copytree(tmp / "codegen", copy)
    specs = json.loads((copy / "specs.json").read_text())
    victim = next(n for n in specs["compiled"]["sha256"] if n.endswith(".so"))
    original = (copy / "compiled" / victim).read_bytes()
    (copy / "compiled" / victim).write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    context = new_context()
    register(context, model)
    with pytest.raises(CodegenDirError, match=r"\.so does not match the sha256 in .*codegen/spec"):
        context.load_codegen_dir(copy, trust_compiled_code=True)
    (copy / "compiled" / victim).write_bytes(original)
    specs["compiled"]["sha256"]["../graph.json"] = "0" * 64  # a name outside compiled/
    (copy / "specs.json").write_text(json.dumps(specs))
    with pytest.raises(CodegenDirError, match="outside"):
        context.load_codegen_dir(copy, trust_compiled_code=True)
