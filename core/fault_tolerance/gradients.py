"""Averaging the gradients of a step over the quorum, through the replica groups' own
(torchft) process group.

The gradients are packed, in the reverse order of the parameters (about the order backward
produces them), into buckets of one dtype and at most :data:`BUCKET_BYTES`, each a flat
buffer kept from step to step. Where a group is a single process with plain (unsharded)
parameters, the gradients *are* views into the buckets (set before the backward that ends
a step, as DDP's ``gradient_as_bucket_view``: backward accumulates into them and the
average is computed in place, no copy either way), and a bucket's all-reduce starts as
soon as backward has produced all of its gradients (a post-accumulate-grad hook per
parameter), so it overlaps the rest of backward, as DDP's buckets do; buckets start
strictly in order, so every group issues the same collectives in the same order. Otherwise
(FSDP2 or TP inside a group: the local shards, final only after the group's own reduction)
the gradients are copied into the buckets after backward and back.

A peer that dies makes an all-reduce fail: the error goes to the manager (the step is then
discarded at the vote) and the remaining buckets are not sent.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed import AllreduceOptions, ReduceOp

from . import recovery

#: The largest bucket (bytes).
BUCKET_BYTES = 4 * 1024 * 1024


class _Bucket:
    __slots__ = ("flat", "params", "ready", "slices", "work")

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        grads = [recovery.local(p) for p in params]
        self.flat = torch.empty(
            sum(g.numel() for g in grads), dtype=grads[0].dtype, device=grads[0].device
        )
        self.slices: list[torch.Tensor] = []
        offset = 0
        for g in grads:
            self.slices.append(self.flat[offset : offset + g.numel()].view(g.shape))
            offset += g.numel()
        self.ready = 0
        self.work: Any = None


class GradientAverager:
    """The buckets of the prepared models' gradients and their all-reduces (see the module
    docstring). ``manager`` is the torchft Manager, ``pg`` the process group it drives."""

    def __init__(self, manager: Any, pg: Any, *, overlap: bool) -> None:
        self.manager = manager
        self.pg = pg
        self.overlap = overlap
        self._key: tuple[int, ...] = ()
        self._buckets: list[_Bucket] = []
        self._where: dict[int, tuple[_Bucket, int]] = {}
        self._hooks: list[Any] = []
        self._armed = False
        self._next = 0  # the first bucket not started yet
        self._failed = False
        self._participants = 1

    # -- layout -----------------------------------------------------------------------------
    def build(self, models: list[nn.Module]) -> None:
        """(Re)build the buckets when the prepared models changed."""
        key = tuple(id(m) for m in models)
        if key == self._key and self._buckets:
            return
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._buckets, self._where, self._key = [], [], {}, key
        unique: dict[int, nn.Parameter] = {}
        for model in models:
            for param in model.parameters():
                if param.requires_grad:
                    unique.setdefault(id(param), param)
        open_buckets: dict[torch.dtype, list[nn.Parameter]] = {}
        sizes: dict[torch.dtype, int] = {}
        for param in reversed(list(unique.values())):
            part = recovery.local(param)
            members = open_buckets.setdefault(part.dtype, [])
            members.append(param)
            sizes[part.dtype] = sizes.get(part.dtype, 0) + part.numel() * part.element_size()
            if sizes[part.dtype] >= BUCKET_BYTES:
                self._buckets.append(_Bucket(members))
                del open_buckets[part.dtype]
                sizes[part.dtype] = 0
        self._buckets.extend(_Bucket(members) for members in open_buckets.values() if members)
        for bucket in self._buckets:
            for index, param in enumerate(bucket.params):
                self._where[id(param)] = (bucket, index)
        if self.overlap and all(recovery.local(p) is p for p in unique.values()):
            for param in unique.values():
                self._hooks.append(param.register_post_accumulate_grad_hook(self._produced))
        self._armed = False

    # -- a step -----------------------------------------------------------------------------
    def arm(self) -> None:
        """Before the backward that ends a step's accumulation: start the buckets as their
        gradients come (with the quorum known)."""
        for bucket in self._buckets:
            bucket.ready = 0
            bucket.work = None
        self._next = 0
        self._failed = bool(self.manager.errored())
        self._participants = max(1, int(self.manager.num_participants()))
        self._armed = bool(self._hooks)
        if self._armed:
            self._view_gradients()

    def _view_gradients(self) -> None:
        """Make every gradient its bucket's view (zeros where there was none, the gradient
        accumulated so far where there was one), so backward accumulates in place."""
        for bucket in self._buckets:
            if all(p.grad is None for p in bucket.params):
                bucket.flat.zero_()
                for param, part in zip(bucket.params, bucket.slices, strict=True):
                    param.grad = part
                continue
            for param, part in zip(bucket.params, bucket.slices, strict=True):
                grad = param.grad
                if grad is part:
                    continue
                if grad is None:
                    part.zero_()
                else:
                    part.copy_(grad)
                param.grad = part

    def _produced(self, param: torch.Tensor) -> None:
        if not self._armed or param.grad is None:
            return
        bucket, index = self._where[id(param)]
        part = bucket.slices[index]
        if param.grad is not part:  # replaced during backward (else accumulated in place)
            part.copy_(param.grad)
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._start_ready()

    def _start_ready(self) -> None:
        buckets = self._buckets
        while self._next < len(buckets) and buckets[self._next].ready >= len(
            buckets[self._next].params
        ):
            self._start(buckets[self._next])
            self._next += 1

    def _start(self, bucket: _Bucket) -> None:
        if self._failed or self.manager.errored():
            self._failed = True
            return
        if not self.manager.is_participating():
            bucket.flat.zero_()
        options = AllreduceOptions()
        options.reduceOp = ReduceOp(ReduceOp.SUM)
        try:
            bucket.work = self.pg.allreduce([bucket.flat], options)
        except Exception as error:  # a peer died: this step is discarded at the vote
            self.manager.report_error(error)
            self._failed = True

    def finish(self) -> None:
        """After backward: start what is left (missing gradients as zeros: every group sends
        the same buffers), wait for every bucket and write the averages into the gradients."""
        if not self._armed:
            self.arm()
            self._armed = False
            for bucket in self._buckets:
                self._collect(bucket)
        else:
            self._armed = False
            for bucket in self._buckets[self._next :]:
                if bucket.ready < len(bucket.params):
                    self._collect(bucket)
        for bucket in self._buckets[self._next :]:
            self._start(bucket)
        self._next = len(self._buckets)
        for bucket in self._buckets:
            if bucket.work is None:
                continue
            try:
                bucket.work.wait()
            except Exception as error:  # a peer died: this step is discarded at the vote
                self.manager.report_error(error)
                self._failed = True
            bucket.work = None
        if self._failed:
            return
        for bucket in self._buckets:
            if self._participants > 1:
                bucket.flat.div_(self._participants)
            for param, part in zip(bucket.params, bucket.slices, strict=True):
                grad = param.grad
                if grad is not part:  # (views need nothing)
                    recovery.local(grad).copy_(part)  # type: ignore[arg-type]

    def _collect(self, bucket: _Bucket) -> None:
        for param, part in zip(bucket.params, bucket.slices, strict=True):
            if param.grad is None:  # every group must send the same buffers
                param.grad = torch.zeros_like(param)
            part.copy_(recovery.local(param.grad))

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
