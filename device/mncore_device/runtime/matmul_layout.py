"""Whether a linear layer's weight runs faster stored transposed on this machine: timed.

A linear layer computes `x @ W.t()` forward, `g.t() @ x` for its weight's gradient and, where
its input needs one, `g @ W` for the input's gradient. MKL's single-precision matmul reads a
transposed right operand more slowly (torch 2.14.1, 1 thread, the forward and the weight's
gradient with W stored as on the host, then transposed; microseconds):

| layer (batch, in -> out) | forward | weight gradient | input gradient |
|---|---|---|---|
| 64, 1024 -> 256 (the tutorial MLP's first) | 263 / 198 | 205 / 223 | 198 / 239 |
| 32, 3072 -> 512 | 1156 / 699 | 658 / 658 | 754 / 1127 |
| 32, 768 -> 3072 | 1890 / 1285 | 1051 / 987 | 1118 / 1858 |
| 128, 512 -> 512 | 472 / 405 | 425 / 500 | 401 / 473 |

Stored transposed, the forward reads W untransposed and the input's gradient reads it
transposed instead: a hidden layer loses in one what it gains in the other. A layer on the
batch itself (an MLP's first) computes no input gradient, so only weights that the graph's
matmuls read as `W.t()` alone are candidates; their forward and weight-gradient matmuls are
timed in both layouts (`timed_layouts`), since the gradient's matmul can lose more than the
forward gains (the 512 -> 512 row).

A weight stored transposed keeps its optimizer state and its gradient laid out as it is: the
values of one shape that the update combines element by element with it (a group, found
through the graph's views and elementwise ops) are all stored so, and the matmul computing
the gradient is computed transposed (`(x.t() @ g).t()`), so the fused update kernel reads
every operand in the same order. A group with any other use (an embedding's gather, an
output) keeps the host's layout."""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from .convolution_layout import fake_values
from .state_layout import TRANSPOSED
from .timed_layouts import other_layout_is_faster

aten = torch.ops.aten
_WHAT_IS_TIMED = "linear weights: forward and weight-gradient matmuls"
_MATMULS = {aten.mm.default: (0, 1), aten.addmm.default: (1, 2)}  # the (a, b) operands
_SAME_LAYOUT = {aten.detach.default, aten.alias.default, aten.clone.default}
_SAME_SHAPE_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
_FULL_REDUCTIONS = {aten.sum.default, aten.linalg_vector_norm.default, aten.norm.Scalar}


@dataclasses.dataclass(frozen=True)
class Matmul:
    """One matmul reading or computing a candidate group's values, as timed: its operands'
    shapes and strides as traced, and whether the group reaches it as its right operand
    (read) or as its result (the gradient, computed transposed in the other layout)."""

    a: tuple[int, int]
    a_strides: tuple[int, int]
    b: tuple[int, int]
    b_strides: tuple[int, int]
    reads_group: bool
    dtype: str


@dataclasses.dataclass(frozen=True)
class Transposition:
    """What a graph stores transposed: state inputs (by index) and the names of the matmuls
    whose results are computed transposed to match them."""

    inputs: tuple[int, ...] = ()
    matmuls: frozenset[str] = frozenset()

    def dim_orders(self) -> dict[int, tuple[int, ...]]:
        return dict.fromkeys(self.inputs, TRANSPOSED)


def transposed_where_faster(
    gm: fx.GraphModule,
    example_args: Sequence[torch.Tensor],
    state_inputs: int,
    mutated: Sequence[int],
    cache_dir: Path | None = None,
) -> Transposition:
    """The groups of `gm` (a functional step graph whose last outputs are the new values of
    the `mutated` inputs) whose matmuls ran faster with their weight stored transposed."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    candidates = [
        p
        for i, p in enumerate(placeholders[:state_inputs])
        if example_args[i].dim() == 2 and example_args[i].is_floating_point()
        if _read_as_transposed_right_operand_only(p)
    ]
    if not candidates:
        return Transposition()
    try:
        values = fake_values(gm, example_args, [n for n in gm.graph.nodes if n.op != "output"])
    except Exception:  # an op without a fake implementation: the host's layout
        return Transposition()
    groups = _Groups(gm, values, placeholders, mutated)
    device = example_args[0].device
    inputs: set[int] = set()
    matmuls: set[str] = set()
    seen = set()
    for weight in candidates:
        root = groups.root(weight)
        if root in seen:
            continue
        seen.add(root)
        found = groups.checked(weight, placeholders[:state_inputs])
        if found is None:
            continue
        members, cases, computed = found
        described = [_WHAT_IS_TIMED, sorted(dataclasses.astuple(c) for c in cases)]
        if other_layout_is_faster(
            described, device, functools.partial(_time_both, cases, device), cache_dir
        ):
            inputs.update(placeholders.index(m) for m in members if m.op == "placeholder")
            matmuls.update(computed)
    return Transposition(tuple(sorted(inputs)), frozenset(matmuls))


def with_results_transposed(gm: fx.GraphModule, matmuls: frozenset[str]) -> fx.GraphModule:
    """A copy of `gm` computing each matmul named in `matmuls` as `(b.t() @ a.t()).t()`: the
    same values, laid out column by column like the weight it is the gradient of."""
    if not matmuls:
        return gm
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in list(graph.nodes):
        if node.name not in matmuls:
            continue
        a, b = node.args
        with graph.inserting_after(node):
            bt = graph.call_function(aten.t.default, (b,))
            with graph.inserting_after(bt):
                at = graph.call_function(aten.t.default, (a,))
                with graph.inserting_after(at):
                    product = graph.call_function(aten.mm.default, (bt, at))
                    with graph.inserting_after(product):
                        result = graph.call_function(aten.t.default, (product,))
        node.replace_all_uses_with(result)
        graph.erase_node(node)
    return _LazyGraphModule(gm, graph)


def _read_as_transposed_right_operand_only(weight: fx.Node) -> bool:
    """Whether the matmuls reading `weight` (through views) read it as `weight.t()` on their
    right, as a linear layer's forward does, and none reads it otherwise."""
    found = False
    for node, flipped in _views_of(weight):
        for user in node.users:
            if user.target in _MATMULS:
                a, b = _MATMULS[user.target]
                if user.args[a] is node or user.args[b] is not node or not flipped:
                    return False
                found = True
    return found


