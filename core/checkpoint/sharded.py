"""Sharded checkpoint parts written with torch.distributed.checkpoint (DCP).

Sharded strategies (FSDP2, the model-parallel strategy) save each model and optimizer as a
DCP folder: every process writes its own shards, and the metadata records each tensor's
global shape, so any number of processes — or one, with plain tensors — can read it back
in whatever layout it uses. These helpers are shared by all strategies, so a checkpoint
written under one layout loads under any other.

Example::

    dcp.save({"model": state}, **dcp_writer_arguments(writer, model_folder(0)))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from .io import CheckpointReader, CheckpointWriter

_CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."


def clean_name(name: str) -> str:
    """A parameter name without activation checkpointing's wrapper prefix."""
    return name.replace(_CHECKPOINT_PREFIX, "")


def dcp_writer_arguments(writer: CheckpointWriter, name: str) -> dict[str, Any]:
    path = writer.path(name)
    if writer.storage.is_local:
        return {"checkpoint_id": path}
    from torch.distributed.checkpoint import FsspecWriter  # type: ignore[attr-defined]

    return {"storage_writer": FsspecWriter(writer.storage.url(path))}


def dcp_reader_arguments(reader: CheckpointReader, name: str) -> dict[str, Any]:
    path = reader.path(name)
    if reader.storage.is_local:
        from torch.distributed.checkpoint import FileSystemReader

        return {"storage_reader": FileSystemReader(path)}
    from torch.distributed.checkpoint import FsspecReader  # type: ignore[attr-defined]

    return {"storage_reader": FsspecReader(reader.storage.url(path))}


def has_part(reader: CheckpointReader, name: str) -> bool:
    return bool(reader.storage.exists(reader.path(name)))


def check_shapes(model: nn.Module, reader: CheckpointReader, name: str) -> None:
    """Raise before loading when the saved tensors' names or global shapes differ from the
    model's, naming what differs."""
    where = reader.storage.url(reader.path(name))
    metadata = dcp_reader_arguments(reader, name)["storage_reader"].read_metadata()
    saved = {
        key[len("model.") :]: tuple(item.size)
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith("model.") and hasattr(item, "size")
    }
    expected = {clean_name(k): tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(saved))
    # A pipeline stage holds part of the model: the other stages' tensors are not its own.
    partial = getattr(model, "_pipeline", None) is not None
    unexpected = [] if partial else sorted(set(saved) - set(expected))
    wrong = [f"{k} {saved[k]} vs {v}" for k, v in expected.items() if k in saved and saved[k] != v]
    if missing or unexpected or wrong:
        raise ValueError(
            f"the sharded weights in {where} do not fit {type(model).__name__}: missing "
            f"{missing[:5]}, unexpected {unexpected[:5]}, different shapes {wrong[:5]}"
        )


def load_model_part(model: nn.Module, reader: CheckpointReader, name: str) -> None:
    """Read a sharded model part into ``model`` in its current layout (any sharding, or
    plain tensors)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = get_model_state_dict(model)
    dcp.load({"model": state}, **dcp_reader_arguments(reader, name))
    set_model_state_dict(model, state)


def load_optimizer_part(
    model: nn.Module, optimizer: Any, reader: CheckpointReader, name: str
) -> None:
    """Read a sharded optimizer part into ``optimizer`` (of ``model``) in its current
    layout; parameters are matched by name, so the layout may differ from the saved one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    state = optimizer_part(model, optimizer)
    dcp.load({"optimizer": state}, **dcp_reader_arguments(reader, name))
    set_optimizer_state_dict(model, optimizer, state, options=_flat())


def optimizer_part(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """The optimizer's sharded state keyed by parameter name. Hyperparameters are flattened
    to one entry per parameter: a pipeline stage's processes hold different parameters,
    and a single shared ``param_groups`` entry would keep only one stage's."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_flat())


def _flat() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)
