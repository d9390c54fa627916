"""The device layer's layout: folder = import name, backends side by side, no Lightning names."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import mncore_device

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "device" / "mncore_device"


def test_the_package_folder_is_the_import_name():
    assert Path(mncore_device.__file__).resolve().parent == PACKAGE


def test_import_device_from_the_repository_root_fails_clearly():
    run = subprocess.run(
        [sys.executable, "-c", "import device"], cwd=REPO, capture_output=True, text=True
    )
    assert run.returncode != 0
    assert "import mncore_device" in run.stderr
    ok = subprocess.run([sys.executable, "-c", "import mncore_device"], cwd=REPO)
    assert ok.returncode == 0


def test_the_device_layer_names_nothing_of_the_lightning_package():
    for path in PACKAGE.rglob("*"):
        if path.is_file() and path.suffix in (".py", ".json"):
            assert "mncore_lightning" not in path.read_text(), path


def _imports(module: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.ImportFrom):
            names.add(("." * node.level) + (node.module or ""))
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_the_backends_do_not_import_each_other():
    emulator, mlsdk = PACKAGE / "emulator.py", PACKAGE / "mlsdk_backend.py"
    assert not any("mlsdk_backend" in name for name in _imports(emulator))
    assert not any(name.endswith("emulator") for name in _imports(mlsdk))
    # ... and the interface imports neither: Context(device) finds them by their backend.
    context = _imports(PACKAGE / "context.py")
    assert not any(n.endswith(("emulator", "mlsdk_backend")) for n in context)


def test_every_backend_implements_the_whole_interface():
    from mncore_device import Backend, Context, EmulatorContext, MLSDKContext

    implementations = {EmulatorContext.backend: EmulatorContext, MLSDKContext.backend: MLSDKContext}
    assert set(implementations) == set(Backend)
    for cls in implementations.values():
        assert issubclass(cls, Context) and not getattr(cls, "__abstractmethods__", None), cls
