"""`MNCoreDDPStrategy`: data parallel over several MN-Core devices and hosts, on torch.distributed.

Each rank (a process: Lightning re-runs the script for the other local ranks, or torchrun / SLURM
start them) drives its own device and runs the compiled steps of `CompiledSteps`. Everything
between ranks is Lightning's DDPStrategy: the launcher, the cluster environments, the process
group, DistributedSampler, `reduce`/`all_gather`/`barrier`/`broadcast` (so `sync_dist` and
rank-zero checkpointing behave as with `strategy="ddp"`). The module is not wrapped in
DistributedDataParallel; gradients are averaged in one of two ways:

* in the graph (the emulator's default): the traced training step all-reduces the gradients
  with torch's functional collectives between backward and the update, so every batch stays
  ONE compiled call;
* split (`split_step=True`, MLSDK's default, since MLSDK compiles no collectives): a compiled
  forward+backward leaves the gradients in device buffers, the host all-reduces them over
  torch.distributed, and a compiled update applies them.

Buffers (BatchNorm's running statistics) follow DistributedDataParallel's default,
`broadcast_buffers=True`, as Lightning's `strategy="ddp"` uses it: before a forward that DDP
would sync (every training step that ends with a gradient all-reduce, then the next forward,
training or the first validation batch of a fit), rank 0's buffers are copied to every rank's
device; each rank then updates them with its own batch. `broadcast_buffers=False` keeps them
per rank, as DDP with that flag. A checkpoint holds rank 0's. SyncBatchNorm (`Trainer(sync_batchnorm=True)`) normalizes with the
statistics of the global batch inside the one compiled step (parallel/sync_batchnorm.py), so its running
statistics agree across ranks; the split step refuses it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.distributed.constants import default_pg_timeout

from mncore_device import Backend, MNDevice, resolve_backend

from ..device_selection import rank_device, resolve_device
from ..steps.update import backward_and_update
from ..strategy import CompiledSteps
from .sync_batchnorm import traced_sync_batchnorm


class MNCoreDDPStrategy(CompiledSteps, DDPStrategy):
    """Data parallel training on several MN-Core devices, one process per device.

    Args:
        device: as MNCoreStrategy's; "pfvm:cuda" and "mncore2:auto" become each rank's own
            device ("pfvm:cuda:<local_rank>", "mncore2:<local_rank>"); "pfvm:cpu" is shared.
        split_step: average gradients on the host between a compiled forward+backward and a
            compiled update, instead of inside the one compiled step. Default: True on MLSDK
            (which compiles no collectives), False on the emulator.
        process_group_backend: torch.distributed backend; default: "nccl" for "pfvm:cuda",
            else "gloo".
        codegen_dir: as MNCoreStrategy's, one subfolder per rank ("rank0", "rank1", ...).
        broadcast_buffers: as DistributedDataParallel's (default True, as Lightning's "ddp"):
            rank 0's buffers (BatchNorm's running statistics) are copied to every rank before
            each forward that DDP would sync them in; False keeps them per rank.
        preset, cache_dir, backend, max_retraces: as MNCoreStrategy's.
        parallel_devices, cluster_environment, checkpoint_io, precision_plugin, timeout,
            start_method: as Lightning's DDPStrategy's (set by the Trainer).
    """

    strategy_name = "mncore_ddp"

    def __init__(
        self,
        device: str | None = None,
        preset: str | None = None,
        codegen_dir: str | os.PathLike[str] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
        backend: str | None = None,
        max_retraces: int = 8,
        split_step: bool | None = None,
        broadcast_buffers: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: str = "popen",
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self._init_steps(device, preset, codegen_dir, cache_dir, backend, max_retraces)
        self._split_request = split_step
        self.broadcast_buffers = broadcast_buffers
        # DistributedDataParallel's require_forward_param_sync: whether the next forward
        # broadcasts the buffers (set at the wrap, then by each forward, see _ddp_forward)
        self._buffers_sync_next = True
        self._update_hook: Any = None  # the split step's update (a device function)
        self.allreduce_seconds = 0.0  # host all-reduce time of the split step (benchmarks)

    @property
    def split_step(self) -> bool:
        """Whether gradients are averaged on the host between two compiled calls."""
        if self._split_request is None:
            return self.backend is Backend.MLSDK
        return self._split_request

    # --- ranks and devices -------------------------------------------------------------------

    def setup_environment(self) -> None:
        """Each rank drives its own device; then Lightning's DDP sets up the process group."""
        self.mncore_device = MNDevice(
            rank_device(resolve_device(self._device_request), self.local_rank)
        )
        self.backend = resolve_backend(self.mncore_device, self._backend_request)
        if self.backend is Backend.MLSDK and self._split_request is False:
            raise MisconfigurationException(
                "MNCoreDDPStrategy(split_step=False) averages gradients inside the compiled "
                "step with collectives, which MLSDK does not compile; use split_step=True "
                "(the default on MLSDK)."
            )
        super().setup_environment()
        if self.codegen_dir is not None:  # ranks compile the same steps: one folder each
            self._codegen_root = getattr(self, "_codegen_root", self.codegen_dir)
            self.codegen_dir = self._codegen_root / f"rank{self.global_rank}"

    def _get_process_group_backend(self) -> str:
        if self._process_group_backend:
            return self._process_group_backend
        return "nccl" if self.mncore_device.torch_device.type == "cuda" else "gloo"

    def configure_ddp(self) -> None:
        """No DistributedDataParallel wrapper (the compiled step averages the gradients); as
        its constructor does, every rank starts from rank 0's parameters and buffers."""
        if self.split_step:
            for name, module in self.model.named_modules():
                if isinstance(module, torch.nn.SyncBatchNorm):
                    raise MisconfigurationException(
                        f"{name or 'the model'} is a SyncBatchNorm (Trainer(sync_batchnorm=True) "
                        "or convert_sync_batchnorm), which MNCoreDDPStrategy(split_step=True) "
                        "cannot run: its statistics are exchanged between ranks inside the "
                        "forward, and the split step's compiled graphs hold no collectives "
                        "(MLSDK compiles none). Use split_step=False (the emulator's default), "
                        "or BatchNorm with per-rank statistics."
                    )
        _sync_module_states(self.model)
        self._buffers_sync_next = True

    # --- buffers: DistributedDataParallel(broadcast_buffers=True) ----------------------------

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        # Lightning runs an accumulating micro-batch under DDP's no_sync(): no gradient sync
        grad_sync = (
            not module.automatic_optimization
            or module.trainer.accumulate_grad_batches == 1
            or self._updating
        )
        self._ddp_forward(grad_sync)
        return super().training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.lightning_module.trainer.state.fn == TrainerFn.FITTING:  # DDP wraps the module
            self._ddp_forward(grad_sync=False)  # evaluation runs without grad
        return super().validation_step(*args, **kwargs)

    def _ddp_forward(self, grad_sync: bool) -> None:
        """What DistributedDataParallel does before a forward: if the last forward synced
        gradients (or none ran since the wrap), rank 0's buffers are broadcast; this forward
        syncs gradients only with grad enabled and outside no_sync()."""
        sync, self._buffers_sync_next = self._buffers_sync_next, grad_sync
        if sync and self.broadcast_buffers and self.world_size > 1:
            self._push_host_edits()  # a hook's edit of a buffer is what rank 0 broadcasts
            self._broadcast_buffers()

    def _broadcast_buffers(self) -> None:
        """Rank 0's device buffers onto every rank's device, in one broadcast per dtype (the
        host tensors are left alone: they refresh from the device as any trained state)."""
        context = self.context
        buffers = [b for b in self.lightning_module.buffers() if context.is_registered(b)]
        if not buffers:
            return
        proxies = [context.get_registered_value_proxy(b) for b in buffers]
        values = [proxy.cpu() for proxy in proxies]
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, value in enumerate(values):
            by_dtype.setdefault(value.dtype, []).append(i)
        for indices in by_dtype.values():
            flat = torch.cat([values[i].reshape(-1) for i in indices])
            dist.broadcast(flat, src=0)
            if self.global_rank == 0:
                continue
            parts = flat.split([values[i].numel() for i in indices])
            for i, part in zip(indices, parts, strict=True):
                proxies[i].load_from(part.view_as(values[i]))
            self._device_is_newer = True  # the host refreshes before the next user hook

    def _register_state(self) -> None:
        super()._register_state()
        self._update_hook = None

    def _captured_training_step(self, args: tuple, manual: bool, window: int, update: bool) -> Any:
        """The step captured by TorchDynamo (steps/hooks.py); its SyncBatchNorm layers
        exchange statistics with functional collectives, which Dynamo keeps in its graph.
        A split step's forward+backward leaves the gradients in device buffers; the host
        all-reduce and the compiled update follow (_after_train_call)."""
        with traced_sync_batchnorm(self.lightning_module):
            result = super()._captured_training_step(args, manual, window, update)
        self._after_train_call(update)
        return result

    # --- gradient averaging --------------------------------------------------------------------

    def _gradient_reduction(self) -> Callable[[list[torch.Tensor]], None] | None:
        if self.split_step or self.world_size == 1:
            return None
        return _TracedAllReduce(self.world_size)

    def _train_plan(self, manual: bool, window: int, update: bool) -> tuple[bool, bool]:
        if not self.split_step:
            return super()._train_plan(manual, window, update)
        if manual:
            raise MisconfigurationException(
                "MNCoreDDPStrategy(split_step=True) splits an automatic-optimization step around "
                "the host all-reduce; a manual-optimization step calls backward and step itself "
                "inside one graph. Use split_step=False (the emulator's default) or automatic "
                "optimization."
            )
        return True, False  # forward+backward into the gradient buffers; the update follows

    def _after_train_call(self, update: bool) -> None:
        """Split step: at the end of an accumulation window, average the device's gradient
        buffers over torch.distributed on the host, then run the compiled update."""
        if not self.split_step or not update:
            return
        buffers = self._gradient_buffers()
        tensors = list(buffers.values())
        start = time.perf_counter()
        self.context.synchronize(tensors)
        _host_all_reduce_mean(tensors, self.world_size)
        self.context.load_from_host(tensors)
        self._host_versions.record()
        self.allreduce_seconds += time.perf_counter() - start
        if self._gradients:  # gradient hooks see the averaged gradients, as under DDP
            self._gradients = [(p, b.detach().clone(), 0) for p, b in buffers.items()]
        if self._update_hook is None:
            self._update_hook = self._compile_update(buffers)
        self._update_hook({})
        self.compiled_calls += 1

    def _compile_update(self, buffers: dict[torch.Tensor, torch.Tensor]) -> Any:
        """The split step's update as a device function: the averaged gradient buffers are
        the gradients; clipping, the optimizer's update and zeroing the buffers, as
        `backward_and_update` runs them after a one-call step's backward (this package's
        code, traced as it is)."""
        module = self.lightning_module
        trainer = module.trainer
        optimizer = self.optimizers[0]

        def update(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            for param, buffer in buffers.items():
                param.grad = buffer
            return backward_and_update(
                module,
                optimizer,
                None,
                self.precision_plugin.scaler,
                accumulate=(trainer.accumulate_grad_batches, buffers),
                update=True,
                reduce_gradients=None,
                gradient_clipping=(trainer.gradient_clip_val, trainer.gradient_clip_algorithm),
                gradient_params=None,
            )

        options = self._compile_options("train")
        codegen_dir = self.codegen_dir / "train_update" if self.codegen_dir else None
        try:
            compiled = self.context.compile(
                update,
                {},
                codegen_dir,
                capture="trace",
                options=options["options"],
                cache_options=options["cache_options"],
            )
        finally:  # tracing restores the host tensors it ran on, which bumps their versions
            self._host_versions.record()
        return compiled

    def __repr__(self) -> str:
        return (
            f"MNCoreDDPStrategy(device={self.mncore_device}, preset={self.preset}, "
            f"split_step={self.split_step})"
        )

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name,
                cls,
                description="data parallel MN-Core: one compiled step per batch and rank",
            )


class _TracedAllReduce:
    """Average gradients across ranks inside a traced step: one functional all-reduce per
    dtype over the flattened gradients (DDP's buckets, in one), divided by the world size
    before summing, as DDP's reducer does. Traces into `_c10d_functional` aten ops."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def __call__(self, grads: list[torch.Tensor]) -> None:
        group = dist.group.WORLD
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for grad in grads:
            by_dtype.setdefault(grad.dtype, []).append(grad)
        with torch.no_grad():
            for same in by_dtype.values():
                flat = torch.cat([g.reshape(-1) for g in same]) / self.world_size
                summed = funcol.wait_tensor(funcol.all_reduce(flat, "sum", group))
                for grad, part in zip(same, summed.split([g.numel() for g in same]), strict=True):
                    grad.copy_(part.view_as(grad))


def _host_all_reduce_mean(tensors: list[torch.Tensor], world_size: int) -> None:
    """The split step's all-reduce, on host tensors: the same flattening and order of
    division as the traced one, so both paths give the same averages."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    with torch.no_grad():
        for same in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in same]) / world_size
            dist.all_reduce(flat)
            for tensor, part in zip(same, flat.split([t.numel() for t in same]), strict=True):
                tensor.copy_(part.view_as(tensor))
