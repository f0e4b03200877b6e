"""The metric adapter: sync functions wired to the core and tail de-duplication."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

from slipstream.data import ActiveLoaders, PreparedDataLoader
from slipstream.runtime import collectives
from slipstream.runtime.state import ProcessState, current_state

try:
    import torchmetrics
except ImportError as error:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(
        "slipstream.integrations.torchmetrics needs torchmetrics: "
        "pip install 'slipstream[torchmetrics]'"
    ) from error

_PREPARED = "_slipstream_prepared"


def gather_all_tensors(
    tensor: torch.Tensor, group: Any = None, *, state: ProcessState | None = None
) -> list[torch.Tensor]:
    """Every process's ``tensor``, whatever its shape on each (torchmetrics' sync contract).

    Shapes may differ in any dimension (a process that saw no data holds an empty tensor).
    """
    state = state if state is not None else current_state()
    if state.num_processes == 1:
        return [tensor]
    shapes = collectives.gather_object([(tuple(tensor.shape), str(tensor.dtype))], state=state)
    largest = max(range(len(shapes)), key=lambda r: _numel(shapes[r][0]))
    dtype = getattr(torch, shapes[largest][1].replace("torch.", ""))
    flat = tensor.detach().to(dtype).reshape(-1)
    longest = max(_numel(shape) for shape, _ in shapes)
    padded = torch.zeros(max(longest, 1), dtype=dtype, device=tensor.device)
    padded[: flat.numel()] = flat
    everyone = collectives.gather(padded.unsqueeze(0), state=state)
    return [
        everyone[rank, : _numel(shape)].reshape(shape) for rank, (shape, _) in enumerate(shapes)
    ]


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _real_rows(loader: PreparedDataLoader, rows: int, state: ProcessState) -> int:
    """How many of this process's ``rows`` in the final batch are real samples."""
    real = loader.final_real_samples
    if real is None or loader.uneven_tail:
        return rows
    # The final global batch lists real samples first, in process order, each process
    # holding ``rows`` of them; the rest are copies from the start of the epoch.
    return max(0, min(rows, real - state.process_index * rows))


def _trim(value: Any, rows: int, keep: int) -> Any:
    if isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape[0] == rows:
        return value[:keep]
    return value


def _batch_rows(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.ndim > 0:
            return int(value.shape[0])
    return None


class _Dedup:
    """Wraps a metric's ``update`` to drop duplicated tail samples."""

    def __init__(
        self,
        metric: Any,
        state: ProcessState,
        loaders: ActiveLoaders | None,
        loader: PreparedDataLoader | None,
    ) -> None:
        self.metric = metric
        self.state = state
        self.loaders = loaders
        self.loader = loader
        self.warned = False

    def active_loader(self) -> PreparedDataLoader | None:
        if self.loader is not None:
            return self.loader
        return self.loaders.innermost if self.loaders is not None else None

    def __call__(self, update: Any, *args: Any, **kwargs: Any) -> Any:
        loader = self.active_loader()
        if loader is None:
            if self.state.num_processes > 1 and not self.warned:
                self.warned = True
                warnings.warn(
                    f"{type(self.metric).__name__}.update() was called outside a prepared "
                    "evaluation DataLoader, so samples that sharding duplicated to even out the "
                    "last batch cannot be removed; prepare() the DataLoader (or use "
                    "even_batches=False) for exact metrics",
                    stacklevel=3,
                )
            return update(*args, **kwargs)
        rows = _batch_rows(args, kwargs)
        if not loader.end_of_dataloader or rows is None:
            return update(*args, **kwargs)
        keep = _real_rows(loader, rows, self.state)
        if keep == rows:
            return update(*args, **kwargs)
        if keep == 0:
            return None  # this process's whole final batch is duplicates
        args = tuple(_trim(a, rows, keep) for a in args)
        kwargs = {k: _trim(v, rows, keep) for k, v in kwargs.items()}
        return update(*args, **kwargs)


def _members(metric: Any) -> list[Any]:
    if isinstance(metric, torchmetrics.MetricCollection):
        return list(metric.values(copy_state=False))
    return [metric]


def prepare_metric(
    metric: Any,
    *,
    state: ProcessState | None = None,
    active_loaders: ActiveLoaders | None = None,
    dataloader: PreparedDataLoader | None = None,
    device: torch.device | None = None,
) -> Any:
    """Make ``metric`` sync through slipstream and skip duplicated tail samples.

    Without an Accelerator pass the prepared evaluation ``dataloader`` (or the
    ``active_loaders`` tracker it reports to). The metric is returned, moved to ``device``.
    """
    if not isinstance(metric, (torchmetrics.Metric, torchmetrics.MetricCollection)):
        raise TypeError(
            f"prepare_metric takes a torchmetrics Metric or MetricCollection, got "
            f"{type(metric).__name__}"
        )
    # Under a parallel layout the processes of one tensor/context-parallel group hold the
    # same samples: metrics sync over the data-parallel processes only.
    state = (state if state is not None else current_state()).data_parallel
    if dataloader is not None and not isinstance(dataloader, PreparedDataLoader):
        raise TypeError(
            "prepare_metric(dataloader=...) needs a prepared DataLoader (prepare() it first); "
            "with a plain DataLoader duplicated tail samples cannot be told apart"
        )
    if getattr(metric, _PREPARED, False):
        return metric
    sync = functools.partial(gather_all_tensors, state=state)
    for member in _members(metric):
        member.dist_sync_fn = sync
        member.distributed_available_fn = lambda: state.num_processes > 1
        dedup = _Dedup(member, state, active_loaders, dataloader)
        member.update = functools.partial(dedup, member.update)
        object.__setattr__(member, _PREPARED, True)
    if isinstance(metric, torchmetrics.MetricCollection):
        object.__setattr__(metric, _PREPARED, True)
    return metric.to(device if device is not None else state.device)
