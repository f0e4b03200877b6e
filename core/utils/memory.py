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
    function: Callable[..., T] | None = None, starting_batch_size: int = 128
) -> Any:
    """Call ``function(batch_size, ...)``, halving ``batch_size`` after each out-of-memory
    error, until it succeeds; fails clearly when the batch size reaches zero."""
    if function is None:
        return functools.partial(
            find_executable_batch_size, starting_batch_size=starting_batch_size
        )
    parameters = list(inspect.signature(function).parameters)
    if not parameters or parameters[0] != "batch_size":
        raise TypeError(
            f"{function.__name__} must take batch_size as its first argument to be used with "
            "find_executable_batch_size"
        )

    @functools.wraps(function)
    def retrying(*args: Any, **kwargs: Any) -> T:
        batch_size = starting_batch_size
        while True:
            if batch_size == 0:
                raise RuntimeError(
                    f"{function.__name__} ran out of memory even with batch_size=1; the model "
                    "itself does not fit"
                )
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as error:
                if not is_out_of_memory(error):
                    raise
                release_memory()
                batch_size //= 2

    return retrying
