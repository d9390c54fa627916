"""`python -m mncore_lightning.preflight path/to/module.py:ClassName [options]`: the preflight
report of a LightningModule (and DataModule) defined in a file, without a Trainer script."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from .run import run_preflight

_HOOKS = {
    "train": "train_dataloader",
    "validate": "val_dataloader",
    "test": "test_dataloader",
    "predict": "predict_dataloader",
}


def load_class(spec: str) -> type:
    """`path/to/file.py:ClassName` -> the class; the file's folder is put on sys.path first,
    as `python path/to/file.py` would (its sibling imports resolve)."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path.endswith(".py"):
        raise SystemExit(f"expected path/to/file.py:ClassName, got {spec!r}")
    file = Path(path).resolve()
    if not file.is_file():
        raise SystemExit(f"no such file: {path}")
    sys.path.insert(0, str(file.parent))
    module_name = f"_preflight_{file.stem}"
    spec_ = importlib.util.spec_from_file_location(module_name, file)
    module = importlib.util.module_from_spec(spec_)
    sys.modules[module_name] = module
    spec_.loader.exec_module(module)
    try:
        return getattr(module, name)
    except AttributeError:
        raise SystemExit(f"{path} defines no {name}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mncore_lightning.preflight", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("module", help="path/to/module.py:ClassName (a LightningModule)")
    parser.add_argument("--datamodule", help="path/to/file.py:ClassName (a LightningDataModule)")
    parser.add_argument("--init-args", default="{}", help="JSON keyword arguments of the module")
    parser.add_argument(
        "--datamodule-args", default="{}", help="JSON keyword arguments of the DataModule"
    )
    parser.add_argument(
        "--batch-size", type=int, help="set `batch_size` on the DataModule (else the module)"
    )
    parser.add_argument(
        "--preset",
        action="append",
        help="time trace + compile at this preset (repeatable; default O0)",
    )
    parser.add_argument("--json", type=Path, help="write the report as JSON here")
    parser.add_argument("--no-rich", action="store_true", help="plain Markdown on a terminal too")
    parser.add_argument(
        "--board-memory-gib", type=float, help="MN-Core 2 board memory to compare the peak with"
    )
    parser.add_argument(
        "--fail-on",
        action="append",
        choices=("graph_break", "retrace", "memory"),
        help="exit with status 1 when the report shows this (repeatable)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module = load_class(args.module)(**json.loads(args.init_args))
    datamodule = None
    if args.datamodule:
        datamodule = load_class(args.datamodule)(**json.loads(args.datamodule_args))
    holder = datamodule if datamodule is not None else module
    if args.batch_size is not None:
        if not hasattr(holder, "batch_size"):
            raise SystemExit(f"--batch-size: {type(holder).__name__} has no batch_size attribute")
        holder.batch_size = args.batch_size
    loaders = _dataloaders(holder)
    if not loaders:
        raise SystemExit(
            f"{type(holder).__name__} gives no DataLoader (train_dataloader, val_dataloader, "
            "test_dataloader, predict_dataloader): pass --datamodule"
        )
    board = int(args.board_memory_gib * 2**30) if args.board_memory_gib else None
    report = run_preflight(module, loaders, tuple(args.preset or ("O0",)), board)
    report.print(rich=False if args.no_rich else None)
    if args.json is not None:
        report.to_json(args.json)
    failures = report.failures(tuple(args.fail_on or ()))
    for failure in failures:
        print(f"preflight: {failure}", file=sys.stderr)
    return 1 if failures else 0


def _dataloaders(holder: Any) -> dict[str, Any]:
    if hasattr(holder, "prepare_data"):
        holder.prepare_data()
    setup = getattr(holder, "setup", None)
    loaders = {}
    for stage, hook in _HOOKS.items():
        if callable(setup):
            setup({"train": "fit", "validate": "validate"}.get(stage, stage))
        try:
            loader = getattr(holder, hook)()
        except Exception:  # noqa: BLE001 - Lightning's default hooks raise when not defined
            continue
        if isinstance(loader, (list, tuple)):
            loader = loader[0] if loader else None
        if loader is not None:
            loaders[stage] = loader
    return loaders


if __name__ == "__main__":
    sys.exit(main())
