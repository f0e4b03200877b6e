"""Helpers for tests of distributed code that Accelerate users import from
``accelerate.test_utils`` and that need the running job (``slipstream migrate`` points those
imports here; plain fixtures such as ``RegressionModel`` stay Accelerate's).

Example::

    from slipstream.test_utils import are_the_same_tensors
    assert are_the_same_tensors(torch.get_rng_state())   # every process holds the same
"""

from __future__ import annotations

import torch

from .runtime.collectives import gather
from .runtime.state import current_state

__all__ = ["are_the_same_tensors"]


def are_the_same_tensors(tensor: torch.Tensor) -> bool:
    """Whether every process holds a tensor equal to this process's ``tensor`` (a
    collective: every process must call it)."""
    state = current_state()
    everyone = gather(tensor[None].clone().to(state.device), state=state).cpu()
    mine = tensor.cpu()
    return all(torch.equal(row, mine) for row in everyone)
