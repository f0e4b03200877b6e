"""The Strategy interface: everything that differs between parallelism flavours.

The Accelerator and the Lightning adapter both call these methods, so each parallelism is
implemented once. A strategy receives the process state and its own options; it never
reads the environment itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from ..state import DistributedType, ProcessState


class Strategy:
    """Base class: single-device behaviour, overridden piece by piece by subclasses."""

    #: Registry name (``"ddp"``, ``"fsdp"``, ...).
    name: ClassVar[str] = "base"

    def __init__(self, state: ProcessState, **options: Any) -> None:
        self.state = state
        self.options = options

    @property
    def distributed_type(self) -> DistributedType:
        return self.state.distributed_type

    # -- wrapping -------------------------------------------------------------------------
    def setup(
        self,
        models: list[nn.Module],
        optimizers: list[torch.optim.Optimizer],
        *,
        device_placement: list[bool],
    ) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
        """Place and wrap models (``device_placement`` has one flag per model); return the
        optimizers to use (a strategy may rebuild them)."""
        wrapped = [
            self.wrap_model(m, device_placement=place)
            for m, place in zip(models, device_placement, strict=True)
        ]
        return wrapped, optimizers

    def wrap_model(self, model: nn.Module, *, device_placement: bool) -> nn.Module:
        if device_placement:
            model = model.to(self.state.device)
        return model

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        """The user's module inside whatever this strategy wrapped it in."""
        return model

    # -- training step --------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        loss.backward(**kwargs)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Skip gradient synchronisation inside the block (no-op without communication)."""
        yield

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(list(parameters), max_norm, norm_type=norm_type)

    # -- weights --------------------------------------------------------------------------
    def model_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The full (unsharded) state dict of ``model``; collective for sharded strategies."""
        return self.unwrap_model(model).state_dict()

    def teardown(self) -> None:
        """Release what the strategy holds (engines, hooks)."""