def _views_of(node: fx.Node) -> list[tuple[fx.Node, bool]]:
    """`node` and its views through transposes and layout-keeping views, each with whether
    it is transposed relative to `node`."""
    found, stack = [], [(node, False)]
    while stack:
        current, flipped = stack.pop()
        found.append((current, flipped))
        for user in current.users:
            flip = _flips(user)
            if flip is not None and user.args[0] is current:
                stack.append((user, flipped ^ flip))
    return found


def _flips(node: fx.Node) -> bool | None:
    """True for a transpose of a 2-D value, False for a view laying it out the same, None
    for anything else (read without the values, as the candidates are found)."""
    if node.op != "call_function":
        return None
    if node.target is aten.t.default:
        return True
    if node.target is aten.transpose.int:
        return sorted(d % 2 for d in node.args[1:3]) == [0, 1]
    if node.target is aten.permute.default:
        return list(node.args[1]) in ([1, 0], [-1, -2], [1, -2], [-1, 0])
    if node.target in _SAME_LAYOUT:
        return (
            None if node.kwargs.get("memory_format") not in (None, torch.preserve_format) else False
        )
    return None


class _Groups:
    """The graph's 2-D values joined where their layouts must agree: through views
    (transposed or not), elementwise ops over operands of one shape, and a state input's
    new value. Each value's parity says whether it is transposed relative to its group."""

    def __init__(
        self,
        gm: fx.GraphModule,
        values: dict[fx.Node, object],
        placeholders: list[fx.Node],
        mutated: Sequence[int],
    ) -> None:
        self.gm, self.values = gm, values
        self.parent: dict[fx.Node, tuple[fx.Node, bool]] = {}
        self.conflicted: set[fx.Node] = set()
        output = next(n for n in gm.graph.nodes if n.op == "output")
        results = output.args[0]
        results = list(results) if isinstance(results, (list, tuple)) else [results]
        self.new_values: dict[fx.Node, fx.Node] = {}  # new value -> its state input
        for index, value in zip(mutated, results[len(results) - len(mutated) :], strict=True):
            if isinstance(value, fx.Node):
                self.new_values[value] = placeholders[index]
                self._join(placeholders[index], value, False)
        self.outputs = [r for r in results if isinstance(r, fx.Node)]
        for node in gm.graph.nodes:
            if node.op != "call_function" or not self._is_2d(node):
                continue
            flip = _flips(node)
            if self._same_shape_view(node):
                flip = False
            if flip is not None:
                self._join(node, node.args[0], flip)
            elif _is_pointwise(node):
                shape = self.values[node].shape
                for arg in node.all_input_nodes:
                    if self._is_2d(arg) and self.values[arg].shape == shape:
                        self._join(node, arg, False)

    def root(self, node: fx.Node) -> fx.Node:
        return self._find(node)[0]

    def checked(
        self, weight: fx.Node, state: list[fx.Node]
    ) -> tuple[list[fx.Node], list[Matmul], set[str]] | None:
        """The members of `weight`'s group, the matmuls timed for it and those computed
        transposed in the other layout; None for a group that must keep the host's layout."""
        root, parity = self._find(weight)
        if root in self.conflicted:
            return None
        members = [n for n in self.parent if self._find(n)[0] is root]
        member_set = set(members)
        cases, computed = [], set()
        for member in members:
            transposed = self._find(member)[1] ^ parity  # relative to the weight
            if member.op == "placeholder":
                if member not in state:
                    return None  # the batch, or a constant
            elif member.target in _MATMULS:
                if member.target is not aten.mm.default:
                    return None  # addmm's added term would need its own transpose
                if not transposed:  # laid out as the weight: computed transposed
                    cases.append(self._matmul(member, reads_group=False))
                    computed.add(member.name)
            elif not (_is_pointwise(member) or _flips(member) is not None
                      or self._same_shape_view(member) or not member.all_input_nodes):  # fmt: skip
                return None  # computed by an op whose layout this does not follow
            for user in member.users:
                if user in member_set or user.target in _FULL_REDUCTIONS:
                    continue
                if user.op == "output":
                    if (
                        self.new_values.get(member) not in member_set
                        or self.outputs.count(member) != 1
                    ):
                        return None  # an output of the step: it would be copied every step
                    continue
                if user.target in _MATMULS and user.args[_MATMULS[user.target][1]] is member:
                    if user.args[_MATMULS[user.target][0]] is member or not transposed:
                        return None
                    cases.append(self._matmul(user, reads_group=True))
                    continue
                return None
        if not any(c.reads_group for c in cases):
            return None
        return members, cases, computed

    def _matmul(self, node: fx.Node, reads_group: bool) -> Matmul:
        a_index, b_index = _MATMULS[node.target]
        a, b = self.values[node.args[a_index]], self.values[node.args[b_index]]
        dtype = str(a.dtype).removeprefix("torch.")
        return Matmul(tuple(a.shape), tuple(a.stride()), tuple(b.shape), tuple(b.stride()),
                      reads_group, dtype)  # fmt: skip

    def _is_2d(self, node: object) -> bool:
        value = self.values.get(node) if isinstance(node, fx.Node) else None
        return isinstance(value, torch.Tensor) and value.dim() == 2

    def _same_shape_view(self, node: fx.Node) -> bool:
        if node.target not in _SAME_SHAPE_VIEWS or not isinstance(node.args[0], fx.Node):
            return False
        source = self.values.get(node.args[0])
        return isinstance(source, torch.Tensor) and source.shape == self.values[node].shape

    def _find(self, node: fx.Node) -> tuple[fx.Node, bool]:
        parent, flipped = self.parent.setdefault(node, (node, False))
        if parent is node:
            return node, False
        root, above = self._find(parent)
        self.parent[node] = (root, flipped ^ above)
        return root, flipped ^ above

    def _join(self, a: fx.Node, b: fx.Node, flip: bool) -> None:
        (ra, pa), (rb, pb) = self._find(a), self._find(b)
        if ra is rb:
            if pa ^ pb != flip:  # a value joined both ways (`w + w.t()`)
                self.conflicted.add(ra)
            return
        self.parent[ra] = (rb, pa ^ pb ^ flip)
        if ra in self.conflicted:
            self.conflicted.add(rb)


