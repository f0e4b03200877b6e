"""``slipstream merge-weights CHECKPOINT OUTPUT_DIR``: consolidate sharded weights.

Turns a sharded checkpoint — torch.distributed.checkpoint (FSDP with SHARDED_STATE_DICT) or
a DeepSpeed ZeRO checkpoint, or a ``save_state`` folder holding either — into safetensors
in one process, without a process group and without the original number of processes.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import TYPE_CHECKING, Any

from ..config import ConfigError

if TYPE_CHECKING:
    import torch

# Names of torch dtypes; torch itself is imported only when merging (`--help` stays fast).
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "merge-weights",
        help="merge a sharded checkpoint into safetensors",
        description=__doc__.splitlines()[0],
    )
    parser.set_defaults(run=run)
    parser.add_argument("checkpoint", help="a save_state folder or a sharded checkpoint folder")
    parser.add_argument("output_dir", help="where model.safetensors (and shards) go")
    parser.add_argument(
        "--dtype",
        choices=sorted(_DTYPES),
        default="fp32",
        help="cast floating-point weights (default fp32)",
    )
    parser.add_argument(
        "--max_shard_size",
        "--max-shard-size",
        default="10GB",
        help="split into shards of at most this size (default 10GB)",
    )
    parser.add_argument(
        "--model_index",
        "--model-index",
        type=int,
        default=0,
        help="which prepared model of a save_state folder (default 0)",
    )
    parser.add_argument(
        "--unsafe_serialization",
        "--unsafe-serialization",
        action="store_true",
        help="write pytorch_model.bin instead of safetensors",
    )


def find_sharded_weights(checkpoint: str, model_index: int = 0) -> str:
    """The torch.distributed.checkpoint folder holding the weights inside ``checkpoint``."""
    if not os.path.isdir(checkpoint):
        raise ConfigError(f"{checkpoint} is not a folder")
    if os.path.isfile(os.path.join(checkpoint, ".metadata")):
        return checkpoint
    candidate = os.path.join(checkpoint, f"pytorch_model_fsdp_{model_index}")
    if os.path.isfile(os.path.join(candidate, ".metadata")):
        return candidate
    present = ", ".join(sorted(os.listdir(checkpoint))) or "nothing"
    raise ConfigError(
        f"{checkpoint} holds no sharded weights (expected a .metadata file or "
        f"pytorch_model_fsdp_{model_index}/); it contains: {present}"
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


def run(args: argparse.Namespace) -> int:
    import torch

    from ..checkpoint import save_weights

    deepspeed = find_deepspeed_checkpoint(args.checkpoint)
    if deepspeed is not None:
        folder = deepspeed[0]
        state = load_deepspeed_weights(*deepspeed)
    else:
        folder = find_sharded_weights(args.checkpoint, args.model_index)
        state = load_sharded_weights(folder)
    names = save_weights(
        state,
        args.output_dir,
        max_shard_size=args.max_shard_size,
        safe_serialization=not args.unsafe_serialization,
        dtype=getattr(torch, _DTYPES[args.dtype]),
        progress=True,
    )
    total = sum(t.numel() for t in state.values())
    print(
        f"merged {len(state)} tensors ({total:,} parameters) from {folder} into "
        f"{args.output_dir}: {', '.join(names)}"
    )
    return 0
