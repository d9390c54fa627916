"""Compiling and calling functions: presets, input checks, specs and explicit transfers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

import mncore_device
from mncore_device import InputSpecError, TensorSpec, preset_path
from tests.device.device_testing import compile_o0, register


def add(batch):
    return {"out": batch["x"] + batch["y"]}


@pytest.fixture
def xy():
    return {"x": torch.randn(4, 3), "y": torch.randn(4, 3)}


@pytest.fixture
def compiled_add(context, xy):
    return compile_o0(context, add, xy)


def test_add_computes_the_sum(compiled_add, xy):
    out = compiled_add(xy)
    assert list(out) == ["out"]
    torch.testing.assert_close(out["out"], xy["x"] + xy["y"], rtol=0, atol=0)
    other = {"x": torch.ones(4, 3), "y": torch.full((4, 3), 2.0)}
    torch.testing.assert_close(compiled_add(other)["out"], torch.full((4, 3), 3.0))


@pytest.mark.parametrize(
    "option_json",
    ["O0", "debug", "O0.json", str(preset_path("O0")), preset_path("debug")],
    ids=["name", "debug-name", "file-name", "path-str", "path"],
)
def test_preset_by_name_or_json_path(context, xy, option_json):
    compiled = context.compile(add, xy, options={"option_json": option_json})
    torch.testing.assert_close(compiled(xy)["out"], xy["x"] + xy["y"], rtol=0, atol=0)


@pytest.mark.parametrize("option_json", ["O9", "fast", "/nonexistent/preset.json"])
def test_unknown_preset_raises_value_error(context, xy, option_json):
    with pytest.raises(ValueError, match="unknown compile preset"):
        context.compile(add, xy, options={"option_json": option_json})


def test_wrong_batch_size_names_input_shapes_and_drop_last(compiled_add):
    with pytest.raises(InputSpecError) as info:
        compiled_add({"x": torch.randn(3, 3), "y": torch.randn(3, 3)})
    message = str(info.value)
    assert "'x'" in message
    assert "[4, 3]" in message and "[3, 3]" in message
    assert "drop_last" in message and "pad" in message


def test_wrong_trailing_shape_raises(compiled_add):
    with pytest.raises(InputSpecError, match=r"'y'.*\[4, 3\].*\[4, 5\]"):
        compiled_add({"x": torch.randn(4, 3), "y": torch.randn(4, 5)})


@pytest.mark.parametrize("keys", [["x"], ["x", "z"]], ids=["missing", "renamed"])
def test_missing_keys_raise_naming_them(compiled_add, keys):
    with pytest.raises(InputSpecError, match=r"without input\(s\) \['y'\].*keys must be"):
        compiled_add({k: torch.randn(4, 3) for k in keys})


def test_extra_keys_are_ignored_as_mlsdk_does(compiled_add):
    """PFN's stable_diffusion_eval.py hands one growing dict to every compiled function."""
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    extra = {"x": x, "y": y, "input_ids": torch.zeros(1, 77, dtype=torch.long), "z": "text"}
    torch.testing.assert_close(compiled_add(extra)["out"], x + y, rtol=0, atol=0)


def test_shapes_differing_only_in_size_one_dimensions_are_reshaped(context):
    """A 0-d timestep for a compiled [1] (stable_diffusion_eval.py's scheduler loop), a [4]
    for a [4, 1]: the same numbers in the same order. Other shapes still raise."""
    compiled = context.compile(
        lambda b: {"out": b["t"] * 2 + b["c"].sum()},
        {"t": torch.tensor([3]), "c": torch.ones(4, 1)},
        options={"option_json": "O0"},
    )
    out = compiled({"t": torch.tensor(5), "c": torch.arange(4.0)})["out"]
    torch.testing.assert_close(out, torch.tensor([16.0]), rtol=0, atol=0)
    proxies = compiled.allocate_input_proxy()
    proxies["t"].load_from(torch.tensor(1))
    proxies["c"].load_from(torch.ones(1, 4, 1))
    torch.testing.assert_close(compiled(proxies)["out"], torch.tensor([6.0]), rtol=0, atol=0)
    with pytest.raises(InputSpecError, match=r"'c'.*\[4, 1\].*\[2, 2\]"):
        compiled({"t": torch.tensor(5), "c": torch.ones(2, 2)})
    with pytest.raises(InputSpecError, match=r"'t'.*int64.*int32"):
        compiled({"t": torch.tensor(5, dtype=torch.int32), "c": torch.ones(4, 1)})


