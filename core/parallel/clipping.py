"""Gradient norms over parameters split across several mesh dimensions.

Under FSDP over tensor parallelism the gradients are DTensors on different meshes: split
layers live on (dp_shard, tp), the rest on (dp_shard) alone, and some processes hold
copies of the same shard. torch's ``clip_grad_norm_`` stacks all per-parameter norms and
fails when the meshes differ; reducing each DTensor norm on its own mesh costs a collective
per group. Here every process adds up its local shards' ``|g|^p``, each divided by how many
processes hold a copy of that shard, and one all-reduce over all processes gives the norm of
the full, unsplit gradients.

Example::

    norm = clip_grad_norm_(model.parameters(), max_norm=1.0)   # the 1-process norm
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

# (mesh, placements, holders) -> processes holding one copy of a local shard.
_COPIES: dict[tuple[Any, ...], int] = {}


def _copies(gradient: Any, holders: int) -> int:
    key = (gradient.device_mesh, tuple(gradient.placements), holders)
    copies = _COPIES.get(key)
    if copies is None:
        mesh = gradient.device_mesh
        copies = max(1, holders // mesh.size())  # processes outside the mesh hold the same
        for dim, placement in enumerate(gradient.placements):
            if placement.is_replicate():
                copies *= mesh.size(dim)
        _COPIES[key] = copies
    return copies


def _local_parts(
    gradients: list[torch.Tensor], holders: list[int]
) -> tuple[list[torch.Tensor], list[int]]:
    """Each gradient's local part to measure and how many processes hold that part."""
    from torch.distributed.tensor import DTensor, Replicate

    parts, copies = [], []
    for gradient, holding in zip(gradients, holders, strict=True):
        if not isinstance(gradient, DTensor):
            parts.append(gradient)
            copies.append(holding)
            continue
        if any(p.is_partial() for p in gradient.placements):
            # Partial sums (a norm's weight under sequence parallelism): add them up first.
            gradient = gradient.redistribute(
                placements=[Replicate() if p.is_partial() else p for p in gradient.placements]
            )
        parts.append(gradient._local_tensor)
        copies.append(_copies(gradient, holding))
    return parts, copies


def _reduce(
    parts: list[torch.Tensor], copies: list[int], norm_type: float, group: Any
) -> torch.Tensor:
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    device = parts[0].device if parts else torch.device("cpu")
    norms = list(torch._foreach_norm(parts, norm_type)) if parts else []
    if len({n.device for n in norms}) > 1:
        norms = [n.to(device) for n in norms]
    if math.isinf(norm_type):
        total = torch.stack(norms).max().double() if norms else torch.zeros((), device=device)
        if distributed:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        return total.float()
    if norms:
        stacked = torch.stack(norms).double()
        powers = stacked.square() if norm_type == 2.0 else stacked**norm_type
        if len(set(copies)) == 1:  # the common case: one division, no weights tensor
            total = powers.sum() / copies[0] if copies[0] != 1 else powers.sum()
        else:
            weights = torch.tensor([1.0 / c for c in copies], dtype=torch.float64, device=device)
            total = (powers * weights).sum()
    else:
        total = torch.zeros((), dtype=torch.float64, device=device)
    if distributed:
        dist.all_reduce(total, group=group)
    return (total.sqrt() if norm_type == 2.0 else total ** (1.0 / norm_type)).float()


def total_norm(
    gradients: list[torch.Tensor],
    norm_type: float = 2.0,
    *,
    holders: int | None = None,
    group: Any = None,
    each: Sequence[int | None] | None = None,
) -> torch.Tensor:
    """The ``norm_type`` norm of all ``gradients`` of all processes together.

    ``holders``: how many processes hold the same set of parameters (all of them, except
    under pipeline parallelism, where each stage's processes hold their own); ``each``:
    that number per gradient where it differs (``None`` entries: ``holders``) — e.g.
    experts kept whole by some processes only; ``group``: the processes to reduce over
    (default: all). A collective when there are several processes: every process must
    call it.
    """
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    default = holders or world
    counts = [c or default for c in each] if each is not None else [default] * len(gradients)
    parts, copies = _local_parts(gradients, counts)
    return _reduce(parts, copies, float(norm_type), group)


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    holders: int | None = None,
    holders_of: Mapping[int, int] | None = None,
) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm``; returns the norm.
    ``holders_of``: ``id(parameter)`` -> processes holding it, where not ``holders``."""
    from torch.distributed.tensor import DTensor

    held = [p for p in parameters if p.grad is not None]
    gradients = [p.grad for p in held if p.grad is not None]
    each = [holders_of.get(id(p)) for p in held] if holders_of else None
    norm = total_norm(gradients, norm_type, holders=holders, each=each)
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for gradient in gradients:
        local = gradient._local_tensor if isinstance(gradient, DTensor) else gradient
        by_device.setdefault(local.device, []).append(local)
    for device, tensors in by_device.items():
        torch._foreach_mul_(tensors, coefficient.to(device))
    return norm
