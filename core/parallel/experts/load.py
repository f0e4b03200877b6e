"""Routing statistics: how many tokens each expert received, and how uneven that is.

Every expert-parallel experts module counts the (token, expert) pairs its router sent to
each expert; :func:`expert_load` sums the counts of all processes holding other tokens (a
collective) and resets them, so called once per optimizer step it gives the tokens per
expert per step. The imbalance of a layer is ``max / mean`` of its counts: 1.0 when every
expert gets the same share, ``num_experts`` when one expert gets everything.

Example::

    load = accelerator.expert_load()       # every process calls it
    load.tokens["model.layers.0.mlp.experts"]   # tensor([130, 122, 141, 119])
    accelerator.log(load.metrics(), step=step)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .layer import ExpertParallel, expert_parallel_of


@dataclass
class ExpertLoad:
    """Tokens routed to each expert since the last reading, per experts module."""

    #: experts module name -> ``[num_experts]`` token counts (int64, on the CPU).
    tokens: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def imbalance(self) -> dict[str, float]:
        """``max / mean`` tokens per expert, per experts module (1.0 = perfectly even)."""
        found = {}
        for name, counts in self.tokens.items():
            mean = counts.double().mean().item()
            found[name] = counts.max().item() / mean if mean > 0 else 0.0
        return found

    @property
    def max_imbalance(self) -> float:
        """The largest imbalance over all experts modules (0.0 when nothing was routed)."""
        return max(self.imbalance.values(), default=0.0)

    def metrics(self, prefix: str = "expert_load") -> dict[str, float]:
        """Flat values for ``accelerator.log``: the overall and per-layer imbalance."""
        values = {f"{prefix}/max_imbalance": self.max_imbalance}
        values.update({f"{prefix}/{name}/imbalance": v for name, v in self.imbalance.items()})
        return values


def expert_parallel_modules(models: Iterable[nn.Module]) -> list[ExpertParallel]:
    """The expert-parallel experts modules of ``models``, in module order."""
    return [ep for model in models for m in model.modules() if (ep := expert_parallel_of(m))]


def expert_load(models: Iterable[nn.Module], group: Any = None) -> ExpertLoad:
    """Tokens per expert since the last call, summed over ``group`` (the processes holding
    other tokens); resets the counts. A collective when there are several processes."""
    modules = expert_parallel_modules(models)
    if not modules:
        return ExpertLoad()
    counts = [m.take_tokens() for m in modules]
    device = counts[0].device
    joined = torch.cat([c.to(device) for c in counts])
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(joined, group=group)
    parts = joined.cpu().split([c.numel() for c in counts])
    return ExpertLoad({m.name: part for m, part in zip(modules, parts, strict=True)})
