"""ExportWeights and ExactMetrics on real 2-process Lightning Trainer runs (CPU, gloo).

The runs live in tests/integrations/lightning_scripts/callbacks.py; each scenario runs once
per module and several tests read its results.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")
pytest.importorskip("torchmetrics")
import torch
from torch import nn

from slipstream.checkpoint import load_weights
from slipstream.integrations.lightning import ExportWeights
from tests.distributed import REPO, run_python

SCRIPT = REPO / "tests" / "integrations" / "lightning_scripts" / "callbacks.py"
PROBE = torch.randn(5, 8, generator=torch.Generator().manual_seed(7))  # as in the script


def _run(scenario: str, out: Path, timeout: float = 240) -> dict[str, Any]:
    result = run_python(str(SCRIPT), scenario, str(out), timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return json.loads((out / "result.json").read_text())


class Net(nn.Module):
    """A plain module with the LightningModule's layout (no Lightning involved)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs)


def _outputs(folder: Path) -> torch.Tensor:
    net = Net()
    net.load_state_dict(load_weights(str(folder)))  # strict: every key, nothing extra
    with torch.no_grad():
        return net(PROBE)


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    pytest.importorskip("deepspeed")
    out = tmp_path_factory.mktemp("export")
    return out, _run("export", out)


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy", ["slipstream", "slipstream_fsdp", "slipstream_deepspeed_stage_3", "ddp"]
)
def test_exported_fp32_weights_reproduce_the_trained_model(export, strategy):
    out, result = export
    trained = torch.tensor(result[strategy]["outputs"])
    assert torch.equal(_outputs(out / strategy / "fp32"), trained)


@pytest.mark.parametrize(
    "strategy", ["slipstream", "slipstream_fsdp", "slipstream_deepspeed_stage_3"]
)
def test_exported_bf16_weights_are_the_rounded_fp32_weights(export, strategy):
    out, result = export
    full = load_weights(str(out / strategy / "fp32"))
    half = load_weights(str(out / strategy / "bf16"))
    assert {t.dtype for t in half.values()} == {torch.bfloat16}
    assert half.keys() == full.keys()
    assert all(torch.equal(half[k], full[k].to(torch.bfloat16)) for k in full)
    trained = torch.tensor(result[strategy]["outputs"])
    torch.testing.assert_close(_outputs(out / strategy / "bf16"), trained, atol=0.05, rtol=0.05)


def test_every_n_epochs_keeps_one_sharded_export_per_epoch(export):
    out, result = export
    every = out / "every"
    assert result["every"] == [
        str(every / "epoch=0"),
        str(every / "epoch=1"),
    ]  # no extra at fit end
    for epoch in (0, 1):
        names = sorted(p.name for p in (every / f"epoch={epoch}").iterdir())
        assert names == [
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json",
        ]
    last = load_weights(str(every / "epoch=1"))
    final = load_weights(str(out / "slipstream" / "fp32"))
    assert last.keys() == final.keys() and all(torch.equal(last[k], final[k]) for k in final)
    first = load_weights(str(every / "epoch=0"))
    assert not all(torch.equal(first[k], final[k]) for k in final)  # trained in between
    assert result["memory_dtypes"] == ["torch.float16"]  # any fsspec URL
    # Atomic replacement on a local disk leaves no staging folders behind.
    assert sorted(p.name for p in (out / "slipstream").iterdir()) == ["bf16", "fp32"]


def test_a_prefix_matching_nothing_fails_before_training(tmp_path):
    result = _run("prefix", tmp_path, timeout=120)
    assert "no weights under prefix 'missing.'" in result["error"]
    assert "['net.']" in result["error"]
    assert result["written"] is False


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"dtype": "int8"}, "unknown dtype 'int8'"),
        ({"dtype": torch.int8}, "not a floating-point type"),
        ({"every_n_epochs": 0}, "every_n_epochs must be >= 1"),
        ({"max_shard_size": "lots"}, "lots"),
    ],
)
def test_bad_export_arguments_are_refused_when_created(arguments, message):
    with pytest.raises(ValueError, match=message):
        ExportWeights("weights/", **arguments)


def test_every_n_epochs_must_be_an_integer():
    with pytest.raises(TypeError, match="every_n_epochs must be an int"):
        ExportWeights("weights/", every_n_epochs=1.5)  # type: ignore[arg-type]


# -- ExactMetrics --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def exact(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run("exact", tmp_path_factory.mktemp("exact"), timeout=180)


def _logged(passes: list[dict[str, float]]) -> dict[str, float]:
    return {k: v for one in passes for k, v in one.items()}


@pytest.mark.parametrize("stage", ["", "_test"])
def test_exact_metrics_give_the_single_process_values_under_lightning_ddp(exact, stage):
    # 1001 and 37 samples on 2 processes: the sampler repeats one sample in each set.
    assert _logged(exact[f"ddp_exact{stage}"]) == exact["reference"]
    assert exact["ddp_exact_attached"] == 3  # two accuracies and the AUROC


def test_without_the_callback_lightning_ddp_counts_repeated_samples(exact):
    plain = _logged(exact["ddp_plain"])
    assert plain != exact["reference"]  # what the callback fixes; the test above can fail


def test_exact_metrics_leave_the_slipstream_strategy_to_itself(exact):
    assert exact["slipstream_exact_attached"] == 0
    assert _logged(exact["slipstream_exact"]) == exact["reference"]
