"""Lightning integration: slipstream's DDP / FSDP2 / DeepSpeed / N-D parallelism, precision
and checkpoints behind ``lightning.pytorch.Trainer(strategy="slipstream")``.

Importing this package imports Lightning (that is the point of importing it) and registers
the strategy names with Lightning's ``StrategyRegistry``:

``slipstream`` (what ``slipstream launch`` or the config says, DDP by default),
``slipstream_ddp``, ``slipstream_fsdp``, ``slipstream_deepspeed``,
``slipstream_deepspeed_stage_1``, ``slipstream_deepspeed_stage_2``,
``slipstream_deepspeed_stage_3``, ``slipstream_deepspeed_stage_3_offload``,
``slipstream_model_parallel`` (tensor and expert parallelism inside FSDP2/HSDP; the layout
comes from ``SlipstreamStrategy(parallelism_config=...)``, e.g. ``ParallelismConfig(ep_size=2)``,
or a ``parallelism_config`` config block).

Example::

    import lightning.pytorch as pl
    import slipstream.integrations.lightning  # noqa: F401  (registers the names)

    trainer = pl.Trainer(strategy="slipstream", accelerator="cpu", devices=2)
    trainer.fit(model, datamodule)
"""

from __future__ import annotations

try:
    import lightning.pytorch as _pl
except ImportError as error:
    raise ImportError(
        "slipstream.integrations.lightning needs Lightning 2.x (the `lightning` package): "
        "pip install 'slipstream[lightning]'"
    ) from error

if int(_pl.__version__.split(".")[0]) < 2:  # pragma: no cover - Lightning 1.x is not supported
    raise ImportError(
        f"slipstream.integrations.lightning needs Lightning >= 2.0, found {_pl.__version__}: "
        "pip install 'slipstream[lightning]'"
    )

from lightning.pytorch.strategies import StrategyRegistry

from .callbacks import ExactMetrics, ExportWeights
from .checkpoint_io import SlipstreamCheckpointIO
from .options import KINDS, REGISTERED
from .precision import SlipstreamPrecision
from .strategy import SlipstreamStrategy


def register_strategies() -> list[str]:
    """Register (again, idempotently) the slipstream names with Lightning; returns them."""
    for name, (description, init_params) in REGISTERED.items():
        StrategyRegistry.register(
            name, SlipstreamStrategy, description=description, override=True, **init_params
        )
    return list(REGISTERED)


register_strategies()

__all__ = [
    "KINDS",
    "REGISTERED",
    "ExactMetrics",
    "ExportWeights",
    "SlipstreamCheckpointIO",
    "SlipstreamPrecision",
    "SlipstreamStrategy",
    "register_strategies",
]
