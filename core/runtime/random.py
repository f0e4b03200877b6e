"""Seeding every random number generator a training script touches.

Example::

    set_seed(42)                          # same on every process
    set_seed(42, device_specific=True)    # 42 + process_index: different dropout per rank
"""

from __future__ import annotations

import random as _random

import torch

from . import xla
from .state import current_state


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed Python's ``random``, NumPy (if installed) and torch (CPU, GPUs, XLA device).

    ``device_specific`` adds the process index so each process draws differently;
    ``deterministic`` also asks torch for deterministic algorithms.
    """
    if device_specific:
        seed += current_state().process_index
    _random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device
    xla.set_rng_state(seed)  # the XLA generator, when torch_xla is in use
    if deterministic:
        torch.use_deterministic_algorithms(True)
