"""Rewrites of a step graph's convolutions before TorchInductor compiles it (O1 and up).

Each gives the same numbers as the convolution it replaces, up to rounding, and is there
because oneDNN's convolution, which both eager PyTorch and Inductor call on the CPU, was
measured slow for that case: kernels wider than their input, depthwise kernels on one tap,
convolutions on maps of a few pixels, and weights whose layout is ambiguous.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from .convolution_layout import fake_values

aten = torch.ops.aten


# Where a convolution on a small map pays as the matrix it is (`_small_map_as_matmul`), whose
# building and gradient cost a pass over that matrix each step whatever the batch. The
# fewest elements of the matrix: ResNet's [256 -> 256] 3x3 on a 2x2 map (a [1024, 1024]
# matrix) made ResNet-50's step 14% faster and ResNet-18's 6-10% at batch 32, while
# DenseNet-121's 24 [128 -> 32] ones ([128, 512]) left its step as it was (192.1 against
# 189.2 ms, batch 32, 1 thread). And the smallest batch: ResNet-18's step at batch 16 was
# level (74.6 against 75.2 ms), at batch 4 slower (55.9 against 52.5 ms).
SMALL_MAP_MIN_ELEMENTS = 1 << 18
SMALL_MAP_MIN_BATCH = 32


def is_call(value: object, target: object) -> bool:
    """`value` is a graph node calling `target`."""
    return isinstance(value, fx.Node) and value.op == "call_function" and value.target is target


def rewritten_convolutions(
    gm: fx.GraphModule, example_args: Sequence[torch.Tensor], matmul_max_pixels: int = 4
) -> fx.GraphModule:
    """`gm` with its convolutions (forward and backward) rewritten where oneDNN was measured
    slow, the same numbers up to rounding; `gm` itself where none is. The shapes come from a
    run on fake tensors of the nodes the convolutions' operands depend on (the forward, not
    the backward and update: a whole graph's run was 5.1 s of DenseNet-121's compile).

    A convolution whose padding is wider than its input (a 7x7 kernel on a 1x1 or 2x2 map)
    keeps only the kernel taps that ever meet the input, and the padding less by as much:
    the taps left out multiply only padding, so the outputs and the input's gradient are the
    same numbers, and the weight's gradient is the trimmed one's padded back with zeros.
    oneDNN runs the whole kernel: measured (torch 2.14.1, 1 thread), ConvNeXt's 7x7
    depthwise convolution on a [4, 768, 1, 1] map took 1.3 ms forward and 1.4 ms backward in
    NCHW and 18 ms backward in channels_last, at batch 32 10.5 ms forward in NCHW. A
    depthwise kernel left with one tap is a product per channel (`_depthwise_as_product`),
    and a 1x1 kernel (as it was, or trimmed to one tap) on a map of at most
    `matmul_max_pixels` pixels a matrix multiplication (`_pointwise_as_matmul`). A dense
    kernel of another size on input and output maps of at most that many pixels is the
    linear map between their pixels: matrix multiplications too, where that map has at
    least `SMALL_MAP_MIN_ELEMENTS` elements and the batch `SMALL_MAP_MIN_BATCH` samples
    (`_small_map_as_matmul`)."""
    convolutions = (aten.convolution.default, aten.convolution_backward.default)
    if not any(node.target in convolutions for node in gm.graph.nodes):
        return gm
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    operands = []  # what the rewrites read the shapes of
    for node in graph.nodes:
        if is_call(node, aten.convolution.default):
            operands += [node.args[0], node.args[1], node]
        elif is_call(node, aten.convolution_backward.default):
            operands += [node.args[1], node.args[2]]
    try:
        values = fake_values(fx.GraphModule(gm, graph), example_args, operands)
    except Exception:  # an op without a fake implementation: the graph keeps its convolutions
        return gm

    def tensor(value: object) -> torch.Tensor | None:
        found = values.get(value) if isinstance(value, fx.Node) else None
        return found if isinstance(found, torch.Tensor) else None

    def shape(value: object) -> torch.Size | None:
        return found.shape if (found := tensor(value)) is not None else None

    kernels: dict[tuple[fx.Node, tuple], fx.Node] = {}  # (weight, taps) -> trimmed kernel
    rows: dict[tuple[fx.Node, tuple], fx.Node] = {}  # (input, stride) -> its pixels as rows
    dense_weights: dict[tuple, fx.Node] = {}  # (weight, pixel pairs) -> _small_map_as_matmul's
    rewritten = False
    for node in list(graph.nodes):
        if is_call(node, aten.convolution.default):
            x, w, at = node.args[0], node.args[1], 3
        elif is_call(node, aten.convolution_backward.default):
            x, w, at = node.args[1], node.args[2], 4
        else:
            continue
        stride, padding, dilation, transposed = node.args[at : at + 4]
        groups = node.args[at + 5]
        x_shape, w_shape = shape(x), shape(w)
        if transposed or x_shape is None or w_shape is None or len(w_shape) != 4:
            continue
        taps = _taps_meeting_the_input(x_shape, w_shape, stride, padding, dilation)
        if taps is None:
            continue
        one_tap = all(first == last for first, last in taps)
        on_the_input = all(first == p for (first, _), p in zip(taps, padding, strict=True))
        pixels = x_shape[2] * x_shape[3]
        if (
            groups == 1
            and not (one_tap and on_the_input)  # a 1x1 product: _pointwise_as_matmul
            and pixels <= matmul_max_pixels
            and x_shape[0] >= SMALL_MAP_MIN_BATCH
        ):
            # (only here: the pairs of a large map's pixels would be millions of entries)
            pairs = _pixel_pairs(x_shape, w_shape, stride, padding, dilation)
            elements = w_shape[0] * w_shape[1] * len(pairs) * pixels
            if len(pairs) <= matmul_max_pixels and elements >= SMALL_MAP_MIN_ELEMENTS:
                _small_map_as_matmul(
                    graph,
                    node,
                    w,
                    x_shape,
                    w_shape,
                    shape(node),
                    pairs,
                    dense_weights,
                    _channels_last(tensor(x)),
                )
                rewritten = True
                continue
        trimmed = any(t != (0, k - 1) for t, k in zip(taps, w_shape[2:], strict=True))
        kernel, pad = w, [0] * 4  # pad: the weight gradient's, the last dimension first
        if trimmed:
            key = (w, tuple(taps))
            kernel = kernels.get(key)
            if kernel is None:  # the forward's node comes first, and its backward's reuses it
                with graph.inserting_before(node):
                    kernel = w
                    for dim, (first, last) in enumerate(taps, start=2):
                        kernel = graph.call_function(
                            aten.slice.Tensor, (kernel, dim, first, last + 1)
                        )
                    # the taps as a contiguous weight, copied once a step in a fused kernel:
                    # a strided view makes oneDNN's convolution (forward and backward) copy
                    # it with aten's copy, 6 ms for a [512, 512, 2, 2] kernel
                    kernel = graph.call_function(
                        aten.clone.default, (kernel,), {"memory_format": torch.contiguous_format}
                    )
                kernels[key] = kernel
            pad = []
            for k, (first, last) in reversed(list(zip(w_shape[2:], taps, strict=True))):
                pad += [first, k - 1 - last]
        channels = x_shape[1]
        if one_tap and on_the_input and w_shape[0] == channels == groups and w_shape[1] == 1:
            if not trimmed:
                continue  # a 1x1 depthwise kernel as written: left to oneDNN
            # a depthwise kernel's one tap on the input itself: a product per channel
            # (PyTorch runs a 1x1 depthwise convolution group by group: 2.7 ms for this)
            _depthwise_as_product(graph, node, kernel, channels, pad)
        elif one_tap and on_the_input and groups == 1 and pixels <= matmul_max_pixels:
            _pointwise_as_matmul(
                graph, node, kernel, x_shape, w_shape[0], stride, pad, rows,
                _channels_last(tensor(x)),
            )  # fmt: skip
        elif trimmed:
            _on_the_taps(graph, node, at, kernel, taps, pad)
        else:
            continue
        rewritten = True
    return _LazyGraphModule(gm, graph) if rewritten else gm


def _channels_last(tensor: torch.Tensor | None) -> bool:
    """Whether a convolution's input is laid out channels_last, as PyTorch's convolutions
    decide (`suggest_memory_format`): then their output and the input's gradient are too."""
    return (
        tensor is not None
        and tensor.dim() == 4
        and not tensor.is_contiguous()
        and tensor.is_contiguous(memory_format=torch.channels_last)
    )


