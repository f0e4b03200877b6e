"""Moving tokens to their experts and back: ``all_to_all`` with variable split sizes over the
expert-parallel processes.

Each process sorts its (token, chosen expert) pairs by expert. The experts are spread in
contiguous blocks (process ``r`` holds experts ``r*L .. r*L+L-1``), so the sorted pairs are
also grouped by the process that holds their expert: one exchange of the counts tells every
process how many rows it will receive from each other process and for which of its experts,
one ``all_to_all`` moves the rows, and a second one (after the experts ran) brings the
results back, where they are put back in the original order and weighted by the router's
weights. The backward pass runs the same exchanges in reverse.

Example::

    routed, back = dispatch(hidden, top_k_index, num_experts=8, group=ep_group)
    outputs = run_my_experts(routed.tokens, routed.expert)       # [rows, hidden]
    hidden_out = combine(outputs, back, top_k_weights)           # [tokens, hidden]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with variable split sizes, differentiable (the
    gradient goes back by the reverse exchange)."""

    @staticmethod
    def forward(
        ctx: Any, rows: torch.Tensor, receive: list[int], send: list[int], group: Any
    ) -> torch.Tensor:
        ctx.receive, ctx.send, ctx.group = receive, send, group
        output = rows.new_empty((sum(receive), *rows.shape[1:]))
        dist.all_to_all_single(output, rows.contiguous(), receive, send, group=group)
        return output

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        back = gradient.new_empty((sum(ctx.send), *gradient.shape[1:]))
        dist.all_to_all_single(back, gradient.contiguous(), ctx.send, ctx.receive, group=ctx.group)
        return back, None, None, None


def exchange(rows: torch.Tensor, receive: list[int], send: list[int], group: Any) -> torch.Tensor:
    """Send ``send[i]`` rows (in order) to process ``i`` of ``group`` and receive
    ``receive[i]`` from it; differentiable."""
    result = _AllToAll.apply(rows, receive, send, group)
    assert isinstance(result, torch.Tensor)
    return result


@dataclass
class Routed:
    """The rows this process received for its experts."""

    tokens: torch.Tensor  # [rows, hidden], grouped by source process, then by expert
    expert: torch.Tensor  # [rows] the local expert (0 .. local - 1) of each row
    per_expert: list[int]  # rows for each local expert


@dataclass
class Return:
    """What :func:`combine` needs to bring the experts' outputs home."""

    order: torch.Tensor  # the (token, slot) pairs in the order they were sent
    send: list[int]
    receive: list[int]
    group: Any


def local_counts(top_k_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many of this process's (token, slot) pairs chose each expert: ``[num_experts]``."""
    return torch.bincount(top_k_index.reshape(-1), minlength=num_experts)


def dispatch(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    num_experts: int,
    group: Any,
    counts: torch.Tensor | None = None,
) -> tuple[Routed, Return]:
    """Send each (token, chosen expert) pair's hidden state to the process holding that
    expert. ``counts``: :func:`local_counts`, when already computed."""
    processes = dist.get_world_size(group)
    local = num_experts // processes
    slots = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sent = hidden[order // slots]
    if counts is None:
        counts = local_counts(top_k_index, num_experts)
    send_counts = counts.view(processes, local)
    receive_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(receive_counts, send_counts, group=group)
    # The one host synchronisation of the layer: split sizes must be known on the host.
    sizes = torch.stack([send_counts.sum(1), receive_counts.sum(1)]).tolist()
    send, receive = [int(s) for s in sizes[0]], [int(s) for s in sizes[1]]
    tokens = exchange(sent, receive, send, group)
    per_source = receive_counts.reshape(-1)
    expert = torch.arange(local, device=hidden.device).repeat(processes)
    expert = expert.repeat_interleave(per_source, output_size=tokens.shape[0])
    per_expert = [int(c) for c in receive_counts.sum(0).tolist()]
    return Routed(tokens, expert, per_expert), Return(order, send, receive, group)


def combine(outputs: torch.Tensor, back: Return, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' outputs back to the processes that sent the tokens, in the original
    (token, slot) order, weighted by the router and summed over the slots."""
    returned = exchange(outputs, back.send, back.receive, back.group)
    inverse = torch.empty_like(back.order)
    inverse[back.order] = torch.arange(back.order.numel(), device=back.order.device)
    pairs = returned[inverse].view(*top_k_weights.shape, outputs.shape[-1])
    return (pairs * top_k_weights.unsqueeze(-1)).sum(dim=1)
