"""Lightning-style callbacks for plain scripts: ``Accelerator(callbacks=[...])``."""

from .base import Callback
from .builtin import EarlyStopping, GradientNormMonitor, ThroughputMonitor
from .runner import CallbackError, CallbackRunner

__all__ = [
    "Callback",
    "CallbackError",
    "CallbackRunner",
    "EarlyStopping",
    "GradientNormMonitor",
    "ThroughputMonitor",
]
