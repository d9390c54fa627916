"""`import mlsdk` without PFN's MLSDK gives the stand-in (compat/mlsdk); with it, the real one.

Each case runs in a fresh interpreter, as a user's script does: what `import mlsdk` finds
depends on sys.path and on what the install put in site-packages. tests/fake_mlsdk plays the
real MLSDK.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STAND_IN = ROOT / "compat"
FAKE = ROOT / "tests" / "fake_mlsdk"

PROBE = """
import importlib, json, site, sys

def found(path, site_dir):
    for name in [n for n in sys.modules if n == "mlsdk" or n.startswith("mlsdk.")]:
        del sys.modules[name]
    sys.path[:0] = path
    if site_dir:
        site.addsitedir(site_dir)  # an install's site-packages, .pth files and all
    importlib.invalidate_caches()
    try:
        import mlsdk, mncore_device
        try:
            from mlsdk.experimental.llm import kv_cache
            llm = kv_cache.__file__
        except ImportError:
            llm = None
        return {
            "mlsdk": mlsdk.__file__,
            "available": mncore_device.mlsdk_available(),
            "context": f"{mlsdk.Context.__module__}.{mlsdk.Context.__qualname__}",
            "llm": llm,
        }
    finally:
        del sys.path[: len(path)]

cases = json.loads(sys.argv[1])
print(json.dumps([found(path, site_dir) for path, site_dir in cases]))
"""


def _probe(cases: list[tuple[list[Path], Path | None]]) -> list[dict]:
    """What `import mlsdk` gives in a fresh interpreter, for each (sys.path entries put in
    front, site-packages dir added) in turn. A site dir stays added: give it last."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, SOURCES)))
    env.pop("PRESET_OPTIONS_DIR", None)
    arg = json.dumps([[list(map(str, path)), str(site) if site else None] for path, site in cases])
    result = subprocess.run(
        [sys.executable, "-c", PROBE, arg],
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


SOURCES = [ROOT, ROOT / "device"]  # this checkout's packages, as the tests import them


@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None, reason="needs setuptools")
def test_stand_in_without_mlsdk_and_the_real_mlsdk_wherever_it_is(tmp_path):
    """Without MLSDK, `import mlsdk` gives the stand-in (the emulator's names; "mncore2:auto"
    still says MLSDK is not installed). A real MLSDK wins, found before the stand-in on
    sys.path or after it (the stand-in then imports it in its place). And `pip install -e .`
    (scripts/setup.sh) installs the stand-in with its finder, behind sys.path."""
    prefix = tmp_path / "prefix"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
        + ["--ignore-installed"]  # else pip uninstalls the running environment's own install
        + ["--no-index", "--prefix", str(prefix), "-e", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    (site_packages,) = prefix.glob("lib/python*/site-packages")
    stand_in, real_first, stand_in_first, installed, installed_and_real = _probe(
        [
            ([STAND_IN], None),
            ([FAKE, STAND_IN], None),
            ([STAND_IN, FAKE], None),
            ([], site_packages),
            ([FAKE], None),  # PYTHONPATH holds MLSDK, the install's finder comes after
        ]
    )
    for found in (stand_in, installed):
        # (the venv's own editable install may map `mlsdk` to another checkout's compat/)
        assert Path(found["mlsdk"]).parts[-3:] == ("compat", "mlsdk", "__init__.py")
        assert found["context"] == "mncore_device.context.Context"
        assert Path(found["llm"]).parts[-5:] == (
            "compat",
            "mlsdk",
            "experimental",
            "llm",
            "kv_cache.py",
        )
        assert found["available"] is False
    assert stand_in["mlsdk"] == str(STAND_IN / "mlsdk" / "__init__.py")
    for found in (real_first, stand_in_first, installed_and_real):
        assert found["mlsdk"] == str(FAKE / "mlsdk" / "__init__.py")
        assert found["available"] is True
        assert not found["context"].startswith("mncore_device")
