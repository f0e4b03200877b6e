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
import logging
import os
import shutil
from collections import defaultdict
from collections.abc import Iterator, Mapping
from typing import Any

import torch

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
            "removed tensors that share memory with another entry while saving: %s (tie them "
            "again after loading)",
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
    others wait. The command line does the same: ``slipstream merge-weights``.
    """
    from ..checkpoint import save_weights
    from ..checkpoint.merge import find_sharded_weights, load_sharded_weights

    state = process_state()
    if state.is_main_process:
        folder = find_sharded_weights(os.fspath(checkpoint_dir))
        save_weights(
            load_sharded_weights(folder),
            os.fspath(output_path),
            safe_serialization=safe_serialization,
        )
        if remove_checkpoint_dir:
            shutil.rmtree(checkpoint_dir)
    state.wait_for_everyone()