def test_wrong_dtype_raises(compiled_add):
    with pytest.raises(InputSpecError, match=r"'x'.*float32.*float64"):
        compiled_add({"x": torch.randn(4, 3, dtype=torch.float64), "y": torch.randn(4, 3)})


def test_a_meta_input_names_the_input_and_what_is_expected(compiled_add, xy):
    meta = torch.empty(4, 3, device="meta")
    with pytest.raises(InputSpecError, match=r"input 'y' is a tensor on the meta device.*real"):
        compiled_add({"x": xy["x"], "y": meta})
    proxy = compiled_add.allocate_input_proxy()["x"]
    with pytest.raises(InputSpecError, match=r"input 'x' is a tensor on the meta device"):
        proxy.load_from(meta)


def test_a_meta_sample_names_the_input_at_compile(context, xy):
    with pytest.raises(InputSpecError, match=r"input 'x' is a tensor on the meta device.*sample"):
        compile_o0(context, add, {"x": torch.empty(4, 3, device="meta"), "y": xy["y"]})


@pytest.mark.parametrize("preset", ["O0", "O1"])
def test_outputs_and_state_carry_no_autograd_history(context, preset):
    """Inputs that require grad (directly or through an input proxy) give plain data."""
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    register(context, model, optimizer)

    def step(batch):
        optimizer.zero_grad()
        y = model(batch["x"])
        loss = (y * batch["w"]).sum()
        loss.backward()
        optimizer.step()
        return {"y": y, "loss": loss, "scaled": batch["w"] * 2}

    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(4, 2).requires_grad_()
    compiled = context.compile(step, {"x": x, "w": w}, options={"option_json": preset})
    proxies = compiled.allocate_input_proxy()
    proxies["x"].load_from(x)
    proxies["w"].load_from(w * 1)  # a non-leaf with a graph of its own
    for inputs in ({"x": x, "w": w}, proxies):
        outputs = compiled(inputs)
        for key, value in outputs.items():
            assert value.grad_fn is None and not value.requires_grad, key
    for value in context.device_values():
        assert value.grad_fn is None and not value.requires_grad
    assert x.grad is None and w.grad is None


def test_input_spec_error_is_a_value_error_and_an_mncore_error():
    assert issubclass(InputSpecError, ValueError)
    assert issubclass(InputSpecError, mncore_device.MNCoreError)


# --- specs and the explicit-transfer API ---------------------------------------------------


@pytest.fixture
def linear(context):
    model = nn.Linear(3, 2)
    register(context, model)
    return model


def forward(model):
    return lambda batch: {"y": model(batch["x"])}


def test_input_and_output_specs(context, linear):
    sample = {"x": torch.randn(5, 3), "i": torch.zeros(5, dtype=torch.int64)}
    compiled = compile_o0(context, lambda b: {"y": linear(b["x"]), "n": b["i"] + 1}, sample)
    assert compiled.input_specs == {
        "x": TensorSpec((5, 3), torch.float32),
        "i": TensorSpec((5,), torch.int64),
    }
    assert compiled.output_specs == {
        "y": TensorSpec((5, 2), torch.float32),
        "n": TensorSpec((5,), torch.int64),
    }


def test_input_proxies_give_the_same_result_as_tensors(context, linear):
    x = torch.randn(4, 3)
    compiled = compile_o0(context, forward(linear), {"x": x})
    proxies = compiled.allocate_input_proxy()
    assert set(proxies) == {"x"}
    proxies["x"].load_from(x, clone=False)
    expected = linear(x).detach()
    from_proxy = compiled(proxies)["y"]
    torch.testing.assert_close(from_proxy, expected)
    torch.testing.assert_close(compiled({"x": x})["y"], from_proxy, rtol=0, atol=0)

    fresh = compiled.allocate_input_proxy()
    fresh["x"].load_from(2 * x)  # the default, clone=True, copies into the buffer
    torch.testing.assert_close(compiled(fresh)["y"], linear(2 * x).detach())


