"""Lightning-style callbacks for plain scripts: ``Accelerator(callbacks=[...])``.

Each callback's module is imported on first use: an Accelerator without the monitors and the
guard never loads them (benchmarks/startup.py).
"""

from __future__ import annotations

from ..runtime.lazy import lazy_exports
from .base import Callback
from .runner import CallbackError, CallbackRunner

_EXPORTS = {
    "BadStepGuard": "guard",
    "BadStepError": "guard",
    "EarlyStopping": "builtin",
    "GradientNormMonitor": "builtin",
    "StragglerMonitor": "stragglers",
    "ThroughputMonitor": "throughput",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

__all__ = [
    "BadStepError",
    "BadStepGuard",
    "Callback",
    "CallbackError",
    "CallbackRunner",
    "EarlyStopping",
    "GradientNormMonitor",
    "StragglerMonitor",
    "ThroughputMonitor",
]
