"""mncore-lightning: train LightningModules on Preferred Networks' MN-Core 2.

`import mncore_lightning` registers the accelerator and strategy "mncore", so that
`Trainer(accelerator="mncore")` compiles each training step into one static graph and runs it
on MN-Core (real hardware with MLSDK, or the emulator on CPU/CUDA).
"""

from . import selection
from .accelerator import MNCoreAccelerator
from .optimizers import MNCoreAdam, MNCoreAdamW, MNCoreSGD
from .precision import MNCorePrecision
from .strategy import MNCoreStrategy

selection.install()

__all__ = [
    "MNCoreAccelerator",
    "MNCoreAdam",
    "MNCoreAdamW",
    "MNCorePrecision",
    "MNCoreSGD",
    "MNCoreStrategy",
]
