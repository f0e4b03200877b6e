"""``slipstream merge-weights CHECKPOINT OUTPUT_DIR``: consolidate sharded weights.

Turns a sharded checkpoint — torch.distributed.checkpoint (FSDP with SHARDED_STATE_DICT) or
a DeepSpeed ZeRO checkpoint, or a ``save_state`` folder holding either — into safetensors
in one process, without a process group and without the original number of processes.
"""

from __future__ import annotations

import argparse
from typing import Any

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


def run(args: argparse.Namespace) -> int:
    import torch

    from ..checkpoint import save_weights
    from ..checkpoint.merge import (
        find_deepspeed_checkpoint,
        find_sharded_weights,
        load_deepspeed_weights,
        load_sharded_weights,
    )

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
