"""Tensor, pipeline, context and expert parallelism in ``slipstream estimate-memory``.

``num_processes = dp_replicate x dp_shard x tp x pp x cp``. What one process holds:

- tp: 1/tp of each weight the tensor-parallel plan splits (a transformers model's own plan;
  for other models every ``nn.Linear`` weight stands in for one), the others whole.
- pp: about 1/pp of that, assuming stages balanced by parameter count.
- cp: splits sequences, not weights, so the cp processes hold the same weights and join the
  ZeRO/FSDP shard group: it is dp_shard x cp, replicated across dp_replicate (HSDP).
- ep: splits the experts (found by the model's own ``base_model_ep_plan`` or ``--ep_plan``)
  over ep processes of the shard group; each process holds 1/ep of them, sharded over the
  other dp_shard x cp / ep; each experts module is its own FSDP unit (1/ep of it gathered).

The data-parallel arithmetic (ZeRO stages, FSDP) then runs over that shard group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..options.errors import ConfigError

# Which weights tensor and expert parallelism split is read in the planning package (slipstream
# plan reads models the same way); the names stay importable from here.
from ..planning.parameters import (  # noqa: F401
    ProcessShare,
    SplitParameter,
    TensorParallelSplit,
    tensor_parallel_split,
)

#: The order in which the table adds the dimensions, one row per step.
STEPS = ("tp", "pp", "cp", "dp_replicate")


@dataclass(frozen=True)
class ParallelLayout:
    """How ``num_processes`` processes are arranged; the rest of the sizes is dp_shard."""

    num_processes: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp_replicate: int = 1
    #: Expert parallelism: a split of the shard group (dp_shard x cp), not a size of its own.
    ep: int = 1

    def __post_init__(self) -> None:
        for dim in (*STEPS, "ep"):
            if self.size(dim) < 1:
                raise ConfigError(f"--{dim}_size must be at least 1, got {self.size(dim)}")
        if self.num_processes % self.model_parallel:
            given = [f"--{dim}_size {self.size(dim)}" for dim in STEPS if self.size(dim) > 1]
            product = " x ".join(given) + (f" = {self.model_parallel}" if len(given) > 1 else "")
            raise ConfigError(
                f"{product} does not divide --num_processes {self.num_processes}; choose "
                "sizes whose product divides the number of processes (what they leave is "
                "data parallel)"
            )
        if self.shard_group % self.ep:
            raise ConfigError(
                f"--ep_size {self.ep} does not divide the {self.shard_group} processes that "
                "shard the model (dp_shard x cp): experts are spread over some of them; choose "
                "an ep size that divides it"
            )

    def size(self, dim: str) -> int:
        return int(getattr(self, dim))

    @property
    def model_parallel(self) -> int:
        """Processes that are not data-parallel peers of each other: the product of sizes."""
        return math.prod(self.size(dim) for dim in STEPS)

    @property
    def dp_shard(self) -> int:
        return self.num_processes // self.model_parallel

    @property
    def shard_group(self) -> int:
        """Processes over which ZeRO and FSDP shard."""
        return self.dp_shard * self.cp

    @property
    def data_parallel_only(self) -> bool:
        return self.model_parallel == 1

    def describe(self) -> str:
        """E.g. ``dp 2 x tp 2 x pp 2``."""
        if self.dp_replicate > 1:
            parts = [f"dp_replicate {self.dp_replicate}", f"dp_shard {self.dp_shard}"]
        else:
            parts = [f"dp {self.dp_shard}"]
        parts += [f"{dim} {self.size(dim)}" for dim in ("tp", "pp", "cp") if self.size(dim) > 1]
        experts = f" (experts over ep {self.ep})" if self.ep > 1 else ""
        return " x ".join(parts) + experts

    def steps(self) -> list[ParallelLayout]:
        """Data parallel only, then each dimension added in turn, ending with this layout."""
        layouts = [ParallelLayout(self.num_processes)]
        sizes: dict[str, int] = {}
        for dim in STEPS:
            if self.size(dim) > 1:
                sizes[dim] = self.size(dim)
                layouts.append(ParallelLayout(self.num_processes, **sizes))
        if self.ep > 1:
            layouts.append(ParallelLayout(self.num_processes, **sizes, ep=self.ep))
        return layouts

    def as_dict(self) -> dict[str, Any]:
        return {
            "description": self.describe(),
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "tp": self.tp,
            "pp": self.pp,
            "cp": self.cp,
            "ep": self.ep,
            "shard_group": self.shard_group,
        }


def experts_note(layout: ParallelLayout, split: TensorParallelSplit, total: int) -> str:
    count = len({p.experts for p in split.parameters if p.experts >= 0})
    return (
        f"ep {layout.ep}: {split.expert_elements:,} of {total:,} parameters are experts "
        f"({count} experts modules); each process holds 1/{layout.ep} of them, sharded over "
        f"{layout.shard_group // layout.ep} (dp_shard x cp / ep)"
    )


def notes(layout: ParallelLayout, split: TensorParallelSplit | None, total: int) -> list[str]:
    """The header lines: the layout and the assumption behind each dimension."""
    lines = [
        f"{layout.num_processes} processes = {layout.describe()}; ZeRO and FSDP shard over "
        f"{layout.shard_group} of them (dp_shard x cp)"
    ]
    if split is not None and layout.tp > 1:
        lines.append(split.describe(layout.tp, total))
    if layout.pp > 1:
        lines.append(
            f"pp {layout.pp}: each stage holds about 1/{layout.pp} of the parameters "
            "(assumes stages balanced by parameter count)"
        )
    if layout.cp > 1:
        lines.append(
            f"cp {layout.cp}: splits sequences, not weights; its processes join the shard group"
        )
    if layout.dp_replicate > 1:
        lines.append(
            f"dp_replicate {layout.dp_replicate}: each of {layout.dp_replicate} replicas holds "
            "the whole sharded state (HSDP)"
        )
    if split is not None and layout.ep > 1:
        lines.append(experts_note(layout, split, total))
    return lines
