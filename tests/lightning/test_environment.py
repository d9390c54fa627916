"""`python -m mncore_lightning`: the environment, and the device and preset a run would pick."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mncore_lightning import device_selection, environment
from mncore_lightning.device_selection import resolve_device, resolve_preset

ROOT = Path(__file__).resolve().parents[2]
FIELDS = (
    "mncore-lightning",
    "python",
    "torch",
    "lightning",
    "MLSDK",
    "device",
    "preset",
    "strategy",
    "inductor cache",
    "codegen dirs",
)


def run_main(**env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k not in ("MNCORE_DEVICE", "MNCORE_PRESET")}
    environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "device")])
    proc = subprocess.run(
        [sys.executable, "-m", "mncore_lightning"],
        capture_output=True,
        text=True,
        env={**environ, **env},
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def field(report: str, name: str) -> str:
    """One field's text, its wrapped continuation lines joined."""
    lines = report.splitlines()
    (start,) = [i for i, line in enumerate(lines) if line.startswith(f"{name}:")]
    text = [lines[start].split(":", 1)[1].strip()]
    for line in lines[start + 1 :]:
        if not line.startswith(" ") or not line.strip():
            break
        text.append(line.strip())
    return " ".join(text)


def test_the_report_fits_one_screen_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MNCORE_DEVICE", raising=False)
    monkeypatch.delenv("MNCORE_PRESET", raising=False)
    monkeypatch.chdir(ROOT)
    report = environment.report()
    lines = report.splitlines()
    assert len(lines) <= 40 and max(map(len, lines)) <= 100
    for name in FIELDS:
        assert field(report, name), name
    assert field(report, "torch").startswith(torch.__version__)
    assert field(report, "mncore-lightning").startswith("0.")

    # The device and preset are those a run without arguments resolves to, with the reason.
    device, preset = field(report, "device"), field(report, "preset")
    assert device.startswith(f"{resolve_device(None)} ($MNCORE_DEVICE is unset")
    assert preset.startswith(f"{resolve_preset(None)} ($MNCORE_PRESET is unset: the default")
    if not device_selection.mlsdk_available():
        assert field(report, "MLSDK").startswith("not installed")
    # The examples' commands, runnable from the repository root.
    for script in ("mnist.py", "mnist_cnn.py", "autoencoder.py", "mlsdk_mnist.py"):
        (line,) = [x for x in lines if f"examples/{script} " in x and "#" in x][:1]
        assert (ROOT / line.split()[1]).is_file()


def test_python_m_mncore_lightning_names_the_variables_that_decided() -> None:
    report = run_main(MNCORE_DEVICE="pfvm:cpu", MNCORE_PRESET="O0")
    assert report.startswith("mncore-lightning environment\n")
    assert field(report, "device").startswith("pfvm:cpu ($MNCORE_DEVICE is set; runs on this")
    assert field(report, "preset").startswith("O0 ($MNCORE_PRESET is set; The traced aten graph")
    assert {name for name in FIELDS if field(report, name)} == set(FIELDS)


def test_device_reasons_follow_the_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MNCORE_DEVICE", raising=False)
    monkeypatch.setattr(device_selection, "mlsdk_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    choice = environment.device_choice()
    assert choice.value == resolve_device(None) == "pfvm:cuda"
    assert "CUDA is available" in choice.reason and "emulator on the GPU" in choice.reason

    monkeypatch.setattr(device_selection, "mlsdk_available", lambda: True)
    choice = environment.device_choice()
    assert choice.value == resolve_device(None) == "mncore2:auto"
    assert "MLSDK is installed" in choice.reason

    # A device a run could not use is reported, not a crash.
    monkeypatch.setenv("MNCORE_DEVICE", "pfvm:tpu")
    choice = environment.device_choice()
    assert (
        choice.value == "pfvm:tpu" and "a run would fail: unknown emulated device" in choice.reason
    )
    monkeypatch.setenv("MNCORE_PRESET", "O9")
    assert "a run would fail: unknown compile preset 'O9'" in environment.preset_choice().reason
