"""Gradient norms over parameters split across several mesh dimensions.

Under FSDP over tensor parallelism the gradients are DTensors on different meshes: split
layers live on (dp_shard, tp), the rest on (dp_shard) alone. torch's ``clip_grad_norm_``
stacks all per-parameter norms into one tensor and fails when the meshes differ; here the
norms are combined per (mesh, placements) group, each group's total is made whole with one
collective, and the groups are combined as plain numbers. The result equals the norm of
the full, unsplit gradients.

Example::

    norm = clip_grad_norm_(model.parameters(), max_norm=1.0)   # the 1-process norm
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def total_norm(gradients: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The ``norm_type`` norm of all ``gradients`` together, as a plain tensor."""
    from torch.distributed.tensor import DTensor

    if not gradients:
        return torch.tensor(0.0)
    groups: dict[Any, list[torch.Tensor]] = {}
    for gradient in gradients:
        key = (
            (gradient.device_mesh, tuple(gradient.placements), gradient.device)
            if isinstance(gradient, DTensor)
            else (None, None, gradient.device)
        )
        groups.setdefault(key, []).append(gradient)
    parts = []
    for members in groups.values():
        norms = torch._foreach_norm(members, norm_type)
        part = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        if isinstance(part, DTensor):
            part = part.full_tensor()  # one collective per group
        parts.append(part)
    device = _local(gradients[0]).device
    return torch.linalg.vector_norm(torch.stack([p.to(device) for p in parts]), norm_type)


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm``; returns the norm."""
    gradients = [p.grad for p in parameters if p.grad is not None]
    norm = total_norm(gradients, float(norm_type))
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for gradient in gradients:
        local = _local(gradient)
        by_device.setdefault(local.device, []).append(local)
    for device, tensors in by_device.items():
        torch._foreach_mul_(tensors, coefficient.to(device))
    return norm
