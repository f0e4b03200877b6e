"""Per-step fault tolerance with torchft: replica groups that drop out and rejoin per step.

torchft is imported only when fault tolerance is turned on (``import slipstream`` never
imports it). See docs/fault-tolerance.md.
"""

from __future__ import annotations

from .controller import FaultTolerance, build_fault_tolerance
from .data import FaultTolerantDataLoader
from .lighthouse import Lighthouse

__all__ = ["FaultTolerance", "FaultTolerantDataLoader", "Lighthouse", "build_fault_tolerance"]
