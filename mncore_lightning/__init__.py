"""mncore-lightning: train LightningModules on Preferred Networks' MN-Core 2.

`import mncore_lightning` registers the accelerator and strategy "mncore", so that
`Trainer(accelerator="mncore")` compiles each training step into one static graph and runs it
on MN-Core (real hardware with MLSDK, or the emulator on CPU/CUDA).
"""

from mncore_device import add_library_dirs

from . import lightning_patch, standalone
from .accelerator import MNCoreAccelerator
from .optimizers import MNCoreAdam, MNCoreAdamW, MNCoreSGD
from .parallel.ddp import MNCoreDDPStrategy
from .precision import MNCorePrecision
from .preflight import MNCorePreflight
from .strategy import MNCoreStrategy

# Errors raised while a step is traced name the user's line, not this package's or Lightning's.
add_library_dirs(
    "mncore_lightning", "lightning", "pytorch_lightning", "lightning_fabric", "torchmetrics"
)
lightning_patch.install()
standalone.install_when_imported()  # the same for `import pytorch_lightning`

__all__ = [
    "MNCoreAccelerator",
    "MNCoreAdam",
    "MNCoreAdamW",
    "MNCoreDDPStrategy",
    "MNCorePreflight",
    "MNCorePrecision",
    "MNCoreSGD",
    "MNCoreStrategy",
]
