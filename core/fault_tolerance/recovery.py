"""What a rejoining replica group copies from a healthy peer: the model, the optimizers,
the schedulers, the RNGs, the position in the data and the semi-synchronous state, as
plain local tensors.

Each process of a group sends and receives only its own part (rank ``r`` of the healthy
group feeds rank ``r`` of the healing one), so sharded (FSDP2, TP) parameters travel as
their local shards and are put back into the same layout.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..checkpoint.rng import capture_rng_states, restore_rng_states
from ..runtime.tree import map_tensors


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a plain tensor as it is)."""
    inner = getattr(tensor, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else tensor


def _copy(tensor: Any) -> Any:
    return local(tensor).detach().clone()


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` as a copy of its local part."""
    state = {f"p:{name}": _copy(p) for name, p in model.named_parameters()}
    state.update({f"b:{name}": _copy(b) for name, b in model.named_buffers()})
    return state


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` (from :func:`model_state` of the same layout) into ``model``."""
    named: dict[str, torch.Tensor] = {f"p:{n}": p for n, p in model.named_parameters()}
    named.update({f"b:{n}": b for n, b in model.named_buffers()})
    missing = sorted(set(named) - set(state))
    if missing:
        raise RuntimeError(
            f"fault tolerance: the healthy peer's model lacks {missing[:3]}: every replica "
            "group must build the same model"
        )
    with torch.no_grad():
        for key, tensor in named.items():
            local(tensor).copy_(state[key])


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state dict with local copies of its tensors."""
    copied: dict[str, Any] = map_tensors(_copy, optimizer.state_dict())
    return copied


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load ``state`` (from :func:`optimizer_state`); state tensors of sharded parameters
    become DTensors of the parameter's layout again."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ids = [i for group in state["param_groups"] for i in group["params"]]
    by_id = dict(zip(ids, params, strict=False))
    rebuilt: dict[Any, dict[str, Any]] = {}
    for key, values in state["state"].items():
        param = by_id.get(key)
        mesh = getattr(param, "device_mesh", None)
        entry = {}
        for name, value in values.items():
            if (
                mesh is not None
                and param is not None
                and isinstance(value, torch.Tensor)
                and value.shape == local(param).shape
                and value.dim() > 0
            ):
                from torch.distributed.tensor import DTensor

                value = DTensor.from_local(
                    value,
                    mesh,
                    param.placements,
                    run_check=False,
                    shape=param.shape,
                    stride=param.stride(),
                )
            entry[name] = value
        rebuilt[key] = entry
    optimizer.load_state_dict({"state": rebuilt, "param_groups": state["param_groups"]})


def rng_state() -> dict[str, Any]:
    return capture_rng_states()


def load_rng_state(state: dict[str, Any]) -> None:
    restore_rng_states(state)


def group_state(group: Any) -> dict[str, Any]:
    """What a healthy peer hands a rejoining replica group: the prepared models,
    optimizers, schedulers, loaders' positions, RNGs, step count and the semi-synchronous
    state of ``group`` (its :class:`~slipstream.fault_tolerance.FaultTolerance`)."""
    steps = group.step_state.optimizer_steps if group.step_state is not None else 0
    semi = group.semi_sync
    return {
        "models": [model_state(m) for m in group.models],
        "optimizers": [optimizer_state(o.optimizer) for o in group.optimizers],
        "schedulers": [s.state_dict() for s in group.schedulers],
        "loaders": [loader.position() for loader in group.loaders],
        "rng": rng_state(),
        "optimizer_steps": steps,
        "replica_id": group.replica_id,
        "semi_sync": semi.state_dict() if semi is not None else None,
    }


def load_group_state(group: Any, state: dict[str, Any]) -> None:
    """Load what :func:`group_state` gave on the peer into ``group``."""
    counts = {
        "models": len(group.models),
        "optimizers": len(group.optimizers),
        "schedulers": len(group.schedulers),
        "loaders": len(group.loaders),
    }
    for key, count in counts.items():
        if len(state[key]) != count:
            raise RuntimeError(
                f"fault tolerance: the healthy peer prepared {len(state[key])} {key}, this "
                f"group {count}: every replica group must run the same script"
            )
    for model, saved in zip(group.models, state["models"], strict=True):
        load_model_state(model, saved)
    for optimizer, saved in zip(group.optimizers, state["optimizers"], strict=True):
        load_optimizer_state(optimizer.optimizer, saved)
    for scheduler, saved in zip(group.schedulers, state["schedulers"], strict=True):
        scheduler.load_state_dict(saved)
    for loader, position in zip(group.loaders, state["loaders"], strict=True):
        loader.load_position(position)
    load_rng_state(state["rng"])
    if group.step_state is not None:
        group.step_state.optimizer_steps = int(state["optimizer_steps"])
    if group.semi_sync is not None:
        group.semi_sync.load_state_dict(state["semi_sync"], step=False)
