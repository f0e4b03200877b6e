"""Lightning's Trainer with a parallel layout: SlipstreamStrategy(parallelism_config=...) on
real CPU process groups (tensor parallelism inside FSDP2, HSDP).

The Trainer runs live in tests/integrations/lightning_scripts/model_parallel.py; each
scenario runs once per session and several tests read its results. The reference is plain
torch on one process, from the same initial weights and on the same global batches.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")
pytest.importorskip("torchmetrics")
import lightning.pytorch as pl

import slipstream.integrations.lightning  # noqa: F401
from slipstream import ParallelismConfig
from slipstream.integrations.lightning import REGISTERED, SlipstreamStrategy
from slipstream.launcher.config import ConfigError
from slipstream.parallel import ParallelismConfigError
from slipstream.strategies import FullyShardedDataParallelPlugin
from tests.distributed import REPO, run_python

#: Starts its own processes for every test: left out of `pytest -m "not slow"`.
pytestmark = pytest.mark.slow

SCRIPT = REPO / "tests" / "integrations" / "lightning_scripts" / "model_parallel.py"
SAMPLES, VALIDATION_SAMPLES = 64, 31
PLAN = {"mlp.up": "colwise", "mlp.down": "rowwise"}
Weights = dict[str, list[float]]


def _run(scenario: str, out: Path, timeout: float) -> dict[str, Any]:
    # One thread per process: 4 processes share 2 cores.
    result = run_python(str(SCRIPT), scenario, str(out), timeout=timeout,
                        env={"OMP_NUM_THREADS": "1"})  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    found = json.loads((out / "result.json").read_text())
    found["ranks"] = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    return found


def _largest_difference(a: Weights, b: Weights) -> float:
    assert a.keys() == b.keys() and a, (sorted(a), sorted(b))
    return max(abs(x - y) for k in a for x, y in zip(a[k], b[k], strict=True))


@pytest.fixture(scope="module")
def tp2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run("tp2", tmp_path_factory.mktemp("tp2"), timeout=300)


@pytest.fixture(scope="module")
def tp2_dp2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run("tp2_dp2", tmp_path_factory.mktemp("tp2_dp2"), timeout=400)


# -- tp=2 on 2 processes -----------------------------------------------------------------------
def test_tensor_parallel_fit_matches_single_process_training(tp2):
    run = tp2["straight"]
    assert run["start"] == tp2["fresh"]  # every process started from the seeded weights
    assert _largest_difference(run["start"], run["end"]) > 0.1  # it trained
    assert _largest_difference(run["end"], tp2["reference"]) < 1e-5
    assert run["global_step"] == 32  # one data-parallel process: 64 samples / 4 x 2 epochs


def test_validate_after_fit_reuses_the_sharded_model(tp2):
    assert tp2["validated"]["val_loss"] == tp2["straight"]["metrics"]["val_loss"]
    assert tp2["validated"]["val_seen"] == VALIDATION_SAMPLES


def test_tensor_parallel_bf16_mixed(tp2):
    run = tp2["bf16"]
    assert run["precision"] == "bf16-mixed"
    # A tp-only layout shards nothing, so there is no FSDP: autocast computes in bf16 and
    # the weights stay fp32.
    assert run["compute_dtype"] == "torch.bfloat16" and run["weight_dtype"] == "torch.float32"
    assert tp2["straight"]["compute_dtype"] == "torch.float32"
    assert _largest_difference(run["end"], tp2["reference_one_epoch"]) < 0.02  # moved ~0.4


def test_tensor_parallel_accumulation_and_clipping(tp2):
    # accumulate_grad_batches=2 and gradient_clip_val from the Trainer: the norm is taken
    # over the whole gradient, split layers (tp) and whole ones together.
    run = tp2["accumulate"]
    assert _largest_difference(run["end"], tp2["reference_accumulate"]) < 1e-5
    assert run["global_step"] == 8


def test_tensor_parallel_sharded_checkpoint_saves_and_restores(tp2):
    assert {
        "checkpoint.json",
        "lightning_state.ckpt",
        "pytorch_model_fsdp_0",
        "optimizer_0",
    } <= set(tp2["saved_files"])
    # ModelCheckpoint(monitor="val_loss") in the 2-epoch run: the better epoch 1 replaced
    # epoch 0 (a decision all processes take together).
    assert tp2["best"] == ["epoch=1.ckpt", ["epoch=1.ckpt"]]
    assert {"lightning_state.ckpt", "pytorch_model_fsdp_0"} <= set(tp2["best_files"])
    resumed = tp2["resumed"]
    assert resumed["start"] == tp2["first"]["end"]  # weights restored before training went on
    # Optimizer (momentum) and loops restored too: the uninterrupted run's weights.
    assert _largest_difference(resumed["end"], tp2["straight"]["end"]) < 1e-6
    assert resumed["epoch"] == 2 and resumed["global_step"] == 32


def test_sharded_checkpoint_restores_under_another_layout(tp2):
    # Saved under tp=2, resumed under dp_shard=2 on the same two processes: the second epoch
    # then has two data-parallel processes and twice the global batch.
    resharded = tp2["resharded"]
    assert resharded["start"] == tp2["first"]["end"]
    assert _largest_difference(resharded["end"], tp2["reference_resharded"]) < 1e-5
    assert resharded["global_step"] == 16 + 8


def test_tensor_parallel_peers_read_the_same_samples(tp2):
    ranks = tp2["ranks"]
    assert [r["tp_rank"] for r in ranks] == [0, 1]
    assert all(r["data_parallel_index"] == 0 and r["sampler"] == [1, 0] for r in ranks)
    assert ranks[0]["seen"] == ranks[1]["seen"]
    assert sorted(ranks[0]["seen"]) == list(range(SAMPLES))
    # self.device_mesh in the LightningModule, as with Lightning's ModelParallelStrategy.
    assert ranks[0]["mesh_dims"] == ["dp_replicate", "dp_shard", "tp"]


def test_logging_and_torchmetrics_count_each_sample_once(tp2):
    for name in ("straight", "accumulate", "resumed"):
        metrics = tp2[name]["metrics"]
        # reduce_fx="sum" with sync_dist=True: the tensor-parallel peer's copy is not added.
        assert metrics["samples"] == SAMPLES
        assert metrics["val_seen"] == VALIDATION_SAMPLES  # a torchmetrics SumMetric


def test_collectives_work_over_the_data_parallel_processes(tp2):
    found = tp2["collectives"]
    assert found["all_gather"] == [0.0]  # one data-parallel process
    assert found["sum_of_ones"] == 1.0
    # Decisions (early stopping, saving) are taken by all processes together.
    assert (found["all_true"], found["all_rank0"], found["any_rank0"]) == (True, False, True)
    assert tp2["repr"] == "SlipstreamStrategy(kind='model_parallel', precision='32-true', " + (
        "layout='tp=2')"
    )


# -- dp_shard=2 x tp=2 and HSDP on 4 processes ---------------------------------------------------
def test_tp_inside_fsdp_on_four_processes_matches_and_resumes(tp2_dp2):
    first, resumed = tp2_dp2["first"], tp2_dp2["resumed"]
    assert first["start"] == tp2_dp2["fresh"]
    assert {"lightning_state.ckpt", "pytorch_model_fsdp_0", "optimizer_0"} <= set(
        tp2_dp2["saved_files"]
    )
    assert resumed["start"] == first["end"]
    # Epoch 1 from the checkpoint, epoch 2 resumed: the uninterrupted reference.
    assert _largest_difference(resumed["end"], tp2_dp2["reference"]) < 1e-5
    assert first["global_step"] == 8 and resumed["global_step"] == 16


def test_hsdp_on_four_processes_matches(tp2_dp2):
    run = tp2_dp2["hsdp"]
    assert _largest_difference(run["end"], tp2_dp2["reference_hsdp"]) < 1e-5
    assert run["global_step"] == 4  # four data-parallel processes: 64 / (4 x 4)


def test_samples_are_sharded_over_data_parallel_coordinates(tp2_dp2):
    ranks = tp2_dp2["ranks"]
    assert [(r["data_parallel_index"], r["tp_rank"]) for r in ranks] == [
        (0, 0), (0, 1), (1, 0), (1, 1),
    ]  # fmt: skip
    assert [r["sampler"] for r in ranks] == [[2, 0], [2, 0], [2, 1], [2, 1]]
    assert ranks[0]["seen"] == ranks[1]["seen"] and ranks[2]["seen"] == ranks[3]["seen"]
    assert sorted(ranks[0]["seen"] + ranks[2]["seen"]) == list(range(SAMPLES))


def test_metrics_and_collectives_on_four_processes(tp2_dp2):
    for name in ("first", "resumed", "hsdp"):
        metrics = tp2_dp2[name]["metrics"]
        assert metrics["samples"] == SAMPLES
        # 31 samples over 2 data-parallel processes: the sampler repeats one, which the
        # exact metrics drop; the tensor-parallel peers' copies are not gathered.
        assert metrics["val_seen"] == VALIDATION_SAMPLES
    found = tp2_dp2["collectives"]
    assert found["all_gather"] == [0.0, 1.0]
    assert found["sum_of_ones"] == 2.0
    assert (found["all_true"], found["all_rank0"], found["any_rank0"]) == (True, False, True)


# -- experts over ep=2 on 2 processes ----------------------------------------------------------------
@pytest.fixture(scope="module")
def ep2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run("ep2", tmp_path_factory.mktemp("ep2"), timeout=300)


def test_expert_parallel_fit_matches_and_resumes(ep2):
    first, resumed = ep2["first"], ep2["resumed"]
    assert first["start"] == ep2["fresh"]
    assert ep2["local_experts"] == [2, 32, 16], "each process holds 2 of the 4 experts"
    assert {"lightning_state.ckpt", "pytorch_model_fsdp_0"} <= set(ep2["saved_files"])
    assert resumed["start"] == first["end"]
    # Epoch 1 from the checkpoint, epoch 2 resumed: the uninterrupted one-process reference.
    assert _largest_difference(resumed["end"], ep2["reference"]) < 1e-5
    assert _largest_difference(first["start"], resumed["end"]) > 0.01  # it trained
    assert "experts over ep=2" in ep2["repr"]


def test_an_expert_parallel_layout_from_the_call_or_a_config():
    layout = ParallelismConfig(ep_size=2, ep_plan=["experts"])
    strategy = SlipstreamStrategy(parallelism_config=layout)
    assert strategy.kind == "model_parallel" and strategy.parallelism.ep_size == 2
    block = {"parallelism_config_ep_size": 2, "parallelism_config_ep_plan": ["experts"]}
    strategy = SlipstreamStrategy(config={"parallelism_config": block})
    assert strategy.kind == "model_parallel" and strategy.parallelism.ep_plan == ["experts"]
    with pytest.raises(ConfigError, match="expert parallelism or HSDP, which cannot be combined"):
        SlipstreamStrategy(config={"distributed_type": "DEEPSPEED", "parallelism_config": block})


# -- configuration and errors (in this process; no Trainer runs) ------------------------------------
def _trainer(strategy: Any, devices: int = 2) -> pl.Trainer:
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, logger=False)


def test_the_registered_name_and_the_argument_build_the_same_strategy():
    assert "slipstream_model_parallel" in pl.strategies.StrategyRegistry.available_strategies()
    assert "slipstream_model_parallel" in REGISTERED
    strategy = _trainer("slipstream_model_parallel").strategy
    assert isinstance(strategy, SlipstreamStrategy) and strategy.kind == "model_parallel"
    assert strategy.parallelism == ParallelismConfig()  # every process a replica
    layout = ParallelismConfig(tp_size=2, tp_plan=PLAN)
    strategy = SlipstreamStrategy(parallelism_config=layout)
    assert strategy.kind == "model_parallel" and strategy.parallelism is layout
    assert strategy._sharded_layout  # the core strategy's default: sharded checkpoints
    assert SlipstreamStrategy(kind="model_parallel", parallelism_config=layout).kind == (
        "model_parallel"
    )
    # FSDP options apply to the FSDP2 part under the mesh (kind="fsdp" is FSDP2 over it).
    strategy = SlipstreamStrategy(
        kind="fsdp", parallelism_config=layout, fsdp_options={"state_dict_type": "FULL_STATE_DICT"}
    )
    assert strategy.kind == "model_parallel" and not strategy._sharded_layout


def test_a_layout_from_a_config_or_the_launcher(tmp_path, monkeypatch):
    block = {"parallelism_config_tp_size": 2, "parallelism_config_tp_plan": PLAN}
    path = tmp_path / "config.yaml"
    path.write_text(
        "distributed_type: MULTI_CPU\nnum_processes: 8\nparallelism_config:\n"
        "  parallelism_config_tp_size: 2\n"
        "  parallelism_config_tp_plan: {mlp.up: colwise, mlp.down: rowwise}\n"
    )
    for config in ({"parallelism_config": block}, str(path)):
        # The sizes must fit the Trainer's processes, not the config's num_processes.
        strategy = _trainer(SlipstreamStrategy(config=config)).strategy
        assert strategy.kind == "model_parallel"
        assert strategy.parallelism.tp_size == 2 and strategy.parallelism.tp_plan == PLAN
    # kind="ddp" in the call outranks the config's layout.
    assert SlipstreamStrategy("ddp", config={"parallelism_config": block}).kind == "ddp"
    monkeypatch.setenv(
        "SLIPSTREAM_LAUNCH_CONFIG",
        json.dumps({"distributed_type": "MULTI_CPU", "parallelism_config": block}),
    )
    strategy = _trainer("slipstream").strategy
    assert strategy.kind == "model_parallel" and strategy.parallelism.tp_size == 2


def test_unknown_kind_lists_model_parallel():
    with pytest.raises(ValueError, match=r"'tensor'.*model_parallel.*slipstream_model_parallel"):
        SlipstreamStrategy(kind="tensor")


def test_layout_errors_say_what_to_change():
    with pytest.raises(ParallelismConfigError, match=r"tp_size=4.*devices=2 x num_nodes=1"):
        _trainer(SlipstreamStrategy(parallelism_config=ParallelismConfig(tp_size=4)))
    with pytest.raises(ValueError, match=r"kind='ddp' does not use; use kind='model_parallel'"):
        SlipstreamStrategy(kind="ddp", parallelism_config=ParallelismConfig(tp_size=2))
    with pytest.raises(TypeError, match=r"slipstream\.ParallelismConfig"):
        SlipstreamStrategy(parallelism_config={"tp_size": 2})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="did you mean 'parallelism_config_tp_size'"):
        SlipstreamStrategy(config={"parallelism_config": {"parallelism_config_tp_sise": 2}})
    with pytest.raises(ConfigError, match=r"'mlp.up' has unknown style 'colwize'"):
        SlipstreamStrategy(
            config={"parallelism_config": {"parallelism_config_tp_plan": {"mlp.up": "colwize"}}}
        )
    deepspeed = {
        "distributed_type": "DEEPSPEED",
        "parallelism_config": {"parallelism_config_tp_size": 2},
    }
    with pytest.raises(ConfigError, match="cannot be combined with DeepSpeed"):
        SlipstreamStrategy(config=deepspeed)
    with pytest.raises(ValueError, match="fsdp_plugin given but the kind is 'ddp'"):
        SlipstreamStrategy(kind="ddp", fsdp_plugin=FullyShardedDataParallelPlugin())
