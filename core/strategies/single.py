"""One process on one device: models are only moved to the device."""

from __future__ import annotations

from typing import ClassVar

from .base import Strategy


class SingleDeviceStrategy(Strategy):
    """No communication at all; what a laptop run uses."""

    name: ClassVar[str] = "single"
