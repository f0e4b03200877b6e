"""``slipstream env``: versions, devices and the active config, ready to paste into a bug
report."""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import sys
from typing import Any

from ..runtime.env import default_config_file

_OPTIONAL = ("numpy", "deepspeed", "lightning", "torchmetrics", "safetensors", "fsspec", "s3fs")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("env", help="print versions, devices and the active config")
    parser.set_defaults(run=run)
    parser.add_argument("--config_file", "--config-file", dest="config_file", default=None)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def report(config_file: str | None = None) -> str:
    """The report as text."""
    import torch

    from .. import __version__

    lines = [
        f"- slipstream version: {__version__}",
        f"- Platform: {platform.platform()}",
        f"- Python version: {sys.version.split()[0]}",
        f"- PyTorch version: {torch.__version__} (CUDA build: {torch.version.cuda or 'no'})",
        f"- GPU available: {torch.cuda.is_available()}",
    ]
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            properties = torch.cuda.get_device_properties(index)
            lines.append(
                f"  - cuda:{index}: {properties.name}, {properties.total_memory / 2**30:.1f} GiB"
            )
    lines.append(f"- CPU cores: {__import__('os').cpu_count()}")
    lines += _xla_lines()
    lines += [f"- {package} version: {_version(package)}" for package in _OPTIONAL]
    path = config_file or str(default_config_file())
    try:
        with open(path) as handle:
            body = handle.read().strip()
        lines.append(f"- config file {path}:")
        lines += [f"    {line}" for line in body.splitlines()]
        lines += _layout_lines(path)
    except FileNotFoundError:
        lines.append(f"- config file {path}: not found (defaults apply)")
    return "\n".join(lines)


def _xla_lines() -> list[str]:
    """torch_xla (TPUs) and the variables that steer it; torch_xla is not imported."""
    from ..runtime.xla import runtime_description, wants_xla

    info = runtime_description()
    version = info.pop("torch_xla")
    lines = [f"- torch_xla version: {version}"]
    if version == "not installed":
        return [*lines, f"- PJRT_DEVICE: {info['PJRT_DEVICE']}"]
    used = wants_xla({}, cpu=False)
    lines.append(f"- XLA runtime: {'used' if used else 'not used'} by default")
    lines += [f"  - {name}: {value}" for name, value in info.items()]
    return lines


def _layout_lines(path: str) -> list[str]:
    """The mesh a ``parallelism_config`` block gives (or why the file would not launch)."""
    from ..launcher.config import ConfigError, load_config

    try:
        config = load_config(path)[0]
        layout = config.parallel_layout()
    except ConfigError as error:
        return [f"- config problem: {error}"]
    if not layout:
        return []
    lines = [f"- parallel layout: {layout}"]
    from ..parallel.config import ParallelismConfig

    sizes = ParallelismConfig.from_config(config.parallelism_config).resolve(config.num_processes)
    if sizes.ep > 1:
        shards = sizes.dp_shard * sizes.cp
        lines.append(
            f"- expert parallelism: experts split over ep={sizes.ep} of the {shards} processes "
            f"that shard the model, each expert FSDP-sharded over {shards // sizes.ep}"
        )
    return lines


def run(args: argparse.Namespace) -> int:
    print("Copy-and-paste this into your bug report:\n")
    print(report(args.config_file))
    return 0
