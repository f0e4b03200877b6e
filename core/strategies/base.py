"""The Strategy interface: everything that differs between parallelism flavours.

The Accelerator and the Lightning adapter both call these methods, so each parallelism is
implemented once. A strategy receives the process state and its own options; it never
reads the environment itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ..checkpoint import sharded
from ..checkpoint.names import indexed_name, model_folder, optimizer_folder
from ..runtime.state import DistributedType, ProcessState

if TYPE_CHECKING:
    from ..checkpoint.io import CheckpointReader, CheckpointWriter


class Strategy:
    """Base class: single-device behaviour, overridden piece by piece by subclasses."""

    #: Registry name (``"ddp"``, ``"fsdp"``, ...).
    name: ClassVar[str] = "base"
    #: True when a prepared model's forward is itself a collective (parameters gathered
    #: from shards, or split across processes): every process must run every forward.
    forward_is_collective: bool = False
    #: False when a subclass overrides :meth:`backward` (an engine that runs it itself);
    #: otherwise the Accelerator calls ``loss.backward()`` directly, once per step.
    plain_backward: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.plain_backward = cls.backward is Strategy.backward

    def __init__(self, state: ProcessState, **options: Any) -> None:
        self.state = state
        self.options = options
        #: Set by the Accelerator: the micro-step bookkeeping (sync_gradients).
        self.step_state: Any = None
        #: The models this strategy has prepared (wrapped), in order.
        self.prepared_models: list[nn.Module] = []

    @property
    def distributed_type(self) -> DistributedType:
        return self.state.device_distributed_type

    # -- wrapping -------------------------------------------------------------------------
    def setup(
        self,
        models: list[nn.Module],
        optimizers: list[torch.optim.Optimizer],
        *,
        device_placement: list[bool],
        **context: Any,
    ) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
        """Place and wrap models (``device_placement`` has one flag per model); return the
        optimizers to use (a strategy may rebuild them). ``context`` carries what else
        prepare() saw (dataloaders, schedulers) for strategies that need it."""
        wrapped = [
            self.wrap_model(m, device_placement=place)
            for m, place in zip(models, device_placement, strict=True)
        ]
        self.prepared_models.extend(wrapped)
        return wrapped, optimizers

    def wrap_model(self, model: nn.Module, *, device_placement: bool) -> nn.Module:
        if device_placement:
            model = model.to(self.state.device)
        return model

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        """The user's module inside whatever this strategy wrapped it in."""
        return model

    def owner_of(self, optimizer: torch.optim.Optimizer) -> nn.Module:
        """The prepared model whose parameters ``optimizer`` updates."""
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for model in self.prepared_models:
            if params & {id(p) for p in model.parameters()}:
                return model
        raise ValueError(
            "prepare() got an optimizer whose parameters belong to no prepared model; prepare "
            "the model together with (or before) its optimizer"
        )

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
        """The full (unsharded) state dict of ``model``; collective for sharded strategies.
        Weights that hooks keep offloaded (dispatched to "cpu" or "disk") are read back."""
        from ..big_modeling.offloaded_models import state_dict_with_offloaded

        return state_dict_with_offloaded(self.unwrap_model(model))

    def checkpoint_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """What ``save_state`` writes for ``model`` (sharded strategies may keep shards)."""
        return self.model_state_dict(model)

    # -- checkpoints ----------------------------------------------------------------------
    # Loading is split in two: ``load_*`` reads and validates and returns a function that
    # applies the state, so nothing changes until every part has been read successfully.
    def save_model_checkpoint(
        self, model: nn.Module, state_dict: dict[str, Any], writer: CheckpointWriter, index: int
    ) -> None:
        """Replicated weights: the folder's owner (the main process) writes
        ``model[_i].safetensors``."""
        if writer.owner:
            writer.save_tensors(indexed_name("model", index, ".safetensors"), state_dict)

    def load_model_checkpoint(
        self, model: nn.Module, reader: CheckpointReader, index: int
    ) -> Callable[[], None]:
        name = indexed_name("model", index, ".safetensors")
        target = self.unwrap_model(model)
        part = model_folder(index)
        if not reader.storage.exists(reader.path(name)) and sharded.has_part(reader, part):
            # Saved sharded (FSDP, tensor parallel): read the shards back as whole tensors.
            sharded.check_shapes(target, reader, part)
            return lambda: sharded.load_model_part(target, reader, part)
        tensors = reader.load_tensors(name, f"weights of model {index}")
        check_matching_weights(target, tensors, reader.storage.url(reader.path(name)))
        return lambda: _load_weights(target, tensors)

    def save_optimizer_checkpoint(
        self, optimizer: torch.optim.Optimizer, writer: CheckpointWriter, index: int
    ) -> None:
        if writer.owner:
            writer.save_object(indexed_name("optimizer", index, ".bin"), optimizer.state_dict())

    def load_optimizer_checkpoint(
        self, optimizer: torch.optim.Optimizer, reader: CheckpointReader, index: int
    ) -> Callable[[], None]:
        name = indexed_name("optimizer", index, ".bin")
        part = optimizer_folder(index)
        if not reader.storage.exists(reader.path(name)) and sharded.has_part(reader, part):
            target = self.unwrap_model(self.owner_of(optimizer))
            return lambda: sharded.load_optimizer_part(target, optimizer, reader, part)
        saved = reader.load_object(name, f"state of optimizer {index}")
        groups, expected = len(saved.get("param_groups", [])), len(optimizer.param_groups)
        if groups != expected:
            raise ValueError(
                f"{reader.storage.url(reader.path(name))} has {groups} parameter group(s) but "
                f"optimizer {index} has {expected}; prepare the optimizers in the same order "
                "as when saving"
            )
        return lambda: optimizer.load_state_dict(saved)

    def teardown(self) -> None:
        """Release what the strategy holds (engines, hooks)."""
        self.prepared_models.clear()


