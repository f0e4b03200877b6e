"""``slipstream merge-weights CHECKPOINT OUTPUT_DIR``: consolidate sharded weights.

Turns a sharded checkpoint — torch.distributed.checkpoint (FSDP with SHARDED_STATE_DICT) or
a DeepSpeed ZeRO checkpoint, or a ``save_state`` folder holding either — into safetensors
in one process, without a process group and without the original number of processes.

This module is also what ``accelerate.commands.merge`` becomes: :func:`merge_command_parser`
and :func:`merge_command` take Accelerate's arguments, so scripts that build the command
themselves run unchanged::

    from slipstream.cli.merge_weights import merge_command, merge_command_parser

    args = merge_command_parser().parse_args(["ckpt/pytorch_model_fsdp_0", "out"])
    merge_command(args)   # on every process: the main process merges, the others wait
"""

from __future__ import annotations

import argparse
from typing import Any

from .text import description

# Names of torch dtypes; torch itself is imported only when merging (`--help` stays fast).
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_DESCRIPTION = description(__doc__, paragraphs=2)


def merge_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The ``merge-weights`` parser, with Accelerate's arguments (``checkpoint_directory``,
    ``output_path``, ``--unsafe_serialization``, ``--remove_checkpoint_dir``) and
    slipstream's (``--dtype``, ``--max_shard_size``, ``--model_index``). Given the
    subcommands of a parser, adds itself there and sets ``func`` to :func:`merge_command`,
    as Accelerate's does.

    Example::

        args = merge_command_parser().parse_args(["ckpt", "out", "--unsafe_serialization"])
    """
    if subparsers is not None:
        parser = subparsers.add_parser(
            "merge-weights",
            help="merge a sharded checkpoint into safetensors",
            description=_DESCRIPTION,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    else:
        parser = argparse.ArgumentParser(
            prog="slipstream merge-weights",
            description=_DESCRIPTION,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    parser.add_argument(
        "checkpoint_directory",
        metavar="CHECKPOINT",
        help="a save_state folder or a sharded checkpoint folder",
    )
    parser.add_argument(
        "output_path", metavar="OUTPUT_DIR", help="where model.safetensors (and shards) go"
    )
    parser.add_argument(
        "--unsafe_serialization",
        "--unsafe-serialization",
        action="store_true",
        help="write pytorch_model.bin instead of safetensors",
    )
    parser.add_argument(
        "--remove_checkpoint_dir",
        "--remove-checkpoint-dir",
        action="store_true",
        help="delete CHECKPOINT after merging",
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(_DTYPES),
        default=None,
        help="cast floating-point weights (default: keep the saved dtype)",
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
    if subparsers is not None:
        parser.set_defaults(func=merge_command, run=run)
    return parser


def register(subparsers: Any) -> None:
    merge_command_parser(subparsers)


def merge_command(args: argparse.Namespace) -> None:
    """Merge as the parsed ``args`` say (Accelerate's ``merge_command``): the main process
    merges, the others wait; an error on the main process raises on every process."""
    _merge(args, progress=False)


def run(args: argparse.Namespace) -> int:
    merged = _merge(args, progress=True)
    if merged is not None:
        print(
            f"merged {merged.tensors} tensors ({merged.parameters:,} parameters) from "
            f"{merged.source} into {args.output_path}: {', '.join(merged.files)}"
        )
    return 0


def _merge(args: argparse.Namespace, progress: bool) -> Any:
    import torch

    from ..checkpoint.merge import merge_weights

    dtype = getattr(args, "dtype", None)
    return merge_weights(
        args.checkpoint_directory,
        args.output_path,
        safe_serialization=not args.unsafe_serialization,
        remove_checkpoint_dir=args.remove_checkpoint_dir,
        dtype=getattr(torch, _DTYPES[dtype]) if dtype else None,
        max_shard_size=getattr(args, "max_shard_size", "10GB"),
        model_index=getattr(args, "model_index", 0),
        progress=progress,
    )
