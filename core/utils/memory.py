"""Running out of memory gracefully: ``find_executable_batch_size`` and ``release_memory``.

Example::

    @find_executable_batch_size(starting_batch_size=256)
    def train(batch_size):
        loader = DataLoader(dataset, batch_size=batch_size)
        ...

    train()   # retried with 128, 64, ... after an out-of-memory error
"""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")

_OOM_MESSAGES = (
    "out of memory",
    "CUDNN_STATUS_NOT_SUPPORTED",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED",
    "DefaultCPUAllocator: can't allocate memory",
    "CUDA error: out of memory",
)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` means a device or host allocation failed."""
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in _OOM_MESSAGES)


def release_memory(*objects: Any) -> list[None]:
    """Drop ``objects``, collect garbage and empty the device cache; returns Nones to
    rebind (``model, opt = release_memory(model, opt)``)."""
    objects = tuple(None for _ in objects)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return list(objects)


def find_executable_batch_size(
    function: Callable[..., T] | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[..., int] | None = None,
) -> Any:
    """Call ``function(batch_size, ...)``, reducing ``batch_size`` after each out-of-memory
    error (to 90% of it, as Accelerate does, or to what ``reduce_batch_size_fn`` returns:
    called with the failed batch size, or with no argument), until it succeeds; fails
    clearly when the batch size reaches zero.

    Example::

        @find_executable_batch_size(starting_batch_size=64)
        def train(batch_size):
            ...
        train()
    """
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    parameters = list(inspect.signature(function).parameters)
    if not parameters or parameters[0] != "batch_size":
        raise TypeError(
            f"{function.__name__} must take batch_size as its first argument to be used with "
            "find_executable_batch_size"
        )

    def reduced(batch_size: int) -> int:
        if reduce_batch_size_fn is None:
            return int(batch_size * 0.9)
        takes_size = bool(inspect.signature(reduce_batch_size_fn).parameters)
        smaller = reduce_batch_size_fn(batch_size) if takes_size else reduce_batch_size_fn()
        if not 0 <= smaller < batch_size:
            raise ValueError(
                f"reduce_batch_size_fn returned {smaller!r} after batch_size={batch_size} ran "
                "out of memory; it must return a smaller batch size (>= 0)"
            )
        return int(smaller)

    @functools.wraps(function)
    def retrying(*args: Any, **kwargs: Any) -> T:
        batch_size = starting_batch_size
        while True:
            if batch_size == 0:
                raise RuntimeError(
                    f"No executable batch size found, reached zero: {function.__name__} ran "
                    "out of memory even with batch_size=1; the model itself does not fit"
                )
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as error:
                if not is_out_of_memory(error):
                    raise
                release_memory()
                batch_size = reduced(batch_size)

    return retrying
