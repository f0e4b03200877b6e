"""Lightning-style callbacks for plain scripts: ``Accelerator(callbacks=[...])``."""

from .base import Callback
from .builtin import EarlyStopping, GradientNormMonitor
from .guard import BadStepGuard
from .runner import CallbackError, CallbackRunner
from .stragglers import StragglerMonitor
from .throughput import ThroughputMonitor

__all__ = [
    "BadStepGuard",
    "Callback",
    "CallbackError",
    "CallbackRunner",
    "EarlyStopping",
    "GradientNormMonitor",
    "StragglerMonitor",
    "ThroughputMonitor",
]
