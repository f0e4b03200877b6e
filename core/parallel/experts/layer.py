"""Expert parallelism on one experts module: keep this process's experts, run them on the
tokens the other processes send.

:class:`ExpertParallel` splits the experts (stacked parameters become DTensors sharded along
the experts on the ``ep`` mesh; a ModuleList keeps only this process's experts, under their
own indices, so names stay those of the whole model), and replaces the module's forward:
dispatch the (token, expert) pairs with ``all_to_all``, run the local experts grouped per
expert — stacked experts through the module's own forward (transformers' grouped matmul
when its ``experts_implementation`` is ``grouped_mm``), listed experts one after another —
and combine the results in the original order, weighted as the router chose. It also counts
the tokens each expert received, for :func:`~slipstream.parallel.experts.load.expert_load`.

Example::

    ExpertParallel(resolve_experts(model, None, ep=2)[0], ep_mesh).install()
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .dispatch import Routed, combine, dispatch, local_counts
from .plan import ExpertsModule

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: The attribute an expert-parallel experts module carries its ExpertParallel under.
ATTRIBUTE = "_slipstream_expert_parallel"


def expert_parallel_of(module: nn.Module) -> ExpertParallel | None:
    """The :class:`ExpertParallel` installed on ``module``, if any."""
    found = module.__dict__.get(ATTRIBUTE)
    return found if isinstance(found, ExpertParallel) else None


def _in_backward() -> bool:
    # Activation checkpointing runs forwards again inside backward; those are not new tokens.
    return bool(torch._C._current_graph_task_id() != -1)


class ExpertParallel:
    """One experts module split over the ``ep`` processes of ``ep_mesh``."""

    def __init__(self, entry: ExpertsModule, ep_mesh: DeviceMesh) -> None:
        self.entry = entry
        self.module = entry.module
        self.mesh = ep_mesh
        self.group = ep_mesh.get_group()
        self.processes = ep_mesh.size()
        self.local = entry.num_experts // self.processes
        self.first = ep_mesh.get_local_rank() * self.local
        self.original: Callable[..., Any] = entry.module.forward
        #: Tokens routed to each expert (of the whole model) since the last reading.
        self.tokens: torch.Tensor | None = None

    @property
    def name(self) -> str:
        return self.entry.name

    # -- splitting ------------------------------------------------------------------------
    def install(self) -> None:
        """Keep this process's experts and route the module's calls through them."""
        if expert_parallel_of(self.module) is not None:
            raise ValueError(f"{self.name} is already split over expert-parallel processes")
        if self.entry.listed is not None:
            self._keep_listed()
        else:
            self._shard_stacked()
        self.module.__dict__[ATTRIBUTE] = self
        self.module.forward = torch.compiler.disable(self.forward)

    def _shard_stacked(self) -> None:
        from torch.distributed.tensor import DTensor, Shard

        for name in self.entry.stacked:
            weight = self.module._parameters[name]
            assert weight is not None
            part = weight.detach()[self.first : self.first + self.local].clone()
            split = DTensor.from_local(part, self.mesh, [Shard(0)], run_check=False)
            self.module._parameters[name] = nn.Parameter(split, weight.requires_grad)

    def _keep_listed(self) -> None:
        # Entries are dropped from the ModuleList's own table: the kept experts keep their
        # indices, so parameter names (and checkpoints) are those of the whole model.
        experts = self.entry.experts_list
        keep = {str(i) for i in range(self.first, self.first + self.local)}
        for key in list(experts._modules):
            if key not in keep:
                del experts._modules[key]

    def local_experts(self) -> list[nn.Module]:
        experts = self.entry.experts_list
        found = [experts._modules[str(self.first + i)] for i in range(self.local)]
        return [m for m in found if m is not None]

    # -- forward ------------------------------------------------------------------------
    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        counts = local_counts(top_k_index, self.entry.num_experts)
        if not _in_backward():
            with torch.no_grad():
                self.tokens = counts.detach() + (self.tokens if self.tokens is not None else 0)
        routed, back = dispatch(
            hidden_states, top_k_index, self.entry.num_experts, self.group, counts
        )
        if self.entry.listed is not None:
            outputs = self._run_listed(routed)
        else:
            outputs = self._run_stacked(routed)
        return combine(outputs, back, top_k_weights).to(hidden_states.dtype)

    def _run_listed(self, routed: Routed) -> torch.Tensor:
        order = torch.argsort(routed.expert, stable=True)
        grouped = routed.tokens[order].split(routed.per_expert)
        # Every local expert runs, also on no rows: its weights then get zero gradients, so
        # FSDP reduces the same tensors on every process.
        outputs = torch.cat(
            [e(rows) for e, rows in zip(self.local_experts(), grouped, strict=True)]
        )
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return outputs[inverse]

    def _run_stacked(self, routed: Routed) -> torch.Tensor:
        rows = routed.tokens
        with self._local_weights() as weights:
            outputs = self.original(
                rows, routed.expert.unsqueeze(-1), rows.new_ones((rows.shape[0], 1))
            )
            if rows.shape[0] == 0:
                # No rows here: keep the weights in the graph (zero gradients) so that the
                # gradient reduction over the expert's shards sees the same tensors everywhere.
                outputs = outputs + sum(w.sum() for w in weights) * 0
        return outputs

    @contextlib.contextmanager
    def _local_weights(self) -> Iterator[list[torch.Tensor]]:
        """The module's stacked weights as this process's plain tensors (and its
        ``num_experts`` the local count) while its own forward runs."""
        from torch.distributed.tensor import DTensor

        module = self.module
        saved = {name: module._parameters[name] for name in self.entry.stacked}
        local = {
            name: w.to_local() if isinstance(w, DTensor) else w
            for name, w in saved.items()
            if w is not None
        }
        count = module.__dict__.get("num_experts")
        module._parameters.update(local)  # type: ignore[arg-type]
        if isinstance(count, int):
            module.__dict__["num_experts"] = self.local
        try:
            yield list(local.values())
        finally:
            module._parameters.update(saved)
            if isinstance(count, int):
                module.__dict__["num_experts"] = count

    # -- statistics ---------------------------------------------------------------------
    def take_tokens(self) -> torch.Tensor:
        """Tokens per expert counted here since the last call (``[num_experts]``), reset."""
        tokens = self.tokens
        self.tokens = None
        if tokens is None:  # no forward since: zeros where the counts would be
            device = next(self.module.parameters()).device
            return torch.zeros(self.entry.num_experts, dtype=torch.long, device=device)
        return tokens
