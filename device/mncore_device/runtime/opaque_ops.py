"""ATen ops that every executor runs through an opaque copy, a custom op of this package.

`aten.mkldnn_rnn_layer` (one layer of `nn.LSTM` on the CPU, in eager as in the traced step)
returns a workspace that its backward, `mkldnn_rnn_layer_backward`, reads. The kernel makes
that workspace only while grad mode is on, and a compiled step runs with grad mode off in two
places: TorchInductor runs a forward-only (inference) graph under no_grad, and a user may call
a compiled step inside `torch.no_grad()`. Without a workspace the backward fails ("Expected a
proper Tensor but got None ... for argument #22 'workspace'"). Inductor's own lowering of the
forward is written for inference: it returns a one-element placeholder as the workspace. And
Inductor hands the backward, an ATen fallback, its input in another memory layout than the
forward had (a recomputed transpose), which the kernel reads as if it were the forward's:
the input weights' gradient comes out wrong.

Each copy has the ATen op's schema and calls the same ATen kernel (so it rounds as eager
does, bit for bit), with grad mode on, which only makes the kernel keep its workspace: inputs
never require grad inside a compiled step, so no autograd graph is recorded. Inductor calls a
custom op as it is, with its inputs in the strides the traced graph recorded (the tag
needs_fixed_stride_order), instead of lowering it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.fx as fx

aten = torch.ops.aten
_NAMESPACE = "mncore_device"


def make_opaque(gm: fx.GraphModule) -> bool:
    """Retarget the ops above to their opaque copies, in place; whether any was found."""
    copies = _copies()
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in copies:
            node.target = copies[node.target]
            changed = True
    if changed:
        gm.recompile()
    return changed


@functools.cache
def _library() -> torch.library.Library:
    return torch.library.Library(_NAMESPACE, "FRAGMENT")


def _copies() -> dict[torch._ops.OpOverload, torch._ops.OpOverload]:
    """ATen op -> its opaque copy (defined on first use)."""
    return {
        aten.mkldnn_rnn_layer.default: _copy(aten.mkldnn_rnn_layer.default, _rnn_layer_fake),
        aten.mkldnn_rnn_layer_backward.default: _copy(aten.mkldnn_rnn_layer_backward.default),
    }


@functools.cache
def _copy(op: torch._ops.OpOverload, fake: Callable | None = None) -> torch._ops.OpOverload:
    """A custom op `mncore_device::<name>` with `op`'s schema that runs `op` in grad mode."""
    name = op._schema.name.split("::")[1]
    schema = str(op._schema).split("::", 1)[1]
    library = _library()
    library.define(schema, tags=(torch.Tag.needs_fixed_stride_order,))

    def run(*args, **kwargs):
        with torch.enable_grad():  # the kernel keeps its workspace only in grad mode
            return op(*args, **kwargs)

    library.impl(name, run, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{_NAMESPACE}::{name}", fake or op, lib=library)
    return getattr(getattr(torch.ops, _NAMESPACE), name).default


def _rnn_layer_fake(input, weight0, weight1, weight2, weight3, hx, cx, *constants):
    """ATen's meta function gives the workspace 0 elements; it has the size the kernel makes
    for these shapes, measured once on zeros (the outputs' shapes and strides are ATen's)."""
    tensors = (input, weight0, weight1, weight2, weight3, hx, cx)
    output, hy, cy, _ = aten.mkldnn_rnn_layer.default(*tensors, *constants)
    specs = tuple((tuple(t.shape), t.dtype) for t in tensors)
    hashable = tuple(tuple(c) if isinstance(c, list) else c for c in constants)
    numel = _workspace_numel(specs, hashable)
    return output, hy, cy, input.new_empty(numel, dtype=torch.uint8)


@functools.cache
def _workspace_numel(specs: tuple, constants: tuple) -> int:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.enable_grad():
        zeros = [torch.zeros(shape, dtype=dtype) for shape, dtype in specs]
        return aten.mkldnn_rnn_layer.default(*zeros, *constants)[3].numel()