def test_input_proxy_reload_does_not_write_into_a_borrowed_tensor(context, linear):
    x = torch.randn(4, 3)
    original = x.clone()
    compiled = compile_o0(context, forward(linear), {"x": x})
    proxy = compiled.allocate_input_proxy()["x"]
    proxy.load_from(x, clone=False)
    proxy.load_from(torch.zeros(4, 3))
    assert torch.equal(x, original), "loading the proxy overwrote the caller's host tensor"


def test_input_proxy_checks_the_spec(context, linear):
    compiled = compile_o0(context, forward(linear), {"x": torch.randn(4, 3)})
    proxy = compiled.allocate_input_proxy()["x"]
    with pytest.raises(InputSpecError, match="drop_last"):
        proxy.load_from(torch.randn(2, 3), clone=False)


def test_registered_value_proxy_load_from_changes_the_next_call(context, linear):
    x = torch.randn(4, 3)
    compiled = compile_o0(context, forward(linear), {"x": x})
    new_weight = torch.arange(6.0).reshape(2, 3)
    host_weight = linear.weight.detach().clone()

    proxy = context.get_registered_value_proxy(linear.weight)
    assert proxy.name == "model@weight"
    assert tuple(proxy.shape) == (2, 3)
    proxy.load_from(new_weight)

    expected = x @ new_weight.T + linear.bias.detach()
    torch.testing.assert_close(compiled({"x": x})["y"], expected)
    torch.testing.assert_close(proxy.cpu(), new_weight, rtol=0, atol=0)
    assert torch.equal(linear.weight, host_weight), "the host changes only at synchronize()"
    context.synchronize()
    assert torch.equal(linear.weight, new_weight)


def test_registered_value_proxy_rejects_a_wrong_shape(context, linear):
    with pytest.raises(ValueError, match=r"model@weight.*\[2, 3\].*\[3, 3\]"):
        context.get_registered_value_proxy(linear.weight).load_from(torch.zeros(3, 3))


def test_outputs_of_one_function_feed_another(context, linear):
    x = torch.randn(4, 3)
    first = compile_o0(context, forward(linear), {"x": x})
    second = compile_o0(context, lambda b: {"z": b["y"].relu() * 2}, {"y": torch.randn(4, 2)})
    z = second(first({"x": x}))["z"]
    torch.testing.assert_close(z, linear(x).detach().relu() * 2)


def test_non_contiguous_inputs_work_with_o0(compiled_add, xy):
    x = xy["x"].t().contiguous().t()  # same values, other strides
    assert not x.is_contiguous()
    out = compiled_add({"x": x, "y": xy["y"]})["out"]
    torch.testing.assert_close(out, xy["x"] + xy["y"], rtol=0, atol=0)


