"""Collectives over nested structures of tensors, on the current (or a given) ProcessState.

Every function is a no-op on a single process and must be called by every process. In debug
mode each call first checks that all ranks agree (see :mod:`slipstream.runtime.debug`).

Example::

    losses = gather(loss.detach())              # shape (num_processes,)
    preds = pad_across_processes(preds, dim=1)  # equal lengths before gathering
    mean = reduce(metric, reduction="mean")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from . import xla
from .debug import collective, verify_collective
from .state import ProcessState, current_state
from .tree import map_structure, map_tensors, replace_tensors, tensor_leaves

__all__ = [
    "broadcast",
    "broadcast_object_list",
    "copy_tensor_to_devices",
    "gather",
    "gather_object",
    "pad_across_processes",
    "reduce",
]

# torch 2.13 renamed all_gather_into_tensor to all_gather_single; keep older torch working.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _state(state: ProcessState | None) -> ProcessState:
    return state if state is not None else current_state()


def _gather_tensor(tensor: torch.Tensor, state: ProcessState) -> torch.Tensor:
    if tensor.ndim == 0:
        tensor = tensor.reshape(1)
    # The gathered values carry no autograd history (as Accelerate's); gathering a tensor
    # that requires grad would otherwise fail inside the in-place collective.
    tensor = tensor.detach().contiguous()
    if state.backend == "xla":  # several XLA processes: torch_xla's own all_gather
        return xla.all_gather(tensor)
    output = torch.empty(
        (state.num_processes * tensor.shape[0], *tensor.shape[1:]),
        dtype=tensor.dtype,
        device=tensor.device,
    )
    _all_gather_single(output, tensor, group=state.group)
    return output


def _only_tensors(data: Any, operation: str) -> None:
    """Reject non-tensor leaves: they cannot be gathered and would silently stay local."""

    def check(value: Any) -> None:
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{operation} gathers tensors, but the data holds a {type(value).__name__} "
                f"({value!r:.40}); gather other values with gather_object (or "
                "gather_for_metrics(..., use_gather_object=True))"
            )

    def is_leaf(value: Any) -> bool:
        if isinstance(value, (list, tuple, Mapping)):
            return False
        return not (dataclasses.is_dataclass(value) and not isinstance(value, type))

    map_structure(check, data, is_leaf)


@collective("gather")
def gather(data: Any, *, state: ProcessState | None = None) -> Any:
    """Concatenate every process's tensors along dim 0 (scalars become shape ``(P,)``).

    All processes must pass the same structure with equal shapes; use
    :func:`pad_across_processes` first when lengths differ.
    """
    _only_tensors(data, "gather")
    state = _state(state)
    if state.num_processes == 1:
        return map_tensors(lambda t: t.reshape(1) if t.ndim == 0 else t, data)
    verify_collective(state, "gather", data)
    return map_tensors(lambda t: _gather_tensor(t, state), data)


@collective("gather")
def gather_uneven(data: Any, *, state: ProcessState | None = None) -> Any:
    """Like :func:`gather` but each process may contribute a different length along dim 0."""
    _only_tensors(data, "gather")
    state = _state(state)
    if state.num_processes == 1:
        return gather(data, state=state)
    tensors = [t.reshape(1) if t.ndim == 0 else t for t in tensor_leaves(data)]
    if not tensors:
        return data
    verify_collective(state, "gather", data, free_dim=0)
    device = tensors[0].device
    lengths = torch.tensor([t.shape[0] for t in tensors], dtype=torch.int64, device=device)
    all_lengths = _gather_tensor(lengths, state).view(state.num_processes, -1)
    gathered = []
    for i, tensor in enumerate(tensors):
        per_rank = all_lengths[:, i].tolist()
        longest = max(per_rank)
        if longest == 0:
            gathered.append(tensor)
            continue
        padded = _pad_dim(tensor, 0, longest, 0, pad_first=False)
        everyone = _gather_tensor(padded, state).split(longest)
        gathered.append(torch.cat([part[:n] for part, n in zip(everyone, per_rank, strict=True)]))
    return replace_tensors(data, gathered)


@collective("gather_object")
def gather_object(obj: Any, *, state: ProcessState | None = None) -> list[Any]:
    """Collect a picklable object from every process.

    A list or tuple contributes its items (the result is one flat list); any other object
    contributes itself, giving a list of ``num_processes`` objects.
    """
    state = _state(state)
    if state.num_processes == 1:
        return list(obj) if isinstance(obj, (list, tuple)) else [obj]
    verify_collective(state, "gather_object", compare_data=False)
    everyone: list[Any] = [None] * state.num_processes
    if state.backend == "xla":
        everyone = xla.gather_objects("slipstream.gather_object", obj)
    else:
        dist.all_gather_object(everyone, obj, group=state.group)
    if isinstance(obj, (list, tuple)):
        return [item for part in everyone for item in part]
    return everyone


def _pad_dim(
    tensor: torch.Tensor, dim: int, size: int, pad_index: Any, pad_first: bool
) -> torch.Tensor:
    if tensor.shape[dim] == size:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = size
    padded = tensor.new_full(shape, pad_index)
    length = tensor.shape[dim]
    start = size - length if pad_first else 0
    padded.narrow(dim, start, length).copy_(tensor)
    return padded


@collective("pad_across_processes")
def pad_across_processes(
    data: Any,
    dim: int = 0,
    pad_index: Any = 0,
    pad_first: bool = False,
    *,
    state: ProcessState | None = None,
) -> Any:
    """Pad each tensor along ``dim`` to the largest size any process has.

    Padding uses ``pad_index`` and goes at the end (or the start with ``pad_first``), so the
    results can then be passed to :func:`gather`.
    """
    state = _state(state)
    if state.num_processes == 1:
        return data
    tensors = tensor_leaves(data)
    if not tensors:
        return data
    for tensor in tensors:
        if tensor.ndim == 0 or not -tensor.ndim <= dim < tensor.ndim:
            raise ValueError(
                f"pad_across_processes(dim={dim}) needs tensors with that dimension; got a "
                f"tensor of shape {tuple(tensor.shape)}"
            )
    verify_collective(state, "pad_across_processes", data, free_dim=dim, dim=dim)
    sizes = torch.tensor(
        [t.shape[dim] for t in tensors], dtype=torch.int64, device=tensors[0].device
    )
    largest = _gather_tensor(sizes, state).view(state.num_processes, -1).amax(0)
    padded = [
        _pad_dim(t, dim, int(n), pad_index, pad_first)
        for t, n in zip(tensors, largest.tolist(), strict=True)
    ]
    return replace_tensors(data, padded)


@collective("reduce")
def reduce(
    data: Any,
    reduction: str = "mean",
    scale: float = 1.0,
    *,
    state: ProcessState | None = None,
) -> Any:
    """Sum (``"sum"``), average (``"mean"``), ``"max"`` or ``"min"`` tensors over processes,
    then multiply by ``scale``.

    Returns new tensors; the inputs are left unchanged. Averaging integer tensors gives
    floating-point results; boolean tensors are rejected (use an integer dtype to count).
    """
    operations = {
        "sum": dist.ReduceOp.SUM,
        "mean": dist.ReduceOp.SUM,
        "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN,
    }
    if reduction not in operations:
        raise ValueError(f"reduction must be 'sum', 'mean', 'max' or 'min', got {reduction!r}")
    state = _state(state)
    world = state.num_processes
    verify_collective(state, "reduce", data, reduction=reduction)

    def one(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype == torch.bool:
            raise TypeError("reduce() of a bool tensor is ambiguous; convert it to int first")
        result = tensor.clone()
        if world > 1 and state.backend == "xla":
            result = xla.all_reduce(result, "sum" if reduction == "mean" else reduction)
        elif world > 1:
            dist.all_reduce(result, op=operations[reduction], group=state.group)
        if reduction == "mean":
            result = result / world
        return result * scale if scale != 1.0 else result

    return map_tensors(one, data)


@collective("broadcast")
def broadcast(data: Any, from_process: int = 0, *, state: ProcessState | None = None) -> Any:
    """Overwrite every process's tensors with those of ``from_process`` (in place)."""
    state = _state(state)
    if state.num_processes == 1:
        return data
    _check_source(from_process, state)
    verify_collective(state, "broadcast", data, from_process=from_process)

    source = state.global_rank(from_process)

    def one(tensor: torch.Tensor) -> torch.Tensor:
        if state.backend == "xla":
            return xla.broadcast(tensor, from_process)
        dist.broadcast(tensor, src=source, group=state.group)
        return tensor

    return map_tensors(one, data)


