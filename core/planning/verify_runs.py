"""Running one layout for real on this machine's CPU: torchrun starts the layout's processes
with :mod:`slipstream.planning.verify_worker`, which reports each process's peak memory and
its median step time.

Example::

    run = run_layout(source, Layout(dp_shard=4, micro_batch=2), layers=4, seq_len=128)
    run.peak_mib, run.step_seconds
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from ..options.errors import ConfigError
from ..runtime.env import child_environment, default_config_file
from .layouts import Layout
from .model_source import ModelSource
from .verify_worker import PREFIX


@dataclass(frozen=True)
class MeasuredRun:
    """What one layout's processes measured."""

    layout: Layout
    layers: int | None
    #: The largest process's peak above its baseline (MiB), and every process's.
    peak_mib: float
    peaks_mib: tuple[float, ...]
    #: Median seconds per optimizer step (the slowest process sets it: steps end at a barrier).
    step_seconds: float
    reports: tuple[dict[str, Any], ...]


def run_layout(
    source: ModelSource,
    layout: Layout,
    *,
    layers: int | None,
    seq_len: int,
    steps: int = 3,
    bucket_elements: int | None = None,
    wrap_classes: tuple[str, ...] = (),
    timeout: float = 600.0,
) -> MeasuredRun:
    """Train ``steps`` steps of ``layout`` on ``layout.world_size`` local CPU processes."""
    if source.kind != "config":
        raise ConfigError(
            "--verify trains a scaled-down copy of the model, which needs a transformers "
            "config (a config.json, a folder or a Hub name), not a module:callable factory"
        )
    spec = {
        "model": source.as_dict(),
        "layout": layout.as_dict(),
        "layers": layers,
        "seq_len": seq_len,
        "steps": steps,
        "bucket_elements": bucket_elements,
        "wrap_classes": list(wrap_classes),
    }
    with tempfile.TemporaryDirectory(prefix="slipstream-verify-") as folder:
        path = os.path.join(folder, "spec.json")
        with open(path, "w") as handle:
            json.dump(spec, handle)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node", str(layout.world_size),
                   "-m", "slipstream.planning.verify_worker", path]  # fmt: skip
        environment = child_environment(
            {
                "OMP_NUM_THREADS": "1",
                # glibc hands large freed blocks back: resident memory follows live tensors.
                "MALLOC_MMAP_THRESHOLD_": "131072",
                "CUDA_VISIBLE_DEVICES": "",  # CPU processes, also on a machine with GPUs
            }
        )
        # DeepSpeed's CPU op is compiled once into slipstream's cache (unless the user's
        # TORCH_EXTENSIONS_DIR says where), as the test suite keeps it.
        extensions = default_config_file().parent / "torch_extensions"
        environment.setdefault("TORCH_EXTENSIONS_DIR", str(extensions))
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, env=environment, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            raise ConfigError(
                f"--verify: {layout.describe()} did not finish in {timeout:.0f} s"
            ) from None
    lines = [line for line in done.stdout.splitlines() if line.startswith(PREFIX)]
    if done.returncode or not lines:
        raise ConfigError(f"--verify: {layout.describe()} failed: {_worker_error(done.stderr)}")
    reports = tuple(sorted(json.loads(lines[-1][len(PREFIX) :]), key=lambda r: r["rank"]))
    peaks = tuple(float(r["peak_mib"]) for r in reports)
    return MeasuredRun(
        layout=layout,
        layers=layers,
        peak_mib=max(peaks),
        peaks_mib=peaks,
        step_seconds=max(float(r["step_seconds"]) for r in reports),
        reports=reports,
    )


def _worker_error(stderr: str) -> str:
    """The exception a worker raised (its last line), not torchrun's summary around it."""
    raw = stderr.splitlines()
    workers = [re.sub(r"^\[rank\d+\]:\s*", "", line).strip() for line in raw
               if re.match(r"^\[rank\d+\]:", line)]  # fmt: skip
    for lines in (workers, [line.strip() for line in raw]):
        errors = [line for line in lines if _is_exception_line(line)]
        if errors:
            return errors[-1]
    return " / ".join(line.strip() for line in raw[-3:])


def _is_exception_line(line: str) -> bool:
    name = line.split(":", 1)[0]
    return name.endswith(("Error", "Exception")) and " " not in name and ":" in line
