"""Optimizers for MN-Core: torch.optim's, traceable into a static step.

SGD, Adam and AdamW have hand-written classes (MNCoreSGD, MNCoreAdam, MNCoreAdamW); RMSprop,
Adagrad, Adadelta, Adamax, NAdam, RAdam, ASGD, Rprop and Adafactor run torch's own update,
traced (`MNCoreTracedOptimizer`). LBFGS cannot run in a static step.

A compiled MN-Core training step is traced once and replayed, so these optimizers keep
their hyperparameters in 0-d tensors (a host-side `group["lr"] = x` refills them in place,
which the device notices), create their state at construction, never read a tensor back
to the host, and keep torch.optim's state_dict layout.
"""

from mncore_device import set_optimizer_converter

from ._base import MNCoreOptimizer, ParamGroup
from ._convert import TORCH_EQUIVALENTS, device_optimizer, from_torch, to_mlsdk_optimizer
from .adam import MNCoreAdam, MNCoreAdamW
from .sgd import MNCoreSGD
from .traced import TRACED_TORCH_OPTIMIZERS, MNCoreTracedOptimizer, TracedParamGroup

# context.registry.register(name, torch_optimizer) runs its MN-Core equivalent on the device.
set_optimizer_converter(device_optimizer)

__all__ = [
    "TORCH_EQUIVALENTS",
    "TRACED_TORCH_OPTIMIZERS",
    "MNCoreTracedOptimizer",
    "TracedParamGroup",
    "device_optimizer",
    "to_mlsdk_optimizer",
    "MNCoreAdam",
    "MNCoreAdamW",
    "MNCoreOptimizer",
    "MNCoreSGD",
    "ParamGroup",
    "from_torch",
]
