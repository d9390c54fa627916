"""New state written by the kernel that computes it, not by a copy kernel after it.

The O1-O4 executors hand Inductor a step graph that ends in one `aten.copy_` per updated
state input (`executors._updating_state_in_place`): each weight, optimizer buffer and
BatchNorm statistic. TorchInductor (torch 2.14.1) lowers such a copy into two scheduler
nodes: the new value, realized as a buffer of its own (it reads the old value it replaces,
and before an input is overwritten every pending reader of it is realized), and a copy of
that buffer into the input. The scheduler then fuses the two into one kernel, so the
generated code is the same as if the value had been stored into the input directly; but
every scheduler node costs its share of the scheduling, fusion search and code generation.
With SGD and momentum that is 4 nodes per parameter (its weight and momentum buffer) where 2
would do: 322 more for ResNet-50's 161 parameters. Inductor itself skips that copy for its
in-place foreach optimizer ops ("reinplacing epilogue copies improves compile time",
`lowering.register_foreach_inplace`), which a CPU step's graph seldom holds: torch.optim picks
its foreach form by default for CUDA tensors only.

And before a copy overwrites an input, Inductor realizes as a buffer every value lowered so
far that reads the input and is not a buffer yet, including the values whose every user has
been lowered and has inlined them (an update's `mul(momentum, 0.9)`): buffers nothing reads,
for which the scheduler builds nodes and then drops them. With SGD and momentum, 2 or 3 of
those per parameter.

Within `new_state_written_in_place()`:
- a `copy_(state, value)` whose value is an elementwise computation that nothing lowered
  after the copy reads (no later node, not the graph's output) makes that computation's own
  buffer store into the state input. It is safe because the copy realizes every other
  pending reader of the state's old value first, so each of them comes before the write in
  the schedule, as with Inductor's own copy; any other value falls back to Inductor's copy.
- the pending readers of the old value whose graph nodes have all their users lowered before
  the copy are not realized: the users that inlined such a value read the old state through
  it and are pending readers themselves (realized before the write) or buffers already.
The generated kernels compute the same values.

Measured (batch 32, O1, 1 thread, each compile alone in a fresh process on an empty cache,
interleaved, 2 runs each way), without -> with the stores alone -> with both:
ResNet-50 42.4, 44.3 -> 40.9, 39.8 -> 39.4, 38.6 s, the scheduler's construction 5.0, 5.3 ->
4.3, 4.1 -> 3.1, 3.0 s, the lowering 3.9, 3.9 -> 3.6, 3.3 -> 3.1, 3.3 s; its operations
1,871 -> 1,229 (1,068 for the step without the update, returning the gradients).
MobileNet v2 (without -> with both) 40.1, 40.1 -> 38.1, 37.2 s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

_COPY = torch.ops.aten.copy_.default


@contextlib.contextmanager
def new_state_written_in_place() -> Iterator[None]:
    """Within this context, Inductor stores a state input's new value from the kernel that
    computes it, and realizes no reader of the old value that nothing will read (see the
    module's docstring). A no-op on a torch whose lowering differs."""
    from torch._inductor import graph as graph_module
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    layout_class, lowering = ir.MutationLayoutSHOULDREMOVE, graph_module.GraphLowering
    if "realize_into" not in vars(layout_class) or "run_node" not in vars(lowering):
        yield
        return
    copy_into, run_node = layout_class.realize_into.__func__, lowering.run_node
    values: dict[int, tuple[Any, list]] = {}  # id -> (value, the graph nodes it is the value of)

    def recording_run_node(self, node: torch.fx.Node) -> Any:
        result = run_node(self, node)
        for value in _tensor_boxes(result):
            values.setdefault(id(value), (value, []))[1].append(node)
        return result

    def realize_into(cls, src: Any, dst: Any, unsafe_alias: bool = False) -> Any:
        copy = V.graph.current_node
        if unsafe_alias or copy is None or copy.target is not _COPY:
            return copy_into(cls, src, dst, unsafe_alias)
        _forget_unread_readers(dst.get_name(), copy, values)
        value = _stored_in_place(src, dst, copy)
        return value if value is not None else copy_into(cls, src, dst, unsafe_alias)

    layout_class.realize_into = classmethod(realize_into)
    lowering.run_node = recording_run_node
    try:
        yield
    finally:
        layout_class.realize_into = classmethod(copy_into)
        lowering.run_node = run_node
        values.clear()


def _tensor_boxes(value: Any) -> Iterator[Any]:
    """The TensorBoxes in a lowered value, as `GraphLowering.register_users_of` walks it (for
    Inductor's pending readers of each buffer)."""
    from torch._inductor import ir

    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensor_boxes(item)
    elif isinstance(value, ir.TensorBox):
        yield value


def _forget_unread_readers(name: str, copy: torch.fx.Node, values: dict) -> None:
    """Drop, from the pending readers of `name`'s old value that Inductor realizes before
    overwriting it, each value whose every graph user is lowered before `copy`: its users
    inlined it (and are pending readers themselves, or buffers already) or realized it, so
    nothing reads it again. Inductor would realize it as a buffer that nothing reads, which
    the scheduler builds a node for and then drops."""
    from torch._inductor.virtualized import V

    def unread(reader: Any) -> bool:
        value, nodes = values.get(id(reader), (None, ()))
        return value is reader and all(_read_only_before(copy, node) for node in nodes)

    readers = V.graph.name_to_users.get(name)
    if readers:
        readers[:] = [reader for reader in readers if not unread(reader)]


def _stored_in_place(src: Any, dst: Any, copy: torch.fx.Node) -> Any:
    """The buffer computing `src`, now stored into `dst`; None (nothing done) where `copy` is
    not one of a sole elementwise value into state."""
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    box = src.data if isinstance(src, ir.TensorBox) else src
    if (
        not isinstance(copy.args[1], torch.fx.Node)
        or not isinstance(box, ir.StorageBox)
        or not isinstance(box.data, ir.Pointwise)  # not yet a buffer: nothing reads it as one
        or not _read_only_before(copy, copy.args[1], but=copy)
    ):
        return None
    graph = V.graph
    dst.realize()
    name = dst.get_name()
    for reader in graph.name_to_users.get(name, ()):  # every other reader of the old value
        if reader.data is not box:
            reader.realize()
    box.realize()  # last: scheduled after them all
    if not isinstance(box.data.layout, ir.FlexibleLayout):
        return None
    box.data.layout = ir.MutationLayoutSHOULDREMOVE(dst)  # which marks `name` mutated
    return box.data


def _read_only_before(copy: torch.fx.Node, node: torch.fx.Node, but: Any = None) -> bool:
    """Whether every user of `node` (but `but`) is lowered before `copy`, and none is the
    graph's output: nothing lowered from `copy` on reads `node`'s value."""
    return all(user is but or (user.op != "output" and user < copy) for user in node.users)
