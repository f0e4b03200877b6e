"""Data parallelism with ``torch.nn.parallel.DistributedDataParallel`` (CPU/gloo or NCCL)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any, ClassVar

from torch import nn

from .base import Strategy, share_router_statistics


class DDPStrategy(Strategy):
    """Every process holds the whole model; gradients are averaged in backward.

    Options are those of :class:`~slipstream.utils.DistributedDataParallelKwargs`; its
    ``comm_hook`` (with ``comm_wrapper`` and ``comm_state_option``) is registered on every
    wrapped model. Without one, CPU processes that all run on one machine average the
    gradients through shared memory (:mod:`slipstream.runtime.shared_memory_all_reduce`)
    unless ``shared_memory_all_reduce=False``.
    """

    name: ClassVar[str] = "ddp"

    def __init__(
        self,
        state: Any,
        *,
        comm_hook: Any = None,
        comm_wrapper: Any = None,
        comm_state_option: dict[str, Any] | None = None,
        shared_memory_all_reduce: bool = True,
        **options: Any,
    ) -> None:
        super().__init__(state, **options)
        self.shared_memory_all_reduce = shared_memory_all_reduce
        from ..options.kwargs import DDPCommunicationHookType as Hook

        self.comm_hook = Hook(comm_hook or Hook.NO)
        self.comm_wrapper = Hook(comm_wrapper or Hook.NO)
        self.comm_state_option = dict(comm_state_option or {})
        # torch registers its bf16 hooks only with NCCL on CUDA (or XCCL on XPU) and raises
        # from inside prepare otherwise; say so here, before any model is wrapped.
        if Hook.BF16 in (self.comm_hook, self.comm_wrapper) and state.device.type not in (
            "cuda",
            "xpu",
        ):
            raise ValueError(
                "bf16 gradient communication (comm_hook or comm_wrapper 'bf16') needs GPUs "
                f"with NCCL (torch's bf16 all-reduce; XPUs with XCCL); on {state.device.type} "
                "processes use 'fp16' instead"
            )

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
        share_router_statistics(model, self.state)
        device = self.state.device
        device_ids = [device.index or 0] if device.type == "cuda" else None
        reducer = self._shared_memory_all_reduce()
        if reducer is None:
            wrapped = DistributedDataParallel(model, device_ids=device_ids, **self.options)
            self._register_comm_hook(wrapped)
            return wrapped
        from .ddp_shared_memory import SharedMemoryDDP

        shared = SharedMemoryDDP(model, device_ids=device_ids, **self.options)
        shared.average_through(reducer)
        return shared

    def _shared_memory_all_reduce(self) -> Any:
        """The processes' shared-memory all-reduce for DDP's gradients, or None (gloo's)."""
        from ..options.kwargs import DDPCommunicationHookType as Hook

        if (
            not self.shared_memory_all_reduce
            or self.comm_hook is not Hook.NO
            or self.state.device.type != "cpu"
        ):
            return None
        from ..runtime.shared_memory_all_reduce import shared_memory_all_reduce

        # A collective the first time: every process wraps the same models in turn.
        return shared_memory_all_reduce()

    def _register_comm_hook(self, model: nn.Module) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        from ..options.kwargs import DDPCommunicationHookType as Hook

        if self.comm_hook is Hook.NO:
            return
        hook: Any
        if self.comm_hook in (Hook.FP16, Hook.BF16):
            hook = (
                default_hooks.fp16_compress_hook
                if self.comm_hook is Hook.FP16
                else default_hooks.bf16_compress_hook
            )
            model.register_comm_hook(state=None, hook=hook)  # type: ignore[operator]
            return
        hook = (
            powerSGD_hook.powerSGD_hook
            if self.comm_hook is Hook.POWER_SGD
            else powerSGD_hook.batched_powerSGD_hook
        )
        if self.comm_wrapper is Hook.FP16:
            hook = default_hooks.fp16_compress_wrapper(hook)
        elif self.comm_wrapper is Hook.BF16:
            hook = default_hooks.bf16_compress_wrapper(hook)
        try:
            hook_state = powerSGD_hook.PowerSGDState(process_group=None, **self.comm_state_option)
        except TypeError as error:
            raise ValueError(
                f"comm_state_option={self.comm_state_option!r} does not fit PowerSGD's state "
                f"({error}); use keys such as matrix_approximation_rank, start_powerSGD_iter"
            ) from None
        model.register_comm_hook(state=hook_state, hook=hook)  # type: ignore[operator]

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
