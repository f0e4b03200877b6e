"""DDP with uneven inputs: ``join_uneven_inputs`` and ``trigger_sync_in_backward``.

With ``even_batches=False`` processes may get different numbers of batches; plain DDP then
hangs at the first backward a finished process no longer joins. Inside
``join_uneven_inputs`` the finished processes shadow the others' collectives
(``torch.distributed.algorithms.Join``), so every process leaves the loop.

Example::

    with accelerator.join_uneven_inputs([model], even_batches=False):
        for batch in loader:
            ...
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

from ..runtime.state import DistributedType

if TYPE_CHECKING:
    from ..data.loader import PreparedDataLoader
    from ..options.kwargs import DataLoaderConfiguration
    from ..runtime.state import ProcessState
    from ..strategies import Strategy


#: Types under which DDP joins processes that ran out of batches.
_JOINABLE_TYPES = (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


class UnevenInputsMixin:
    """Joining processes that ran out of batches (DDP)."""

    state: ProcessState
    strategy: Strategy
    _dataloaders: list[PreparedDataLoader]
    dataloader_config: DataLoaderConfiguration

    @contextlib.contextmanager
    def join_uneven_inputs(
        self, joinables: Sequence[Any], even_batches: bool | None = None
    ) -> Iterator[None]:
        """Let processes with fewer batches finish the loop under DDP.

        ``joinables``: the prepared (DDP) models, and any other
        ``torch.distributed.algorithms.Joinable`` such as a ``ZeroRedundancyOptimizer``.
        ``even_batches`` overrides the prepared map-style loaders' setting inside the block;
        joining is enabled when batches are uneven.
        """
        configured = self.dataloader_config.even_batches
        wanted = configured if even_batches is None else even_batches
        if self.state.num_processes == 1:
            yield
            return
        # The job's type as the state reports it (scripts may set it, as in Accelerate).
        kind = self.state.distributed_type
        if self.strategy.name != "ddp" or kind not in _JOINABLE_TYPES:
            if not wanted:
                raise ValueError(
                    f"join_uneven_inputs works with DDP; under {kind.value} a process that "
                    "runs out of batches would leave the others waiting in a collective. "
                    "Keep even_batches=True (the final global batch is completed instead)"
                )
            warnings.warn(
                "Joining uneven inputs is only supported for multi-GPU training and other DDP "
                f"jobs, as a result `join_uneven_inputs` will have no effect under {kind.value} "
                "(with even_batches=True every process gets the same number of batches)",
                stacklevel=3,
            )
            yield
            return
        from torch.distributed.algorithms import Join, Joinable

        unwrapped = [getattr(j, "_orig_mod", j) for j in joinables]
        for joinable in unwrapped:
            if not isinstance(joinable, Joinable):
                raise TypeError(
                    f"join_uneven_inputs takes prepared DDP models (or other Joinables); got "
                    f"{type(joinable).__name__}. A model that was not wrapped in DDP (frozen, "
                    "or a single process) has nothing to join"
                )
        restore = self._override_even_batches(even_batches)
        try:
            with Join(unwrapped, enable=not wanted, throw_on_early_termination=False):
                yield
        finally:
            for sampler, value in restore:
                sampler.even_batches = value

    def _override_even_batches(self, even_batches: bool | None) -> list[tuple[Any, bool]]:
        if even_batches is None:
            return []
        from ..data.samplers import ShardedBatchSampler  # loaded with the prepared loaders

        restore = []
        iterable_seen = False
        for loader in self._dataloaders:
            sampler = loader.shard
            if isinstance(sampler, ShardedBatchSampler):
                restore.append((sampler, sampler.even_batches))
                sampler.even_batches = even_batches
            else:
                iterable_seen = True
        if iterable_seen:
            warnings.warn(
                "Overriding even_batches is only supported for map-style datasets, yet some "
                "dataloaders given were iterable: they keep the setting they were prepared with",
                stacklevel=4,
            )
        return restore

    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model: nn.Module) -> Iterator[None]:
        """Synchronise ``model``'s gradients in the next backward even inside ``no_sync``
        (e.g. on the last micro-batch of a cycle you run by hand)."""
        from torch.nn.parallel import DistributedDataParallel

        ddp = getattr(model, "_orig_mod", model)
        if not isinstance(ddp, DistributedDataParallel):
            yield  # nothing synchronises gradients lazily outside DDP
            return
        saved = (ddp.require_backward_grad_sync, ddp.require_forward_param_sync)
        ddp.require_backward_grad_sync = ddp.require_forward_param_sync = True
        # The reducer decides at forward time whether backward reduces; re-arm it for a
        # forward that already ran inside no_sync.
        ddp.reducer.prepare_for_backward([])
        try:
            yield
        finally:
            ddp.require_backward_grad_sync, ddp.require_forward_param_sync = saved