def _laid_out_as_convolution(
    graph: fx.Graph, value: fx.Node, is_channels_last: bool, channels_last: bool
) -> fx.Node:
    """`value`, a map computed in place of a convolution's output or its input's gradient,
    copied into the memory format the convolution gives those where it is not in it: the
    views the trace recorded after the convolution were made on its strides, and fail on
    others (ConvNeXt's LayerNorm over channels, after a 2x2 convolution on a 2x2
    channels_last map, took its input's gradient as NCHW rows: Inductor refused the graph
    and O1 ran it op by op)."""
    if is_channels_last == channels_last:
        return value
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    return graph.call_function(aten.clone.default, (value,), {"memory_format": memory_format})


def _taps_meeting_the_input(
    x_shape: Sequence[int],
    w_shape: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
) -> list[tuple[int, int]] | None:
    """Per spatial dimension, the first and last kernel tap that meets the input (not only
    padding); None where that cannot be said simply (dilation, or trimming would change
    the output's size)."""
    taps = []
    for size, k, s, p, d in zip(x_shape[2:], w_shape[2:], stride, padding, dilation, strict=True):
        out = (size + 2 * p - k) // s + 1
        first, last = max(0, p - (out - 1) * s), min(k - 1, size - 1 + p)
        if (
            (d != 1 and k > 1)
            or first > last
            or (size + 2 * (p - first) - (last - first + 1)) // s + 1 != out
        ):
            return None
        taps.append((first, last))
    return taps


