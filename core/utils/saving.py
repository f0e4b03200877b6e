"""Saving from one process: ``save``/``load`` in place of ``torch.save``/``torch.load``, state
dicts cleaned for safetensors, and merging a sharded FSDP checkpoint into one file.

Example::

    save(model.state_dict(), "weights.safetensors", safe_serialization=True)  # main process
    wait_for_everyone()
    state_dict = load("weights.bin")      # torch.load(weights_only=True)
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import logging
from collections import defaultdict
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..runtime import xla
from ..runtime.synchronize import process_state

logger = logging.getLogger(__name__)


def id_tensor_storage(tensor: torch.Tensor) -> tuple[torch.device, int, int]:
    """(device, address, size) of the storage under ``tensor``: equal for tensors that
    share memory (tied weights, views)."""
    try:
        storage = tensor.untyped_storage()
        return tensor.device, storage.data_ptr(), storage.nbytes()
    except (NotImplementedError, RuntimeError):  # tensor subclasses without a storage
        return tensor.device, 0, tensor.nelement() * tensor.element_size()


def clean_state_dict_for_safetensors(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` with one name per shared storage (safetensors refuses shared memory;
    the others are dropped with a warning) and contiguous tensors."""
    names: defaultdict[tuple[torch.device, int, int], list[str]] = defaultdict(list)
    for name, value in state_dict.items():
        if isinstance(value, torch.Tensor):
            names[id_tensor_storage(value)].append(name)
    dropped = {name for group in names.values() for name in group[1:]}
    if dropped:
        logger.warning(
            "Removed shared tensor %s while saving: they share memory with another entry "
            "(safetensors stores each storage once); tie them again after loading",
            sorted(dropped),
        )
    return {
        name: value.contiguous() if isinstance(value, torch.Tensor) else value
        for name, value in state_dict.items()
        if name not in dropped
    }


def save(
    obj: Any, f: Any, save_on_each_node: bool = False, safe_serialization: bool = False
) -> None:
    """``torch.save(obj, f)`` on the main process only (on each machine's main process with
    ``save_on_each_node``); ``safe_serialization`` writes a state dict as safetensors."""
    state = process_state()
    if not (state.is_local_main_process if save_on_each_node else state.is_main_process):
        return
    if xla.xla_loaded():  # XLA tensors are written as CPU tensors (as xm.save does)
        obj = xla.to_cpu(obj)
    if safe_serialization:
        from safetensors.torch import save_file

        save_file(clean_state_dict_for_safetensors(obj), f, metadata={"format": "pt"})
    else:
        torch.save(obj, f)


def _numpy_globals() -> list[Any]:
    """What ``torch.load(weights_only=True)`` needs to rebuild NumPy arrays (RNG states)."""
    try:
        import numpy as np
    except ImportError:
        return []
    core = getattr(np, "_core", None) or np.core
    found = [core.multiarray._reconstruct, np.ndarray, np.dtype, codecs.encode]
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        found += [getattr(dtypes, name) for name in dir(dtypes) if name.endswith("DType")]
    return found


@contextlib.contextmanager
def _allowing(extra: list[Any]) -> Iterator[None]:
    allowing = getattr(torch.serialization, "safe_globals", None)
    if allowing is None or not extra:
        yield
        return
    with allowing(extra):
        yield


def load(f: Any, map_location: Any = None, **kwargs: Any) -> Any:
    """``torch.load`` with ``weights_only=True`` unless told otherwise; NumPy arrays (as in
    Accelerate's RNG state files) are allowed too."""
    kwargs.setdefault("weights_only", True)
    extra = _numpy_globals() if kwargs["weights_only"] else []
    with _allowing(extra):
        return torch.load(f, map_location=map_location, **kwargs)


def merge_fsdp_weights(
    checkpoint_dir: str,
    output_path: str,
    safe_serialization: bool = True,
    remove_checkpoint_dir: bool = False,
) -> None:
    """Merge a sharded FSDP checkpoint (torch.distributed.checkpoint: a folder with a
    ``.metadata`` file, or a ``save_state`` folder holding ``pytorch_model_fsdp_0``) into
    ``output_path/model.safetensors`` (``pytorch_model.bin`` without
    ``safe_serialization``; shards and an index above 10GB), on the main process; the
    others wait, and an error on the main process raises on all of them. The command line
    does the same: ``slipstream merge-weights``.

    Example::

        merge_fsdp_weights("ckpt/pytorch_model_fsdp_0", "merged/")
    """
    from ..checkpoint.merge import merge_weights

    merge_weights(
        checkpoint_dir,
        output_path,
        safe_serialization=safe_serialization,
        remove_checkpoint_dir=remove_checkpoint_dir,
    )


