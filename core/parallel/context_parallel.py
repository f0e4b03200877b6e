"""Context parallelism: each process of the ``cp`` group holds a slice of every sequence and
attention exchanges keys and values through torch's context-parallel SDPA.

torch implements it for CUDA attention kernels only (on CPU its DTensor dispatch has no
rule for the CPU flash-attention kernel), so slipstream refuses ``cp_size > 1`` elsewhere
instead of letting attention run on a partial sequence.

Example (inside the training loop, like Accelerate)::

    with accelerator.maybe_context_parallel(
        buffers=[input_ids, labels], buffer_seq_dims=[1, 1], no_restore_buffers={input_ids, labels}
    ):
        loss = model(input_ids=input_ids, labels=labels).loss
        accelerator.backward(loss)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from .config import ParallelismConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def check_context_parallel_supported(device: torch.device) -> None:
    """Raise unless torch can run context-parallel attention on ``device``."""
    if device.type != "cuda":
        raise ParallelismConfigError(
            f"cp_size > 1 needs torch's context-parallel attention, which torch provides for "
            f"CUDA devices only; this process runs on {device.type}. Use cp_size=1 here (split "
            "the work with dp_shard_size or tp_size instead), or run on GPUs"
        )
    try:
        from torch.distributed.tensor.experimental import context_parallel  # noqa: F401
    except ImportError:
        raise ParallelismConfigError(
            f"cp_size > 1 needs torch.distributed.tensor.experimental.context_parallel, which "
            f"torch {torch.__version__} does not have; install torch>=2.7"
        ) from None


def check_context_parallel_model(model: nn.Module) -> None:
    """Raise when a transformers model does not route attention through SDPA."""
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation is not None and implementation != "sdpa":
        raise ParallelismConfigError(
            f"cp_size > 1 splits attention through torch's scaled_dot_product_attention, but "
            f"{type(model).__name__} uses attn_implementation={implementation!r}; load it with "
            "attn_implementation='sdpa'"
        )


@contextlib.contextmanager
def context_parallel_region(
    cp_mesh: DeviceMesh,
    buffers: list[torch.Tensor],
    buffer_seq_dims: list[int],
    no_restore_buffers: set[torch.Tensor] | None,
    comm_strategy: str,
) -> Iterator[None]:
    """Shard ``buffers`` along their sequence dims over ``cp_mesh`` (in place) and run SDPA
    context-parallel inside the block."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    if len(buffers) != len(buffer_seq_dims):
        raise ValueError(
            f"maybe_context_parallel got {len(buffers)} buffers but {len(buffer_seq_dims)} "
            "buffer_seq_dims; give the sequence dimension of each buffer"
        )
    chunks = 2 * cp_mesh.size()  # torch balances causal work with 2 chunks per process
    for index, (buffer, dim) in enumerate(zip(buffers, buffer_seq_dims, strict=True)):
        if buffer.shape[dim] % chunks:
            raise ValueError(
                f"buffer {index} has sequence length {buffer.shape[dim]} (dim {dim}), which "
                f"2 x cp_size = {chunks} does not divide; pad sequences to a multiple of {chunks}"
            )
    set_rotate_method(comm_strategy)
    with context_parallel(
        cp_mesh,
        buffers=buffers,
        buffer_seq_dims=buffer_seq_dims,
        no_restore_buffers=no_restore_buffers or set(),
    ):
        yield
