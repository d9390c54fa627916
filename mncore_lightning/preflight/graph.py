"""What a compiled step's graph says before it runs: op counts by kind, value sizes, and the
peak of the values alive at once (the activations), estimated from shapes alone and measured
by running the graph.

The graph is the one the device layer compiles (an FX graph of aten ops, read back from the
step's codegen directory): its placeholders are the device state (parameters, buffers,
optimizer state, captured constants) and then the step's inputs, in the order of specs.json.
"""

from __future__ import annotations

import contextlib
import operator
import os
import sys
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

aten = torch.ops.aten

OP_KINDS = ("matmul", "convolution", "elementwise", "reduction", "collective", "other")
_MATMUL = {
    "mm",
    "bmm",
    "addmm",
    "addbmm",
    "baddbmm",
    "matmul",
    "linear",
    "dot",
    "mv",
    "addmv",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_attention_math",
}
_CONVOLUTION = {"convolution", "convolution_backward", "_convolution", "conv2d", "conv1d"}
_REDUCTION = {
    "sum",
    "mean",
    "amax",
    "amin",
    "max",
    "min",
    "argmax",
    "argmin",
    "prod",
    "var",
    "var_mean",
    "std",
    "norm",
    "linalg_vector_norm",
    "_log_softmax",
    "_softmax",
    "_log_softmax_backward_data",
    "_softmax_backward_data",
    "nll_loss_forward",
    "nll_loss_backward",
    "native_batch_norm",
    "native_batch_norm_backward",
    "_native_batch_norm_legit",
    "_native_batch_norm_legit_functional",
    "_native_batch_norm_legit_no_training",
    "native_layer_norm",
    "native_layer_norm_backward",
    "native_group_norm",
    "native_group_norm_backward",
    "logsumexp",
    "cumsum",
    "max_pool2d_with_indices",
    "max_pool2d_with_indices_backward",
    "avg_pool2d",
    "avg_pool2d_backward",
    "_adaptive_avg_pool2d",
    "_adaptive_avg_pool2d_backward",
    "_foreach_norm",
}
_COLLECTIVE_NAMESPACES = ("c10d_functional", "_c10d_functional", "c10d")


def op_kind(node: fx.Node) -> str | None:
    """The kind of a graph node's op; None for what is no computation (inputs, outputs,
    views, tuple indexing, dtype-free shape ops)."""
    if node.op != "call_function" or node.target is operator.getitem:
        return None
    target = node.target
    namespace = getattr(target, "namespace", None)
    if namespace in _COLLECTIVE_NAMESPACES:
        return "collective"
    if _is_view(node):
        return None
    name = getattr(target, "_opname", None) or getattr(target, "__name__", str(target))
    name = name.split(".")[0]
    if name in _MATMUL:
        return "matmul"
    if name in _CONVOLUTION:
        return "convolution"
    if name in _REDUCTION:
        return "reduction"
    schema = getattr(target, "_schema", None)
    if schema is not None and namespace == "aten":
        return "elementwise" if _pointwise(target) else "other"
    return "other"


def _pointwise(target: object) -> bool:
    tags = getattr(target, "tags", ())
    return torch.Tag.pointwise in tags


def _is_view(node: fx.Node) -> bool:
    """An op whose result shares its first argument's memory (view, t, expand ...)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def op_counts(gm: fx.GraphModule) -> dict[str, int]:
    """How many ops of each kind the graph runs (views and indexing are not counted)."""
    counts = Counter(kind for node in gm.graph.nodes if (kind := op_kind(node)) is not None)
    return {kind: counts.get(kind, 0) for kind in OP_KINDS}


def propagate_shapes(gm: fx.GraphModule, specs: Sequence[tuple[tuple[int, ...], torch.dtype]]):
    """Give every node a fake value (node.meta['val']) from the placeholders' shapes and
    dtypes, in order; nothing is computed."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fakes = [torch.empty(shape, dtype=dtype) for shape, dtype in specs]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)