def test_o1_computes_an_add_with_alpha_after_a_matmul_as_eager(context):
    """TorchInductor (torch 2.14.1) miscompiles add(w, add(mm, w, alpha=c), alpha=d), the shape
    of an L2 weight-decay update; the O1 executor rewrites the scaling so that it does not."""

    def step(batch):
        w, x, y = batch["w"], batch["x"], batch["y"]
        return {"out": w.add(torch.mm(y.t(), x).add(w, alpha=0.01), alpha=-0.1)}

    torch.manual_seed(0)
    batch = {"w": torch.randn(4, 3), "x": torch.randn(5, 3), "y": torch.randn(5, 4)}
    compiled = context.compile(step, batch, options={"option_json": "O1"})
    torch.testing.assert_close(compiled(batch)["out"], step(batch)["out"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("capture", ["trace", "dynamo"])
@pytest.mark.parametrize("preset, generated", [("O0", 1), ("debug", 0)])
def test_a_compile_generates_the_graphs_python_code_at_most_once(
    context, monkeypatch, preset, generated, capture
):
    """Each graph pass used to regenerate the whole graph's Python code (seconds for a large
    model): now only the O0 executor, which runs that code, has it generated, once (and
    TorchDynamo the code of the graph it captures, once)."""
    generated += capture == "dynamo"
    calls = []
    real = torch.fx.GraphModule.recompile
    monkeypatch.setattr(
        torch.fx.GraphModule, "recompile", lambda self: calls.append(1) or real(self)
    )
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    register(context, model, optimizer)

    def step(batch):
        optimizer.zero_grad()
        loss = model(batch["x"]).square().mean()
        loss.backward()
        optimizer.step()
        return {"loss": loss}

    batch = {"x": torch.randn(5, 3)}
    compiled = context.compile(step, batch, options={"option_json": preset}, capture=capture)
    assert len(calls) == generated
    expected = model(batch["x"]).square().mean()
    torch.testing.assert_close(compiled(batch)["loss"], expected)
    assert len(calls) == generated


@pytest.mark.parametrize("limit, cpp_wrapper", [(1000, True), (2, False)])
def test_inductor_presets_give_small_graphs_the_cpp_wrapper(
    context, tmp_path, monkeypatch, limit, cpp_wrapper
):
    """On the CPU, a graph of at most `cpp_wrapper_max_ops` operations is built with Inductor's
    C++ wrapper (one compiler run); a larger one keeps the Python wrapper, whose kernels
    compile in parallel, and Inductor's reordering for peak memory is off there (it would
    split the kernels between the backward's calls into more libraries to build)."""
    import json

    import torch._inductor.compile_fx as inductor

    patches = []
    monkeypatch.setattr(
        inductor, "compile_fx", lambda gm, args, config_patches: patches.append(config_patches)
    )
    preset = json.loads(preset_path("O1").read_text())
    assert preset["cpp_wrapper_max_ops"] == 4000 and "cpp_wrapper" not in preset["inductor_options"]
    preset["cpp_wrapper_max_ops"] = limit
    (tmp_path / "preset.json").write_text(json.dumps(preset))

    def step(batch):  # three operations: mul, add, sum
        return {"out": (batch["x"] * 2 + 1).sum()}

    context.compile(step, {"x": torch.ones(3)}, options={"option_json": tmp_path / "preset.json"})
    assert patches[-1].get("cpp_wrapper", False) is cpp_wrapper
    assert patches[-1].get("reorder_for_peak_memory", True) is cpp_wrapper


def test_inductors_fusion_search_pairs_only_nodes_of_one_size_through_a_scalar_input(
    context, monkeypatch
):
    """A step's optimizer reads its hyperparameters as 0-d inputs, once per parameter: each of
    them groups every update for Inductor's fusion search, which tried each pair of updates
    within 64 places, though updates of different sizes cannot fuse: most of DenseNet-121's
    21 s of fusion search. The O1 executor groups the nodes reading a small read-only input by
    their size: far fewer pairs are tried, and the same fusions are made (Inductor fuses the
    same-shaped updates through their shared scalars)."""
    import contextlib

    from torch._inductor import config as inductor_config
    from torch._inductor import scheduler

    from mncore_device.runtime import executors
    from tests.device.device_testing import make_sgd, training_step

    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(10) for m in (nn.Linear(8, 8), nn.Tanh())])
    optimizer = make_sgd(model.parameters(), kind="mncore")  # lr, momentum, dampening: 0-d
    register(context, model, optimizer)
    step = training_step(model, optimizer, lambda m, b: m(b["x"]).pow(2).mean())
    batch = {"x": torch.randn(4, 8)}

    real_can_fuse, real_fuse_nodes = scheduler.Scheduler.can_fuse, scheduler.Scheduler.fuse_nodes

    def compile_recording(search_context) -> tuple[int, list[str]]:
        tried, fused = [0], []

        def can_fuse(self, *args, **kwargs):
            tried[0] += 1
            return real_can_fuse(self, *args, **kwargs)

        def fuse_nodes(self, nodes):
            result = real_fuse_nodes(self, nodes)
            fused.extend(node.get_name() for node in result)
            return result

        monkeypatch.setattr(scheduler.Scheduler, "can_fuse", can_fuse)
        monkeypatch.setattr(scheduler.Scheduler, "fuse_nodes", fuse_nodes)
        monkeypatch.setattr(executors, "scalar_inputs_pair_equal_sizes", search_context)
        with inductor_config.patch(force_disable_caches=True):  # both compiles schedule
            context.compile(step, batch, options={"option_json": "O1"})
        return tried[0], fused

    tried, fused = compile_recording(executors.scalar_inputs_pair_equal_sizes)
    tried_by_inductor, fused_by_inductor = compile_recording(contextlib.nullcontext)
    assert fused and fused == fused_by_inductor
    # 10 weights (64 elements) and 10 biases (8): the scalars' groups held 100 pairs of a weight's
    # update and a bias's for Inductor to try, in every round, and none of them can fuse
    assert tried_by_inductor - tried >= 200, (tried, tried_by_inductor)


