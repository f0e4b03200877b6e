"""Which parameters of a model tensor and expert parallelism split, and what one process of
a layout holds before ZeRO/FSDP sharding (read from a model on the meta device).

- tp: 1/tp of each weight the tensor-parallel plan splits (a transformers model's own plan;
  for other models every ``nn.Linear`` weight stands in for one), the others whole.
- pp: about 1/pp of that, assuming stages balanced by parameter count.
- ep: 1/ep of the experts (found by the model's own ``base_model_ep_plan`` or a plan given).

Example::

    split = tensor_parallel_split(model, list(units(model)), tp=2)
    split.per_process(tp=2, pp=1).total
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

# The weights a style splits, by the weight dimension it splits (STYLE_SPLITS' values):
# column-wise splits the outputs, and a Linear's bias follows its outputs.
_SPLIT_PARAMETERS = {
    "out": ("weight", "bias"),
    "in": ("weight",),
    "rows": ("weight",),
    "columns": ("weight",),
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
