"""torchdata's ``StatefulDataLoader`` under slipstream.

A ``StatefulDataLoader`` passed to ``prepare()``, or any loader with
``DataLoaderConfiguration(use_stateful_dataloader=True)``, becomes a prepared loader that is
also a ``StatefulDataLoader`` (so code that checks for one, or calls its ``state_dict`` /
``load_state_dict``, keeps working). Positions resume exactly as for every prepared loader;
on top, a stream whose dataset is *stateful* (has ``state_dict()`` and
``load_state_dict()``, torchdata's protocol) resumes from the dataset's saved state: the
batches consumed before the checkpoint are not read again. ``save_state`` keeps that state
per process.

Example::

    loader = StatefulDataLoader(my_stream, batch_size=32)
    loader = accelerator.prepare(loader)
    ...
    accelerator.save_state()          # includes my_stream.state_dict() at this batch
"""

from __future__ import annotations

import copy
import functools
import sys
from collections.abc import Iterator
from typing import Any

from .iterable import IterableDatasetShard
from .loader import PreparedDataLoader

_INSTALL = "pip install torchdata"


def is_stateful_dataloader(loader: Any) -> bool:
    """Whether ``loader`` is a torchdata ``StatefulDataLoader`` (without importing torchdata)."""
    module = sys.modules.get("torchdata.stateful_dataloader")
    cls = getattr(module, "StatefulDataLoader", None)
    return cls is not None and isinstance(loader, cls)


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


@functools.cache
def stateful_loader_class(
    base: type[PreparedDataLoader] = PreparedDataLoader,
) -> type[PreparedDataLoader]:
    """``base`` (a prepared loader class) combined with torchdata's ``StatefulDataLoader``."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError as error:
        raise ImportError(
            f"use_stateful_dataloader needs torchdata's StatefulDataLoader: {_INSTALL}"
        ) from error

    class StatefulPreparedDataLoader(base, StatefulDataLoader):  # type: ignore[valid-type,misc]
        """A prepared loader that is also a ``StatefulDataLoader`` (see the module)."""

        use_stateful_dataloader = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._source_state: Any = None
            if self._resumes_from_source():
                self._capture_position = self._capture_source_state

        def _resumes_from_source(self) -> bool:
            # A stateful stream that every process reads whole, keeping its slice; streams
            # that shard themselves and dispatched batches resume by position.
            return isinstance(self.shard, StatefulDatasetShard) and self.dispatch is None

        def _capture_source_state(self) -> None:
            self._source_state = StatefulDataLoader.state_dict(self)

        def _batches(self) -> Iterator[Any]:
            self._source_state = None
            return super()._batches()

        def process_state(self) -> Any:
            if self.batches_yielded == 0 or self._source_state is None:
                return None  # at an epoch boundary the position says everything
            return self._source_state

        def _restore_process_state(self, state: Any) -> bool:
            if not self._resumes_from_source():
                return False
            StatefulDataLoader.load_state_dict(self, state)
            return True

        def state_dict(self) -> dict[str, Any]:
            return {**self.position_state(), "process_state": self.process_state()}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            PreparedDataLoader.load_state_dict(self, state)

    name = f"Stateful{base.__name__}"
    StatefulPreparedDataLoader.__name__ = StatefulPreparedDataLoader.__qualname__ = name
    return StatefulPreparedDataLoader


class StatefulDatasetShard(IterableDatasetShard):
    """This process's slice of a stateful stream, itself stateful: its state is the
    stream's after the global batches read so far (and the first one, which completes a
    short final batch)."""

    def state_dict(self) -> dict[str, Any]:
        return {"dataset": copy.deepcopy(self.dataset.state_dict()), "initial": self.initial}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state["dataset"])
        self.restored_initial = list(state["initial"])
