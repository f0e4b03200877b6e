"""Build a model without allocating its weights: parameters land on the meta device.

A meta tensor has a shape and a dtype but no storage, so a model of any size is built in
milliseconds and costs no memory; its weights are then read from a checkpoint with
:func:`~slipstream.big_modeling.load_checkpoint_and_dispatch`.

Example::

    with init_empty_weights():
        model = nn.Sequential(*[nn.Linear(10_000, 10_000) for _ in range(100)])  # 40 GB, 0 bytes
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from .tensors import parameter_like


@contextlib.contextmanager
def init_empty_weights(include_buffers: bool = False) -> Iterator[None]:
    """Build modules inside the block with their parameters on the meta device.

    Buffers are still created for real unless ``include_buffers=True``: many models compute
    constant buffers in ``__init__`` (rotary frequencies, position ids) that no checkpoint
    holds, and a meta buffer would have nothing to be loaded from.

    Example::

        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config)
        model = load_checkpoint_and_dispatch(model, "checkpoint/", device_map="auto")
    """
    with init_on_device(torch.device("meta"), include_buffers=include_buffers):
        yield


@contextlib.contextmanager
def init_on_device(
    device: torch.device | str | int, include_buffers: bool = False
) -> Iterator[None]:
    """Build modules inside the block with their parameters (and, with
    ``include_buffers=True``, buffers) on ``device``.

    Example::

        with init_on_device("cuda:0"):
            layer = nn.Linear(4096, 4096)   # created on the GPU, no CPU copy first
    """
    target = torch.device(device)
    if include_buffers:
        # Every tensor made in the block goes to the device: torch's device context does it.
        with target:
            yield
        return
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device != target:
            module._parameters[name] = parameter_like(param, param.to(target))

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
