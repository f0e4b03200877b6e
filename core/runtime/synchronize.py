"""Keeping processes in step without an Accelerator: a barrier, and the same random numbers.

:func:`synchronize_rng_states` copies process 0's generator states to every process, so
shuffles and random augmentations that should agree do. Every process must call these.

Example::

    generator = torch.Generator()
    synchronize_rng_states(["torch", "generator"], generator=generator)
    wait_for_everyone()
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..options.choices import RNGType
from .collectives import broadcast
from .state import ProcessState


def process_state() -> ProcessState:
    """This process's state: an Accelerator's or PartialState's, else a new one (joining the
    process group the launcher describes)."""
    from .partial_state import PartialState

    return PartialState().state


def wait_for_everyone() -> None:
    """Block until every process reaches this line (nothing on a single process)."""
    process_state().wait_for_everyone()


def _current(rng_type: RNGType, generator: torch.Generator | None) -> torch.Tensor:
    if rng_type is RNGType.TORCH:
        return torch.get_rng_state()
    if rng_type is RNGType.CUDA:
        if not torch.cuda.is_available():
            raise ValueError("cannot synchronize the CUDA generator: this process sees no GPU")
        return torch.cuda.get_rng_state()
    if rng_type is RNGType.GENERATOR:
        if generator is None:
            raise ValueError("synchronizing RNGType.GENERATOR needs generator=")
        return generator.get_state()
    raise ValueError(
        f"cannot synchronize the {rng_type.value} generator: slipstream runs on CPUs and CUDA "
        "GPUs (use 'torch', 'cuda' or 'generator')"
    )


def synchronize_rng_state(
    rng_type: RNGType | str | None = None, generator: torch.Generator | None = None
) -> None:
    """Give every process the state process 0's generator ``rng_type`` has (``torch``, the
    default: the CPU generator; ``cuda``: this GPU's; ``generator``: ``generator``)."""
    kind = RNGType(rng_type) if rng_type is not None else RNGType.TORCH
    rng_state = _current(kind, generator)
    state = process_state()
    if state.num_processes > 1:
        # NCCL moves GPU tensors only; the generator states are CPU byte tensors.
        on_device = rng_state.to(state.device)
        rng_state = broadcast(on_device, from_process=0, state=state).cpu()
    if kind is RNGType.TORCH:
        torch.set_rng_state(rng_state)
    elif kind is RNGType.CUDA:
        torch.cuda.set_rng_state(rng_state)
    else:
        assert generator is not None  # _current checked it
        generator.set_state(rng_state)


def synchronize_rng_states(
    rng_types: Iterable[RNGType | str], generator: torch.Generator | None = None
) -> None:
    """:func:`synchronize_rng_state` for each of ``rng_types``.

    Example::

        synchronize_rng_states(["torch", "cuda"])
    """
    for rng_type in rng_types:
        synchronize_rng_state(RNGType(rng_type), generator=generator)
