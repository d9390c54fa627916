"""MLSDK's names, one test each, used as PFN's example scripts use them.

Every name is imported from `mncore_lightning.mlsdk`, the module a ported script imports in
place of `mlsdk`. Correctness is measured against eager PyTorch.
"""

from __future__ import annotations

import copy
import json
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mncore_device import InputSpecError, compile_keywords
from mncore_lightning.mlsdk import (
    CacheOptions,
    Context,
    IOSpec,
    MNCoreAdam,
    MNCoreLRScheduler,
    MNCoreOptimizer,
    MNCoreSGD,
    MNDevice,
    TensorLike,
    TensorProxy,
    register_pytree_dataclass,
    register_pytree_namedtuple,
    set_buffer_name_in_optimizer,
    set_tensor_name_in_module,
    storage,
    trace_event,
    trace_scope,
)


def _context() -> Context:
    context = Context(MNDevice("pfvm:cpu"))
    Context.switch_context(context)
    return context


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _batch(n: int = 6, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, 8, generator=g), "t": torch.randint(0, 4, (n,), generator=g)}


def _register(context: Context, model: nn.Module, optimizer=None) -> None:
    set_tensor_name_in_module(model, "model")
    for p in model.parameters():
        context.register_param(p)
    if optimizer is not None:
        set_buffer_name_in_optimizer(optimizer, "optimizer")
        context.register_optimizer_buffers(optimizer)


def _train_step(model, optimizer):
    def train_step(inp):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inp["x"]), inp["t"])
        loss.backward()
        optimizer.step()
        return {"loss": loss}

    return train_step


@pytest.fixture(autouse=True)
def _fresh_warnings():
    """Each test sees the once-per-process warnings afresh."""
    compile_keywords._warned.clear()
    yield
    compile_keywords._warned.clear()


# --- Context.compile's keywords -----------------------------------------------------------


def test_compile_takes_mlsdk_keywords_it_honours_without_warning(tmp_path):
    context = _context()
    model = _mlp()
    _register(context, model)

    def infer(inp):
        return {"y": model(inp["x"])}

    batch = _batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiled = context.compile(
            infer,
            {"x": batch["x"]},
            storage.path(tmp_path / "infer"),
            options={"option_json": "O0", "float_dtype": "float"},
            num_compiler_threads=1,
            quiet=True,
            training=False,
        )
    torch.testing.assert_close(compiled({"x": batch["x"]})["y"], model(batch["x"]))


def test_a_keyword_the_emulator_cannot_honour_warns_once():
    context = _context()

    def double(inp):
        return {"y": inp["x"] * 2}

    x = torch.ones(3)
    with pytest.warns(UserWarning) as record:
        for _ in range(2):
            context.compile(
                double,
                {"x": x},
                options={"option_json": "O0", "gemm_layout_spec": "/tmp/spec.json"},
                export_kwargs={"use_fx2onnx": True},
            )
    messages = [str(w.message) for w in record]
    assert sum("'gemm_layout_spec'" in m for m in messages) == 1, messages
    assert sum("export_kwargs" in m for m in messages) == 1, messages


def test_float_dtype_rejects_an_unknown_value():
    context = _context()
    with pytest.raises(ValueError, match="float_dtype='half'"):
        context.compile(
            lambda inp: {"y": inp["x"] * 2},
            {"x": torch.ones(2)},
            options={"option_json": "O0", "float_dtype": "half"},
        )


