"""Inductor's search for fusions, without pairing every node that reads one scalar input with
every other.

TorchInductor (torch 2.14.1) finds fusion candidates by grouping the scheduler's nodes by
each buffer they use and trying every pair within 64 places of each other in a group. A
step graph's optimizer reads its hyperparameters (learning rate, momentum, ...) as 0-d
inputs, once per parameter's update: each of them makes a group of every update, and the
pairs tried grow with the parameters times 64, each after Inductor's costly checks (loop
reordering, cycles). Two updates that share only those scalars can fuse only horizontally,
and Inductor's C++ backend fuses two nodes horizontally only over iteration spaces of the
same number of elements (the same loops, a pointwise loop over a reduction's, or one flat
loop over the other's): the updates of weights of different sizes never fuse, and those
were nearly all the pairs. Measured (DenseNet-121, 364 parameters, batch 32, O1): of the
87,000 pairs in the groups of the search's first round (of four), 64,000 were in the groups
of MNCoreSGD's three scalars (the same 21,000 pairs of updates three times; each is checked
once); the four searches took 21 s of the compile, 6 s without those groups.

While a search runs, `used_buffer_names` of its nodes names each of the graph's read-only
inputs smaller than `score_fusion_memory_threshold` once per iteration-space size
(`name@size`), so a scalar groups only the nodes of one size, whose pairs Inductor still
tries (it fuses same-shaped updates through their two or three shared scalars: more bytes
than that threshold). Every other use of the names (dependencies, mutations, code
generation) is untouched, and so is every fusion made. With Inductor's
`expand_dimension_for_pointwise_nodes` (nodes of different sizes fused), nothing changes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def scalar_inputs_pair_equal_sizes() -> Iterator[None]:
    """Within this context, Inductor's fusion search groups the nodes reading a small
    read-only graph input by the size of their iteration space (see the module's docstring).
    A no-op on a torch whose scheduler has other names."""
    from torch._inductor import config, scheduler

    node_class, scheduler_class = scheduler.BaseSchedulerNode, scheduler.Scheduler
    if "used_buffer_names" not in vars(node_class) or "get_possible_fusions" not in vars(
        scheduler_class
    ):
        yield
        return
    used, search = node_class.used_buffer_names, scheduler_class.get_possible_fusions
    split: list[frozenset[str]] = []  # the names split by size in the search running now

    def used_buffer_names(self):
        names = used(self)
        if not split or not (names & split[-1]):
            return names
        small = names & split[-1]
        size = _iteration_size(self)
        per_size = type(names)(f"{name}@{size}" for name in small) if size else type(names)()
        return (names - small) | per_size

    def get_possible_fusions(self, nodes, is_reorder_round):
        split.append(
            frozenset()
            if config.expand_dimension_for_pointwise_nodes
            else _small_read_only_inputs()
        )
        try:
            return search(self, nodes, is_reorder_round)
        finally:
            split.pop()

    node_class.used_buffer_names = used_buffer_names
    scheduler_class.get_possible_fusions = get_possible_fusions
    try:
        yield
    finally:
        node_class.used_buffer_names = used
        scheduler_class.get_possible_fusions = search


def _small_read_only_inputs() -> frozenset[str]:
    """The graph being compiled's inputs that nothing writes and whose bytes are fewer than
    the least shared data Inductor fuses two nodes for."""
    from torch._inductor import config
    from torch._inductor.virtualized import V

    graph = V.graph
    small = set()
    for name, value in graph.graph_inputs.items():
        if name in graph.mutated_inputs:
            continue
        try:
            layout = value.get_layout()
            nbytes = int(layout.storage_size()) * layout.dtype.itemsize
        except Exception:  # a symbolic size, a TorchBind object: not one of these
            continue
        if nbytes < config.score_fusion_memory_threshold:
            small.add(name)
    return frozenset(small)


def _iteration_size(node) -> int | None:
    """The number of elements a scheduler node's loops run over (reduction included); None
    for a node without loops (an extern kernel's)."""
    from torch._inductor.utils import sympy_product

    group = getattr(node, "group", None)
    if not group or len(group) != 2 or len(group[1]) != 2:
        return None
    ranges, reduction = group[1]
    try:
        return int(sympy_product(ranges) * sympy_product(reduction))
    except TypeError:  # a symbolic size: one group for them all
        return -1
