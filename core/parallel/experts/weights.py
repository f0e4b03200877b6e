"""Whole-model weights when experts are listed (an ``nn.ModuleList`` per experts module).

Stacked experts are DTensors sharded along the experts, so the usual full state dict
(``full_tensor`` of every DTensor) already holds every expert. Listed experts are separate
modules, and each process keeps only its own: the main process's full state dict lacks the
other processes' experts. :func:`merge_listed_experts` sends each expert-parallel
process's experts to the first one of its expert group, which then holds all of them. Its
sharded checkpoint parts name every expert of the model; :func:`check_listed_shapes` checks
a saved part against a model that holds only some of them.

Example::

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    full = merge_listed_experts(full, experts, ep_group, keep=is_main)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .layer import ExpertParallel


def listed_prefixes(experts: Sequence[ExpertParallel]) -> list[str]:
    """The name prefixes of the listed experts' weights (``"<module>.<list>."``)."""
    prefixes = []
    for ep in experts:
        if ep.entry.listed is not None:
            inner = ".".join(p for p in (ep.name, ep.entry.listed) if p)
            prefixes.append(inner + ".")
    return prefixes


def merge_listed_experts(
    full: dict[str, Any], prefixes: Sequence[str], group: Any, *, receive: bool
) -> dict[str, Any]:
    """``full`` (this process's full weights) with the listed experts of every process of
    ``group`` added on its first process (``receive`` there), empty elsewhere. A collective
    over ``group``."""
    mine = {
        k: v.detach().cpu()
        for k, v in full.items()
        if isinstance(v, torch.Tensor) and any(k.startswith(p) for p in prefixes)
    }
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.gather_object(mine, parts if receive else None, group_dst=0, group=group)
    if not receive:
        return {}
    merged = dict(full)
    for part in parts:
        merged.update(part)
    # The model's order, each experts module's entries by expert index.
    known = {name: i for i, name in enumerate(full)}
    first = {
        p: min((known[k] for k in full if k.startswith(p)), default=len(known)) for p in prefixes
    }

    def position(name: str) -> tuple[int, int, str]:
        for prefix in prefixes:
            if name.startswith(prefix):
                index = name[len(prefix) :].split(".", 1)[0]
                return first[prefix], int(index) if index.isdecimal() else 0, name
        return known.get(name, len(known)), -1, name

    return dict(sorted(merged.items(), key=lambda item: position(item[0])))


def check_listed_shapes(
    expected: dict[str, tuple[int, ...]],
    saved: dict[str, tuple[int, ...]],
    prefixes: Sequence[str],
    where: str,
) -> None:
    """Raise when a saved part lacks one of this process's tensors or has another shape;
    other processes' experts in it are expected."""
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(
        k for k in set(saved) - set(expected) if not any(k.startswith(p) for p in prefixes)
    )
    wrong = [f"{k} {saved[k]} vs {v}" for k, v in expected.items() if k in saved and saved[k] != v]
    if missing or unexpected or wrong:
        raise ValueError(
            f"the sharded weights in {where} do not fit the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}, different shapes {wrong[:5]}"
        )
