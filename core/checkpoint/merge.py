"""Sharded weights read back whole in one process, without a process group and without the
number of processes that wrote them: torch.distributed.checkpoint folders (FSDP2, the
model-parallel strategy) and DeepSpeed ZeRO checkpoints. ``slipstream merge-weights``,
``merge_command`` and ``merge_fsdp_weights`` are built on :func:`merge_weights`.

Example::

    state = load_sharded_weights(find_sharded_weights("checkpoints/step_100"))
    merge_weights("checkpoints/step_100", "merged/")   # model.safetensors, on the main process
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..options.errors import ConfigError
from ..runtime.synchronize import process_state
from .layout import everyone
from .names import model_folder
from .weights import save_weights

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Merged:
    """What :func:`merge_weights` did: the folder it read, the files it wrote, the size."""

    source: str
    files: list[str]
    tensors: int
    parameters: int


def merge_weights(
    checkpoint: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    safe_serialization: bool = True,
    remove_checkpoint_dir: bool = False,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "10GB",
    model_index: int = 0,
    progress: bool = False,
) -> Merged | None:
    """Merge a sharded checkpoint (a torch.distributed.checkpoint folder, a DeepSpeed ZeRO
    checkpoint, or a ``save_state`` folder holding either) into ``output_dir`` as
    ``model.safetensors`` (``pytorch_model.bin`` without ``safe_serialization``; shards and
    an index above ``max_shard_size``). Only the main process merges; call it on every
    process of a job (an error on the main process raises on all). Returns what was merged
    on the main process, ``None`` on the others.

    Example::

        merge_weights("ckpt/pytorch_model_fsdp_0", "out/", dtype=torch.bfloat16)
    """
    state = process_state()

    def merge() -> Merged | None:
        if not state.is_main_process:
            return None
        source = os.fspath(checkpoint)
        deepspeed = find_deepspeed_checkpoint(source)
        if deepspeed is not None:
            folder, weights = deepspeed[0], load_deepspeed_weights(*deepspeed)
        else:
            folder = find_sharded_weights(source, model_index)
            weights = load_sharded_weights(folder)
        files = save_weights(
            weights,
            os.fspath(output_dir),
            max_shard_size=max_shard_size,
            safe_serialization=safe_serialization,
            dtype=dtype,
            progress=progress,
        )
        if remove_checkpoint_dir:
            shutil.rmtree(source)
        parameters = sum(t.numel() for t in weights.values())
        return Merged(folder, files, len(weights), parameters)

    return everyone(state, merge)


def find_sharded_weights(checkpoint: str, model_index: int = 0) -> str:
    """The torch.distributed.checkpoint folder holding the weights inside ``checkpoint``."""
    if not os.path.exists(checkpoint):
        raise ConfigError(f"{checkpoint} does not exist: pass the folder save_state wrote")
    if not os.path.isdir(checkpoint):
        raise ConfigError(f"{checkpoint} is not a folder")
    if os.path.isfile(os.path.join(checkpoint, ".metadata")):
        return checkpoint
    candidate = os.path.join(checkpoint, model_folder(model_index))
    if os.path.isfile(os.path.join(candidate, ".metadata")):
        return candidate
    present = ", ".join(sorted(os.listdir(checkpoint))) or "nothing"
    raise ConfigError(
        f"{checkpoint} holds no sharded weights (expected a .metadata file or "
        f"{model_folder(model_index)}/); it contains: {present}"
    )


def load_sharded_weights(folder: str) -> dict[str, torch.Tensor]:
    """All weights of a torch.distributed.checkpoint folder, in this process."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as scratch:
        merged = os.path.join(scratch, "merged.pt")
        dcp_to_torch_save(folder, merged)
        state: dict[str, Any] = torch.load(merged, weights_only=True)
    if set(state) == {"model"}:
        state = state["model"]
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def find_deepspeed_checkpoint(checkpoint: str) -> tuple[str, str | None] | None:
    """(folder, tag) of a DeepSpeed ZeRO checkpoint in ``checkpoint``, if there is one."""
    if os.path.isfile(os.path.join(checkpoint, "latest")):
        return checkpoint, None  # DeepSpeed reads the tag from "latest"
    parent, tag = os.path.split(os.path.normpath(checkpoint))
    names = os.listdir(checkpoint) if os.path.isdir(checkpoint) else []
    if any(name.startswith(("zero_pp_rank_", "bf16_zero_pp_rank_")) for name in names):
        return parent, tag
    return None


def load_deepspeed_weights(folder: str, tag: str | None) -> dict[str, torch.Tensor]:
    """fp32 weights of a ZeRO checkpoint of any stage, in this process (no process group)."""
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError:
        raise ConfigError(
            f"{folder} is a DeepSpeed checkpoint; merging it needs DeepSpeed installed"
        ) from None
    import torch

    state = get_fp32_state_dict_from_zero_checkpoint(folder, tag=tag)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
