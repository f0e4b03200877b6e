"""Lightning's checkpoint hooks on the core strategies' checkpoint layouts.

* DDP, and FSDP with ``FULL_STATE_DICT``: one file written by the main process through
  :class:`~slipstream.integrations.lightning.SlipstreamCheckpointIO` (any fsspec URL). For
  FSDP the full weights and optimizer state come from the core FSDP strategy (gathered to
  the main process) and go back through it on load.
* FSDP with ``SHARDED_STATE_DICT``, model parallelism (by default), and DeepSpeed: a folder
  holding the core strategy's own parts (torch.distributed.checkpoint, the DeepSpeed engine
  checkpoint) plus Lightning's remaining state, committed atomically (see
  :mod:`.checkpoint_io`).

Mixed into :class:`~slipstream.integrations.lightning.SlipstreamStrategy`.

Example::

    trainer.save_checkpoint("runs/epoch=3.ckpt")       # a file or a folder, by strategy
    trainer.fit(model, ckpt_path="runs/epoch=3.ckpt")  # restores model, optimizer, loops
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO

from slipstream.checkpoint.names import indexed_name
from slipstream.runtime.state import ProcessState
from slipstream.strategies import Strategy

from . import checkpoint_io as ckpt


class CheckpointingMixin:
    """Checkpoint hooks of the Lightning strategy, delegated to the core strategy."""

    kind: str
    core: Strategy | None
    state: ProcessState | None
    weights_dtype: torch.dtype | None
    _fsdp_plugin: Any
    _reader: Any
    _checkpoint_io: CheckpointIO | None
    model: Any
    lightning_module: Any
    optimizers: list[Any]

    if TYPE_CHECKING:  # provided by the strategy class and CollectivesMixin

        def broadcast(self, obj: Any, src: int = 0) -> Any: ...
        def _require_core(self) -> Strategy: ...

    @property
    def checkpoint_io(self) -> CheckpointIO:
        if self._checkpoint_io is None:
            self._checkpoint_io = ckpt.SlipstreamCheckpointIO()
        elif isinstance(self._checkpoint_io, _WrappingCheckpointIO):
            # e.g. AsyncCheckpointIO: wraps ours unless it was given another one.
            self._checkpoint_io.checkpoint_io = ckpt.SlipstreamCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = io

    @property
    def _sharded_layout(self) -> bool:
        if self.kind == "deepspeed":
            return True
        plugin = self._fsdp_plugin
        if self.kind == "model_parallel":
            # No plugin: the core strategy's default, sharded checkpoints.
            return plugin is None or plugin.sharded_state_dict
        return self.kind == "fsdp" and plugin is not None and plugin.sharded_state_dict

    @property
    def _plain(self) -> bool:
        """DDP (or nothing set up yet): Lightning's own handling of state dicts applies."""
        return self.kind == "ddp" or self.core is None

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # Sharded models load into their shards: restore once the core has wrapped them.
        return True

    # -- what goes into a checkpoint ----------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._plain:
            return super().lightning_module_state_dict()  # type: ignore[misc,no-any-return]
        assert self.core is not None and self.model is not None
        if self._sharded_layout:
            return self.core.checkpoint_state_dict(self.model)  # shards, or {} for DeepSpeed
        return self.core.model_state_dict(self.model)  # gathered to the main process

    def full_state_dict(self) -> dict[str, Any]:
        """The full (unsharded) weights, on the main process (collective for FSDP and
        DeepSpeed, whose other processes get an empty dict).

        Example::

            weights = trainer.strategy.full_state_dict()   # call on every process
            if trainer.is_global_zero:
                torch.save(weights, "weights.pt")
        """
        if self._plain:
            return dict(self.lightning_module.state_dict())
        assert self.core is not None and self.model is not None
        return self.core.model_state_dict(self.model)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self._plain:
            return super().optimizer_state(optimizer)  # type: ignore[misc,no-any-return]
        if self._sharded_layout:
            return {}  # the core strategy writes it in save_checkpoint
        assert self.core is not None and self.state is not None
        inner = getattr(optimizer, "_optimizer", optimizer)
        index = next(i for i, o in enumerate(self.optimizers) if o is inner)
        # FSDP FULL_STATE_DICT: the core gathers the full optimizer state to the main process.
        parts = ckpt.MemoryParts(self.state)
        self.core.save_optimizer_checkpoint(inner, parts.writer(), index)
        return dict(parts.objects.get(indexed_name("optimizer", index, ".bin"), {}))

    # -- saving and loading -------------------------------------------------------------------------
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        assert self.state is not None
        path = os.fspath(self.broadcast(os.fspath(filepath)))  # every process, one path
        if self._sharded_layout and self.core is not None:
            if storage_options is not None:
                raise TypeError(
                    "storage_options is not supported for sharded checkpoints (FSDP "
                    "SHARDED_STATE_DICT, DeepSpeed); configure the filesystem through fsspec"
                )
            ckpt.save_sharded(
                self.state,
                self.core,
                self.model,
                list(self.optimizers),
                checkpoint,
                path,
                self.weights_dtype,
            )
            return
        dtype = self.weights_dtype
        if dtype is not None and "state_dict" in checkpoint:
            checkpoint["state_dict"] = {
                k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                for k, v in checkpoint["state_dict"].items()
            }
        io = self.checkpoint_io
        ckpt.on_main(self.state, lambda: io.save_checkpoint(checkpoint, path, storage_options))

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict:
        assert self.state is not None
        path = os.fspath(self.broadcast(os.fspath(checkpoint_path)))
        self._reader = None
        if ckpt.is_sharded_checkpoint(path):
            rest, self._reader = ckpt.open_sharded(self.state, path, weights_only)
            return rest
        return self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._reader is None and self._plain:
            # What Lightning's Strategy does (whose signature lacks `strict` before 2.2).
            self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=strict)
            return
        core = self._require_core()
        assert self.model is not None and self.state is not None
        reader = self._reader
        if reader is None:  # one file holding the full weights (FSDP FULL_STATE_DICT)
            name = indexed_name("model", 0, ".safetensors")
            reader = ckpt.MemoryParts(self.state, {name: checkpoint["state_dict"]}).reader()
        core.load_model_checkpoint(self.model, reader, 0)()

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self._reader is None and self._plain:
            super().load_optimizer_state_dict(checkpoint)  # type: ignore[misc]
            return
        core = self._require_core()
        assert self.state is not None
        reader = self._reader
        if reader is None:
            states = checkpoint["optimizer_states"]
            names = [indexed_name("optimizer", i, ".bin") for i in range(len(states))]
            reader = ckpt.MemoryParts(self.state, dict(zip(names, states, strict=True))).reader()
        for index, optimizer in enumerate(self.optimizers):
            core.load_optimizer_checkpoint(optimizer, reader, index)()