def _pixel_pairs(
    x_shape: Sequence[int],
    w_shape: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
) -> list[list[tuple[int, int] | None]]:
    """For each output pixel (row-major), for each input pixel (row-major): the kernel tap
    (row, column) that multiplies that input pixel into that output pixel, None if none."""

    def tap(offset: int, k: int, d: int) -> int | None:  # offset: input + padding - out * stride
        return offset // d if offset % d == 0 and 0 <= offset // d < k else None

    rows, columns = (
        [
            [tap(i + p - o * s, k, d) for i in range(size)]
            for o in range((size + 2 * p - d * (k - 1) - 1) // s + 1)
        ]
        for size, k, s, p, d in zip(
            x_shape[2:], w_shape[2:], stride, padding, dilation, strict=True
        )
    )
    return [
        [None if th is None or tw is None else (th, tw) for th in row for tw in column]
        for row in rows
        for column in columns
    ]


def _small_map_as_matmul(
    graph: fx.Graph,
    node: fx.Node,
    w: fx.Node,
    x_shape: Sequence[int],
    w_shape: Sequence[int],
    out_shape: Sequence[int] | None,
    pairs: list[list[tuple[int, int] | None]],
    dense_weights: dict[tuple, fx.Node],
    channels_last: bool,
) -> None:
    """Replace `node`, a dense convolution (or its backward) on a map of a few pixels, with
    matrix multiplications by the linear map it is: a weight [C_out * P, C_in * Q] (P output
    and Q input pixels) that holds, for each pair of pixels, the kernel tap joining them
    (zeros where none does), built from the kernel each step and shared by the forward and
    its backward. The input is [N, C_in * Q] as it lies in NCHW, the weight gradient that
    matrix's gradient summed back tap by tap (`out_shape`: the forward's output; None for a
    backward). The output and the input's gradient come out
    NCHW; `channels_last` (the input is) lays them out as the convolution would
    (`_laid_out_as_convolution`).

    For a 3x3 kernel on a 2x2 map every tap that meets the input is a pair, so the matmuls
    do the convolution's arithmetic; oneDNN is slow on such maps. Measured (torch 2.14.1,
    1 thread, batch 32, forward and backward): ResNet's [256 -> 256] 3x3 on a 2x2 map
    6.0-7.3 ms as a convolution, 2.7 ms for the three matmuls. The weight and its gradient
    are a stack of the taps' [C_out, C_in] blocks, copied in loops over C_in. Two ways with
    less code to build lost the gain in ResNet-18's step (one gather per matrix, indices
    from `arange`: 114.5 ms against 109.0 without the rewrite; a view of the kernel by
    unfolds, pixels in reverse: 104.5 against 103.1): their loops run over the 2 to 4
    pixels innermost and do not vectorize."""
    n, c_in, height, width = x_shape
    c_out = w_shape[0]
    p_count, q_count = len(pairs), height * width

    def call(target, *args):
        return graph.call_function(target, args)

    def block(value: fx.Node, i: int, j: int, at: tuple[int, int]) -> fx.Node:
        """value[..., i, ..., j, ...] (dimensions `at`): one [C_out, C_in] block."""
        return call(aten.select.int, call(aten.select.int, value, at[1], j), at[0], i)

    def stacked(blocks: list[fx.Node | None], dim: int) -> fx.Node:  # None: zeros
        zeros = None
        if None in blocks:
            zeros = call(aten.zeros_like.default, next(b for b in blocks if b is not None))
        return call(aten.stack.default, [zeros if b is None else b for b in blocks], dim)

    with graph.inserting_before(node):
        key = (w, tuple(tuple(row) for row in pairs))
        big = dense_weights.get(key)
        if big is None:  # the forward's node comes first, and its backward's reuses it
            taps = {tap: block(w, *tap, at=(2, 3)) for row in pairs for tap in row if tap}
            big = stacked([taps.get(tap) for row in pairs for tap in row], 1)  # [Co, P*Q, Ci]
            big = call(aten.reshape.default, big, [c_out, p_count, q_count, c_in])
            big = call(aten.permute.default, big, [0, 1, 3, 2])
            big = call(aten.reshape.default, big, [c_out * p_count, c_in * q_count])
            dense_weights[key] = big
        if node.target is aten.convolution.default:
            x, bias = node.args[0], node.args[2]
            x_flat = call(aten.reshape.default, x, [n, c_in * q_count])
            transposed = call(aten.permute.default, big, [1, 0])
            if bias is None:
                out = call(aten.mm.default, x_flat, transposed)
            else:  # each output channel's bias at each of its pixels
                bias = call(aten.reshape.default, bias, [c_out, 1])
                bias = call(aten.expand.default, bias, [c_out, p_count])
                bias = call(aten.reshape.default, bias, [c_out * p_count])
                out = call(aten.addmm.default, bias, x_flat, transposed)
            out = call(aten.reshape.default, out, list(out_shape))
            node.replace_all_uses_with(_laid_out_as_convolution(graph, out, False, channels_last))
            graph.erase_node(node)
            return
        grad_output, x = node.args[0], node.args[1]
        grad_flat = call(aten.reshape.default, grad_output, [n, c_out * p_count])
        for user in list(node.users):
            index = user.args[1]
            if index == 0:
                value = call(aten.mm.default, grad_flat, big)
                value = call(aten.reshape.default, value, list(x_shape))
                value = _laid_out_as_convolution(graph, value, False, channels_last)
            elif index == 1:
                x_flat = call(aten.reshape.default, x, [n, c_in * q_count])
                grad_big = call(aten.permute.default, grad_flat, [1, 0])
                grad_big = call(aten.mm.default, grad_big, x_flat)
                grad_big = call(aten.reshape.default, grad_big, [c_out, p_count, c_in, q_count])
                per_tap: dict[tuple[int, int], fx.Node] = {}  # each tap: its pairs' sum
                for p, row in enumerate(pairs):
                    for q, tap in enumerate(row):
                        if tap:
                            term = block(grad_big, p, q, at=(1, 3))
                            total = per_tap.get(tap)
                            per_tap[tap] = (
                                term if total is None else call(aten.add.Tensor, total, term)
                            )
                kernel = [(i, j) for i in range(w_shape[2]) for j in range(w_shape[3])]
                value = stacked([per_tap.get(tap) for tap in kernel], 2)  # [Co, Ci, K*K]
                value = call(aten.reshape.default, value, list(w_shape))
            else:
                value = call(aten.sum.dim_IntList, grad_output, [0, 2, 3])
            user.replace_all_uses_with(value)
            graph.erase_node(user)
        graph.erase_node(node)


def _on_the_taps(
    graph: fx.Graph,
    node: fx.Node,
    at: int,
    kernel: fx.Node,
    taps: list[tuple[int, int]],
    pad: list[int],
) -> None:
    """`node`, a convolution or its backward, run on the trimmed `kernel` with the padding
    less by the taps left out; its weight gradient padded back to the whole kernel."""
    args = list(node.args)
    args[at - 2] = kernel  # the weight: args[1] of convolution, args[2] of its backward
    args[at + 1] = [p - first for p, (first, _) in zip(args[at + 1], taps, strict=True)]
    node.args = tuple(args)
    node.meta.pop("val", None)  # (the backward's weight gradient is the trimmed one)
    if node.target is aten.convolution.default:
        return
    for user in list(node.users):
        if is_call(user, operator.getitem) and user.args[1] == 1:
            user.meta.pop("val", None)
            with graph.inserting_after(user):
                full = graph.call_function(aten.constant_pad_nd.default, (user, pad, 0.0))
            user.replace_all_uses_with(full, delete_user_cb=lambda u, full=full: u is not full)


def _pointwise_as_matmul(
    graph: fx.Graph,
    node: fx.Node,
    kernel: fx.Node,
    x_shape: Sequence[int],
    out_channels: int,
    stride: Sequence[int],
    pad: list[int],
    rows: dict[tuple[fx.Node, tuple], fx.Node],
    channels_last: bool,
) -> None:
    """Replace `node`, a convolution (or its backward) whose kernel is one tap (`kernel`,
    [C_out, C_in, 1, 1]) on the input's pixels, with matrix multiplications over the
    pixels read at the stride, as rows [N * H_out * W_out, C]; the weight gradient is padded
    back to the whole kernel by `pad`. `rows`: the input's rows made by a forward before,
    which its backward reads too (one copy of an NCHW input, not two). The output and the
    input's gradient come out as rows, channels_last; `channels_last` (the input is) says
    whether the convolution's would be (`_laid_out_as_convolution`).

    oneDNN's convolution on a few pixels was measured (torch 2.14.1, 1 thread, batch 32,
    forward and backward) at 13.2 ms for ResNet-50's [2048 -> 512] 1x1 kernel on a 1x1 map,
    against 2.5 ms as matrix multiplications; 1.9 against 1.2 ms for DenseNet-121's
    [1024 -> 128] on a 2x2 map (at batch 4: 2.7 against 0.24 ms). On 4x4 maps the two were
    level, so larger maps keep the convolution."""
    n, c_in, height, width = x_shape
    rows_h, rows_w = (height - 1) // stride[0] + 1, (width - 1) // stride[1] + 1

    def call(target, *args):
        return graph.call_function(target, args)

    def as_rows(value: fx.Node, channels: int) -> fx.Node:  # [N, C, H, W] -> [N*H*W, C]
        return call(
            aten.reshape.default, call(aten.permute.default, value, [0, 2, 3, 1]), [-1, channels]
        )

    def as_map(rows: fx.Node, channels: int) -> fx.Node:  # [N*H*W, C] -> [N, C, H, W]
        value = call(aten.reshape.default, rows, [n, rows_h, rows_w, channels])
        return call(aten.permute.default, value, [0, 3, 1, 2])

    with graph.inserting_before(node):
        weight = call(aten.reshape.default, kernel, [out_channels, c_in])
        x = node.args[0] if node.target is aten.convolution.default else node.args[1]
        key = (x, tuple(stride))
        if key not in rows:
            read = x
            for dim, step in ((2, stride[0]), (3, stride[1])):
                if step != 1:
                    read = call(aten.slice.Tensor, read, dim, 0, x_shape[dim], step)
            rows[key] = as_rows(read, c_in)
        x_rows = rows[key]
        if node.target is aten.convolution.default:
            bias = node.args[2]
            transposed_weight = call(aten.permute.default, weight, [1, 0])
            if bias is None:
                out = call(aten.mm.default, x_rows, transposed_weight)
            else:
                out = call(aten.addmm.default, bias, x_rows, transposed_weight)
            out = as_map(out, out_channels)
            pixels_out = rows_h * rows_w
            out = _laid_out_as_convolution(graph, out, pixels_out > 1, channels_last)
            node.replace_all_uses_with(out)
            graph.erase_node(node)
            return
        grad_output = node.args[0]
        grad_rows = as_rows(grad_output, out_channels)
        for user in list(node.users):
            index = user.args[1]
            if index == 0:
                value = as_map(call(aten.mm.default, grad_rows, weight), c_in)
                as_rows_still = rows_h * rows_w > 1  # (slice_backward's zeros are NCHW)
                sizes = [n, c_in, rows_h, width]
                for dim, step, size in ((3, stride[1], width), (2, stride[0], height)):
                    if step != 1:
                        sizes[dim] = size
                        value = call(
                            aten.slice_backward.default, value, list(sizes), dim, 0, size, step
                        )
                        as_rows_still = False
                value = _laid_out_as_convolution(graph, value, as_rows_still, channels_last)
            elif index == 1:
                transposed_grad = call(aten.permute.default, grad_rows, [1, 0])
                value = call(aten.mm.default, transposed_grad, x_rows)
                value = call(aten.reshape.default, value, [out_channels, c_in, 1, 1])
                if any(pad):
                    value = call(aten.constant_pad_nd.default, value, pad, 0.0)
            else:
                value = call(aten.sum.dim_IntList, grad_output, [0, 2, 3])
            user.replace_all_uses_with(value)
            graph.erase_node(user)
        graph.erase_node(node)


def _depthwise_as_product(
    graph: fx.Graph, node: fx.Node, kernel: fx.Node, channels: int, pad: list[int]
) -> None:
    """Replace `node`, a depthwise convolution (or its backward) whose output is its input
    times one weight per channel (`kernel`, [C, 1, 1, 1]), with that product; the weight
    gradient is padded back to the whole kernel by `pad`."""
    per_channel = [1, channels, 1, 1]
    with graph.inserting_before(node):
        scale = graph.call_function(aten.reshape.default, (kernel, per_channel))
        if node.target is aten.convolution.default:
            x, bias = node.args[0], node.args[2]
            result = graph.call_function(aten.mul.Tensor, (x, scale))
            if bias is not None:
                shift = graph.call_function(aten.reshape.default, (bias, per_channel))
                result = graph.call_function(aten.add.Tensor, (result, shift))
            node.replace_all_uses_with(result)
            graph.erase_node(node)
            return
        grad_output, x = node.args[0], node.args[1]
        for user in list(node.users):
            index = user.args[1]
            if index == 0:
                value = graph.call_function(aten.mul.Tensor, (grad_output, scale))
            elif index == 1:
                product = graph.call_function(aten.mul.Tensor, (grad_output, x))
                summed = graph.call_function(aten.sum.dim_IntList, (product, [0, 2, 3]))
                value = graph.call_function(aten.reshape.default, (summed, [channels, 1, 1, 1]))
                value = graph.call_function(aten.constant_pad_nd.default, (value, pad, 0.0))
            else:
                value = graph.call_function(aten.sum.dim_IntList, (grad_output, [0, 2, 3]))
            user.replace_all_uses_with(value)
            graph.erase_node(user)
        graph.erase_node(node)


def channels_last_weights(
    gm: fx.GraphModule, example_args: Sequence[torch.Tensor]
) -> fx.GraphModule:
    """`gm` with each convolution weight that is a graph input and whose memory is laid out
    the same in both formats (one input channel per group, or a 1x1 kernel) read through a
    view with channels_last strides: no copy, only the strides oneDNN reads the format from.

    Under Inductor's channels_last layout optimization the activations are channels_last,
    and Inductor gives a weight that is a graph input the channels_last strides it needs,
    except where the weight already is channels_last by its memory: there it is left with
    its contiguous strides, and oneDNN, asked for a convolution whose input is ambiguous too
    (1x1 spatial, as at the end of MobileNet v3), picks the format from the weight's strides
    and runs its NCHW depthwise kernel. Measured (torch 2.14.1, 1 thread, batch 32, 32x32):
    MobileNet v3 small's 5x5 depthwise convolution on its 1x1 feature map took 10.3 ms a
    step instead of 0.13 ms, its backward 10.0 ms instead of 3.4, and the whole step 52 ms
    instead of 31. torch.compile's graphs get the same views from Inductor, as AOTAutograd
    hands it parameters that are not mutated inputs."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    examples = dict(
        zip((n for n in graph.nodes if n.op == "placeholder"), example_args, strict=False)
    )
    first = next(n for n in graph.nodes if n.op != "placeholder")
    views: dict[fx.Node, fx.Node] = {}
    for node in list(graph.nodes):
        if is_call(node, aten.convolution.default):
            index = 1
        elif is_call(node, aten.convolution_backward.default):
            index = 2
        else:
            continue
        weight = node.args[index]
        value = examples.get(weight)
        if not isinstance(value, torch.Tensor) or value.dim() != 4:
            continue
        if not (value.is_contiguous() and value.is_contiguous(memory_format=torch.channels_last)):
            continue
        if weight not in views:
            strides = (
                torch.empty(value.shape, device="meta")
                .to(memory_format=torch.channels_last)
                .stride()
            )
            with graph.inserting_before(first):
                views[weight] = graph.call_function(
                    aten.as_strided.default, (weight, list(value.shape), list(strides))
                )
        node.update_arg(index, views[weight])
    return _LazyGraphModule(gm, graph) if views else gm