def check_matching_weights(model: nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Raise before loading when names or shapes differ, naming what differs."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = [
        f"{k} {tuple(tensors[k].shape)} vs {tuple(v.shape)}"
        for k, v in expected.items()
        if k in tensors and tuple(tensors[k].shape) != tuple(v.shape)
    ]
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"missing {missing[:5]}")
        if unexpected:
            parts.append(f"unexpected {unexpected[:5]}")
        if wrong:
            parts.append(f"different shapes {wrong[:5]}")
        raise ValueError(
            f"the weights in {where} do not fit {type(model).__name__}: {'; '.join(parts)}"
        )


def sync_module_states(model: nn.Module, state: ProcessState, group: Any = None) -> None:
    """Give every process of ``group`` (default: all) the parameters and buffers of the
    group's first process (as DDP does when it wraps).

    Sharding strategies take each process's part of its *local* weights; without this a
    model initialised differently on some process (a rank-dependent seed, say) would be
    silently assembled from different initialisations.
    """
    import torch.distributed as dist

    group = group if group is not None else state.group
    if group is None:
        group = dist.group.WORLD
    if state.num_processes == 1 or dist.get_world_size(group) == 1:
        return
    tensors = [t.detach() for t in [*model.parameters(), *model.buffers()]]
    if any(t.is_meta for t in tensors):
        return  # nothing to copy yet; the weights are materialised or loaded later
    coalesced = getattr(dist, "_broadcast_coalesced", None)
    if coalesced is not None and tensors:
        coalesced(group, tensors, 64 * 1024 * 1024, 0)  # source: the group's first process
    else:
        for tensor in tensors:
            dist.broadcast(tensor, group_src=0, group=group)


def _load_weights(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    model.load_state_dict(tensors, strict=True)


def share_router_statistics(model: nn.Module, state: ProcessState) -> None:
    """A mixture-of-experts model's load-balancing loss over the global batch, as one
    process computes it, when ``state``'s processes see different samples: the loss is a
    product of batch means, so the mean of per-process losses is another number
    (:func:`slipstream.parallel.experts.install_global_aux_loss`; a no-op for other models)."""
    if state.num_processes > 1:
        import torch.distributed as dist

        from ..parallel.experts.aux_loss import install_global_aux_loss

        install_global_aux_loss(model, state.group or dist.group.WORLD)
