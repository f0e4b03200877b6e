"""Accelerate's loader classes, :class:`DataLoaderShard` and :class:`DataLoaderDispatcher`:
what ``prepare()`` returns (for ``isinstance`` checks), and buildable directly with
Accelerate's constructor, ``DataLoaderShard(dataset, batch_size=4, ...)``.

Built directly, a loader is not sharded (as in Accelerate: ``prepare()`` shards); it places
batches on ``device``, knows its ``end_of_dataloader``, tracks its position for
``state_dict()``/``load_state_dict()`` and, with ``use_stateful_dataloader=True``, is also a
torchdata ``StatefulDataLoader``.

Example::

    loader = DataLoaderShard(list(range(16)), batch_size=4)
    for batch in loader:
        last = loader.end_of_dataloader
"""

from __future__ import annotations

from typing import Any

import torch

from .loader import PreparedDataLoader

#: Accelerate's constructor keywords slipstream's loaders have no use for: the job's
#: layout decides sharding, and generators are kept in step whatever is passed.
_IGNORED = ("synchronized_generator", "torch_device_mesh", "_drop_last")


class _AccelerateConstructor(PreparedDataLoader):
    """Takes Accelerate's keywords as well as those ``prepare()`` passes."""

    def __new__(cls, *args: Any, use_stateful_dataloader: bool = False, **kwargs: Any) -> Any:
        if use_stateful_dataloader and not cls.use_stateful_dataloader:
            from .stateful import stateful_loader_class

            stateful: Any = stateful_loader_class(cls)  # type: ignore[arg-type]
            return super().__new__(stateful)  # Python then runs its __init__
        return super().__new__(cls)

    def __init__(
        self,
        dataset: Any,
        device: torch.device | str | None = None,
        rng_types: Any = None,
        *,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,
        _non_blocking: bool = False,
        **kwargs: Any,
    ) -> None:
        for name in _IGNORED:
            kwargs.pop(name, None)
        kwargs.setdefault("non_blocking", _non_blocking)
        device = torch.device(device) if isinstance(device, str) else device
        super().__init__(dataset, device=device, rng_types=rng_types, **kwargs)
        if skip_batches:
            self.skip_next_pass(skip_batches)


class DataLoaderShard(_AccelerateConstructor):
    """A prepared loader whose processes each load their own share of every global batch
    (Accelerate's name). ``prepare()`` builds it; built directly with Accelerate's
    arguments (``DataLoaderShard(dataset, device=None, rng_types=None, skip_batches=0,
    use_stateful_dataloader=False, **DataLoader's)``) it loads what its sampler gives.

    Example::

        loader = prepare_data_loader(DataLoader(ds, batch_size=8))
        assert isinstance(loader, DataLoaderShard)
    """


class DataLoaderDispatcher(_AccelerateConstructor):
    """A prepared loader whose main process reads every global batch and sends each
    process its slice (``dispatch_batches=True``; Accelerate's name). ``prepare()`` builds
    it; built directly (Accelerate's arguments, ``split_batches`` and ``slice_fn``
    included) it is one process's loader, and in a job of several processes refused:
    prepare a plain DataLoader with ``dispatch_batches=True`` instead.

    Example::

        loader = prepare_data_loader(DataLoader(stream, batch_size=8), dispatch_batches=True)
        assert isinstance(loader, DataLoaderDispatcher)   # with more than one process
    """

    def __init__(
        self,
        dataset: Any,
        split_batches: bool = False,
        *,
        slice_fn: Any = None,
        **kwargs: Any,
    ) -> None:
        del split_batches, slice_fn  # one process reads and keeps the whole batch
        super().__init__(dataset, **kwargs)
        if self.dispatch is None and self.state.data_parallel_size > 1:
            raise ValueError(
                "a DataLoaderDispatcher built directly would dispatch over "
                f"{self.state.data_parallel_size} processes without knowing the global batch; "
                "build a DataLoader and prepare it with dispatch_batches=True "
                "(DataLoaderConfiguration(dispatch_batches=True) or prepare_data_loader(..., "
                "dispatch_batches=True))"
            )