def test_inductors_code_generation_does_its_repeated_work_once(context, monkeypatch, tmp_path):
    """Inductor's C++ code generation simplifies each index once per loop variable to choose
    the loop it vectorizes, and binds its dtype rules at every construction of their
    singleton handler (DenseNet-121: 2,833 sympy.simplify calls on 1,086 indices, 12.3 s;
    52,907 constructions, ~3.3 s). The O1 executor does each once per distinct input: fewer
    simplify calls and rule bindings, the same generated code."""
    import contextlib

    import sympy
    from torch._inductor import config as inductor_config
    from torch._inductor import sizevars
    from torch._inductor.dtype_propagation import DtypePropagationOpsHandler

    from mncore_device.runtime import codegen_memo, executors

    step, batch = _registered_conv_step(context)
    real_simplify, real_bind = sympy.simplify, DtypePropagationOpsHandler.__init__

    def compile_counting(work_context, cache: Path) -> tuple[int, int, list[str]]:
        simplified, bound = [0], [0]

        def simplify(*args, **kwargs):
            simplified[0] += 1
            return real_simplify(*args, **kwargs)

        def bind(self):
            bound[0] += 1
            real_bind(self)

        for cached in (
            codegen_memo._simplified,
            sizevars.simplify_index_in_vec_range,
            sizevars.stride_at_vec_range,
        ):
            cached.cache_clear()  # what an earlier compile in this process analysed
        handler = DtypePropagationOpsHandler._instance  # the singleton, once built
        if handler is not None:
            handler.__dict__.pop("_bound_rules", None)
        monkeypatch.setattr(sympy, "simplify", simplify)
        monkeypatch.setattr(codegen_memo, "_SIMPLIFY", simplify)
        monkeypatch.setattr(DtypePropagationOpsHandler, "__init__", bind)
        monkeypatch.setattr(executors, "codegen_work_remembered", work_context)
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
        with inductor_config.patch(force_disable_caches=True):
            context.compile(step, batch, options={"option_json": "O1"})
        monkeypatch.setattr(sympy, "simplify", real_simplify)
        monkeypatch.setattr(DtypePropagationOpsHandler, "__init__", real_bind)
        sources = sorted(p.name for p in cache.rglob("*") if p.suffix in (".cpp", ".py"))
        return simplified[0], bound[0], sources

    # Inductor's one-time probes of the CPU go into the first compile's cache only
    compile_counting(contextlib.nullcontext, tmp_path / "first")
    simplified, bound, sources = compile_counting(
        codegen_memo.codegen_work_remembered, tmp_path / "remembered"
    )
    by_inductor = compile_counting(contextlib.nullcontext, tmp_path / "inductor")
    assert sources and sources == by_inductor[2]  # named by a hash of their code
    assert 0 < simplified < by_inductor[0], (simplified, by_inductor[0])
    assert bound == 1 < by_inductor[1], (bound, by_inductor[1])


