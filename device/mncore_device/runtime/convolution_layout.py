"""Whether a step's convolutions run faster in channels_last on this machine: timed, not
guessed from their shapes.

Under Inductor's channels_last layout optimization, a graph's convolutions run in
channels_last, and the device holds their weights (and those weights' optimizer state) so
(`state_layout`). Which layout wins depends on the convolutions' shapes in ways no simple
rule separated (torch 2.14.1, oneDNN, 1 thread, batch 32, 32x32 images, whole O1 steps, when
channels_last still cost a copy of each weight and of its gradient a step):
- faster in channels_last: MobileNet v2 1.30x, SqueezeNet 1.1 1.32x, RegNetY-400MF 1.12x,
  DenseNet-121 1.06x;
- slower: ResNet-18 0.57x, ResNet-50 0.84x.
Neither depthwise convolutions (RegNet's are grouped 8 channels per group, DenseNet's and
SqueezeNet's are dense) nor 1x1 kernels (half of ResNet-50's) tell them apart. The sum of the
graph's convolutions timed one by one (forward and backward, each weight in the layout
timed) picks the faster layout.

A decision is kept per set of convolutions, thread count and device (`timed_layouts`): a
warm compile does not time again."""

from __future__ import annotations

import collections
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass
from pathlib import Path

import torch
from torch import fx

from .timed_layouts import other_layout_is_faster

aten = torch.ops.aten
# part of a decision's key: decisions timed otherwise (with a copy of each weight to
# channels_last and of its gradient back, as when state was always stored contiguous) are
# not reused
_WHAT_IS_TIMED = "weights stored in their graph's layout"


@dataclass(frozen=True)
class Convolution:
    """One 2-D convolution of a graph: what its forward and backward time depends on."""

    input: tuple[int, ...]
    weight: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int
    input_gradient: bool  # False for a convolution of a graph input (the batch)
    dtype: str


def convolutions_of(
    gm: fx.GraphModule, example_args: Sequence[torch.Tensor]
) -> collections.Counter[Convolution]:
    """The graph's 2-D forward convolutions, with how many times each occurs. Their shapes
    come from a run on fake tensors of the nodes they depend on (a step graph's forward
    only, not its backward and update); none where that fails."""
    convolutions = [n for n in gm.graph.nodes if _is_convolution(n) and len(n.args) >= 9]
    if not convolutions:
        return collections.Counter()
    try:
        values = fake_values(gm, example_args, [n.args[0] for n in convolutions])
    except Exception:  # an op without a fake implementation: the stored layout
        return collections.Counter()
    found: collections.Counter[Convolution] = collections.Counter()
    for node in convolutions:
        x, w = (values.get(a) for a in node.args[:2])
        stride, padding, dilation, transposed, _, groups = node.args[3:9]
        if transposed or not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
            continue
        if w.dim() != 4:
            continue
        found[
            Convolution(
                tuple(x.shape), tuple(w.shape), tuple(stride), tuple(padding), tuple(dilation),
                groups, node.args[0].op != "placeholder", str(w.dtype).removeprefix("torch."),
            )
        ] += 1  # fmt: skip
    return found


def fake_values(
    gm: fx.GraphModule, example_args: Sequence[torch.Tensor], wanted: Sequence[object]
) -> dict[fx.Node, object]:
    """The values of the `wanted` nodes (and of the graph's inputs) on fake tensors, from a
    run of only the nodes they depend on. A compiled graph is rebuilt from its JSON form
    (`artifacts.canonical`) and has no values recorded on its nodes; the convolutions'
    shapes need only the forward that computes their operands."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    needed: set[fx.Node] = set()
    stack = [n for n in wanted if isinstance(n, fx.Node)]
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    values: dict[fx.Node, object] = {}
    placeholders = iter(example_args)
    with mode, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                values[node] = mode.from_tensor(next(placeholders))
            elif node in needed and node.op == "call_function":
                args, kwargs = fx.map_arg((node.args, node.kwargs), values.__getitem__)
                values[node] = node.target(*args, **kwargs)
            elif node in needed:  # get_attr and the like: not in a step graph
                raise NotImplementedError(node.op)
    return values


def channels_last_is_faster(
    convolutions: collections.Counter[Convolution],
    device: torch.device,
    cache_dir: Path | None = None,
) -> bool:
    """Whether `convolutions` (forward and backward, each weight stored in the layout timed:
    see StateLayout) took less time in channels_last than in NCHW, timed here. Decided once
    per set of convolutions, thread count and device (`timed_layouts`)."""
    if not convolutions:
        return False
    described = [_WHAT_IS_TIMED, sorted((astuple(c), n) for c, n in convolutions.items())]
    return other_layout_is_faster(
        described, device, lambda: _time_both(convolutions, device), cache_dir
    )


def _time_both(
    convolutions: collections.Counter[Convolution], device: torch.device
) -> tuple[float, float]:
    """Seconds for one pass over `convolutions` in the stored layout and in channels_last:
    the least of up to three timed passes each, after one untimed pass (oneDNN builds its
    kernels on a shape's first call); fewer where the first timed pass is clear."""
    runs = {layout: _runs(convolutions, device, layout) for layout in (False, True)}
    best = {layout: float("inf") for layout in runs}
    for attempt in range(4):
        for layout, run in runs.items():
            seconds = run()
            if attempt:
                best[layout] = min(best[layout], seconds)
        ratio = best[True] / best[False] if attempt else 1.0
        if attempt and not 0.9 < ratio < 1.1:
            break
    return best[False], best[True]


def _runs(
    convolutions: collections.Counter[Convolution], device: torch.device, channels_last: bool
) -> Callable[[], float]:
    """A function timing one pass over `convolutions` in one layout, on tensors made once."""
    layout = torch.channels_last if channels_last else torch.contiguous_format
    cases = []
    generator = torch.Generator(device=device).manual_seed(0)
    for conv, count in convolutions.items():
        dtype = getattr(torch, conv.dtype)
        x = torch.randn(conv.input, generator=generator, device=device, dtype=dtype)
        w = torch.randn(conv.weight, generator=generator, device=device, dtype=dtype)
        y = aten.convolution(x, w, None, conv.stride, conv.padding, conv.dilation, False,
                             [0, 0], conv.groups)  # fmt: skip
        grad = torch.randn(y.shape, generator=generator, device=device, dtype=dtype)
        # the weight as the device stores it for a graph in this layout (StateLayout)
        cases.append((conv, count, x.contiguous(memory_format=layout),
                      w.contiguous(memory_format=layout),
                      grad.contiguous(memory_format=layout)))  # fmt: skip
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def run() -> float:
        total = 0.0
        for conv, count, x, w, grad in cases:
            synchronize()
            start = time.perf_counter()
            aten.convolution(x, w, None, conv.stride, conv.padding, conv.dilation,
                             False, [0, 0], conv.groups)  # fmt: skip
            aten.convolution_backward(
                grad, x, w, None, conv.stride, conv.padding, conv.dilation, False,
                [0, 0], conv.groups, [conv.input_gradient, True, False],
            )  # fmt: skip
            synchronize()
            total += count * (time.perf_counter() - start)
        return total

    return run


def _is_convolution(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is aten.convolution.default
