"""XLA devices (TPUs; XLA:CPU in tests) through torch_xla, as Accelerate runs them.

Models are moved to the XLA device (which gives them new parameter objects: the optimizers
prepared with them are pointed at the new ones), gradients are averaged over the XLA
processes with ``xm.all_reduce`` before clipping or stepping (no wrapper, as in
Accelerate), and every optimizer step ends with the XLA step barrier
(``torch_xla.sync()``), as ``xm.optimizer_step(optimizer, barrier=True)`` does. Weights and
optimizer state are copied to the CPU before they are written.

FSDP, DeepSpeed and the model-parallel layouts are refused with a clear error: torch_xla's
own FSDP (``XlaFullyShardedDataParallel``) and SPMD are not integrated.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from ..runtime import xla
from ..runtime.state import DistributedType
from .base import Strategy


class XlaStrategy(Strategy):
    """One model replica per XLA process; gradients averaged at the optimizer step."""

    name: ClassVar[str] = "xla"

    def __init__(self, state: Any, **options: Any) -> None:
        super().__init__(state, **options)
        #: Set after the gradients of the current step were averaged (clipping does it
        #: before the optimizer step; the step must not average them again).
        self._reduced = False

    @property
    def distributed_type(self) -> DistributedType:
        return DistributedType.XLA

    def setup(
        self,
        models: list[nn.Module],
        optimizers: list[torch.optim.Optimizer],
        *,
        device_placement: list[bool],
        **context: Any,
    ) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
        before = [dict(model.named_parameters(remove_duplicate=False)) for model in models]
        wrapped, optimizers = super().setup(
            models, optimizers, device_placement=device_placement, **context
        )
        moved: dict[int, nn.Parameter] = {}
        for old, model in zip(before, wrapped, strict=True):
            for name, parameter in model.named_parameters(remove_duplicate=False):
                if name in old and old[name] is not parameter:
                    moved[id(old[name])] = parameter
        if moved:
            for optimizer in optimizers:
                _repoint(optimizer, moved)
        return wrapped, optimizers

    # -- the step -------------------------------------------------------------------------
    def _parameters(self, optimizer: Any) -> list[torch.Tensor]:
        return [p for group in optimizer.param_groups for p in group["params"]]

    def reduce_gradients(self, parameters: list[torch.Tensor]) -> None:
        """Average gradients over the XLA processes (once per step)."""
        if self.state.num_processes > 1 and not self._reduced:
            xla.all_reduce_gradients(parameters)
            self._reduced = True

    def before_optimizer_step(self, optimizer: Any) -> None:
        """Called by the step coordinator before ``optimizer.step()``."""
        if self.state.num_processes > 1 and not self._reduced:
            xla.all_reduce_gradients(self._parameters(optimizer))

    def after_optimizer_step(self) -> None:
        """The XLA step barrier: run the step's graph (``torch_xla.sync()``)."""
        self._reduced = False
        xla.sync()

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        parameters = list(parameters)
        if self.state.num_processes > 1:  # clip the averaged gradients (as Accelerate)
            every: list[torch.Tensor] = [
                p for model in self.prepared_models for p in model.parameters()
            ]
            self.reduce_gradients(every or parameters)
        return super().clip_grad_norm_(parameters, max_norm, norm_type)

    # -- weights --------------------------------------------------------------------------
    def model_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The weights as CPU tensors (XLA tensors cannot be written as they are)."""
        return dict(xla.to_cpu(super().model_state_dict(model)))


def _repoint(optimizer: Any, moved: dict[int, nn.Parameter]) -> None:
    """Point ``optimizer`` (and its per-parameter state) at the moved parameters."""
    for group in optimizer.param_groups:
        group["params"] = [moved.get(id(p), p) for p in group["params"]]
    state = getattr(optimizer, "state", None)
    if isinstance(state, dict) and state:
        for key in [k for k in state if id(k) in moved]:
            state[moved[id(key)]] = state.pop(key)


def refuse(name: str) -> ValueError:
    """The error for a strategy that does not run on XLA devices."""
    return ValueError(
        f"the '{name}' strategy does not run on XLA devices: slipstream runs XLA jobs as data "
        "parallelism (one model replica per XLA process, gradients averaged with "
        "xm.all_reduce); torch_xla's own FSDP and SPMD are not integrated. Remove the FSDP / "
        "DeepSpeed / parallelism settings, or run on CPUs/GPUs (unset PJRT_DEVICE, drop --tpu)"
    )