def _is_pointwise(node: fx.Node) -> bool:
    target = node.target
    if node.op != "call_function" or target is operator.getitem:
        return False
    return torch.Tag.pointwise in getattr(target, "tags", ())


def _time_both(cases: Sequence[Matmul], device: torch.device) -> tuple[float, float]:
    """Seconds for one pass over `cases` with the group stored as on the host and
    transposed: the least of up to three timed passes each, after an untimed one; fewer
    where the first timed pass is clear."""
    runs = {layout: _runs(cases, device, layout) for layout in (False, True)}
    best = {layout: math.inf for layout in runs}
    for attempt in range(4):
        for layout, run in runs.items():
            seconds = run()
            if attempt:
                best[layout] = min(best[layout], seconds)
        if attempt and not 0.9 < best[True] / best[False] < 1.1:
            break
    return best[False], best[True]


def _runs(cases: Sequence[Matmul], device: torch.device, transposed: bool) -> Callable[[], float]:
    """A function timing one pass over `cases` in one layout (each matmul five times), on
    tensors made once: a read of the group with its right operand untransposed, the group's
    gradient computed as `(b.t() @ a.t()).t()`."""
    generator = torch.Generator(device=device).manual_seed(0)
    operands = []

    def made(shape, strides, dtype):
        value = torch.empty_strided(shape, strides, device=device, dtype=dtype)
        return value.copy_(torch.randn(shape, generator=generator, device=device, dtype=dtype))

    for case in cases:
        dtype = getattr(torch, case.dtype)
        a, b = made(case.a, case.a_strides, dtype), made(case.b, case.b_strides, dtype)
        if transposed and case.reads_group:
            b = b.contiguous()
        elif transposed:
            a, b = b.t(), a.t()
        operands.append((a, b))
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def run() -> float:
        synchronize()
        start = time.perf_counter()
        for _ in range(5):
            for a, b in operands:
                torch.mm(a, b)
        synchronize()
        return time.perf_counter() - start

    return run
