"""Loss curves as PNG files, drawn from the metrics a run logged itself.

Every example ends by writing ``<outdir>/loss_curve.png``. The Lightning examples read their
curves back from their TensorBoard event files, so the picture shows exactly what TensorBoard
would show; the plain MLSDK loop passes the losses it collected.

Only the Agg (file) backend is used: the examples run on headless hosts and in tests, where an
interactive backend would fail or pop up windows. Figures are built with ``matplotlib.figure``
rather than ``pyplot`` so no global backend state is touched either.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

# Headless default for anything in this process that uses pyplot later; a backend the user chose
# (MPLBACKEND already set) wins. matplotlib is imported lazily below, after this line ran.
os.environ.setdefault("MPLBACKEND", "Agg")

Series = Sequence[tuple[int, float]]


def read_tensorboard_scalars(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """All scalars in the event files of ``log_dir``, as ``{tag: [(step, value), ...]}``.

    Points are sorted by step: a directory with several event files (a resumed run) is read
    file by file in name order, which is not always time order (``...pid.10`` < ``...pid.9``).
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep all
    accumulator.Reload()
    return {
        tag: sorted((event.step, event.value) for event in accumulator.Scalars(tag))
        for tag in accumulator.Tags()["scalars"]
    }


def plot_loss_curve(
    series: Mapping[str, Series], path: str | Path, title: str = "loss", xlabel: str = "step"
) -> Path:
    """Draw one line per series (markers for short ones, such as per-epoch values) into ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(7, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name, points in series.items():
        if not points:
            continue
        steps, values = zip(*points, strict=True)
        ax.plot(steps, values, label=name, marker="o" if len(points) <= 20 else None)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("loss")
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return path


def plot_tensorboard_losses(log_dir: str | Path, path: str | Path, title: str = "loss") -> Path:
    """Plot the training and validation losses (tags containing "loss") logged in ``log_dir``."""
    scalars = read_tensorboard_scalars(log_dir)
    losses = {
        tag: points
        for tag, points in sorted(scalars.items())
        if "loss" in tag and not tag.startswith("test")
    }
    return plot_loss_curve(losses, path, title=title, xlabel="global step")
