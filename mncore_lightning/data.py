"""Static shapes need full batches: training loaders are rebuilt with drop_last=True, unless
MNCoreStrategy(last_batch="compile") trains each epoch's short last batch with a graph of its
own."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

from lightning.fabric.utilities.data import _reinstantiate_wrapped_cls
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _get_dataloader_init_args_and_kwargs
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

LAST_BATCH_OPTIONS = ("drop", "compile")
TRAIN_LAST_BATCH = (
    "To train them as cpu does, pass MNCoreStrategy(last_batch='compile'): the short last "
    "batch then runs as a second compiled graph."
)


def with_drop_last(dataloader: DataLoader) -> DataLoader:
    """`dataloader` rebuilt with drop_last=True; warns how many samples each epoch skips."""
    batch_sampler = dataloader.batch_sampler
    if isinstance(dataloader.dataset, IterableDataset):
        return _iterable_with_drop_last(dataloader)
    if getattr(batch_sampler, "drop_last", True):
        return dataloader
    if type(batch_sampler) is not BatchSampler:
        warnings.warn(
            f"the training DataLoader uses a custom batch sampler ({type(batch_sampler).__name__}) "
            "with drop_last=False; MNCoreStrategy cannot rebuild it, and a smaller last batch "
            "will fail the compiled step's static shape check. Make it drop the last batch.",
            stacklevel=2,
        )
        return dataloader
    args, kwargs = _get_dataloader_init_args_and_kwargs(
        dataloader, dataloader.sampler, RunningStage.TRAINING
    )
    kwargs.pop("batch_sampler", None)
    kwargs.update(batch_size=batch_sampler.batch_size, drop_last=True, sampler=dataloader.sampler)
    kwargs.pop("shuffle", None)
    rebuilt = _reinstantiate_wrapped_cls(dataloader, *args, **kwargs)
    try:
        skipped = len(batch_sampler.sampler) % batch_sampler.batch_size
    except TypeError:
        skipped = None
    if skipped != 0:
        amount = "some samples" if skipped is None else f"{skipped} samples"
        warnings.warn(
            f"MNCoreStrategy set drop_last=True on the training DataLoader (a compiled step has "
            f"a static batch size of {batch_sampler.batch_size}): {amount} per epoch are "
            f"skipped. {TRAIN_LAST_BATCH}",
            UserWarning,
            stacklevel=2,
        )
    return rebuilt


def _iterable_with_drop_last(dataloader: DataLoader) -> DataLoader:
    """An iterable-style loader that batches for itself drops its short last batch too."""
    if dataloader.batch_size is None or dataloader.drop_last:
        return dataloader
    args, kwargs = _get_dataloader_init_args_and_kwargs(
        dataloader, dataloader.sampler, RunningStage.TRAINING
    )
    for key in ("batch_sampler", "sampler", "shuffle"):
        kwargs.pop(key, None)
    kwargs.update(batch_size=dataloader.batch_size, drop_last=True)
    rebuilt = _reinstantiate_wrapped_cls(dataloader, *args, **kwargs)
    warnings.warn(
        f"MNCoreStrategy set drop_last=True on the training DataLoader over an IterableDataset "
        f"(a compiled step has a static batch size of {dataloader.batch_size}): a short last "
        f"batch of each epoch is skipped. {TRAIN_LAST_BATCH}",
        UserWarning,
        stacklevel=3,
    )
    return rebuilt


class StepGroup(list):
    """The consecutive batches one K-step device call trains on (a list, so that Lightning's
    batch transfer keeps its type)."""


class StepGroups:
    """A training loader whose items are lists of `steps` consecutive batches of `loader`.

    `MNCoreStrategy(steps_per_call=K)` runs each item as one device call of K steps, so
    Lightning's loop and its batch-level hooks see one item per K batches. An epoch whose batch
    count is not a multiple of K ends with one shorter group holding the remaining batches (a
    second compiled graph, traced once): no batch is dropped or run twice.
    """

    def __init__(self, loader: Any, steps: int) -> None:
        self.loader = loader
        self.steps = steps

    def __iter__(self) -> Iterator[StepGroup]:
        group = StepGroup()
        for batch in self.loader:
            group.append(batch)
            if len(group) == self.steps:
                yield group
                group = StepGroup()
        if group:
            yield group

    def __len__(self) -> int:
        return -(-len(self.loader) // self.steps)  # ceil: the last group may be shorter

    def __getattr__(self, name: str) -> Any:
        # dataset, batch_size, sampler...: what code reading trainer.train_dataloader expects
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)
