"""The ``slipstream.preparers`` entry point: lets ``Accelerator.prepare`` accept metrics.

Kept free of a torchmetrics import so that loading the entry point costs nothing for
scripts that do not use torchmetrics.
"""

from __future__ import annotations

import sys
from typing import Any


class ExactMetricPreparer:
    """Hands torchmetrics objects given to ``Accelerator.prepare`` to ``prepare_metric``."""

    @staticmethod
    def matches(obj: Any) -> bool:
        torchmetrics = sys.modules.get("torchmetrics")
        if torchmetrics is None:  # no metric can exist without torchmetrics imported
            return False
        return isinstance(obj, (torchmetrics.Metric, torchmetrics.MetricCollection))

    @staticmethod
    def prepare(obj: Any, accelerator: Any) -> Any:
        from .metric import prepare_metric

        return prepare_metric(
            obj,
            state=accelerator.state,
            active_loaders=accelerator.active_loaders,
            device=accelerator.device,
        )
