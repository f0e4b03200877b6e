"""How a model splits into pipeline stages: its units in forward order and which stage
holds which.

Three kinds of models split without tracing:

* ``nn.Sequential`` (nested Sequentials/ModuleLists of blocks are opened one level): every
  child is a unit.
* transformers models that describe their layout (``config.base_model_pp_plan`` and the
  class's ``_pp_plan``): the embedding, each decoder layer, the final norm and the head.
* any model declaring ``_pp_plan`` = its top-level children in forward order (one of them
  may be a ModuleList/Sequential of blocks), the promise that its forward applies them
  one after the other.

Blocks are balanced over stages by parameter count (or by count); explicit split points
(``pp_split_points=["layers.4"]``: a stage starts at each) override the balance.

Example::

    layout = pipeline_layout(model)
    stages = assign_stages(layout, num_stages=4)   # unit names per stage
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..config import ParallelismConfigError
from ..config_values import PIPELINE_BALANCE as BALANCE


@dataclass(frozen=True)
class Unit:
    """A piece of the model that belongs to exactly one stage."""

    name: str  # qualified module name
    parameters: int
    #: "pre" units go to the first stage, "post" units to the last, blocks are balanced.
    role: str = "block"


@dataclass(frozen=True)
class PipelineLayout:
    """A model's units in forward order and how to run a subset of them."""

    kind: str  # "sequential", "transformers" or "declared"
    units: tuple[Unit, ...]
    #: For transformers models: the attribute holding the base model ("" for a base model).
    base_prefix: str = ""
    #: The container of the blocks (e.g. "model.layers"), or "" for plain Sequentials.
    blocks: str = ""

    @property
    def names(self) -> list[str]:
        return [u.name for u in self.units]


def _parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _is_container(module: nn.Module) -> bool:
    return isinstance(module, (nn.Sequential, nn.ModuleList))


def _children(model: nn.Module) -> str:
    names = [name for name, _ in model.named_children()]
    return ", ".join(names) if names else "(none)"


def pipeline_layout(model: nn.Module) -> PipelineLayout:
    """The units of ``model``; a clear error when the model does not say how to split it."""
    if isinstance(model, nn.Sequential):
        units: list[Unit] = []
        for name, child in model.named_children():
            if _is_container(child) and len(child._modules) > 0:
                units += [Unit(f"{name}.{n}", _parameters(c)) for n, c in child.named_children()]
            else:
                units.append(Unit(name, _parameters(child)))
        return PipelineLayout("sequential", tuple(units))
    transformers = _transformers_layout(model)
    if transformers is not None:
        return transformers
    declared = getattr(model, "_pp_plan", None) or getattr(model, "pp_plan", None)
    if isinstance(declared, (Mapping, Sequence)) and not isinstance(declared, str) and declared:
        return _declared_layout(model, list(declared))
    raise ParallelismConfigError(
        f"cannot split {type(model).__name__} into pipeline stages: it is not an "
        "nn.Sequential, not a transformers model with a pipeline plan, and does not declare "
        f"its layout. Its top-level children are: {_children(model)}. Wrap the pieces in "
        "nn.Sequential(...), or set _pp_plan on the class to the names of its top-level "
        "children in forward order (the forward must apply them one after the other)"
    )


def _transformers_layout(model: nn.Module) -> PipelineLayout | None:
    config = getattr(model, "config", None)
    base_plan = getattr(config, "base_model_pp_plan", None)
    if not base_plan or "layers" not in base_plan:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    if not isinstance(base, nn.Module):
        prefix, base = "", model
    path = f"{prefix}." if prefix else ""
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        return None
    units: list[Unit] = []
    names = list(base_plan)
    position = names.index("layers")
    for name in names[:position]:
        units.append(Unit(path + name, _parameters(getattr(base, name)), "pre"))
    units += [Unit(f"{path}layers.{n}", _parameters(layer)) for n, layer in layers.named_children()]
    for name in names[position + 1 :]:
        units.append(Unit(path + name, _parameters(getattr(base, name)), "post"))
    if base is not model:
        heads = getattr(type(model), "_pp_plan", None) or {}
        for name in heads:
            units.append(Unit(name, _parameters(getattr(model, name)), "post"))
    return PipelineLayout("transformers", tuple(units), base_prefix=prefix, blocks=f"{path}layers")


