"""This process's memory as Linux reports it, and the bytes a model's tensors hold.

Example::

    reset_high_water_mark()
    train_step()
    peak = status_mb("VmHWM")
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def status_mb(field: str) -> float:
    """A ``/proc/self/status`` field (``VmRSS``, ``VmHWM``) in MiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def reset_high_water_mark() -> None:
    """Start ``VmHWM`` again from the current resident size."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the storages behind ``tensors``' local parts, each storage once: a view into
    a larger buffer (FSDP2's padded shards, DDP's bucket views) counts the whole buffer."""
    from torch.distributed.tensor import DTensor

    storages: dict[int, int] = {}
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def tensor_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of this process's parameters, gradients and optimizer state."""
    parameters = list(model.parameters())
    state = [
        value
        for per_parameter in optimizer.state.values()
        for value in per_parameter.values()
        if isinstance(value, torch.Tensor)
    ]
    return {
        "parameters": storage_bytes(parameters),
        "gradients": storage_bytes([p.grad for p in parameters if p.grad is not None]),
        "optimizer": storage_bytes(state),
    }
