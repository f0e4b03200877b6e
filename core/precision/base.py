"""Precision: how forward passes run and how losses are scaled for one mixed-precision mode.

One class per mode; the Accelerator and the Lightning adapter use the same objects.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from ..runtime.nested import convert_to_fp32

_ORIGINAL_FORWARD = "_slipstream_original_forward"
# The (context, convert_outputs_to_fp32, convert_inputs) a forward was patched with.
_PATCH = "_slipstream_forward_patch"


class Precision:
    """Full fp32 precision: no autocast, no loss scaling."""

    #: The ``mixed_precision`` value this class implements.
    mode: ClassVar[str] = "no"
    #: Whether :meth:`scale_loss` changes the loss (the training step skips the call if not).
    scales_loss: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.scales_loss = cls.scale_loss is not Precision.scale_loss

    def __init__(
        self,
        device: torch.device,
        *,
        convert_outputs_to_fp32: bool = True,
        autocast_enabled: bool = True,
        cache_enabled: bool | None = None,
    ) -> None:
        self.device = device
        self.convert_outputs_to_fp32 = convert_outputs_to_fp32
        self.autocast_enabled = autocast_enabled
        self.cache_enabled = cache_enabled

    @property
    def scaler(self) -> Any:
        """A ``torch.amp.GradScaler`` when losses are scaled (fp16), else ``None``."""
        return None

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype matmuls run in."""
        return torch.float32

    @contextlib.contextmanager
    def autocast(self, enabled: bool = True, cache_enabled: bool | None = None) -> Iterator[None]:
        yield

    def convert_model(self, model: nn.Module) -> nn.Module:
        """Prepare ``model`` for this precision (patch its forward, cast or swap layers)."""
        return model

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss


def patch_forward_with(
    model: nn.Module,
    context: Callable[[], Any],
    convert_outputs_to_fp32: bool,
    convert_inputs: Callable[[Any], Any] | None = None,
) -> nn.Module:
    """Replace ``model.forward`` by one running under ``context()``; undone by
    :func:`restore_forward`."""
    if hasattr(model, _ORIGINAL_FORWARD):
        return model
    original = model.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if convert_inputs is not None:
            args, kwargs = convert_inputs((args, kwargs))
        with context():
            outputs = original(*args, **kwargs)
        return convert_to_fp32(outputs) if convert_outputs_to_fp32 else outputs

    setattr(model, _ORIGINAL_FORWARD, original)
    model.__dict__[_PATCH] = (context, convert_outputs_to_fp32, convert_inputs)
    model.forward = forward
    return model


def restore_forward(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_forward_with` (the model then runs at its own precision)."""
    if hasattr(model, _ORIGINAL_FORWARD):
        delattr(model, _ORIGINAL_FORWARD)
        model.__dict__.pop(_PATCH, None)
        if "forward" in model.__dict__:
            del model.__dict__["forward"]
    return model


def move_forward_patch(source: nn.Module, targets: list[nn.Module]) -> None:
    """Give ``targets`` (modules built from ``source``, e.g. pipeline stages whose forward
    differs from the model's) the precision patch of ``source``'s forward, each on its own
    forward, and take it off ``source``."""
    patch = source.__dict__.get(_PATCH)
    if patch is None:
        return
    for target in targets:
        restore_forward(target)  # a shallow copy carries the source's bound wrapper
        patch_forward_with(target, *patch)
    restore_forward(source)
