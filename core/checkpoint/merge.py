"""Sharded weights read back whole in one process, without a process group and without the
number of processes that wrote them: torch.distributed.checkpoint folders (FSDP2, the
model-parallel strategy) and DeepSpeed ZeRO checkpoints. ``slipstream merge-weights`` and
``merge_fsdp_weights`` are built on these.

Example::

    state = load_sharded_weights(find_sharded_weights("checkpoints/step_100"))
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Any

from ..options.errors import ConfigError
from .names import model_folder

if TYPE_CHECKING:
    import torch


def find_sharded_weights(checkpoint: str, model_index: int = 0) -> str:
    """The torch.distributed.checkpoint folder holding the weights inside ``checkpoint``."""
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
