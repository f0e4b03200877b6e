"""The error every part of ``slipstream.parallel`` raises for a layout or plan that cannot
work. A :class:`~slipstream.options.errors.ConfigError`, so ``slipstream launch`` ends the job
with exit code 2 and the message, the same on every process.

Example::

    raise ParallelismConfigError("tp_size=3 does not divide the 32 heads of ...")
"""

from __future__ import annotations

from ..options.errors import ConfigError


class ParallelismConfigError(ConfigError):
    """The parallel sizes or options cannot work with this job or model."""
