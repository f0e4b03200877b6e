"""torchmetrics integration: distributed evaluation that is exact on uneven datasets.

``accelerator.prepare(metric)`` (or :func:`prepare_metric` without an Accelerator) makes a
torchmetrics ``Metric`` or ``MetricCollection``

* sync its states over slipstream's process group with slipstream's collectives, and
* skip the samples that a prepared evaluation dataloader duplicated to even out its final
  batch, before they reach ``update``,

so ``compute()`` on any number of processes equals the single-process value.

Example::

    metric = accelerator.prepare(torchmetrics.classification.MulticlassAccuracy(num_classes=4))
    for inputs, targets in eval_loader:          # a prepared DataLoader
        metric.update(model(inputs), targets)
    accuracy = metric.compute()                  # on every process
"""

from typing import Any

from .preparer import ExactMetricPreparer

__all__ = ["ExactMetricPreparer", "gather_all_tensors", "prepare_metric"]


def __getattr__(name: str) -> Any:
    # Imported on first use: torchmetrics is loaded only by code that asks for it.
    if name in ("gather_all_tensors", "prepare_metric"):
        from . import metric

        return getattr(metric, name)
    raise AttributeError(name)
