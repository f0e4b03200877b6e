"""Exact torchmetrics under the Lightning adapter.

Lightning's ``DistributedSampler`` evens out an evaluation set of N samples by repeating its
first indices, then process r takes every world-th index from r on: its *real* samples are
the first ``len(range(r, N, world))`` it sees in a pass; the rest are duplicates that plain
torchmetrics would count twice. The strategy attaches to every torchmetrics ``Metric`` of
the LightningModule

* slipstream's sync function (:func:`slipstream.integrations.torchmetrics.gather_all_tensors`,
  which handles unequal shapes), and
* an ``update`` wrapper that counts the samples of the current validation/test pass and
  drops those beyond this process's real count,

so ``self.log("val_acc", self.val_acc)`` gives the single-process value exactly.

Example::

    class Model(LightningModule):
        def __init__(self):
            super().__init__()
            self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=4)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.val_acc.update(self(x), y)          # duplicates are dropped here
            self.log("val_acc", self.val_acc)
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
from torch.utils.data import DistributedSampler

from slipstream.runtime.state import ProcessState

_ATTACHED = "_slipstream_lightning_exact"


def real_samples(loader: Any) -> int | None:
    """How many of the samples ``loader`` yields on this process are not duplicates, or None
    when the loader does not shard with a padding ``DistributedSampler``."""
    sampler = getattr(loader, "sampler", None)
    if not isinstance(sampler, DistributedSampler):
        sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    if not isinstance(sampler, DistributedSampler) or sampler.drop_last:
        return None
    try:
        total = len(sampler.dataset)  # type: ignore[arg-type]
    except TypeError:
        return None
    return len(range(sampler.rank, total, sampler.num_replicas))


class EvaluationPasses:
    """Which evaluation pass is running and how many samples each metric has seen in it."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.active = False
        self.dataloader_idx = 0
        self._seen: dict[tuple[int, int], int] = {}
        self._real: dict[int, int | None] = {}

    def start(self, trainer: Any) -> None:
        """A validation or test pass begins: counting starts from zero."""
        self.trainer = trainer
        self.active = True
        self.dataloader_idx = 0
        self._seen.clear()
        self._real.clear()

    def stop(self) -> None:
        self.active = False

    def _loaders(self) -> list[Any]:
        trainer = self.trainer
        loop = getattr(trainer, "_evaluation_loop", None)
        combined = getattr(loop, "_combined_loader", None)
        if combined is not None:
            return list(combined.flattened)
        loaders = trainer.test_dataloaders if trainer.testing else trainer.val_dataloaders
        if loaders is None:
            return []
        return list(loaders) if isinstance(loaders, (list, tuple)) else [loaders]

    def real(self) -> int | None:
        """This process's real sample count in the current dataloader, None if unknown."""
        index = self.dataloader_idx
        if index not in self._real:
            loaders = self._loaders() if self.trainer is not None else []
            self._real[index] = real_samples(loaders[index]) if index < len(loaders) else None
        return self._real[index]

    def keep(self, metric: Any, rows: int) -> int:
        """How many of ``rows`` new samples for ``metric`` are real; records them as seen."""
        if not self.active:
            return rows
        real = self.real()
        if real is None:
            return rows
        key = (id(metric), self.dataloader_idx)
        seen = self._seen.get(key, 0)
        self._seen[key] = seen + rows
        return max(0, min(rows, real - seen))


def _batch_rows(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.ndim > 0:
            return int(value.shape[0])
    return None


def _trim(value: Any, rows: int, keep: int) -> Any:
    if isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape[0] == rows:
        return value[:keep]
    return value


def _exact_update(
    passes: EvaluationPasses, metric: Any, update: Any, *args: Any, **kwargs: Any
) -> Any:
    rows = _batch_rows(args, kwargs)
    if rows is None:
        return update(*args, **kwargs)
    keep = passes.keep(metric, rows)
    if keep == rows:
        return update(*args, **kwargs)
    if keep == 0:
        return None  # this whole batch repeats samples another process already has
    args = tuple(_trim(a, rows, keep) for a in args)
    kwargs = {k: _trim(v, rows, keep) for k, v in kwargs.items()}
    return update(*args, **kwargs)


def attach_exact_metrics(module: torch.nn.Module, state: ProcessState, passes: Any) -> int:
    """Give every torchmetrics Metric inside ``module`` slipstream's sync and the duplicate
    filter; returns how many metrics were attached (0 when torchmetrics is not in use)."""
    torchmetrics = sys.modules.get("torchmetrics")
    if torchmetrics is None:  # no metric can exist without torchmetrics imported
        return 0
    from slipstream.integrations.torchmetrics import gather_all_tensors

    attached = 0
    for metric in module.modules():
        if not isinstance(metric, torchmetrics.Metric) or getattr(metric, _ATTACHED, False):
            continue
        metric.dist_sync_fn = functools.partial(gather_all_tensors, state=state)
        metric.distributed_available_fn = lambda: state.num_processes > 1
        metric.update = functools.partial(_exact_update, passes, metric, metric.update)
        object.__setattr__(metric, _ATTACHED, True)
        attached += 1
    return attached