def test_float_dtype_mixed_computes_in_bfloat16_like_eager_autocast():
    context = _context()
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
    _register(context, model)

    def infer(inp):
        return {"y": model(inp["x"])}

    x = torch.randn(16, 64)
    mixed = context.compile(infer, {"x": x}, options={"option_json": "O0", "float_dtype": "mixed"})
    full = context.compile(infer, {"x": x}, options={"option_json": "O0", "float_dtype": "float"})
    y_mixed, y_full = mixed({"x": x})["y"], full({"x": x})["y"]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        reference = model(x)
    assert reference.dtype == torch.bfloat16
    # MLSDK's mixed precision is internal: outputs keep the host tensors' dtype (float32),
    # holding autocast's bfloat16 result exactly
    assert y_mixed.dtype == y_full.dtype == torch.float32
    torch.testing.assert_close(y_mixed, reference.float(), rtol=0, atol=0)
    assert not torch.equal(y_mixed, y_full)  # really reduced precision ...
    torch.testing.assert_close(y_mixed, y_full, rtol=0.05, atol=0.05)  # ... yet close
    assert mixed.output_specs["y"] == full.output_specs["y"]


def test_float_dtype_mixed_keeps_outputs_the_host_tensors_already_hold_in_bfloat16():
    """Host tensors in bfloat16 (a bfloat16 model): outputs stay bfloat16, as in "float"."""
    context = _context()
    model = nn.Linear(8, 4).to(torch.bfloat16)
    _register(context, model)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    compiled = context.compile(
        lambda inp: {"y": model(inp["x"]), "n": inp["x"].sum().long()},
        {"x": x},
        options={"option_json": "O0", "float_dtype": "mixed"},
    )
    out = compiled({"x": x})
    assert out["y"].dtype == torch.bfloat16 and out["n"].dtype == torch.int64
    torch.testing.assert_close(out["y"], model(x).detach(), rtol=0, atol=0)


def test_io_spec_constraints_and_is_memcopyable_to():
    context = _context()
    sample = torch.randn(4, 5)
    consumer = context.compile(
        lambda inp: {"result": inp["shared"] + 1},
        {"shared": sample},
        options={"option_json": "O0"},
        training=False,
    )
    assert isinstance(consumer.input_specs["shared"], IOSpec)
    producer = context.compile(
        lambda inp: {"shared": inp["x"] * 2},
        {"x": sample},
        options={"option_json": "O0"},
        training=False,
        io_spec_constraints={"shared": consumer.input_specs["shared"]},
    )
    assert producer.output_specs["shared"].is_memcopyable_to(consumer.input_specs["shared"])
    out = consumer(producer({"x": torch.ones_like(sample)}))["result"].cpu()
    torch.testing.assert_close(out, torch.full_like(out, 3.0))
    with pytest.raises(InputSpecError, match=r"io_spec_constraints\['shared'\]"):
        context.compile(
            lambda inp: {"shared": inp["x"][:2] * 2},
            {"x": sample},
            options={"option_json": "O0"},
            io_spec_constraints={"shared": consumer.input_specs["shared"]},
        )


# --- the legacy training compile: optimizers=[...], {"backprop": True} ------------------------


def _eager_sgd_steps(model, batches, rates, momentum=0.9):
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=rates[0], momentum=momentum)
    losses = []
    for batch, rate in zip(batches, rates, strict=True):
        optimizer.param_groups[0]["lr"] = rate
        optimizer.zero_grad()
        loss = F.cross_entropy(model(batch["x"]), batch["t"])
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return model, losses