@collective("broadcast_object_list")
def broadcast_object_list(
    objects: list[Any], from_process: int = 0, *, state: ProcessState | None = None
) -> list[Any]:
    """Replace the items of ``objects`` on every process with those of ``from_process``."""
    state = _state(state)
    if state.num_processes == 1:
        return objects
    _check_source(from_process, state)
    verify_collective(
        state,
        "broadcast_object_list",
        compare_data=False,
        length=len(objects),
        from_process=from_process,
    )
    if state.backend == "xla":
        mine = list(objects) if state.process_index == from_process else None
        objects[:] = xla.gather_objects("slipstream.broadcast_object_list", mine)[from_process]
        return objects
    dist.broadcast_object_list(objects, src=state.global_rank(from_process), group=state.group)
    return objects


@collective("copy_tensor_to_devices")
def copy_tensor_to_devices(
    tensor: torch.Tensor | None = None, *, state: ProcessState | None = None
) -> torch.Tensor:
    """The tensor that one process holds, on every process: the others pass ``None`` and
    need not know its shape or dtype (unlike :func:`broadcast`).

    Example::

        table = build_table() if accelerator.is_main_process else None
        table = copy_tensor_to_devices(table)
    """
    state = _state(state)
    owners = gather_object(
        [(tuple(tensor.shape), tensor.dtype) if tensor is not None else None], state=state
    )
    held = [i for i, entry in enumerate(owners) if entry is not None]
    if len(held) != 1:
        raise ValueError(
            "copy_tensor_to_devices needs the tensor on exactly one process (None on the "
            f"others); processes {held or 'none'} passed one"
        )
    shape, dtype = owners[held[0]]
    if tensor is None:
        tensor = torch.empty(shape, dtype=dtype, device=state.device)
    return broadcast(tensor.to(state.device).contiguous(), held[0], state=state)


def _check_source(from_process: int, state: ProcessState) -> None:
    if not 0 <= from_process < state.num_processes:
        raise ValueError(
            f"from_process={from_process} is not a process index (0..{state.num_processes - 1})"
        )
