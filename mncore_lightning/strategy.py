"""`MNCoreStrategy`: every training batch (or group of `steps_per_call` batches) is ONE
compiled call on the MN-Core device.

The machinery is the `CompiledSteps` mixin, shared with the data-parallel MNCoreDDPStrategy
(parallel/ddp.py); MNCoreStrategy puts it on Lightning's SingleDeviceStrategy.

At setup the strategy converts the optimizers in place to ones the device runs, names and
registers the module's parameters and buffers and the optimizers' state with a device-layer
Context. The first training batch compiles zero_grad + training_step + backward + clipping +
the update into one static graph (or the user's whole manual step); every later batch is one
call of it. Validation, test and predict steps get forward-only graphs that read the device's
current weights. What a step was traced for (module structure, trainable parameters, batch
layout) is checked at batch boundaries (structure.py) and the step traced again when it
changed; host tensors are refreshed before the hooks the user
overrides and before checkpoints, and host edits are pushed back (host_sync.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NoReturn

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils._pytree import tree_leaves
from torch.utils.data import DataLoader
from typing_extensions import override

from mncore_device import (
    Backend,
    CacheOptions,
    Context,
    MNDevice,
    NonFiniteError,
    TensorSpec,
    get_tensor_name,
    resolve_backend,
    set_buffer_name_in_optimizer,
    set_tensor_name,
    set_tensor_name_in_module,
)
from mncore_device.runtime.specs import check_input

from .accelerator import MNCoreAccelerator
from .data import LAST_BATCH_OPTIONS, StepGroup, StepGroups, with_drop_last
from .device_selection import resolve_device, resolve_preset
from .host_sync import GRADIENT_HOOKS, HostSync, HostVersions, overridden_hooks
from .optimizers import MNCoreOptimizer, device_optimizer
from .optimizers._convert import track_step_calls
from .precision import MNCorePrecision
from .steps.groups import run_captured_group
from .steps.hooks import CapturedHook, tensor_layout
from .steps.manual import captured_manual_step
from .steps.update import ANOMALY_PRESET
from .structure import describe_change, structure_of

_EVAL_HOOKS = ("validation_step", "test_step", "predict_step")
log = logging.getLogger(__name__)
_WRAPPED_PRECISIONS = ("bf16-mixed", "bf16-true", "16-mixed")


class CompiledSteps:
    """What every MN-Core strategy shares: compiled training and evaluation steps on one
    device-layer Context, host/device synchronization, guards and re-tracing.

    A mixin in front of a Lightning strategy class (SingleDeviceStrategy for MNCoreStrategy,
    DDPStrategy for MNCoreDDPStrategy). Subclasses call `_init_steps` from `__init__` and may
    override `_gradient_reduction` (how a training graph averages gradients across ranks) and
    `_train_plan`/`_after_train_call` (a training step split around a host all-reduce).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # The arguments it was made with: a strategy of the other Lightning package
        # (lightning.pytorch vs pytorch_lightning) is rebuilt from them (lightning_patch.py).
        strategy = super().__new__(cls)
        strategy._init_args = (args, kwargs)
        return strategy

    def _init_steps(
        self,
        device: str | None,
        preset: str | None,
        codegen_dir: str | os.PathLike[str] | None,
        cache_dir: str | os.PathLike[str] | None,
        backend: str | None,
        max_retraces: int,
        steps_per_call: int = 1,
        last_batch: str = "drop",
        fullgraph: bool = False,
    ) -> None:
        if last_batch not in LAST_BATCH_OPTIONS:
            raise ValueError(
                f"last_batch must be one of {', '.join(map(repr, LAST_BATCH_OPTIONS))}, got "
                f"{last_batch!r}: 'drop' rebuilds the training DataLoader with drop_last=True, "
                "'compile' trains each epoch's short last batch with a second compiled graph."
            )
        self.last_batch = last_batch
        if isinstance(steps_per_call, bool) or not isinstance(steps_per_call, int):
            raise TypeError(f"steps_per_call must be an int, got {steps_per_call!r}")
        if steps_per_call < 1:
            raise ValueError(f"steps_per_call must be at least 1, got {steps_per_call}")
        # a precision plugin passed to the constructor; else the Trainer's flag decides
        self._precision_given = self._precision_plugin is not None
        self._device_request = device
        self._backend_request = backend
        self.mncore_device = MNDevice(resolve_device(device))
        self.backend = resolve_backend(self.mncore_device, backend)
        self.preset = resolve_preset(preset)
        self.codegen_dir = Path(codegen_dir) if codegen_dir is not None else None
        self.cache_options = CacheOptions(cache_dir) if cache_dir is not None else None
        self.context: Context | None = None
        self._device_is_newer = False
        self._host_sync: HostSync | None = None
        self._user_hooks: set[str] = set()
        self.user_hook_ran = False  # set by HostSync: the module's structure may have changed
        self.max_retraces = max_retraces
        self._updating = False
        self.retraces = 0
        self._retraces_by_stage: dict[str, int] = {}
        self._gradients: list[tuple[torch.nn.Parameter, torch.Tensor, int]] = []
        self.compiled_calls = 0
        self.steps_per_call = steps_per_call
        self.last_call_steps = 1  # training steps the last compiled training call ran
        self.fullgraph = fullgraph
        # the hooks captured by TorchDynamo (steps/hooks.py), by stage and kind of step
        self._captured: dict[tuple, CapturedHook] = {}

    # --- the accelerator and the precision plugin are ours -----------------------------------

    @property
    def accelerator(self) -> Any:
        return self._accelerator

    @accelerator.setter
    def accelerator(self, accelerator: Any) -> None:
        # Lightning's connector assigns the Trainer's accelerator here.
        if accelerator is not None and not isinstance(accelerator, MNCoreAccelerator):
            raise ValueError(
                f"MNCoreStrategy needs accelerator='mncore', got {type(accelerator).__name__}: pass "
                "Trainer(accelerator='mncore', strategy=MNCoreStrategy(...))."
            )
        self._accelerator = accelerator

    @property
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self._precision_plugin = MNCorePrecision()
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Lightning's connector assigns its own choice here. A plain 32-bit Precision is what
        # MNCorePrecision already is; bf16 plugins are wrapped (their contexts are traced into
        # the step); anything else would silently change the step, so it is refused.
        if plugin is None:
            self._precision_plugin = getattr(self, "_precision_plugin", None)
            return
        if type(plugin) is Precision:
            plugin = getattr(self, "_precision_plugin", None) or MNCorePrecision()
        elif not isinstance(plugin, MNCorePrecision):
            if getattr(plugin, "precision", None) not in _WRAPPED_PRECISIONS:
                raise MisconfigurationException(
                    f"MNCoreStrategy runs backward and the optimizer step inside its compiled "
                    f"graph and supports precision='32-true', 'bf16-mixed', 'bf16-true' and "
                    f"'16-mixed' only; "
                    f"got the {type(plugin).__name__} plugin "
                    f"(precision={getattr(plugin, 'precision', None)!r})."
                )
            plugin = MNCorePrecision(_on_host(plugin))
        self._precision_plugin = plugin

    # --- setup -------------------------------------------------------------------------------

    @override
    def setup(self, trainer: Any) -> None:
        backend = "MLSDK" if self.backend is Backend.MLSDK else "emulated"
        rank_zero_info(f"MN-Core available: True ({self.mncore_device}, {backend}), used: True")
        self.context = Context(self.mncore_device, self.backend)
        Context.switch_context(self.context)
        super().setup(trainer)
        self._register_state()
        if self.steps_per_call > 1 and trainer.training:
            self._check_steps_per_call(trainer)

    def _check_steps_per_call(self, trainer: Any) -> None:
        """What a K-step call cannot do as Lightning would, refused before the first step."""
        k, module = self.steps_per_call, self.lightning_module
        refused = None
        if not module.automatic_optimization:
            refused = "manual optimization (training_step calls the optimizers itself)"
        elif trainer.accumulate_grad_batches != 1:
            refused = f"accumulate_grad_batches={trainer.accumulate_grad_batches}"
        elif any(c.interval == "step" for c in self.lr_scheduler_configs):
            refused = "an LR scheduler with interval='step' (Lightning steps it once per call)"
        elif self._user_hooks.intersection(GRADIENT_HOOKS):
            refused = "a gradient hook (on_after_backward, on_before_optimizer_step)"
        if refused:
            raise MisconfigurationException(
                f"{type(self).__name__}(steps_per_call={k}) runs {k} training steps in one "
                f"device call and does not support {refused}; use steps_per_call=1."
            )

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        """Replace optimizers by those the device runs (MN-Core's or MLSDK's), schedulers too."""
        super().setup_optimizers(trainer)
        converted = [device_optimizer(self.context, opt) for opt in self.optimizers]
        for old, new in zip(self.optimizers, converted, strict=True):
            if new is not old:  # MLSDK's own optimizer: the schedulers must drive it
                for config in self.lr_scheduler_configs:
                    _repoint_scheduler(config.scheduler, old, new)
        self.optimizers = converted  # also rewraps them as LightningOptimizers

    def _register_state(self) -> None:
        """Name and register the module's parameters and buffers and the optimizers' state."""
        module = self.lightning_module
        set_tensor_name_in_module(module, "model")
        for param in module.parameters():
            self.context.register_param(param)
        for buffer in module.buffers():
            self.context.register_buffer(buffer)
        scaler = self.precision_plugin.scaler
        if scaler is not None:  # 16-mixed: the loss scale is device state, updated in the step
            scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
            for name in ("scale", "growth_tracker"):
                tensor = getattr(scaler, f"_{name}")
                set_tensor_name(tensor, f"grad_scaler@{name}")
                self.context.register_buffer(tensor)
        several = len(self.optimizers) > 1
        for index, optimizer in enumerate(self.optimizers):
            if isinstance(optimizer, MNCoreOptimizer):
                optimizer.ensure_state()
            set_buffer_name_in_optimizer(optimizer, f"optimizer{index}" if several else "optimizer")
            self.context.register_optimizer_buffers(optimizer)
        self._grad_buffers: dict[torch.Tensor, torch.Tensor] = {}
        self._captured = {}
        self._device_is_newer = False
        self._watch_host_tensors()
        self._structure = structure_of(module, self.optimizers)
        trainer = module.trainer
        if self._host_sync not in trainer.callbacks:
            self._user_hooks = overridden_hooks(module, trainer.callbacks)
            self._host_sync = HostSync(self, self._user_hooks)
            if self._user_hooks:  # nobody overrides a hook: no callback, no per-batch calls
                trainer.callbacks.insert(0, self._host_sync)
        self._gradients: list[tuple[torch.nn.Parameter, torch.Tensor, int]] = []

    def _check_structure(self) -> None:
        """After a user hook ran: a module whose structure changed (pruning's parameters and
        masks, parametrizations, hooks added) is registered again and its steps re-traced."""
        structure = structure_of(self.lightning_module, self.optimizers)
        if structure == self._structure:
            return
        before, after = self._structure, structure
        self.synchronize()
        self.context = Context(self.mncore_device, self.backend)
        Context.switch_context(self.context)
        self._register_state()
        self._retrace("the compiled steps", describe_change(before, after))

    def _retrace(self, what: str, reason: str) -> None:
        """Count and report one re-trace; past `max_retraces` in a stage, refuse."""
        stage = self._stage()
        count = self._retraces_by_stage.get(stage, 0) + 1
        if count > self.max_retraces:
            raise MisconfigurationException(
                f"MNCoreStrategy traced {what} again {self.max_retraces} times in the {stage} "
                f"stage, and it changed once more: {reason}. A compiled step is traced for a "
                "fixed module structure, trainable parameters and batch layout; keep them fixed "
                "between steps, or raise MNCoreStrategy(max_retraces=...)."
            )
        self._retraces_by_stage[stage] = count
        self.retraces += 1
        rank_zero_info(f"MN-Core: re-tracing {what}: {reason}")

    # --- steps ---------------------------------------------------------------------------------

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch, rest = args[0], args[1:]
        module = self.lightning_module
        steps = None  # a plain batch, or the number of batches in a group (steps_per_call)
        if self.steps_per_call > 1:
            if not isinstance(batch, StepGroup):
                raise MisconfigurationException(
                    f"MNCoreStrategy(steps_per_call={self.steps_per_call}) groups the batches "
                    "of one training DataLoader, but training_step got a "
                    f"{type(batch).__name__}: use a single training DataLoader, and return "
                    "the group (a list of batches) unchanged from batch transfer hooks."
                )
            batch = list(batch)
            max_steps = module.trainer.max_steps
            if max_steps >= 0:  # Lightning stops at max_steps: a group runs no step past it
                batch = batch[: max(max_steps - module.trainer.global_step, 1)]
            steps = len(batch)
        self._push_host_edits()  # may re-register a module whose structure changed
        manual = not module.automatic_optimization
        window = 1 if manual else module.trainer.accumulate_grad_batches
        update = window == 1 or self._updating
        try:  # (not a generator's context manager: this runs every step)
            if steps is not None:  # K steps, one device call (steps/groups.py)
                return run_captured_group(self, batch, rest)
            return self._captured_training_step(args, manual, window, update)
        except NonFiniteError as error:
            self._stopped_by_anomaly(error, rest)

    def _captured_training_step(self, args: tuple, manual: bool, window: int, update: bool) -> Any:
        """One training step (forward, backward and update) as one device call; a plan
        without the update (`_train_plan`: a split step) leaves the gradients in buffers."""
        trainer = self.lightning_module.trainer
        accumulating, update = self._train_plan(manual, window, update)
        key = ("train", window, update)
        hook = self._captured.get(key)
        if hook is None and not self.lightning_module.automatic_optimization:
            hook = self._captured[key] = captured_manual_step(self)
        if hook is None:
            if not self.optimizers:
                raise MisconfigurationException(
                    "MNCoreStrategy needs an optimizer from configure_optimizers to compile "
                    "the training step"
                )
            hook = CapturedHook(
                self,
                "training_step",
                optimizer=self.optimizers[0],
                update_options={
                    "accumulate": (window, self._gradient_buffers()) if accumulating else None,
                    "update": update,
                    "reduce_gradients": self._gradient_reduction(),
                    "gradient_clipping": (
                        trainer.gradient_clip_val,
                        trainer.gradient_clip_algorithm,
                    ),
                    "return_gradients": bool(self._user_hooks.intersection(GRADIENT_HOOKS)),
                },
                fullgraph=self.fullgraph,
                compile_options=self._compile_options("train"),
            )
            self._captured[key] = hook
        self._check_captured_batch(hook, args)
        result = hook(*args)
        self._device_is_newer = True
        self._gradients = [(hook.gradient_params[k], g, 0) for k, g in hook.gradients.items()]
        self.compiled_calls += 1
        self.last_call_steps = 1
        return result

    def _check_captured_batch(self, hook: CapturedHook, args: tuple) -> None:
        """A training batch of other shapes than the last one inside an epoch (a short last
        batch the loader kept) is refused, as for a traced step, unless last_batch="compile";
        at an epoch boundary (a reloaded DataLoader) the step is compiled for the new ones."""
        shapes = tensor_layout(args[0])
        if shapes == hook.batch_shapes:  # the common case, every step: cheap
            return
        hook.batch_shapes = shapes
        leaves = tree_leaves(args[0])
        inputs = {f"batch/{i}": t for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)}
        specs = {key: TensorSpec.of(value) for key, value in inputs.items()}
        last = hook.batch_specs  # the epoch's full batches'
        batch_idx = args[1] if len(args) > 1 and isinstance(args[1], int) else None
        if last is None:
            hook.batch_specs = specs
        if last is None or specs == last:
            return
        trainer = self.lightning_module.trainer
        batches = trainer.num_training_batches
        if self.last_batch == "compile" and (batches == float("inf") or batch_idx == batches - 1):
            return  # a short last batch: its own device graph (no re-compile of the step)
        hook.batch_specs = specs
        if batch_idx == 0:
            change = (
                next(
                    f"{key} changed from {list(last[key].shape)} to {list(spec.shape)}"
                    for key, spec in specs.items()
                    if last.get(key) != spec
                )
                if specs.keys() == last.keys()
                else "its elements changed"
            )
            self._retrace("training_step", f"the training batch changed: {change}")
            return
        for key, value in inputs.items():
            if key in last:
                check_input(key, last[key], value)

    def _stopped_by_anomaly(self, error: NonFiniteError, rest: tuple) -> NoReturn:
        """Trainer(detect_anomaly=True): a NaN or inf a training graph computed (the debug
        preset's executor checks every op, see _compile_options) stops the fit, naming the
        step, as PyTorch's anomaly error stops it on cpu; the step's results were not kept."""
        if not torch.is_anomaly_enabled():
            raise error
        trainer = self.lightning_module.trainer
        batch_idx = rest[0] if rest and isinstance(rest[0], int) else None
        raise NonFiniteError(
            f"Trainer(detect_anomaly=True) stopped the compiled training step "
            f"(batch_idx={batch_idx}, global_step={trainer.global_step}): {error}. Nothing "
            "of this step was applied: the weights are those before it."
        ) from error

    def _compile_options(self, stage: str) -> dict[str, Any]:
        """What `Context.compile` gets for a captured hook's graphs; each graph's codegen
        folder is "<stage>_<count>", as for the traced steps. Under anomaly mode
        (Trainer(detect_anomaly=True)) training graphs run with the preset whose executor
        checks every op for NaN and stops at the first, naming its line (for an op of the
        backward, the forward line it differentiates); evaluation is not checked, as on cpu."""
        root = self.codegen_dir
        anomaly = stage == "train" and torch.is_anomaly_enabled()
        return {
            "options": {"option_json": ANOMALY_PRESET if anomaly else self.preset},
            "cache_options": self.cache_options,
            "codegen_dir": (
                (lambda: root / f"{stage}_{len(self.compiled_functions(stage))}")
                if root is not None
                else None
            ),
        }

    def _train_plan(self, manual: bool, window: int, update: bool) -> tuple[bool, bool]:
        """Whether the training graph accumulates gradients into device buffers, and whether
        it runs the update; one step of a single device does both in one graph."""
        return window > 1, update

    def _gradient_reduction(self) -> Any:
        """What the training graph calls on the gradients before the update (None: nothing;
        data parallel averages them across ranks)."""
        return None

    def _after_train_call(self, update: bool) -> None:
        """After each compiled training call (a split step runs its update here)."""

    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        """Lightning runs this micro-batch through the optimizer step: it ends an
        accumulation window (MNCorePrecision.optimizer_step)."""
        self._updating = True
        try:
            yield
        finally:
            self._updating = False

    def _gradient_buffers(self) -> dict[torch.Tensor, torch.Tensor]:
        """One registered tensor per trainable parameter, where gradients accumulate on the
        device between the micro-batches of a window."""
        if not self._grad_buffers:
            for param in self.lightning_module.parameters():
                if param.requires_grad:
                    buffer = torch.zeros_like(param)
                    set_tensor_name(buffer, "grad@" + get_tensor_name(param).replace("@", "/"))
                    self.context.register_buffer(buffer)
                    self._grad_buffers[param] = buffer
            self._watch_host_tensors()
        return self._grad_buffers

    def _watch_host_tensors(self) -> None:
        """Host and device agree now on every registered tensor: watch them for host edits."""
        self._host_versions = HostVersions(list(self.context.registered_tensors().values()))

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("validation_step", args)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test_step", args)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("predict_step", args)

    def _eval_step(self, hook_name: str, args: tuple) -> Any:
        """Each stage (sanity check, validate, test, predict) has its own captured hook: one
        device function per batch shape (and dataloader), so a ragged last batch costs one
        more compile."""
        self._push_host_edits()  # an EMA or SWA swap, say: evaluate the weights the host holds
        key = (self._stage(), hook_name)
        hook = self._captured.get(key)
        if hook is None:
            hook = CapturedHook(
                self,
                hook_name,
                fullgraph=self.fullgraph,
                compile_options=self._compile_options(key[0]),
            )
            self._captured[key] = hook
        result = hook(*args)
        self.compiled_calls += 1
        return result

    def _stage(self) -> str:
        stage = self.lightning_module.trainer.state.stage
        return stage.value if stage is not None else "unknown"

    def _to_host(self, outputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The one place where device outputs (logged values, returns) become host tensors."""
        return self.context.to_host(outputs)

    # --- data ------------------------------------------------------------------------------------

    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training:
            return dataloader
        if isinstance(dataloader, DataLoader) and self.last_batch == "drop":
            dataloader = with_drop_last(dataloader)
        if self.steps_per_call > 1:
            return StepGroups(dataloader, self.steps_per_call)
        return dataloader

    # --- host <-> device --------------------------------------------------------------------------

    def synchronize(self) -> None:
        """Write the device's parameters, buffers and optimizer state into the host tensors."""
        if self.context is not None and self._device_is_newer:
            self.context.synchronize()
            self._device_is_newer = False
            self._host_versions.record()

    def _push_host_edits(self) -> None:
        """Before a compiled call: registered host tensors changed since host and device last
        agreed (in place, by `.data =`, by load_state_dict, in a user hook) are pushed to the
        device."""
        if self.user_hook_ran:
            # The host was refreshed before the hook, so it holds the device's values plus the
            # hook's edits, some of which no version counter sees (`p.data.copy_(x)`, as
            # weight-averaging callbacks swap weights): push all of it.
            self.user_hook_ran = False
            self._check_structure()
            if not self._device_is_newer:
                self.context.load_from_host()
                self._host_versions.record()
                return
        changed = self._host_versions.changed()
        if not changed:
            return
        if self._device_is_newer:
            name = get_tensor_name(changed[0])
            raise MisconfigurationException(
                f"the host value of {name} was changed while the MN-Core device held newer "
                "weights (outside the hooks before which MNCoreStrategy refreshes the host), so "
                "the change would be lost. Change weights in a LightningModule or Callback hook "
                "such as on_train_batch_end or on_train_epoch_end."
            )
        self.context.load_from_host(changed)
        self._host_versions.record()

    def install_gradients(self) -> None:
        """Give each parameter the gradient the last compiled step computed (p.grad), for the
        gradient hooks (on_after_backward, on_before_optimizer_step)."""
        for param, grad, _ in self._gradients:
            param.grad = grad
        self._gradients = [(p, g, g._version) for p, g, _ in self._gradients]

    def check_gradients_untouched(self, hook: str) -> None:
        """A gradient hook may read p.grad but not change it: the update already ran."""
        for param, grad, version in self._gradients:
            if param.grad is not grad or grad._version != version:
                name = get_tensor_name(param) or list(param.shape)
                raise MisconfigurationException(
                    f"{hook} changed the gradient of {name}, but under MNCoreStrategy the "
                    "optimizer update already ran inside the compiled step, so the change "
                    "would be ignored. Read gradients in this hook; to change them, do it "
                    "inside training_step or configure_gradient_clipping (traced into the step)."
                )

    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.synchronize()
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        self.synchronize()
        return super().optimizer_state(optimizer)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self.synchronize()  # see load_optimizer_state_dict
        super().load_model_state_dict(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """A checkpoint loaded mid-fit (the learning-rate finder restores the weights it started
        from): the host is brought up to date first, so that the loaded values are host edits,
        pushed to the device before the next compiled call, and no later synchronization
        writes the device's older values over them."""
        self.synchronize()
        super().load_optimizer_state_dict(checkpoint)

    def on_exception(self, exception: BaseException) -> None:
        self.synchronize()
        super().on_exception(exception)

    def teardown(self) -> None:
        self.synchronize()
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and self._host_sync in trainer.callbacks:
            trainer.callbacks.remove(self._host_sync)
        self.context = None
        self._captured = {}
        super().teardown()

    # --- reporting ----------------------------------------------------------------------------------

    def compiled_functions(self, stage: str | None = None) -> list[Any]:
        """The device functions compiled so far for `stage`: "train", or an evaluation stage
        ("sanity_check", "validate", "test", "predict"); all of them if None. A step traced
        again (a re-compile, another batch shape) adds one."""
        functions = []
        for key, hook in self._captured.items():
            if stage in (None, key[0]):
                functions += hook.compiled
        return functions

    def training_graph_kinds(self) -> list[tuple[int, bool]]:
        """(accumulate_grad_batches, runs the update) of each kind of training graph compiled:
        an accumulation window has a graph for its micro-batches and one that ends it."""
        kinds = {(key[1], key[2]) for key in self._captured if key[0] == "train"}
        return sorted(kinds)

    def device_stats(self) -> dict[str, float]:
        """Counters for DeviceStatsMonitor."""
        seconds = sum(h.compile_seconds for h in self._captured.values())
        functions = sum(len(h.compiled) for h in self._captured.values())
        memory = 0
        if self.context is not None:
            memory = sum(v.numel() * v.element_size() for v in self.context.device_values())
        return {
            "mncore/device_memory_bytes": float(memory),
            "mncore/compiled_functions": float(functions),
            "mncore/compiled_calls": float(self.compiled_calls),
            "mncore/compile_seconds": float(seconds),
            "mncore/retraces": float(self.retraces),
        }


class MNCoreStrategy(CompiledSteps, SingleDeviceStrategy):
    """Train and evaluate a LightningModule with compiled static-shape steps on one MN-Core.

    Args:
        device: "pfvm:cpu", "pfvm:cuda", "mncore2:auto", "mncore2:N"; default: $MNCORE_DEVICE,
            else real hardware when MLSDK is installed, else pfvm:cuda when CUDA is available,
            else pfvm:cpu.
        preset: compile preset, "debug" or "O0" ... "O4" (default: $MNCORE_PRESET, else O1).
        codegen_dir: where each compiled step's graph and specs are written (optional).
        cache_dir: compile cache shared between runs (optional).
        backend: "mlsdk" or "emulator"; default: the device string decides ("mncore2:*" runs
            on PFN's MLSDK, "pfvm:*" on the emulator). backend="mlsdk" runs "pfvm:*" on
            MLSDK's own virtual machine.
        max_retraces: how often a stage's steps may be traced again because something they
            were traced for changed (module structure, trainable parameters, batch layout) or
            a value they read changed (Dynamo's re-compiles); past it, an error names what
            keeps changing.
        steps_per_call: training batches run by one device call (default 1). With K > 1,
            the training DataLoader's batches are grouped K at a time and each group runs as
            one compiled graph holding K whole training steps (as Keras' steps_per_execution),
            which spreads the per-call cost of Lightning's loop and of the strategy over K
            steps. Lightning then sees one batch per group: `batch_idx`, batch-level hooks
            (which get the list of the group's batches), `limit_train_batches`,
            `val_check_interval` and `log_every_n_steps` count groups; per-step `self.log`
            values arrive K at a time (epoch aggregates are exact, a logger's step-level
            series gets the group's last value), `trainer.global_step` counts every
            optimizer step and training_step's returned loss is the group's last. An epoch
            whose batch count is not a multiple of K ends with one shorter group (a second
            graph), and a group that would run past `max_steps` is cut there. Each step of
            a group runs training_step's Python under TorchDynamo as on cpu (its batch_idx
            and global_step, its guards, its attribute writes; steps/groups.py), and the
            K steps' graphs run as one device call. Supported with automatic optimization,
            without gradient accumulation, step-interval LR schedulers or gradient hooks;
            each of those raises a clear error, as does a step whose Python needs a device
            value at once (`self.log(name, loss.item())`).
        last_batch: what becomes of a training epoch's short last batch (a dataset size that
            is not a multiple of the batch size). "drop" (default): the training DataLoader
            is rebuilt with drop_last=True, as a static batch size needs, and a warning says
            how many samples each epoch skips. "compile": the loader is kept as it is, and
            the short last batch runs as a second compiled graph, traced once for its shape:
            every sample is trained on, with cpu's numbers.
    """

    strategy_name = "mncore"

    def __init__(
        self,
        device: str | None = None,
        preset: str | None = None,
        codegen_dir: str | os.PathLike[str] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        accelerator: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
        backend: str | None = None,
        max_retraces: int = 8,
        steps_per_call: int = 1,
        last_batch: str = "drop",
        fullgraph: bool = False,
    ) -> None:
        super().__init__(
            device=torch.device("cpu"),
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            # None: the Trainer's precision flag decides, through the setter below
            precision_plugin=precision_plugin,
        )
        self._init_steps(
            device,
            preset,
            codegen_dir,
            cache_dir,
            backend,
            max_retraces,
            steps_per_call,
            last_batch,
            fullgraph,
        )

    def setup_environment(self) -> None:
        """A single-device strategy asked for several devices would silently train on one."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        connector = getattr(trainer, "_accelerator_connector", None)
        devices = len(getattr(connector, "_parallel_devices", ()) or ())
        if devices > 1 or (trainer is not None and trainer.num_nodes > 1):
            raise MisconfigurationException(
                f"MNCoreStrategy drives one MN-Core device, but the Trainer asked for "
                f"devices={devices}, num_nodes={trainer.num_nodes}: use strategy='mncore_ddp' "
                "(or MNCoreDDPStrategy(...), or leave strategy unset) to train data parallel."
            )
        super().setup_environment()

    def __repr__(self) -> str:
        return f"MNCoreStrategy(device={self.mncore_device}, preset={self.preset})"

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls, description="one compiled step per batch on MN-Core"
            )


def _repoint_scheduler(scheduler: Any, old: Any, new: Any) -> None:
    """Make a scheduler (and the schedulers it chains) drive the converted optimizer."""
    if getattr(scheduler, "optimizer", None) is old:
        scheduler.optimizer = new
        track_step_calls(new)
    for child in getattr(scheduler, "_schedulers", ()):  # SequentialLR, ChainedScheduler
        _repoint_scheduler(child, old, new)


def _on_host(plugin: Precision) -> Precision:
    """Lightning picks autocast's device from the accelerator ("cuda" for any it does not
    know), but the step is traced on the host's tensors: autocast and the fp16 GradScaler must
    be the CPU's, or they would silently do nothing."""
    if not isinstance(plugin, MixedPrecision) or plugin.device == "cpu":
        return plugin
    scaler = None
    if plugin.scaler is not None:  # a GradScaler for a device this machine lacks is disabled
        old, settings = plugin.scaler, ("init_scale", "growth_factor", "backoff_factor")
        kwargs = {k: getattr(old, f"_{k}") for k in settings if hasattr(old, f"_{k}")}
        if hasattr(old, "_growth_interval"):
            kwargs["growth_interval"] = old._growth_interval
        scaler = torch.amp.GradScaler("cpu", **kwargs)
    return MixedPrecision(plugin.precision, "cpu", scaler=scaler)