def test_backprop_compile_adds_backward_and_update_with_fed_learning_rates():
    """run_timm's legacy path: a torch.optim.SGD registered by name, a loss-only function."""
    context = _context()
    model = _mlp().train()
    reference_start = copy.deepcopy(model)
    context.registry.register("model0", model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    context.registry.register("optimizer0", optimizer)

    def f(inputs):
        return {"loss": F.cross_entropy(model(inputs["x"]), inputs["t"])}

    batches = [_batch(seed=i) for i in range(3)]
    compiled = context.compile(
        f,
        dict(batches[0]),
        optimizers=[optimizer],
        options={"backprop": True, "option_json": "O0"},
    )
    rates = [0.1, 0.05, 0.2]
    losses = []
    for step, (batch, rate) in enumerate(zip(batches, rates, strict=True)):
        inputs = dict(batch)
        inputs["optimizer0@0@mncore_learning_rate"] = torch.tensor(rate)
        inputs["optimizer0@0@mncore_global_step"] = torch.tensor(step)
        inputs["mncore_grad_scale_factor"] = torch.tensor(1)
        losses.append(compiled(inputs)["loss"].cpu())
    context.synchronize()
    expected_model, expected_losses = _eager_sgd_steps(reference_start, batches, rates)
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected_losses))
    for got, want in zip(model.parameters(), expected_model.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_backprop_compile_unscales_the_grad_scale_factor():
    context = _context()
    model = _mlp()
    reference_start = copy.deepcopy(model)
    optimizer = MNCoreSGD(model.parameters(), 0.1, 0.9, 0.0)
    _register(context, model, optimizer)

    def f(inputs):
        return {"loss": F.cross_entropy(model(inputs["x"]), inputs["t"])}

    batch = _batch()
    compiled = context.compile(
        f, batch, optimizers=[optimizer], options={"backprop": True, "option_json": "O0"}
    )
    inputs = {
        **batch,
        "optimizer@0@mncore_learning_rate": torch.tensor(0.1),
        "optimizer@0@mncore_global_step": torch.tensor(0),
        "mncore_grad_scale_factor": torch.tensor(1024),
    }
    compiled(inputs)
    context.synchronize()
    expected_model, _ = _eager_sgd_steps(reference_start, [batch], [0.1])
    for got, want in zip(model.parameters(), expected_model.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_backprop_needs_both_optimizers_and_the_option():
    context = _context()
    with pytest.raises(ValueError, match="go together"):
        context.compile(
            lambda inp: {"loss": inp["x"].sum()},
            {"x": torch.ones(2)},
            options={"backprop": True, "option_json": "O0"},
        )


# --- optimizers and schedulers ---------------------------------------------------------------


def test_mncore_optimizer_is_the_common_base():
    params = [nn.Parameter(torch.ones(2))]
    for optimizer in (MNCoreSGD(params, 0.1), MNCoreAdam(params, lr=0.1)):
        assert isinstance(optimizer, MNCoreOptimizer)
        assert isinstance(optimizer, torch.optim.Optimizer)


def test_mncore_adam_takes_chainer_style_aliases():
    params = [nn.Parameter(torch.ones(2))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch_style = MNCoreAdam(params, lr=0.01, chainer_use_torch=True)
    assert torch_style.defaults["lr"] == 0.01
    with pytest.warns(UserWarning, match="chainer_use_torch=False"):
        chainer = MNCoreAdam(
            params,
            learning_rate=0.02,
            alpha=0.8,
            beta=0.99,
            norm_coefficient=0.1,
            epsilon=1e-6,
            chainer_use_torch=False,
        )
    group = chainer.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (
        0.02,
        (0.8, 0.99),
        1e-6,
        0.1,
    )
    with pytest.raises(TypeError, match="alias 'epsilon'"):
        MNCoreAdam(params, eps=1e-5, epsilon=1e-6)


def test_mncore_lr_scheduler_pushes_each_new_rate_to_the_device():
    context = _context()
    model = _mlp()
    reference = copy.deepcopy(model)
    optimizer = MNCoreSGD(model.parameters(), 0.2, 0.9, 0.0)
    _register(context, model, optimizer)
    scheduler = MNCoreLRScheduler(
        torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5), context
    )
    batches = [_batch(seed=i) for i in range(3)]
    compiled = context.compile(
        _train_step(model, optimizer), batches[0], options={"option_json": "O0"}
    )
    for batch in batches:
        compiled(batch)
        scheduler.step()
    context.synchronize()
    assert scheduler.get_last_lr() == [0.025]
    expected, _ = _eager_sgd_steps(reference, batches, [0.2, 0.1, 0.05])
    for got, want in zip(model.parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# --- proxies, traces, storage, registry, automap, cache options -------------------------------


def test_tensor_proxy_covers_what_the_device_hands_out():
    context = _context()
    model = _mlp()
    _register(context, model)
    compiled = context.compile(
        lambda inp: {"y": model(inp["x"])}, {"x": _batch()["x"]}, options={"option_json": "O0"}
    )
    proxies = compiled.allocate_input_proxy()
    proxies["x"].load_from(_batch()["x"])
    out = compiled(proxies)["y"]
    registered = context.get_registered_value_proxy(next(model.parameters()))
    for value in (out, proxies["x"], registered):
        assert isinstance(value, TensorProxy)
        assert isinstance(value.cpu(), torch.Tensor)
    assert not isinstance(3.0, TensorProxy)
    assert isinstance(out, TensorLike) and isinstance(proxies["x"], TensorLike)
    torch.testing.assert_close(out.cpu(), model(_batch()["x"]))


def test_trace_scope_writes_chrome_trace_events(tmp_path):
    context = _context()
    model = _mlp()
    optimizer = MNCoreSGD(model.parameters(), 0.1, 0.9, 0.0)
    _register(context, model, optimizer)
    path = tmp_path / "trace" / "perfetto_trace.pb"
    with trace_scope(path):
        compiled = context.compile(
            _train_step(model, optimizer),
            _batch(),
            storage.path(tmp_path / "train_step"),
            options={"option_json": "O0"},
        )
        compiled(_batch())
        with trace_event("HtoD"):
            context.get_registered_value_proxy(model[0].weight).load_from(model[0].weight)
        context.synchronize()
    events = json.loads(path.read_text())["traceEvents"]
    by_name = {e["name"]: e for e in events}
    assert by_name["compile"]["ph"] == "X"
    assert by_name["train_step"]["cat"] == "call"
    assert by_name["load_from"]["cat"] == "transfer"
    assert by_name["synchronize"]["cat"] == "transfer"
    assert [e["ph"] for e in events if e["name"] == "HtoD"] == ["B", "E"]
    for event in events:
        assert isinstance(event["ts"], float) and isinstance(event["pid"], int)
        assert isinstance(event["tid"], int)
        if event["ph"] == "X":
            assert event["dur"] >= 0
    assert by_name["compile"]["ts"] < by_name["train_step"]["ts"] < by_name["synchronize"]["ts"]


def test_storage_path_takes_target(tmp_path):
    directory = storage.path(target=str(tmp_path / "out"))
    directory.mkdir()
    torch.save({"w": torch.ones(2)}, directory / "checkpoint.pt")
    assert torch.load(storage.path(tmp_path) / "out" / "checkpoint.pt")["w"].sum() == 2


def test_registry_registers_a_module_and_an_optimizer_by_name():
    context = _context()
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    optimizer = MNCoreSGD(model.parameters(), 0.1, 0.9, 0.0)
    context.registry.register("model", model)
    context.registry.register("opt", optimizer)
    names = context.registered_names
    assert "model@0/weight" in names and "model@1/running_mean" in names
    assert sum(n.startswith("opt@") for n in names) == 2 * len(list(model.parameters()))
    with pytest.raises(TypeError, match="torch.nn.Module or a torch.optim.Optimizer"):
        context.registry.register("x", torch.ones(2))


@register_pytree_namedtuple
class _Pair(NamedTuple):
    x: torch.Tensor


@register_pytree_dataclass
@dataclass
class _Box:
    x: torch.Tensor


def test_compile_automap_takes_pytrees_of_tensors():
    context = _context()

    def add(arg1, arg2, *, kwarg_ls, kwarg_dc):
        return {"sum": arg1[0] + arg2.x + kwarg_ls[0] + kwarg_dc.x, "box": _Box(arg2.x * 2)}

    sample = torch.randn(3, 4)
    compiled = context.compile_automap(
        add,
        ((sample,), _Pair(sample)),
        {"kwarg_ls": [sample], "kwarg_dc": _Box(sample)},
        options={"option_json": "O0", "float_dtype": "float"},
    )
    ones = torch.ones(3, 4)
    result = compiled((ones,), _Pair(ones), kwarg_ls=[ones], kwarg_dc=_Box(ones))
    torch.testing.assert_close(result["sum"].cpu(), ones * 4)
    assert isinstance(result["box"], _Box)
    torch.testing.assert_close(result["box"].x, ones * 2)
    with pytest.raises(InputSpecError, match="structure"):
        compiled((ones, ones), _Pair(ones), kwarg_ls=[ones], kwarg_dc=_Box(ones))
    with pytest.raises(TypeError, match="not a NamedTuple"):
        register_pytree_namedtuple(_Box)


def test_cache_options_takes_mlsdks_flags(tmp_path):
    context = _context()
    options = {"option_json": "O0"}

    def double(inp):
        return {"y": inp["x"] * 2}

    flags = dict(enable_app_cache=True, enable_onnx_cache=True, enable_gpfn2obj_cache=True)
    off = CacheOptions(str(tmp_path / "off"), enable_codegen_cache=False, **flags)
    context.compile(double, {"x": torch.ones(2)}, options=options, cache_options=off)
    assert not (tmp_path / "off").exists()
    on = CacheOptions(str(tmp_path / "on"), enable_codegen_cache=True, **flags)
    first = context.compile(double, {"x": torch.ones(2)}, options=options, cache_options=on)
    second = context.compile(double, {"x": torch.ones(2)}, options=options, cache_options=on)
    assert (first.cache_hit, second.cache_hit) == (False, True)


def test_float_dtype_mixed_trains_like_eager_autocast():
    """Forward under autocast, backward and update as autograd does them: as eager."""
    context = _context()
    model = _mlp()
    reference = copy.deepcopy(model)
    optimizer = MNCoreSGD(model.parameters(), 0.1, 0.9, 0.0)
    _register(context, model, optimizer)
    batches = [_batch(seed=i) for i in range(3)]
    compiled = context.compile(
        _train_step(model, optimizer),
        batches[0],
        options={"option_json": "O0", "float_dtype": "mixed"},
    )
    losses = [compiled(b)["loss"].cpu() for b in batches]
    context.synchronize()
    eager_optimizer = torch.optim.SGD(reference.parameters(), 0.1, 0.9)
    expected = []
    for batch in batches:
        eager_optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(reference(batch["x"]), batch["t"])
        loss.backward()
        eager_optimizer.step()
        expected.append(loss.detach())
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=1e-6, atol=1e-6)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# --- Context.invalidate ---------------------------------------------------------------------


def test_invalidate_releases_a_stage_and_the_next_context_starts_afresh():
    """PFN's pipeline scripts compile one stage per Context, copy its outputs to the host,
    invalidate it, and build the next stage in a new Context."""
    from mncore_device import ContextInvalidatedError

    model = _mlp()
    x = _batch()["x"]
    context = _context()
    context.registry.register("model", model)
    compiled = context.compile(lambda inp: {"y": model(inp["x"])}, {"x": x}, options={})
    host = {k: v.cpu() for k, v in compiled({"x": x}).items()}
    proxy = context.get_registered_value_proxy(model[0].weight)

    context.invalidate()
    context.invalidate()  # twice: nothing more happens
    assert context.invalidated and context.registered_names == []
    torch.testing.assert_close(host["y"], model(x).detach(), rtol=0, atol=0)  # host copies stay
    with pytest.raises(ContextInvalidatedError, match="compiled function.*invalidated"):
        compiled({"x": x})
    for use in (
        lambda: context.compile(lambda inp: {"y": inp["x"]}, {"x": x}),
        context.synchronize,
        lambda: context.register_param(model[0].weight),
        lambda: Context.switch_context(context),
        proxy.cpu,
    ):
        with pytest.raises(ContextInvalidatedError, match="invalidate"):
            use()
    with pytest.raises(RuntimeError, match="no current Context"):
        Context.get_current_context()

    following = _context()  # the same tensors register again in a new context
    following.registry.register("model", model)
    again = following.compile(lambda inp: {"y": model(inp["x"]) * 2}, {"x": x}, options={})
    torch.testing.assert_close(again({"x": x})["y"], model(x).detach() * 2, rtol=0, atol=0)
