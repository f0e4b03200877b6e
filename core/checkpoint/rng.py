"""Every random number generator a training process draws from, as plain checkpointable data.

Example::

    states = capture_rng_states()
    ...
    restore_rng_states(states)   # the next draws repeat exactly
"""

from __future__ import annotations

import random
from typing import Any

import torch

from ..runtime import xla


def capture_rng_states() -> dict[str, Any]:
    """Python, NumPy (if installed), torch CPU, CUDA and XLA generator states."""
    version, internal, gauss = random.getstate()
    states: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "torch": torch.get_rng_state(),
    }
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        kind, keys, position, has_gauss, cached = np.random.get_state(legacy=True)
        keys = np.asarray(keys)
        states["numpy"] = {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype("int64")),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    xla_state = xla.rng_state()  # only when torch_xla is in use
    if xla_state is not None:
        states["xla"] = xla_state
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    """Put back what :func:`capture_rng_states` returned."""
    python = states["python"]
    random.setstate((python["version"], tuple(python["state"]), python["gauss"]))
    torch.set_rng_state(states["torch"])
    if "numpy" in states:
        import numpy as np

        saved = states["numpy"]
        np.random.set_state(
            (
                saved["kind"],
                saved["keys"].numpy().astype("uint32"),
                saved["position"],
                saved["has_gauss"],
                saved["cached"],
            )
        )
    if "cuda" in states and torch.cuda.is_available():
        cuda_states = list(states["cuda"])[: torch.cuda.device_count()]
        torch.cuda.set_rng_state_all(cuda_states)
    if "xla" in states:
        xla.set_rng_state(states["xla"])
