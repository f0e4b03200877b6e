"""The router's load-balancing loss over the global batch, as one process would compute it.

A mixture-of-experts model adds ``coef x num_experts x sum_e f_e x P_e`` to its loss, where
``f_e`` is the share of the batch's tokens routed to expert ``e`` and ``P_e`` the mean router
probability of ``e``: a product of two batch means, so the mean of per-process losses is
*not* the loss of the whole batch. Here each process hands the model's own loss function the
router logits of every process that holds other tokens (the data-parallel and
context-parallel ones), gathered: every process computes the same, global loss. In backward
each process keeps the gradient of its own rows, times the number of processes (the data-
parallel gradient average divides it again) — no communication, because every process's
loss uses the aux loss the same way.

transformers MoE models (Mixtral, Qwen2/3-MoE, OLMoE, gpt-oss, ...) compute it with a
module-level ``load_balancing_loss_func(gate_logits, num_experts, top_k, attention_mask)``;
:func:`install_global_aux_loss` wraps that function (the wrapper acts only inside the
forward of a model it was installed on). Models of your own call :func:`global_router_rows`
on their router logits before computing their aux loss.

Example::

    install_global_aux_loss(model, token_group)   # model(..., output_router_logits=True)
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

_FUNCTION = "load_balancing_loss_func"
_MARK = "_slipstream_global_batch"
#: The token groups of the models whose forward is running (innermost last).
_ACTIVE: list[Any] = []


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, sizes: list[int], group: Any) -> torch.Tensor:
        ctx.sizes, ctx.rank = sizes, dist.get_rank(group)
        width = max(sizes)
        padded = rows.new_zeros((width, *rows.shape[1:]))
        padded[: rows.shape[0]] = rows
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([part[:size] for part, size in zip(parts, sizes, strict=True)])

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        start = sum(ctx.sizes[: ctx.rank])
        own = gradient[start : start + ctx.sizes[ctx.rank]]
        return own * len(ctx.sizes), None, None


@torch.compiler.disable
def global_router_rows(
    rows: torch.Tensor | tuple[torch.Tensor, ...], group: Any
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """The rows (tokens) of ``rows`` from every process of ``group``, in process order:
    the global batch's router logits. Use the result only in a loss every process adds the
    same way (its gradient is scaled for the data-parallel average). A collective."""
    single = isinstance(rows, torch.Tensor)
    layers: tuple[torch.Tensor, ...] = (rows,) if isinstance(rows, torch.Tensor) else tuple(rows)
    if not layers or group is None or dist.get_world_size(group) == 1:
        return rows
    sizes = _sizes(layers[0].shape[0], layers[0].device, group)
    gathered = tuple(_GatherRows.apply(layer, sizes, group) for layer in layers)
    return gathered[0] if single else gathered


def _sizes(rows: int, device: torch.device, group: Any) -> list[int]:
    mine = torch.tensor([rows], device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return [int(t.item()) for t in every]


def _global_mask(mask: torch.Tensor | None, rows: int, device: torch.device, group: Any) -> Any:
    """Every process's padding mask, flattened and joined as one row ``[1, tokens]``
    (``None`` when no process has one)."""
    mine = torch.tensor([int(mask is not None)], device=device)
    flags = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(flags, mine, group=group)
    if not any(int(f.item()) for f in flags):
        return None
    flat = mask.reshape(-1) if mask is not None else torch.ones(rows, device=device)
    gathered = global_router_rows(flat.detach().float(), group)
    assert isinstance(gathered, torch.Tensor)
    return gathered.unsqueeze(0)


def _global_batch(function: Callable[..., Any]) -> Callable[..., Any]:
    parameters = list(inspect.signature(function).parameters)
    mask_at = parameters.index("attention_mask") if "attention_mask" in parameters else None

    def loss(gate_logits: Any, *args: Any, **kwargs: Any) -> Any:
        group = _ACTIVE[-1] if _ACTIVE else None
        if group is None or not isinstance(gate_logits, tuple) or not gate_logits:
            return function(gate_logits, *args, **kwargs)
        args_list = list(args)
        mask = kwargs.get("attention_mask")
        positional = mask_at is not None and len(args_list) >= mask_at
        if positional:
            mask = args_list[mask_at - 1]  # type: ignore[operator]
        first = gate_logits[0]
        mask = _global_mask(mask, first.shape[0], first.device, group)
        if positional:
            args_list[mask_at - 1] = mask  # type: ignore[operator]
        elif mask_at is not None:
            kwargs["attention_mask"] = mask
        return function(global_router_rows(gate_logits, group), *args_list, **kwargs)

    loss.__dict__[_MARK] = True
    loss.__wrapped__ = function  # type: ignore[attr-defined]
    return loss


def _defining_module(model: nn.Module) -> ModuleType | None:
    """The module of the model's class (or a base) that defines the aux-loss function."""
    for cls in type(model).__mro__:
        module = sys.modules.get(cls.__module__)
        function = getattr(module, _FUNCTION, None)
        if callable(function):
            names = list(inspect.signature(function).parameters)
            if names and names[0] == "gate_logits":
                return module
    return None


def install_global_aux_loss(model: nn.Module, group: Any) -> bool:
    """Make ``model``'s (transformers) load-balancing loss that of the global batch over
    ``group`` while its forward runs; ``False`` when the model has no such function."""
    module = _defining_module(model)
    if module is None or group is None or dist.get_world_size(group) == 1:
        return False
    function = getattr(module, _FUNCTION)
    if not getattr(function, _MARK, False):
        setattr(module, _FUNCTION, _global_batch(function))

    @torch.compiler.disable
    def enter(_: nn.Module, args: Any) -> None:
        _ACTIVE.append(group)

    @torch.compiler.disable
    def leave(_: nn.Module, args: Any, output: Any) -> None:
        if _ACTIVE:
            _ACTIVE.pop()

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)
    return True
