"""Inductor's search for fusions, without pairing up every node that reads one scalar input.

TorchInductor (torch 2.14.1) finds fusion candidates by grouping the scheduler's nodes by
each buffer they use and trying every pair within 64 places of each other in a group. A
step graph's optimizer reads its hyperparameters (learning rate, momentum, ...) as 0-d
inputs, once per parameter's update: each of them makes a group of every update, and the
pairs tried grow with the parameters times 64. No such pair can fuse: two updates share
only those scalars, fewer bytes than `score_fusion_memory_threshold`, below which Inductor
refuses a horizontal fusion, and only after its costly checks (loop reordering, cycles).
Measured (DenseNet-121, 364 parameters, batch 32, O1): of the 87,000 pairs in the groups of
the search's first round (of four), 64,000 were in the groups of MNCoreSGD's three scalars
(the same 21,000 pairs of updates three times; each is checked once); the four searches
took 21 s of the compile, 6 s without those groups.

While a search runs, `used_buffer_names` of its nodes leaves out the graph's read-only
inputs smaller than that threshold, so they group nothing; every other use of the names
(dependencies, mutations, code generation) is untouched, and so is every fusion made."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def scalar_inputs_pair_nothing() -> Iterator[None]:
    """Within this context, Inductor's fusion search skips the groups of small read-only
    graph inputs (see the module's docstring). A no-op on a torch whose scheduler has other
    names."""
    from torch._inductor import scheduler

    node_class, scheduler_class = scheduler.BaseSchedulerNode, scheduler.Scheduler
    if "used_buffer_names" not in vars(node_class) or "get_possible_fusions" not in vars(
        scheduler_class
    ):
        yield
        return
    used, search = node_class.used_buffer_names, scheduler_class.get_possible_fusions
    skipped: list[frozenset[str]] = []  # the names left out by the search running now

    def used_buffer_names(self):
        names = used(self)
        if not skipped or not (names & skipped[-1]):
            return names
        return names - skipped[-1]

    def get_possible_fusions(self, nodes, is_reorder_round):
        skipped.append(_small_read_only_inputs())
        try:
            return search(self, nodes, is_reorder_round)
        finally:
            skipped.pop()

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
