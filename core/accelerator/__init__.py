"""The Accelerator facade and the parts it is assembled from: setup (assembly), prepare()
(preparation), the training step, run information, uneven inputs, profiling and compile.

Example::

    from slipstream.accelerator import Accelerator
    accelerator = Accelerator(mixed_precision="bf16")
"""

from .accelerator import Accelerator

__all__ = ["Accelerator"]
