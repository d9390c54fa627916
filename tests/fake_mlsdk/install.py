"""Put the fake `mlsdk` (tests/fake_mlsdk/mlsdk) on the import path for one test, then remove it.

Test files import this module (`from tests.fake_mlsdk import install as fake`) and wrap
`installed` in a fixture. While installed, `import mlsdk` gives a fresh fake (empty call log) and
$PRESET_OPTIONS_DIR points at the fake's preset files; afterwards `mlsdk` is not importable
again, so other tests still see "MLSDK not installed".
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

FAKE_ROOT = Path(__file__).resolve().parent
PRESET_DIR = FAKE_ROOT / "preset_options"


def _forget() -> None:
    for name in [n for n in sys.modules if n == "mlsdk" or n.startswith("mlsdk.")]:
        del sys.modules[name]
    sys.path_importer_cache.pop(str(FAKE_ROOT), None)
    importlib.invalidate_caches()


@contextlib.contextmanager
def installed(
    monkeypatch: pytest.MonkeyPatch, compile_keyword: str = "codegen_dir"
) -> Iterator[ModuleType]:
    """The fake mlsdk, importable as `mlsdk` inside the block.

    compile_keyword="codegen_base_dir" gives an older SDK's Context.compile signature.
    """
    monkeypatch.setenv("FAKE_MLSDK_COMPILE_KEYWORD", compile_keyword)
    monkeypatch.setenv("PRESET_OPTIONS_DIR", str(PRESET_DIR))
    _forget()
    sys.path.insert(0, str(FAKE_ROOT))
    try:
        yield importlib.import_module("mlsdk")
    finally:
        sys.path.remove(str(FAKE_ROOT))
        _forget()
