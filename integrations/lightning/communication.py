"""Lightning's collective API (reduce, all_gather, broadcast, barrier) on slipstream's
collectives, and the evaluation-pass bookkeeping behind exact metrics.

``reduce`` and ``all_gather`` work over the data-parallel processes (all of them unless a
parallel layout puts several processes on the same samples); ``broadcast``, ``barrier`` and
``reduce_boolean_decision`` over every process.

Mixed into :class:`~slipstream.integrations.lightning.SlipstreamStrategy`; ``self.state`` is
the core :class:`~slipstream.runtime.state.ProcessState` once the process group is set up.

Example::

    trainer.strategy.all_gather(torch.tensor([rank]))      # shape (world_size, 1)
    trainer.strategy.reduce(loss, reduce_op="sum")
"""

from __future__ import annotations

from typing import Any

import torch

from slipstream.runtime import collectives
from slipstream.runtime.state import ProcessState

from .metrics import EvaluationPasses

_REDUCTIONS = {"sum": "sum", "mean": "mean", "avg": "mean", "max": "max", "min": "min"}


def core_reduction(reduce_op: Any) -> str:
    """Lightning's reduce_op (None, a string or a torch ReduceOp) as a core reduction.

    ``None`` means sum, as in Lightning's own DDP strategy.
    """
    if reduce_op is None:
        return "sum"
    name = reduce_op if isinstance(reduce_op, str) else str(reduce_op).rsplit(".", 1)[-1]
    try:
        return _REDUCTIONS[name.lower()]
    except KeyError:
        raise ValueError(
            f"SlipstreamStrategy.reduce supports sum, mean/avg, max and min, not {reduce_op!r}"
        ) from None


class CollectivesMixin:
    """Collectives through :mod:`slipstream.runtime.collectives` (no-ops before setup on one process)."""

    state: ProcessState | None
    passes: EvaluationPasses
    lightning_module: Any

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Reduce a tensor over the data-parallel processes (``self.log(..., sync_dist=True)``
        lands here); anything that is not a tensor is returned unchanged.

        Without a parallel layout these are all processes. Under tensor parallelism the
        processes of one group hold the same samples, so each share of the data counts once
        (a logged ``reduce_fx="sum"`` is not multiplied by the tensor-parallel size).
        """
        if not isinstance(tensor, torch.Tensor) or self.state is None:
            return tensor
        return collectives.reduce(tensor, core_reduction(reduce_op), state=self.state.data_parallel)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """``all``/``any`` of ``decision`` over every process (early stopping, checkpoint
        saving): a decision is taken by all processes together, tensor-parallel peers
        included, so it is not a data-parallel reduction."""
        if self.state is None or self.state.num_processes == 1:
            return bool(decision)
        votes = torch.tensor(int(decision), device=self.state.device)
        total = collectives.reduce(votes, "sum", state=self.state)
        return bool(total == self.state.num_processes) if all else bool(total)

    def all_gather(
        self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False
    ) -> torch.Tensor:
        """Every data-parallel process's ``tensor`` stacked: shape
        ``(data_parallel_size, *tensor.shape)`` (the world size without a parallel layout);
        with ``sync_grads`` gradients flow back to each process's input."""
        state = self.state.data_parallel if self.state is not None else None
        if state is None or state.num_processes == 1:
            return tensor.unsqueeze(0)
        if sync_grads:
            # Differentiable: the backward pass sums every process's gradient for a slot.
            import torch.distributed as dist
            from torch.distributed.nn.functional import all_gather

            where = state.group if state.group is not None else dist.group.WORLD
            return torch.stack(all_gather(tensor.contiguous(), group=where))
        gathered: torch.Tensor = collectives.gather(tensor.unsqueeze(0), state=state)
        return gathered

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self.state is None or self.state.num_processes == 1:
            return obj
        return collectives.broadcast_object_list([obj], from_process=src, state=self.state)[0]

    def barrier(self, name: str | None = None) -> None:
        if self.state is not None:
            self.state.wait_for_everyone()

    # -- evaluation passes (exact metrics) ---------------------------------------------------------
    def batch_to_device(
        self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0
    ) -> Any:
        # The loops tell the strategy which dataloader each batch comes from.
        self.passes.dataloader_idx = dataloader_idx
        return super().batch_to_device(batch, device, dataloader_idx)  # type: ignore[misc]

    def on_validation_start(self) -> None:
        self.passes.start(self.lightning_module.trainer)

    def on_test_start(self) -> None:
        self.passes.start(self.lightning_module.trainer)

    def on_validation_end(self) -> None:
        self.passes.stop()

    def on_test_end(self) -> None:
        self.passes.stop()
