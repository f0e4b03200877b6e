"""Fault tolerance with torchft: replica groups that drop out and rejoin per step, or per
interval of semi-synchronous training (LocalSGD, DiLoCo).

torchft is imported only when fault tolerance is turned on (``import slipstream`` never
imports it). See docs/fault-tolerance.md.
"""

from __future__ import annotations

from .build import build_fault_tolerance
from .controller import FaultTolerance
from .data import FaultTolerantDataLoader
from .lighthouse import Lighthouse

__all__ = ["FaultTolerance", "FaultTolerantDataLoader", "Lighthouse", "build_fault_tolerance"]