def _declared_layout(model: nn.Module, declared: list[Any]) -> PipelineLayout:
    children = dict(model.named_children())
    units: list[Unit] = []
    blocks = ""
    for name in declared:
        child = children.get(str(name))
        if child is None:
            raise ParallelismConfigError(
                f"{type(model).__name__}._pp_plan names {name!r}, which is not one of its "
                f"top-level children: {_children(model)}"
            )
        if _is_container(child) and not blocks:
            blocks = str(name)
            units += [Unit(f"{name}.{n}", _parameters(c)) for n, c in child.named_children()]
        else:
            units.append(Unit(str(name), _parameters(child)))
    return PipelineLayout("declared", tuple(units), blocks=blocks)


def _balanced(weights: list[int], parts: int) -> list[int]:
    """Cut points splitting ``weights`` into ``parts`` contiguous non-empty groups with the
    smallest possible largest group (linear partition, exact)."""
    n = len(weights)
    prefix = [0]
    for weight in weights:
        prefix.append(prefix[-1] + weight)
    inf = float("inf")
    # best[k][i]: smallest largest group splitting the first i weights into k groups.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, i = [], n
    for k in range(parts, 0, -1):
        bounds.append(i)
        i = cut[k][i]
    return sorted(bounds)[:-1]


def _split_point_index(layout: PipelineLayout, point: str) -> int:
    names = layout.names
    exact = [i for i, name in enumerate(names) if name == point]
    matches = exact or [i for i, name in enumerate(names) if name.endswith("." + point)]
    if len(matches) != 1:
        shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
        problem = "is not" if not matches else "names several of"
        raise ParallelismConfigError(
            f"pipeline split point {point!r} {problem} the model's pipeline units ({shown})"
        )
    return matches[0]


def assign_stages(
    layout: PipelineLayout,
    num_stages: int,
    *,
    split_points: Sequence[str] | None = None,
    balance: str = "parameters",
) -> list[list[str]]:
    """Unit names of each of ``num_stages`` stages, in order."""
    units = list(layout.units)
    if split_points:
        if len(split_points) != num_stages - 1:
            raise ParallelismConfigError(
                f"{len(split_points)} pipeline split point(s) make {len(split_points) + 1} "
                f"stages, but the layout has {num_stages} (pp_size x stages per rank); give "
                f"{num_stages - 1} split points"
            )
        starts = [_split_point_index(layout, p) for p in split_points]
        if starts != sorted(set(starts)) or starts[0] == 0:
            raise ParallelismConfigError(
                f"pipeline split points {list(split_points)} must be in forward order, distinct "
                "and after the first unit"
            )
        bounds = [0, *starts, len(units)]
        return [[u.name for u in units[a:b]] for a, b in itertools.pairwise(bounds)]
    if balance not in BALANCE:
        raise ParallelismConfigError(
            f"pp_balance must be one of {', '.join(BALANCE)}, got {balance!r}"
        )
    pre = [u for u in units if u.role == "pre"]
    post = [u for u in units if u.role == "post"]
    blocks = [u for u in units if u.role == "block"]
    if len(blocks) < num_stages:
        raise ParallelismConfigError(
            f"{num_stages} pipeline stages need at least {num_stages} blocks to split, but the "
            f"model has {len(blocks)} ({', '.join(u.name for u in blocks) or 'none'}); use "
            "fewer stages (pp_size x stages per rank) or a deeper model"
        )
    if balance == "count":
        weights = [1] * len(blocks)
    else:
        weights = [max(1, u.parameters) for u in blocks]
        # The embedding and the head ride with the first and last block.
        weights[0] += sum(u.parameters for u in pre)
        weights[-1] += sum(u.parameters for u in post)
    bounds = [0, *_balanced(weights, num_stages), len(blocks)]
    stages = [[u.name for u in blocks[a:b]] for a, b in itertools.pairwise(bounds)]
    stages[0] = [u.name for u in pre] + stages[0]
    stages[-1] = stages[-1] + [u.name for u in post]
    return stages
