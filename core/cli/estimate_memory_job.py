"""Which job ``slipstream estimate-memory`` estimates for: flags over a config file over one
process.

Without ``--num_processes`` the estimate is for the job the saved configuration describes
(``--config_file``, else the file ``slipstream config`` wrote): its process count, its
``parallelism_config`` sizes and expert plan, and the strategy and precision it trains
with. Each flag given overrides the file's value.

Example::

    job = job_from(num_processes=None, config_file="fsdp.yaml", sizes={"tp": None, ...})
    job.layout.describe()     # "dp 2 x tp 2", from fsdp.yaml
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..launcher.config import LaunchConfig, load_config
from ..runtime.env import default_config_file
from .estimate_memory_parallel import ParallelLayout

#: The layout flags, by mesh dimension (dp_shard is what the others leave).
DIMENSIONS = ("tp", "pp", "cp", "dp_replicate", "ep")


@dataclass(frozen=True)
class Job:
    """The processes and layout to estimate for, and where they came from."""

    layout: ParallelLayout
    ep_plan: list[str] | None = None
    #: The config file read, or None (flags and defaults only).
    source: Path | None = None
    #: The strategy row and dtype column the config trains with, e.g. ("FSDP", "bf16").
    strategy: str | None = None
    dtype: str | None = None

    def as_dict(self) -> dict[str, str | None]:
        """Where the job came from, for ``--json`` (the layout is in ``parallel``)."""
        source = None if self.source is None else str(self.source)
        return {"config_file": source, "strategy": self.strategy, "dtype": self.dtype}

    def describe(self) -> str:
        """One line saying what the estimate is for (printed above the table)."""
        processes = self.layout.num_processes
        text = f"Estimated for {processes} process{'es' if processes > 1 else ''}"
        if not self.layout.data_parallel_only or self.layout.ep > 1:
            text += f" ({self.layout.describe()})"
        if self.source is None:
            return text + (
                "; no saved configuration: pass --num_processes N (and the --*_size flags), or "
                "--config_file FILE"
                if processes == 1
                else ""
            )
        text += f", from {self.source}"
        if self.strategy is not None:
            text += f", which trains with {self.strategy}"
            text += f" in {self.dtype}" if self.dtype else ""
        return text + " (flags override it)"


def _strategy(config: LaunchConfig) -> tuple[str | None, str | None]:
    """The table's row and column for how ``config`` trains."""
    dtype = {"fp16": "fp16", "bf16": "bf16", "no": "fp32"}.get(config.mixed_precision)
    if config.distributed_type == "FSDP":
        return "FSDP", dtype
    if config.distributed_type == "DEEPSPEED":
        stage = config.deepspeed_config.get("zero_stage")
        return (f"ZeRO-{stage}" if str(stage) in ("1", "2", "3") else "DeepSpeed"), dtype
    if config.num_processes > 1:
        return "DDP", dtype
    return None, dtype


def _given(sizes: Mapping[str, int | None], dim: str, otherwise: int) -> int:
    value = sizes.get(dim)
    return otherwise if value is None else value


def job_from(
    num_processes: int | None,
    config_file: str | None,
    sizes: Mapping[str, int | None],
    ep_plan: str | None = None,
) -> Job:
    """The job for these flags (``None``: not given). A config file is read when named, or
    (the saved default) when ``num_processes`` is not given."""
    path: Path | None = Path(config_file) if config_file else None
    if path is None and num_processes is None and default_config_file().is_file():
        path = default_config_file()
    plan = [p.strip() for p in ep_plan.split(",") if p.strip()] if ep_plan else None
    if path is None:
        given = {dim: _given(sizes, dim, 1) for dim in DIMENSIONS}
        return Job(ParallelLayout(num_processes or 1, **given), plan)
    config, _ = load_config(path)  # errors name the file and the key
    from ..parallel.config import ParallelismConfig

    from_file = {dim: 1 for dim in DIMENSIONS}
    if config.parallelism_config:
        parallel = ParallelismConfig.from_config(config.parallelism_config)
        resolved = parallel.resolve(config.num_processes)
        from_file = {dim: resolved.size(dim) for dim in DIMENSIONS}
        if plan is None and isinstance(parallel.ep_plan, list):
            plan = parallel.ep_plan
    chosen = {dim: _given(sizes, dim, from_file[dim]) for dim in DIMENSIONS}
    layout = ParallelLayout(num_processes or config.num_processes, **chosen)
    strategy, dtype = _strategy(config)
    return Job(layout, plan, path, strategy, dtype)
