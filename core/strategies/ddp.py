"""Data parallelism with ``torch.nn.parallel.DistributedDataParallel`` (CPU/gloo or NCCL)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any, ClassVar

from torch import nn

from .base import Strategy


class DDPStrategy(Strategy):
    """Every process holds the whole model; gradients are averaged in backward.

    Options are those of :class:`~slipstream.utils.DistributedDataParallelKwargs`.
    """

    name: ClassVar[str] = "ddp"

    def wrap_model(self, model: nn.Module, *, device_placement: bool) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(model, DistributedDataParallel):
            raise ValueError(
                "prepare() got a model already wrapped in DistributedDataParallel; pass the "
                "plain nn.Module (slipstream wraps it for the active strategy)"
            )
        model = super().wrap_model(model, device_placement=device_placement)
        if self.state.num_processes == 1 or not any(p.requires_grad for p in model.parameters()):
            # Nothing to synchronise (frozen or evaluation-only model).
            return model
        device = self.state.device
        device_ids = [device.index or 0] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, **self.options)

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        wrapped = _ddp_class()
        return model.module if wrapped is not None and isinstance(model, wrapped) else model

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        wrapped = _ddp_class()
        if wrapped is not None and isinstance(model, wrapped):
            with model.no_sync():
                yield
        else:
            yield


def _ddp_class() -> Any:
    """DistributedDataParallel if anything imported it yet (no model can be wrapped before)."""
    module = sys.modules.get("torch.nn.parallel.distributed")
    return getattr(module, "DistributedDataParallel", None)
