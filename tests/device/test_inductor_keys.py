"""Inductor's torch/triton source keys, remembered across processes (what keeps
load_codegen_dir from re-hashing torch's sources): always Inductor's own values, and never
trusted once the files they cover change."""

from __future__ import annotations

import json
import os

from torch._inductor import codecache

from mncore_device.runtime import inductor_keys


def test_remembered_keys_are_inductors_own_and_a_stale_entry_is_recomputed(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(inductor_keys, "_done", [])
    inductor_keys.apply_remembered_source_keys()
    path = tmp_path / inductor_keys.FILE_NAME
    data = json.loads(path.read_text())
    assert bytes.fromhex(data["torch"]["key"]["bytes"]) == codecache.torch_key()
    data["torch"] = {"fingerprint": "files changed since", "key": {"bytes": "00"}}
    path.write_text(json.dumps(data))
    monkeypatch.setattr(inductor_keys, "_done", [])
    inductor_keys.apply_remembered_source_keys()
    data = json.loads(path.read_text())
    assert bytes.fromhex(data["torch"]["key"]["bytes"]) == codecache.torch_key()
    assert data["torch"]["fingerprint"] != "files changed since"


def test_the_fingerprint_changes_when_a_source_file_changes(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    module = package / "module.py"
    module.write_text("x = 1\n")
    before = inductor_keys._fingerprint(str(tmp_path), (".py",), False)
    assert inductor_keys._fingerprint(str(tmp_path), (".py",), False) == before
    module.write_text("x = 22\n")
    os.utime(module, ns=(1, 1))
    assert inductor_keys._fingerprint(str(tmp_path), (".py",), False) != before
