"""Run a traced graph on the emulated device, as the preset says.

debug and O0 run the graph op by op (debug checks every op for NaN/inf); O1 and above hand it
to TorchInductor, each level more aggressive than the last. Every executor takes the flat list
of graph inputs and returns the flat list of graph outputs.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.fx as fx

from ._source import user_frame_from_stack_trace
from .errors import NonFiniteError
from .inductor_keys import apply_remembered_source_keys
from .presets import Preset

Executor = Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor]]


def build_executor(
    gm: fx.GraphModule,
    preset: Preset,
    device: torch.device,
    example_args: Sequence[torch.Tensor],
    cache_dir: Path | None = None,
    compile_threads: int | None = None,
) -> Executor:
    """Make `gm` runnable on `device` under `preset` (compiling now, not on the first call).

    compile_threads: worker threads for Inductor's compile (MLSDK's num_compiler_threads)."""
    _retarget_devices(gm, device)
    if preset.executor == "interpreter":
        if preset.check_finite:
            return lambda args: _FiniteCheckingInterpreter(gm).run(*args)
        return lambda args: gm(*args)
    return _compile_with_inductor(gm, preset, example_args, cache_dir, compile_threads)


def _retarget_devices(gm: fx.GraphModule, device: torch.device) -> None:
    """Tensors the graph creates (zeros, random masks) are created in device memory."""
    if device.type == "cpu":
        return
    for node in gm.graph.nodes:
        if isinstance(node.kwargs.get("device"), torch.device):
            node.update_kwarg("device", device)
    gm.recompile()


def _compile_with_inductor(
    gm: fx.GraphModule,
    preset: Preset,
    example_args: Sequence[torch.Tensor],
    cache_dir,
    compile_threads: int | None = None,
) -> Executor:
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    options = dict(list_mode_options(preset.inductor_mode))
    options.update(preset.inductor_options)
    if compile_threads is not None:
        options["compile_threads"] = int(compile_threads)
    if example_args and example_args[0].device.type != "cuda":
        options.pop("triton.cudagraphs", None)
    elif example_args:  # pfvm:cuda keeps the Python wrapper: a C++ one is untested there
        options.pop("cpp_wrapper", None)
    _scale_before_adding(gm)
    with _inductor_cache_dir(cache_dir), _static_shape_env(example_args) as fake_args:
        apply_remembered_source_keys()
        compiled = compile_fx(gm, fake_args, config_patches=options)
    return lambda args: compiled(*args)


def _scale_before_adding(gm: fx.GraphModule) -> None:
    """Rewrite `add(x, y, alpha=a)` / `sub(x, y, alpha=a)` as `add(x, mul(y, a))`.

    TorchInductor in torch 2.14.1 miscompiles `add(w, add(mm(a, b), w, alpha=c), alpha=d)`
    (a weight-decay update on a matmul's gradient): the result is off by far more than
    rounding. The same math with the scaling as its own op compiles correctly.
    """
    aten = torch.ops.aten
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (aten.add.Tensor, aten.sub.Tensor):
            continue
        alpha = node.kwargs.get("alpha", 1)
        if alpha == 1 or len(node.args) != 2:
            continue
        with gm.graph.inserting_before(node):
            scaled = gm.graph.call_function(aten.mul.Tensor, (node.args[1], alpha))
        scaled.meta.update(node.meta)
        node.args = (node.args[0], scaled)
        node.kwargs = {k: v for k, v in node.kwargs.items() if k != "alpha"}
        changed = True
    if changed:
        gm.recompile()


@contextlib.contextmanager
def _static_shape_env(example_args: Sequence[torch.Tensor]):
    """Fake copies of `example_args`, every dimension static, under a fake mode that has a
    ShapeEnv: without one Inductor bypasses its FX graph cache and AOTAutograd's cache ("No
    shape env"), so a second compile or a load_codegen_dir of the same graph would run
    Inductor's whole codegen again."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    fake_mode = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True)
    with tracing(TracingContext(fake_mode)):
        yield [fake_mode.from_tensor(arg, static_shapes=True) for arg in example_args]


@contextlib.contextmanager
def _inductor_cache_dir(cache_dir: Path | None):
    """Point Inductor's on-disk caches at the user's CacheOptions directory."""
    if cache_dir is None:
        yield
        return
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(cache_dir) / "inductor")
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous


class _FiniteCheckingInterpreter(fx.Interpreter):
    """The debug preset: run op by op; NaN anywhere stops the step at the op that made it.

    Infinities are legitimate inside a step (a `-inf` attention mask that softmax turns into
    zeros), so inf is reported only where it reaches the step's results: its outputs and the
    new values of its state (the update, and so the gradients behind it). The report names
    the op where that inf first appeared, following inf-carrying inputs back from the result.
    """

    def run(self, *args, **kwargs):
        self._inf_nodes: set[fx.Node] = set()
        return super().run(*args, **kwargs)

    def run_node(self, node: fx.Node):
        result = super().run_node(node)
        if node.op == "call_function":
            for value in result if isinstance(result, (tuple, list)) else (result,):
                if not (isinstance(value, torch.Tensor) and value.is_floating_point()):
                    continue
                if torch.isfinite(value).all():
                    continue
                if torch.isnan(value).any():
                    raise NonFiniteError(_message(node, "NaN"))
                self._inf_nodes.add(node)
        elif node.op == "output":
            for value_node in node.all_input_nodes:
                if value_node in self._inf_nodes:
                    raise NonFiniteError(_message(self._origin(value_node), "inf"))
        return result

    def _origin(self, node: fx.Node) -> fx.Node:
        """The first op on an inf-carrying path into `node`."""
        while True:
            inputs = [n for n in node.all_input_nodes if n in self._inf_nodes]
            if not inputs:
                return node
            node = inputs[0]


def _message(node: fx.Node, kind: str) -> str:
    where = user_frame_from_stack_trace(node.meta.get("stack_trace"))
    return (
        f"debug preset: op {node.target} (graph node '{node.name}') produced {kind} first"
        + (f", from {where}" if where else "")
        + (" and it reaches the step's outputs or state" if kind == "inf" else "")
    )
