#!/usr/bin/env bash
# Create .venv and install mncore-lightning with what the examples and tests need.
# torch and torchvision are pinned (torch==2.14.1, torchvision==0.29.1): pip takes them from
# the local wheel cache where there is one instead of downloading several GB.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[examples,dev]'
.venv/bin/python -c "import torch, lightning, mncore_lightning; print(f'mncore-lightning ready: torch {torch.__version__}, lightning {lightning.__version__}')"