def _nbytes(value: object) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    return 0


@dataclass(frozen=True)
class ActivationEstimate:
    peak_bytes: int  # the most bytes of intermediate values alive at once
    peak_node: str  # the node at which the peak is reached
    total_bytes: int  # all intermediate values, as if none were ever freed


def activation_peak(gm: fx.GraphModule) -> ActivationEstimate:
    """A liveness walk over the graph in execution order: each op's result is allocated when
    it runs and freed after its last use (a view keeps its base alive and costs nothing; each
    result of a multi-result op, as batch norm's, lives as long as its own uses); graph
    outputs (returned values and the new state) stay alive to the end. Needs
    node.meta['val'] (propagate_shapes)."""
    nodes = list(gm.graph.nodes)
    index = {node: i for i, node in enumerate(nodes)}
    end = len(nodes)
    unit: dict[fx.Node, tuple[fx.Node, int | None] | None] = {}  # the memory a node holds
    sizes: dict[tuple[fx.Node, int | None], int] = {}
    born: dict[int, list[tuple[fx.Node, int | None]]] = {}
    for node in nodes:
        first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        if node.op != "call_function":
            unit[node] = None  # inputs and state: not activations
        elif node.target is operator.getitem and first is not None:
            unit[node] = (
                (first, node.args[1]) if unit.get(first, 0) == (first, "tuple") else unit.get(first)
            )
        elif _is_view(node) and first is not None:
            unit[node] = unit.get(first)
        else:
            value = node.meta.get("val")
            if isinstance(value, (tuple, list)):
                unit[node] = (node, "tuple")
                keys = [(node, i) for i in range(len(value))]
                for key, item in zip(keys, value, strict=True):
                    sizes[key] = _nbytes(item)
            else:
                keys = [(node, None)]
                unit[node] = keys[0]
                sizes[keys[0]] = _nbytes(value)
            born[index[node]] = keys
    last_use: dict[tuple[fx.Node, int | None], int] = {}
    for node in nodes:
        held = unit.get(node)
        if held is None:
            continue
        for user in node.users:
            when = end if user.op == "output" else index[user]
            if held[1] == "tuple":  # uses of a multi-result op go through getitem
                continue
            last_use[held] = max(last_use.get(held, 0), when)
    live, peak, peak_node, total = 0, 0, "", 0
    frees: Counter[int] = Counter()
    for i, node in enumerate(nodes):
        for key in born.get(i, ()):
            size = sizes[key]
            total += size
            live += size
            frees[max(last_use.get(key, i), i)] += size
        if live > peak:
            peak, peak_node = live, node.name
        live -= frees.pop(i, 0)
    return ActivationEstimate(peak, peak_node, total)


def measured_peak(gm: fx.GraphModule, args: Sequence[torch.Tensor]) -> int:
    """Run the graph once on real tensors as the emulator's O0 executor does (its generated
    code, op by op, each value dropped after its last use) and return the most bytes the
    CPU allocator held at once above what it held before the call, from PyTorch's memory
    profiler: the allocations net of the frees of each top-level op, in order. (An op's
    own temporary workspace, freed before it returns, is not seen.)"""
    from torch.profiler import ProfilerActivity, profile

    with (
        _native_stderr_silenced(),
        torch.no_grad(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
        outputs = gm(*args)
    del outputs
    events = sorted(
        (e for e in prof.events() if e.cpu_parent is None), key=lambda e: e.time_range.start
    )
    live = peak = 0
    for event in events:
        live += event.cpu_memory_usage
        peak = max(peak, live)
    return peak


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """The profiler's C++ library logs its start and stop (and, without a GPU, an error it
    recovers from) straight to file descriptor 2: not the report's business."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def placeholder_specs(specs: Mapping) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The placeholders' shapes and dtypes from a codegen directory's specs.json: the state
    first, then the inputs."""
    entries = [*specs["state"], *specs["inputs"].values()]
    return [(tuple(e["shape"]), getattr(torch, e["dtype"])) for e in entries]