def test_a_cpp_wrapper_graphs_entry_and_kernels_compile_at_the_same_time(
    context, monkeypatch, tmp_path
):
    """Inductor builds a C++ wrapper's entry (-O1) and its kernels (-O3) as two object files,
    one compiler run after the other; the O1 executor runs the two at once and links when
    both are done (ResNet-18's cold compile 30.3 -> 25.3 s on two cores)."""
    import time

    from torch._inductor import cpp_builder

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # nothing built yet
    builds = []
    real_build = cpp_builder.CppBuilder.build

    def build(self):
        start = time.perf_counter()
        real_build(self)
        target, command = self.get_target_file_path(), self.get_command_line()
        builds.append((target, command, start, time.perf_counter()))

    monkeypatch.setattr(cpp_builder.CppBuilder, "build", build)
    torch.manual_seed(0)
    batch = {"x": torch.randn(6, 5), "w": torch.randn(5, 3)}

    def step(batch):
        return {"out": torch.tanh(batch["x"] @ batch["w"]).sum(0)}

    compiled = context.compile(step, batch, options={"option_json": "O1"})
    torch.testing.assert_close(compiled(batch)["out"], step(batch)["out"])
    entry, kernels = [b for b in builds if Path(b[0]).suffix == ".o"]
    assert max(entry[2], kernels[2]) < min(entry[3], kernels[3])  # the two compilers overlap
    (link,) = [b for b in builds if entry[0] in b[1] and kernels[0] in b[1]]
    assert link[2] >= max(entry[3], kernels[3])


