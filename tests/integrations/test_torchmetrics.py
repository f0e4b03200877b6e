"""torchmetrics on 2 processes equals the single-process value on uneven datasets."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

torchmetrics = pytest.importorskip("torchmetrics")
from torchmetrics import MeanSquaredError, MetricCollection  # noqa: E402
from torchmetrics.classification import (  # noqa: E402
    BinaryAccuracy,
    BinaryAUROC,
    MulticlassAccuracy,
    MulticlassAUROC,
    MulticlassF1Score,
)

from slipstream import Accelerator, ParallelismConfig  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

SAMPLES, BATCH = 1001, 16  # 1001 is a multiple of neither 16 nor 2 x 16


def _data():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(SAMPLES, 4, generator=generator)
    labels = torch.randint(0, 4, (SAMPLES,), generator=generator)
    # Integer-valued regression data: sums of squared errors are exact in float32.
    predicted = torch.randint(-5, 6, (SAMPLES,), generator=generator).float()
    observed = torch.randint(-5, 6, (SAMPLES,), generator=generator).float()
    return logits, labels, predicted, observed


def _metrics():
    return {
        "accuracy": MulticlassAccuracy(num_classes=4),
        "f1": MulticlassF1Score(num_classes=4, average="macro"),
        "auroc": MulticlassAUROC(num_classes=4),
        "mse": MeanSquaredError(),
        "collection": MetricCollection({"acc": BinaryAccuracy(), "auroc": BinaryAUROC()}),
    }


def _evaluate(
    prepare: bool = True, split_batches: bool = False, tensor_parallel: bool = False
) -> dict:
    # Under tp 2 x dp 2 the two processes of a tensor-parallel pair hold the same samples.
    layout = ParallelismConfig(dp_shard_size=2, tp_size=2) if tensor_parallel else None
    acc = Accelerator(split_batches=split_batches, parallelism_config=layout)
    logits, labels, predicted, observed = _data()
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(SAMPLES)), batch_size=BATCH))
    metrics = {name: acc.prepare(m) if prepare else m for name, m in _metrics().items()}
    for (index,) in loader:
        metrics["accuracy"].update(logits[index], labels[index])
        metrics["f1"].update(logits[index], labels[index])
        metrics["auroc"].update(logits[index].softmax(-1), labels[index])
        metrics["mse"].update(predicted[index], observed[index])
        metrics["collection"].update(logits[index, 0].sigmoid(), labels[index] % 2)
    results = {}
    for name, metric in metrics.items():
        value = metric.compute()
        if isinstance(value, dict):
            results.update({f"{name}.{k}": v.item() for k, v in value.items()})
        else:
            results[name] = value.item()
    results["device"] = str(metrics["accuracy"].tp.device)
    return results


@pytest.mark.parametrize("split_batches", [False, True])
def test_two_processes_equal_one_process_exactly(split_batches):
    single = _evaluate()
    r0, r1 = run_distributed(_evaluate, True, split_batches)
    for name, value in single.items():
        assert r0[name] == value and r1[name] == value, name


def test_tensor_parallel_peers_are_counted_once():
    single = _evaluate()
    results = run_distributed(_evaluate, True, False, True, world_size=4, timeout=180)
    for name, value in single.items():
        assert all(r[name] == value for r in results), name


def test_without_preparing_torchmetrics_counts_the_duplicates():
    single = _evaluate()
    raw = run_distributed(_evaluate, False)[0]
    assert raw["accuracy"] != single["accuracy"], "the raw metric saw duplicated samples"


def _without_accelerator() -> dict:
    from slipstream.data import shard_data_loader
    from slipstream.integrations.torchmetrics import prepare_metric
    from slipstream.runtime.state import ProcessState

    state = ProcessState.from_environment()
    logits, labels, _, _ = _data()
    loader = shard_data_loader(
        DataLoader(TensorDataset(torch.arange(SAMPLES)), batch_size=BATCH), state=state
    )
    metric = prepare_metric(MulticlassAccuracy(num_classes=4), state=state, dataloader=loader)
    for (index,) in loader:
        metric.update(logits[index], labels[index])
    return {"accuracy": metric.compute().item()}


def test_the_adapter_works_without_an_accelerator():
    single = _evaluate()
    assert run_distributed(_without_accelerator)[0]["accuracy"] == single["accuracy"]


def _outside_a_prepared_loader() -> str:
    import warnings

    acc = Accelerator()
    metric = acc.prepare(MulticlassAccuracy(num_classes=4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metric.update(torch.randn(4, 4), torch.randint(0, 4, (4,)))
    return str(caught[0].message) if caught else ""


def test_updating_outside_a_prepared_loader_says_dedup_cannot_apply():
    message = run_distributed(_outside_a_prepared_loader)[0]
    assert "outside a prepared evaluation DataLoader" in message
    assert "prepare() the DataLoader" in message


def test_bad_input():
    from slipstream.data import shard_data_loader
    from slipstream.integrations.torchmetrics import prepare_metric
    from slipstream.runtime.state import ProcessState

    with pytest.raises(TypeError, match="takes a torchmetrics Metric"):
        prepare_metric(torch.nn.Linear(1, 1))
    plain = DataLoader(TensorDataset(torch.arange(4)), batch_size=2)
    with pytest.raises(TypeError, match="needs a prepared DataLoader"):
        prepare_metric(MulticlassAccuracy(num_classes=2), dataloader=plain)
    state = ProcessState.from_environment(environ={})
    loader = shard_data_loader(plain, state=state)
    assert prepare_metric(MulticlassAccuracy(num_classes=2), dataloader=loader, state=state)


def test_missing_torchmetrics_is_a_clear_error():
    code = (
        "import sys; sys.modules['torchmetrics'] = None\n"
        "from slipstream.integrations.torchmetrics import prepare_metric\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0
    assert "pip install 'slipstream[torchmetrics]'" in result.stderr
