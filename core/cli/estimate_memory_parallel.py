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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..options.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

#: The order in which the table adds the dimensions, one row per step.
STEPS = ("tp", "pp", "cp", "dp_replicate")
# The weights a style splits, by the weight dimension it splits (STYLE_SPLITS' values):
# column-wise splits the outputs, and a Linear's bias follows its outputs.
_SPLIT_PARAMETERS = {
    "out": ("weight", "bias"),
    "in": ("weight",),
    "rows": ("weight",),
    "columns": ("weight",),
}


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


@dataclass(frozen=True)
class SplitParameter:
    """One distinct parameter of the model and whether tensor parallelism splits it."""

    elements: int
    trainable: bool
    split: bool
    #: The index of the experts module holding it (-1: not an expert weight).
    experts: int = -1


@dataclass(frozen=True)
class ProcessShare:
    """Parameter elements one process holds before ZeRO/FSDP sharding."""

    total: int
    trainable: int
    largest_unit: int
    #: Of ``total`` and ``trainable``: expert weights (split over ep, sharded over the rest).
    experts: int = 0
    trainable_experts: int = 0


@dataclass(frozen=True)
class TensorParallelSplit:
    """Which parameters of a model tensor parallelism splits, and its FSDP units."""

    model: str
    parameters: tuple[SplitParameter, ...]  # each distinct (untied) parameter once
    units: tuple[tuple[int, ...], ...]  # indices into ``parameters``, one tuple per unit
    modules: int  # modules that have a split weight
    from_plan: bool  # the model's own plan, not the nn.Linear stand-in

    @property
    def split_elements(self) -> int:
        return sum(p.elements for p in self.parameters if p.split)

    @property
    def expert_elements(self) -> int:
        return sum(p.elements for p in self.parameters if p.experts >= 0)

    def per_process(self, tp: int, pp: int, ep: int = 1) -> ProcessShare:
        """What one process of a ``tp`` x ``pp`` layout (experts over ``ep``) holds."""
        # A split weight is padded to whole shards, as DTensor's uneven Shard is.
        local = [-(-p.elements // tp) if p.split else p.elements for p in self.parameters]
        expert = [ep > 1 and p.experts >= 0 for p in self.parameters]
        local = [-(-n // ep) if e else n for n, e in zip(local, expert, strict=True)]
        total = sum(local)
        trainable = sum(n for n, p in zip(local, self.parameters, strict=True) if p.trainable)
        experts = sum(n for n, e in zip(local, expert, strict=True) if e)
        trainable_experts = sum(
            n for n, p, e in zip(local, self.parameters, expert, strict=True) if e and p.trainable
        )
        # A stage still gathers its largest unit whole, however the stages are balanced.
        # Split experts are units of their own (each experts module), gathered over efsdp.
        largest = max(sum(local[i] for i in unit if not expert[i]) for unit in self.units)
        modules: dict[int, int] = {}
        for n, p, e in zip(local, self.parameters, expert, strict=True):
            if e:
                modules[p.experts] = modules.get(p.experts, 0) + n
        largest = max([largest, *modules.values()])
        return ProcessShare(
            -(-total // pp),
            -(-trainable // pp),
            largest,
            -(-experts // pp),
            -(-trainable_experts // pp),
        )

    def describe(self, tp: int, total: int) -> str:
        what = (
            f"the model's own tp_plan splits {self.split_elements:,} of {total:,} parameters"
            if self.from_plan
            else f"{self.model} has no tp_plan; as a stand-in every nn.Linear weight is split: "
            f"{self.split_elements:,} of {total:,} parameters"
        )
        return f"tp {tp}: {what} ({self.modules} modules), 1/{tp} of them per process"


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


def _split_names(style: Any) -> tuple[str, ...]:
    from ..parallel.tensor_parallel import STYLE_SPLITS

    if isinstance(style, str):
        name = style
        split = STYLE_SPLITS.get(style)
    else:  # a DTensor ParallelStyle object from the model's tp_plan
        name = type(style).__name__.lower()
        split = None
    if split is None and name not in STYLE_SPLITS:
        # Styles newer than STYLE_SPLITS (e.g. transformers' "local_colwise") by their name.
        split = "out" if "colwise" in name else "in" if "rowwise" in name else None
    return _SPLIT_PARAMETERS.get(split, ()) if split else ()


def tensor_parallel_split(
    model: nn.Module,
    units: Sequence[nn.Module],
    tp: int,
    ep: int = 1,
    ep_plan: Sequence[str] | None = None,
) -> TensorParallelSplit:
    """The split of ``model`` under its own tensor-parallel plan (else every nn.Linear
    weight); ``units`` are its FSDP units. With ``ep > 1`` the experts (of ``ep_plan``, else
    the model's own plan) are marked. Raises when ``tp`` or ``ep`` cannot split the sizes."""
    from torch import nn

    from ..parallel.experts import inside_experts, resolve_experts
    from ..parallel.tensor_parallel import check_divisible, expand_plan, model_plan

    experts = resolve_experts(model, ep_plan, ep) if ep > 1 else []
    holder: dict[int, int] = {}
    for position, found in enumerate(experts):
        holder.update({id(p): position for p in found.module.parameters()})
    plan = model_plan(model)
    split: set[int] = set()
    modules = 0
    if plan:
        planned = expand_plan(model, plan, strict=False)
        # Split experts are not tensor-parallel (the model-parallel strategy drops them).
        planned = [entry for entry in planned if not inside_experts(entry.name, experts)]
        # The model-parallel strategy would refuse this tp_size: an estimate for it misleads.
        check_divisible(model, planned, tp)
        named = dict(model.named_modules())
        for entry in planned:
            names = _split_names(entry.style)
            hits = [p for n, p in named[entry.name].named_parameters(recurse=False) if n in names]
            split.update(id(p) for p in hits)
            modules += bool(hits)
    else:
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        split = {id(m.weight) for m in linears}
        modules = len(linears)
    parameters = list(model.parameters())  # deduplicated, so tied weights count once
    index = {id(p): i for i, p in enumerate(parameters)}
    groups = [tuple(index[id(p)] for p in unit.parameters()) for unit in units]
    # As count_parameters: the root's own parameters are a unit; a leaf model is one unit.
    own = tuple(index[id(p)] for p in model.parameters(recurse=False))
    return TensorParallelSplit(
        model=type(model).__name__,
        parameters=tuple(
            SplitParameter(p.numel(), p.requires_grad, id(p) in split, holder.get(id(p), -1))
            for p in parameters
        ),
        units=(own, *groups) if groups else (tuple(range(len(parameters))),),
        modules=modules,
        from_plan=bool(plan),
    )