def test_a_python_wrappers_kernels_build_a_few_to_a_library_while_inductor_generates_the_rest(
    monkeypatch, tmp_path
):
    """Inductor builds each C++ kernel of a graph with the Python wrapper as a library of its
    own (a compiler run each, mostly loading the precompiled header), and only when the
    finished wrapper module is imported. The O1 executor defines them a few to a library and
    hands each library to its build pool when it is defined, before that import: the same
    kernels from the same sources, fewer libraries, each built once, the same results."""
    import contextlib
    import functools
    import json
    import math
    import threading

    from torch._inductor import config as inductor_config
    from torch._inductor import cpp_builder
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.codecache import CppPythonBindingsCodeCache, PyCodeCache

    from mncore_device.runtime import executors, kernel_libraries
    from tests.device.device_testing import new_context

    preset = json.loads(preset_path("O1").read_text())
    preset["cpp_wrapper_max_ops"] = 0  # the Python wrapper, whatever the graph's size
    preset["channels_last_where_faster"] = False  # no layout timing: the same code each time
    (tmp_path / "O1.json").write_text(json.dumps(preset))
    real_build, real_load = cpp_builder.CppBuilder.build, PyCodeCache.load_by_key_path
    real_pool, real_library = kernel_libraries.ThreadPoolExecutor, kernel_libraries.kernel_library
    real_pybinding = AsyncCompile.cpp_pybinding

    def compile_recording(libraries, cache: Path):
        builds: list[str] = []  # the libraries built
        events: list[str] = []  # "asked" (a library handed to the pool), "import" (the module)
        kernels: list[tuple] = []  # (argtypes, source) of each kernel the module defines
        lock = threading.Lock()

        def build(self):
            with lock:
                builds.append(Path(self.get_target_file_path()).name)
            return real_build(self)

        def load_by_key_path(*args, **kwargs):
            events.append("import")
            return real_load(*args, **kwargs)

        class RecordingPool(real_pool):
            def submit(self, *args, **kwargs):
                events.append("asked")
                return super().submit(*args, **kwargs)

        def library(async_compile, listed):
            kernels.extend((tuple(argtypes), source) for argtypes, source in listed)
            return real_library(async_compile, listed)

        def pybinding(self, argtypes, source):
            kernels.append((tuple(argtypes), source))
            return real_pybinding(self, argtypes, source)

        monkeypatch.setattr(cpp_builder.CppBuilder, "build", build)
        monkeypatch.setattr(PyCodeCache, "load_by_key_path", load_by_key_path)
        monkeypatch.setattr(kernel_libraries, "ThreadPoolExecutor", RecordingPool)
        monkeypatch.setattr(kernel_libraries, "kernel_library", library)
        monkeypatch.setattr(AsyncCompile, "cpp_pybinding", pybinding)
        monkeypatch.setattr(CppPythonBindingsCodeCache, "cache", {})  # nothing built yet
        monkeypatch.setattr(executors, "kernels_built_in_libraries", libraries)
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
        context = new_context()
        step, batch = _registered_conv_step(context)  # the same weights each time
        with inductor_config.patch(force_disable_caches=True, compile_threads=2):
            compiled = context.compile(step, batch, options={"option_json": tmp_path / "O1.json"})
        return builds, events, sorted(kernels), compiled(batch)

    # Inductor's one-time probes of the CPU go into the first compile's cache only
    compile_recording(contextlib.nullcontext, tmp_path / "first")
    two_each = functools.partial(kernel_libraries.kernels_built_in_libraries, per_library=2)
    builds, events, kernels, results = compile_recording(two_each, tmp_path / "libraries")
    by_inductor, inductors_events, inductors_kernels, inductors_results = compile_recording(
        contextlib.nullcontext, tmp_path / "inductor"
    )
    assert len(kernels) >= 3 and kernels == inductors_kernels  # a library not full, too
    assert len(by_inductor) == len(kernels), by_inductor  # Inductor: a library per kernel
    libraries = math.ceil(len(kernels) / 2)
    assert len(builds) == len(set(builds)) == libraries, builds  # each library once
    # every full library was handed to the pool before the module's import
    assert events[: len(kernels) // 2] == ["asked"] * (len(kernels) // 2), events
    assert "import" in events and "asked" not in inductors_events, inductors_events
    for name, value in results.items():
        assert torch.equal(value, inductors_results[name]), name


def test_a_kernel_library_that_does_not_build_builds_its_kernels_one_by_one(monkeypatch, tmp_path):
    """Kernels that cannot share a library (here each defines the same C function) are
    built one to a library, as Inductor builds them, and each still does what its own source
    says; kernels that can share one do, and run as their sources say."""
    from torch._inductor import config as inductor_config
    from torch._inductor import cpp_builder
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    from mncore_device.runtime.kernel_libraries import kernel_library

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(CppPythonBindingsCodeCache, "cache", {})
    built: list[str] = []
    real_build = cpp_builder.CppBuilder.build

    def build(self):
        built.append(Path(self.get_target_file_path()).name)
        return real_build(self)

    monkeypatch.setattr(cpp_builder.CppBuilder, "build", build)

    def kernel(add: float, shared: str = "") -> tuple[list[str], str]:
        source = f"""#include <torch/csrc/inductor/cpp_prefix.h>
{shared}
extern "C" void kernel(const float* in_ptr0, float* out_ptr0)
{{
    for (int64_t i = 0; i < 4; i++) out_ptr0[i] = in_ptr0[i] + {add}f;
}}
"""
        return ["const float*", "float*"], source

    clash = 'extern "C" int mncore_test_clash() { return 0; }'
    x = torch.arange(4.0)
    with inductor_config.patch(compile_threads=1):
        for kernels, libraries in (
            ([kernel(1.0), kernel(2.0), kernel(3.0)], 1),
            ([kernel(4.0, clash), kernel(5.0, clash)], 3),  # the library, then each kernel
        ):
            built.clear()
            functions = kernel_library(AsyncCompile(), kernels)
            assert len(built) == libraries, built
            for function, (_, source) in zip(functions, kernels, strict=True):
                out = torch.empty(4)
                function(x, out)
                add = float(source.split("in_ptr0[i] + ")[1].split("f;")[0])
                assert torch.equal(out, x + add), (out, add)


def test_new_state_is_written_by_the_kernel_that_computes_it(monkeypatch):
    """Inductor lowers each copy of a new weight, momentum or BatchNorm statistic into its state
    input as two scheduler nodes (the value as a buffer, then a copy of it), which it fuses back
    into one kernel, and it first realizes every pending reader of the old value as a buffer,
    even those nothing reads, which its scheduler builds nodes for and then drops. The O1
    executor has the value's own node store into the state, and realizes only the readers
    something reads: one live node fewer per state input whose new value no other node reads
    as a buffer, no dead ones, and the same results."""
    import contextlib

    from torch._inductor import config as inductor_config
    from torch._inductor import graph, scheduler

    from mncore_device.runtime import executors, state_writes
    from tests.device.device_testing import new_context

    real_init, real_run = scheduler.Scheduler.__init__, graph.GraphLowering.run
    real_elimination = scheduler.Scheduler.dead_node_elimination

    def train_recording(written_in_place) -> tuple[int, int, int, list[float], dict]:
        made, dead, copies = [], [], []

        def init(self, operations, *args, **kwargs):
            made.append(len(operations))
            real_init(self, operations, *args, **kwargs)

        def dead_node_elimination(self):
            before = len(self.nodes)
            real_elimination(self)
            dead.append(before - len(self.nodes))

        def run(self, *args, **kwargs):
            copies.append(sum(n.target is torch.ops.aten.copy_.default for n in self.graph.nodes))
            return real_run(self, *args, **kwargs)

        monkeypatch.setattr(scheduler.Scheduler, "__init__", init)
        monkeypatch.setattr(scheduler.Scheduler, "dead_node_elimination", dead_node_elimination)
        monkeypatch.setattr(graph.GraphLowering, "run", run)
        monkeypatch.setattr(executors, "new_state_written_in_place", written_in_place)
        context = new_context()
        step, batch = _registered_conv_step(context)
        with inductor_config.patch(force_disable_caches=True):  # both compiles schedule
            compiled = context.compile(step, batch, options={"option_json": "O1"})
        losses = [compiled(batch)["loss"].item() for _ in range(3)]
        context.synchronize()
        state = {name: t.clone() for name, t in context.registered_tensors().items()}
        return made[-1], dead[0], copies[-1], losses, state

    made, dead, copies, losses, state = train_recording(state_writes.new_state_written_in_place)
    made_by_inductor, dead_by_inductor, _, losses_by_inductor, state_by_inductor = train_recording(
        contextlib.nullcontext
    )
    assert copies == len(state) == 21  # 6 weights, 12 MNCoreSGD states, BatchNorm's 3
    assert dead == 0 < dead_by_inductor
    # all but the 6 momentum buffers, whose new value the weights' update reads as a buffer
    assert (made_by_inductor - dead_by_inductor) - made == copies - 6
    assert losses == losses_by_inductor
    assert state.keys() == state_by_inductor.keys()
    for name, value in state.items():
        assert torch.equal(value, state_by_inductor[name]), name


def test_state_read_before_another_states_write_reads_its_old_value(context):
    """A step that reads one state's old value into another's new value (b += a, then a *= x)
    gets eager's results, whichever order the graph writes them in."""

    class Pairs(nn.Module):
        def __init__(self):
            super().__init__()
            for name in "abcd":
                self.register_buffer(name, torch.randn(64))

    torch.manual_seed(0)
    state, eager = Pairs(), Pairs()
    eager.load_state_dict(state.state_dict())
    register(context, state)

    def update(module, batch):
        module.b.add_(module.a)  # a's old value: read before a's write, by b's write only
        module.a.mul_(batch["x"])
        module.c.mul_(batch["x"])  # c's new value: read by d's write and by the output
        module.d.add_(module.c)
        return {"total": module.d.sum()}

    sample = {"x": torch.full((64,), 2.0)}
    compiled = context.compile(lambda b: update(state, b), sample, options={"option_json": "O1"})
    for i in range(3):
        batch = {"x": torch.full((64,), 1.5 + i)}
        out = compiled(batch)["total"]
        expected = update(eager, batch)["total"]
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-5)
    context.synchronize()
    for name in "abcd":
        torch.testing.assert_close(getattr(state, name), getattr(eager, name), rtol=0, atol=0)


def _registered_conv_step(context):
    """A small convolution, BatchNorm and linear step with MNCoreSGD, registered with
    `context`, and a batch for it: a step graph with a few kernels of each kind."""
    from tests.device.device_testing import make_sgd, training_step

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(288, 4)
    )
    optimizer = make_sgd(model.parameters(), kind="mncore")
    register(context, model, optimizer)
    step = training_step(model, optimizer, lambda m, b: m(b["x"]).pow(2).mean())
    return step, {"x": torch.randn(4, 3, 6, 6)}
