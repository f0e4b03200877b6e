"""Lightning's Trainer on slipstream: SlipstreamStrategy on real 2-process CPU groups.

The Trainer runs live in tests/integrations/lightning_scripts/fit.py (with devices=2
Lightning re-runs the script per process); each scenario runs once per session and several
tests read its results.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")
import lightning.pytorch as pl

import slipstream.integrations.lightning  # noqa: F401
from slipstream.integrations.lightning import (
    REGISTERED,
    SlipstreamPrecision,
    SlipstreamStrategy,
)
from tests.distributed import REPO, run_cli, run_python

SCRIPT = REPO / "tests" / "integrations" / "lightning_scripts" / "fit.py"
Weights = dict[str, list[float]]


def _run(scenario: str, out: Path, timeout: float = 150) -> dict[str, Any]:
    result = run_python(str(SCRIPT), scenario, str(out), timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return json.loads((out / "result.json").read_text())


def _largest_difference(a: Weights, b: Weights) -> float:
    assert a.keys() == b.keys() and a, (sorted(a), sorted(b))
    return max(abs(x - y) for k in a for x, y in zip(a[k], b[k], strict=True))


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run("ddp", tmp_path_factory.mktemp("ddp"))


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run("fsdp", tmp_path_factory.mktemp("fsdp"))


@pytest.fixture(scope="module")
def deepspeed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("deepspeed")
    return _run("deepspeed", tmp_path_factory.mktemp("deepspeed"), timeout=240)


# -- DDP: the same numbers as Lightning's own "ddp" -------------------------------------------
def test_fit_matches_lightning_ddp_exactly(ddp):
    slip, reference = ddp["plain"]["slipstream"], ddp["plain"]["ddp"]
    assert slip["end"] == reference["end"]
    assert slip["start"] != slip["end"]  # it trained
    assert slip["global_step"] == reference["global_step"] == 16  # 64 samples / (2 x 4) x 2


def test_sync_dist_logging_reduces_over_processes(ddp):
    metrics = ddp["plain"]["slipstream"]["metrics"]
    assert metrics["rank_mean"] == 1.5  # ranks log 1 and 2
    assert metrics["rank_max"] == 2.0
    assert metrics["train_loss"] == ddp["plain"]["ddp"]["metrics"]["train_loss"]


def test_manual_optimization_matches_ddp(ddp):
    assert ddp["manual"]["slipstream"]["end"] == ddp["manual"]["ddp"]["end"]
    assert ddp["manual"]["slipstream"]["end"] == ddp["plain"]["slipstream"]["end"]


def test_collectives_answer_lightnings_api(ddp):
    found = ddp["collectives"]  # as seen by rank 0
    assert found["gather_shape"] == [2, 2, 3] and found["gather_values"] == [0.0, 1.0]
    assert found["sync_grads"] == [2.0]  # d/dx of (1 * x_0 + 10 * x_1) summed over 2 ranks
    assert found["broadcast"] == {"rank": 1}
    assert (found["sum"], found["max"], found["mean"]) == (3.0, 2.0, 1.5)
    assert found["not_a_tensor"] == "text"
    assert (found["all"], found["any"]) == (False, True)
    # The group was formed by the core ProcessState from Lightning's ranks (tcp:// init).
    assert found["group"] == ["lightning", True]


def test_accumulation_and_clipping_set_on_the_trainer_match_ddp(ddp):
    slip, reference = ddp["accumulate"]["slipstream"], ddp["accumulate"]["ddp"]
    assert slip["end"] == reference["end"]
    assert slip["global_step"] == reference["global_step"] == 6  # ceil(8 / 3) per epoch
    assert slip["end"] != ddp["plain"]["slipstream"]["end"]


def test_validate_test_and_predict(ddp):
    stages = ddp["stages"]
    assert stages["validate"]["val_loss"] == pytest.approx(stages["test"]["test_loss"])
    assert stages["predict_rows"] == 32  # predict shards without repeating samples


def test_bf16_mixed_runs_under_autocast_and_converges(ddp):
    run = ddp["bf16"]
    assert run["precision"] == "bf16-mixed" and run["autocast"] is True
    assert run["losses"][-1] < run["losses"][0]
    assert _largest_difference(run["end"], ddp["plain"]["slipstream"]["end"]) < 0.05


def test_16_mixed_runs(ddp):
    # On CPU Lightning itself turns Trainer(precision="16-mixed") into bf16-mixed ...
    assert ddp["fp16_trainer"]["precision"] == "bf16-mixed"
    # ... while SlipstreamStrategy(precision="16-mixed") runs fp16 with the core GradScaler.
    run = ddp["fp16_strategy"]
    assert run["precision"] == "16-mixed" and run["plugin"] == "SlipstreamPrecision"
    assert run["autocast"] is True and run["scale"] > 0
    assert run["losses"][-1] < run["losses"][0]


def test_resume_from_a_local_checkpoint_on_two_processes(ddp):
    resume = ddp["resume"]
    assert resume["start"] == resume["saved"]  # model restored before training continued
    # Optimizer (momentum) and loops restored too: the same as an uninterrupted run.
    assert resume["end"] == ddp["plain"]["slipstream"]["end"]
    assert resume["epoch"] == 2 and resume["global_step"] == 16


def test_weights_dtype_casts_saved_weights(ddp):
    assert ddp["weights_dtype"] == ["torch.bfloat16"]


def test_torchmetrics_logged_from_validation_step_are_exact(ddp):
    metrics = ddp["metrics"]
    # 1001 samples, batch 16, 2 processes: Lightning's sampler repeats one sample.
    assert metrics["slipstream_accuracy"] == metrics["exact_accuracy"]
    assert metrics["slipstream_auroc"] == pytest.approx(metrics["exact_auroc"], abs=1e-6)
    # Plain Lightning DDP counts the repeated sample.
    assert metrics["ddp_accuracy"] != metrics["exact_accuracy"]


# -- FSDP and DeepSpeed --------------------------------------------------------------------------
@pytest.mark.slow
def test_fsdp_sharded_checkpoint_saves_and_restores(fsdp):
    assert fsdp["saved_is_dir"]
    assert {
        "checkpoint.json",
        "lightning_state.ckpt",
        "pytorch_model_fsdp_0",
        "optimizer_0",
    } <= set(fsdp["saved_files"])
    assert fsdp["consolidated_dtypes"] == ["torch.bfloat16"]  # weights_dtype=torch.bfloat16
    # ModelCheckpoint saved after steps 4 and 8, removing the first folder.
    assert fsdp["checkpoints"] == ["epoch=0-step=8.ckpt"]
    assert fsdp["from_callback"]["start"] == fsdp["first"]["end"]
    assert fsdp["resumed"]["start"] == fsdp["first"]["end"]
    assert fsdp["resumed"]["end"] == fsdp["straight"]["end"]
    assert fsdp["resumed"]["global_step"] == 16


def test_fsdp_trains_like_ddp(fsdp):
    # "straight" calls self.net(x) inside training_step: the root unit still gathers.
    assert _largest_difference(fsdp["straight"]["end"], fsdp["ddp"]["end"]) < 1e-6


def test_fsdp_accumulation_clipping_and_bf16(fsdp):
    assert _largest_difference(fsdp["accumulate"]["end"], fsdp["ddp_accumulate"]["end"]) < 1e-6
    run = fsdp["bf16"]
    assert run["precision"] == "bf16-mixed"
    # FSDP's MixedPrecisionPolicy casts the gathered weights; no autocast around them.
    assert run["weight_dtype"] == "torch.bfloat16" and run["autocast"] is False
    assert run["losses"][-1] < run["losses"][0]


def test_fsdp_full_state_dict_is_one_file(fsdp):
    assert fsdp["full_is_file"]
    assert fsdp["full_resumed"]["start"] == fsdp["full_first"]["end"]
    assert fsdp["full_resumed"]["end"] == fsdp["straight"]["end"]


@pytest.mark.slow
def test_deepspeed_stage_3_saves_and_restores(deepspeed):
    assert {"checkpoint.json", "lightning_state.ckpt", "latest", "pytorch_model"} <= set(
        deepspeed["saved_files"]
    )
    assert deepspeed["resumed"]["start"] == deepspeed["first"]["end"]
    assert _largest_difference(deepspeed["resumed"]["end"], deepspeed["straight"]["end"]) < 1e-6
    assert _largest_difference(deepspeed["straight"]["end"], deepspeed["ddp"]["end"]) < 1e-5
    assert deepspeed["validated"]["val_loss"] > 0  # a fresh engine evaluates after fit


def test_deepspeed_accumulation_clipping_and_bf16(deepspeed):
    accumulate, reference = deepspeed["accumulate"], deepspeed["ddp_accumulate"]
    assert _largest_difference(accumulate["end"], reference["end"]) < 1e-5
    assert accumulate["global_step"] == reference["global_step"] == 6
    run = deepspeed["bf16"]
    assert run["precision"] == "bf16-mixed" and run["weight_dtype"] == "torch.bfloat16"
    assert run["losses"][-1] < run["losses"][0]


# -- launchers and single process ------------------------------------------------------------------
def test_started_by_slipstream_launch_without_respawning(tmp_path):
    result = run_cli(
        "launch", "-n", "2", "--cpu", "--mixed_precision", "bf16",
        str(SCRIPT), "launch", str(tmp_path), timeout=150,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert [r["rank"] for r in reports] == [0, 1]  # exactly two processes trained
    assert len({r["pid"] for r in reports}) == 2
    assert all(r["cluster"] == "TorchElasticEnvironment" and r["world_size"] == 2 for r in reports)
    # The launcher's --mixed_precision applies when the Trainer sets no precision.
    assert all(r["precision"] == "bf16-mixed" and r["kind"] == "ddp" for r in reports)


def test_single_process_memory_url_round_trip(tmp_path):
    result = _run("single", tmp_path)
    assert result["world_size"] == 1 and result["launcher"] == "NoneType"
    assert result["loaded"] == result["saved"] and result["loaded_epoch"] == 1
    assert result["resumed"]["start"] == result["saved"]
    assert result["resumed"]["global_step"] == 32


# -- configuration and errors (in this process; no Trainer runs) ------------------------------------
def _trainer(strategy: Any, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False, **kwargs)


def test_all_names_are_registered():
    available = pl.strategies.StrategyRegistry.available_strategies()
    assert set(REGISTERED) <= set(available)
    strategy = _trainer("slipstream_deepspeed_stage_3_offload").strategy
    assert isinstance(strategy, SlipstreamStrategy) and strategy.kind == "deepspeed"
    plugin = strategy._deepspeed_plugin
    assert plugin.zero_stage == 3 and plugin.offload_param_device == "cpu"
    assert _trainer("slipstream").strategy.kind == "ddp"


def test_configuration_from_a_config_file_dict_or_launch_config(tmp_path):
    from slipstream.launcher.config import LaunchConfig

    path = tmp_path / "config.yaml"
    path.write_text(
        "distributed_type: FSDP\nmixed_precision: bf16\n"
        "fsdp_config:\n  fsdp_state_dict_type: SHARDED_STATE_DICT\n"
    )
    for config in (
        str(path),
        {"distributed_type": "FSDP", "mixed_precision": "bf16",
         "fsdp_config": {"fsdp_state_dict_type": "SHARDED_STATE_DICT"}},
        LaunchConfig(distributed_type="FSDP", mixed_precision="bf16",
                     fsdp_config={"fsdp_state_dict_type": "SHARDED_STATE_DICT"}),
    ):  # fmt: skip
        trainer = _trainer(SlipstreamStrategy(config=config))
        assert trainer.strategy.kind == "fsdp"
        assert trainer.strategy._fsdp_plugin.sharded_state_dict
        assert trainer.precision == "bf16-mixed"  # the config's precision, Trainer said none
    # kind= wins over distributed_type; the Trainer's precision over the config's.
    trainer = _trainer(SlipstreamStrategy("ddp", config=str(path)), precision="bf16-true")
    assert trainer.strategy.kind == "ddp" and trainer.precision == "bf16-true"


def test_launcher_environment_configuration(monkeypatch):
    monkeypatch.setenv(
        "SLIPSTREAM_LAUNCH_CONFIG",
        json.dumps({"distributed_type": "DEEPSPEED", "mixed_precision": "fp16",
                    "deepspeed_config": {"zero_stage": 1}}),
    )  # fmt: skip
    trainer = _trainer("slipstream")
    assert trainer.strategy.kind == "deepspeed"
    assert trainer.strategy._deepspeed_plugin.zero_stage == 1
    assert trainer.precision == "16-mixed"
    assert isinstance(trainer.precision_plugin, SlipstreamPrecision)


def test_unknown_kind_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"'fdsp'.*ddp, fsdp, deepspeed.*slipstream_fsdp"):
        SlipstreamStrategy(kind="fdsp")
    with pytest.raises(ValueError, match="DistributedDataParallel options"):
        SlipstreamStrategy(kind="fsdp", find_unused_parameters=True)


def test_conflicting_precision_is_one_clear_error():
    from lightning.pytorch.plugins.precision import MixedPrecision

    strategy = SlipstreamStrategy(precision="16-mixed")
    with pytest.raises(ValueError, match=r"precision is set twice.*'16-mixed'.*'bf16-mixed'"):
        _trainer(strategy, precision="bf16-mixed")
    strategy = SlipstreamStrategy(precision="16-mixed")
    with pytest.raises(ValueError, match="precision is set twice"):
        _trainer(strategy, plugins=[MixedPrecision("bf16-mixed", "cpu")])
    # The same precision in both places is fine.
    assert _trainer(SlipstreamStrategy(precision="bf16"), precision="bf16-mixed").precision == (
        "bf16-mixed"
    )
    with pytest.raises(ValueError, match="cannot use the precision plugin DoublePrecision"):
        _trainer("slipstream", precision="64-true")


@pytest.mark.parametrize("blocked", ["lightning", "lightning.pytorch"])
def test_lightning_missing_names_the_extra(blocked):
    code = (
        f"import sys; sys.modules[{blocked!r}] = None\n"
        "import slipstream, slipstream.integrations\n"
        "try:\n"
        "    import slipstream.integrations.lightning\n"
        "except ImportError as error:\n"
        "    print(error)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert result.returncode == 0, result.stderr
    assert "pip install 'slipstream[lightning]'" in result.stdout


def test_importing_slipstream_does_not_import_lightning():
    code = "import sys, slipstream, slipstream.integrations; print('lightning' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert result.stdout.strip() == "False", result.stderr