def _fsdp_file(model_index: int) -> str:
    """Accelerate's ``pytorch_model_fsdp.bin`` / ``pytorch_model_fsdp_1.bin``."""
    return f"pytorch_model_fsdp{'' if model_index == 0 else f'_{model_index}'}.bin"


def _sharded(fsdp_plugin: Any) -> bool:
    """Whether the plugin (slipstream's, or Accelerate's holding torch's enum) saves shards."""
    kind = getattr(fsdp_plugin, "state_dict_type", "FULL_STATE_DICT")
    return str(getattr(kind, "name", kind)).upper() == "SHARDED_STATE_DICT"


def _state_dict_options(fsdp_plugin: Any, model: torch.nn.Module, adapter_only: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from .introspection import is_peft_model

    full = not _sharded(fsdp_plugin)
    return StateDictOptions(
        full_state_dict=full,
        cpu_offload=full,
        # A PEFT model's adapters are its trainable parameters (Accelerate saves the same).
        ignore_frozen_params=adapter_only and is_peft_model(model),
        strict=not (adapter_only and is_peft_model(model)),
    )


def save_fsdp_model(
    fsdp_plugin: Any,
    accelerator: Any,
    model: torch.nn.Module,
    output_dir: str,
    model_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
) -> None:
    """Save a prepared FSDP model's weights as ``save_state`` does, for Accelerate code
    that calls this directly. Every process must call it.

    With ``SHARDED_STATE_DICT`` every process writes its shards into
    ``output_dir/pytorch_model_fsdp_{model_index}/`` (torch.distributed.checkpoint;
    :func:`merge_fsdp_weights` turns it into one file); with ``FULL_STATE_DICT`` the main
    process writes ``output_dir/pytorch_model_fsdp.bin`` (``_1``... for later models).
    ``adapter_only`` keeps only a PEFT model's trainable (adapter) weights. Sharded weights
    are always written with torch.distributed.checkpoint (``use_dcp=False``, Accelerate's
    per-rank files, is refused).

    Example::

        save_fsdp_model(accelerator.state.fsdp_plugin, accelerator, model, "out")
        merge_fsdp_weights("out/pytorch_model_fsdp_0", "merged")
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from ..checkpoint.io import CheckpointWriter
    from ..checkpoint.layout import everyone
    from ..checkpoint.names import model_folder
    from ..checkpoint.sharded import dcp_writer_arguments
    from ..checkpoint.storage import Storage

    state = accelerator.state
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    options = _state_dict_options(fsdp_plugin, model, adapter_only)
    if not use_dcp and not options.full_state_dict:
        raise ValueError(
            "save_fsdp_model(use_dcp=False) writes per-rank files that load only on as many "
            "processes; slipstream writes sharded weights with torch.distributed.checkpoint "
            "(use_dcp=True), which loads on any number"
        )
    state_dict = get_model_state_dict(model, options=options)
    storage = Storage.for_url(output_dir)
    writer = CheckpointWriter(storage, storage.root, state)
    if options.full_state_dict:
        name = _fsdp_file(model_index)
        everyone(state, lambda: writer.save_object(name, state_dict) if writer.owner else None)
    else:
        dcp.save({"model": state_dict}, **dcp_writer_arguments(writer, model_folder(model_index)))


def load_fsdp_model(
    fsdp_plugin: Any,
    accelerator: Any,
    model: torch.nn.Module,
    input_dir: str,
    model_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
) -> None:
    """Load what :func:`save_fsdp_model` wrote (or Accelerate's function of that name) into
    a prepared model, in its current layout (any number of processes for sharded weights).
    Every process must call it.

    Example::

        load_fsdp_model(accelerator.state.fsdp_plugin, accelerator, model, "out")
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
    )

    from ..checkpoint.io import CheckpointReader
    from ..checkpoint.names import model_folder
    from ..checkpoint.sharded import dcp_reader_arguments
    from ..checkpoint.storage import Storage

    model = getattr(model, "_orig_mod", model)
    options = _state_dict_options(fsdp_plugin, model, adapter_only)
    if not use_dcp and not options.full_state_dict:
        raise ValueError("load_fsdp_model(use_dcp=False): see save_fsdp_model; use use_dcp=True")
    storage = Storage.for_url(input_dir)
    reader = CheckpointReader(storage, storage.root, accelerator.state, {})
    if options.full_state_dict:
        full = load(storage.readable(reader.require(_fsdp_file(model_index), "FSDP weights")))
        # Every process read the file: no broadcast needed, each takes its shards.
        set_model_state_dict(model, full, options=dataclasses.replace(options, cpu_offload=False))
        return
    # Accelerate accepts the pytorch_model_fsdp_N folder itself or the folder holding it.
    name = "" if "pytorch_model_fsdp" in storage.name(storage.root) else model_folder(model_index)
    state_dict = get_model_state_dict(model, options=options)
    dcp.load({"model": state_dict}, **dcp_reader_arguments(reader, name))
    set_model_state_dict(model, state_dict, options=options)


def _optimizer_strategy(accelerator: Any, fsdp_plugin: Any, use_dcp: bool, caller: str) -> Any:
    strategy = accelerator.strategy
    if not use_dcp and _sharded(fsdp_plugin):
        raise ValueError(
            f"{caller}(use_dcp=False) writes per-rank files that load only on as many "
            "processes; slipstream writes sharded optimizer state with "
            "torch.distributed.checkpoint (use_dcp=True), which loads on any number"
        )
    if _sharded(fsdp_plugin) != _sharded(getattr(strategy, "plugin", None)):
        raise ValueError(
            f"{caller}: the plugin asks for {getattr(fsdp_plugin, 'state_dict_type', None)} "
            "but the Accelerator's strategy saves "
            f"{getattr(getattr(strategy, 'plugin', None), 'state_dict_type', 'FULL_STATE_DICT')}"
            ": pass accelerator.state.fsdp_plugin"
        )
    return strategy


def save_fsdp_optimizer(
    fsdp_plugin: Any,
    accelerator: Any,
    optimizer: Any,
    model: torch.nn.Module,
    output_dir: str,
    optimizer_index: int = 0,
    use_dcp: bool = True,
) -> None:
    """Save a prepared FSDP optimizer's state as ``save_state`` does, through the
    Accelerator's strategy; every process must call it. ``SHARDED_STATE_DICT`` writes
    ``output_dir/optimizer_{optimizer_index}/`` (torch.distributed.checkpoint, loadable on
    any number of processes), ``FULL_STATE_DICT`` ``output_dir/optimizer.bin`` (main process).

    Example::

        save_fsdp_optimizer(accelerator.state.fsdp_plugin, accelerator, optimizer, model, "out")
    """
    from ..checkpoint.io import CheckpointWriter
    from ..checkpoint.layout import everyone
    from ..checkpoint.storage import Storage

    strategy = _optimizer_strategy(accelerator, fsdp_plugin, use_dcp, "save_fsdp_optimizer")
    storage = Storage.for_url(output_dir)
    writer = CheckpointWriter(storage, storage.root, accelerator.state)
    inner = getattr(optimizer, "optimizer", optimizer)  # a prepared optimizer's own
    everyone(
        accelerator.state,
        lambda: strategy.save_optimizer_checkpoint(inner, writer, optimizer_index),
    )


def load_fsdp_optimizer(
    fsdp_plugin: Any,
    accelerator: Any,
    optimizer: Any,
    model: torch.nn.Module,
    input_dir: str,
    optimizer_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
) -> None:
    """Load what :func:`save_fsdp_optimizer` wrote into a prepared optimizer, in its
    current layout; every process must call it.

    Example::

        load_fsdp_optimizer(accelerator.state.fsdp_plugin, accelerator, optimizer, model, "out")
    """
    from ..checkpoint.io import CheckpointReader
    from ..checkpoint.layout import everyone
    from ..checkpoint.names import optimizer_folder
    from ..checkpoint.storage import Storage

    strategy = _optimizer_strategy(accelerator, fsdp_plugin, use_dcp, "load_fsdp_optimizer")
    storage = Storage.for_url(input_dir)
    root = storage.root
    if storage.name(root) == optimizer_folder(optimizer_index):  # Accelerate takes it too
        root = storage.parent(root)
    reader = CheckpointReader(storage, root, accelerator.state, {})
    inner = getattr(optimizer, "optimizer", optimizer)
    apply = everyone(
        accelerator.state,
        lambda: strategy.load_optimizer_checkpoint(inner, reader, optimizer_index),
    )
    apply()
