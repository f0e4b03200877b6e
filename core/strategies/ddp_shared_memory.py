"""DistributedDataParallel whose gradients are averaged through shared memory
(:mod:`slipstream.runtime.shared_memory_all_reduce`), for CPU processes on one machine.

The all-reduce goes in as DDP's communication hook. DDP takes one hook per model, once, and
scripts register their own on prepared models (``model.register_comm_hook(state, hook)``,
as with plain DDP), so the hook slipstream registers is a slot: it averages through shared
memory until the script registers a hook, which then takes the slot, exactly as if it had
been registered with DDP itself (torch's checks, its name in DDP's logs, one registration
only).

Example (what :class:`~slipstream.strategies.DDPStrategy` does)::

    reducer = shared_memory_all_reduce()  # None: keep DistributedDataParallel
    model = SharedMemoryDDP(module)
    model.average_through(reducer)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from ..runtime.shared_memory_all_reduce import SharedMemoryAllReduce, cached


class HookSlot:
    """The hook a :class:`SharedMemoryDDP` runs, and its state: the shared-memory mean
    until the script registers its own (``taken``)."""

    def __init__(self, hook: Any, state: Any) -> None:
        self.hook, self.state, self.taken = hook, state, False


def slot_hook(slot: HookSlot, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return slot.hook(slot.state, bucket)


def mean_hook(
    state: SharedMemoryAllReduce, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The bucket's mean over the processes, as torch's default hook computes it (divided by
    the number of processes, then summed; with two processes DDP's own bits). A bucket of
    sparse gradients (``nn.Embedding(sparse=True)``) goes over gloo, as it would without."""
    buffer = bucket.buffer()
    if buffer.layout is not torch.strided:
        return allreduce_hook(None, bucket)  # type: ignore[arg-type]  # (the default group)
    buffer.div_(state.world)
    state.all_reduce(buffer)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


# DDP checks a hook's annotations against the classes themselves; this module's are strings
# (postponed evaluation), so give it the classes.
for _hook in (slot_hook, mean_hook):
    _hook.__annotations__.update(
        bucket=dist.GradBucket, **{"return": torch.futures.Future[torch.Tensor]}
    )


class SharedMemoryDDP(DistributedDataParallel):
    """DistributedDataParallel averaging its gradients through shared memory until the
    script registers a communication hook of its own."""

    def average_through(self, reducer: SharedMemoryAllReduce) -> None:
        self._slipstream_slot = HookSlot(mean_hook, reducer)
        super().register_comm_hook(self._slipstream_slot, slot_hook)
        self._comm_hooks.clear()  # what DDP lists is the script's hooks (none yet)

    def register_comm_hook(self, state: object, hook: Any) -> None:
        """torch's ``register_comm_hook``: ``hook`` replaces the shared-memory mean (once,
        as in torch)."""
        slot = getattr(self, "_slipstream_slot", None)
        if slot is None:  # DDP's own constructor registering one (mixed_precision)
            super().register_comm_hook(state, hook)
            return
        if slot.taken:
            raise RuntimeError(
                "register_comm_hook or register_builtin_comm_hook can only be called once."
            )
        self._check_comm_hook(hook)
        if self.logger is not None:
            self.logger._set_comm_hook_name(hook.__qualname__)
        self._comm_hooks.append((hook, state))
        slot.hook, slot.state, slot.taken = hook, state, True

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        """torch's built-in hooks, as the Python hooks they stand for (DDP takes one hook,
        and the slot holds it)."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hooks = {
            dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
            dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook,
        }
        if comm_hook_type not in hooks:
            raise ValueError(f"unknown built-in communication hook {comm_hook_type!r}")
        self.register_comm_hook(None, hooks[comm_hook_type])

    def join(self, *args: Any, **kwargs: Any) -> Any:
        """torch's ``join``; ``divide_by_initial_world_size=False`` needs DDP's own
        all-reduce (with any communication hook torch divides by the initial size)."""
        divide = kwargs.get("divide_by_initial_world_size", args[0] if args else True)
        if not divide:
            raise ValueError(
                "join(divide_by_initial_world_size=False) needs DDP's own all-reduce, which a "
                "communication hook replaces (also slipstream's shared-memory one): prepare "
                "with DistributedDataParallelKwargs(shared_memory_all_reduce=False)"
            )
        return super().join(*args, **kwargs)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A copy (or an unpickled model) gets a new reducer, without hooks: give it the slot
        # again. The shared-memory reducer does not travel (it maps this job's memory): in
        # this process the copy takes the same one, elsewhere gloo's all-reduce.
        super().__setstate__(state)
        slot = self._slipstream_slot
        if not slot.taken:
            reducer = cached()
            slot.hook, slot.state = (mean_hook, reducer) if reducer else (allreduce_hook, None)
        dist._register_comm_hook(self.reducer, slot, slot_hook)
