"""Bad fault-tolerance settings fail early with a message naming what to change."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from slipstream import FaultToleranceKwargs
from slipstream.launcher.config import LaunchConfig, validate
from slipstream.options.errors import ConfigError


def test_bad_options_name_the_field() -> None:
    with pytest.raises(ConfigError, match="min_replicas"):
        FaultToleranceKwargs(min_replicas=0)
    with pytest.raises(ConfigError, match="below min_replicas"):
        FaultToleranceKwargs(min_replicas=3, replica_groups=2)
    with pytest.raises(ConfigError, match=r"http://127\.0\.0\.1:29510"):
        FaultToleranceKwargs(lighthouse="127.0.0.1:29510")
    with pytest.raises(ConfigError, match="unknown key 'min_replica'"):
        FaultToleranceKwargs.from_config({"min_replica": 1})


def test_launch_config_checks_the_groups() -> None:
    with pytest.raises(ConfigError, match=r"replica_groups \(2\) must divide num_processes \(3\)"):
        validate(LaunchConfig(num_processes=3, fault_tolerance_config={"replica_groups": 2}))
    config = validate(LaunchConfig(num_processes=4, fault_tolerance_config={"replica_groups": 2}))
    assert config.worker_settings()["fault_tolerance_config"] == {"replica_groups": 2}


def test_missing_lighthouse_and_names_are_explained() -> None:
    pytest.importorskip("torchft")
    from slipstream.fault_tolerance import build_fault_tolerance
    from slipstream.runtime.env import patch_environment
    from slipstream.runtime.state import ProcessState

    state = ProcessState.__new__(ProcessState)  # only passed through, never used here
    with patch_environment(SLIPSTREAM_FT_LIGHTHOUSE="", TORCHFT_LIGHTHOUSE=""):
        with pytest.raises(ConfigError, match="lighthouse='http://HOST:PORT'"):
            build_fault_tolerance(FaultToleranceKwargs(), {}, state)
        with pytest.raises(ConfigError, match="must end in the group's index"):
            build_fault_tolerance(
                FaultToleranceKwargs(lighthouse="http://127.0.0.1:1", replica_id="main"), {}, state
            )


def test_import_slipstream_does_not_import_torchft() -> None:
    code = (
        "import sys, slipstream; slipstream.FaultToleranceKwargs; print('torchft' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "False", result.stderr


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ({"distributed_type": "DEEPSPEED"}, "does not run with DeepSpeed"),
        (
            {"distributed_type": "FSDP", "parallelism_config": {"parallelism_config_pp_size": 2}},
            r"does not run with pipeline parallelism \(pp_size=2\)",
        ),
        (
            {"distributed_type": "MEGATRON_LM", "megatron_lm_config": {"megatron_lm_pp_degree": 2}},
            "does not run with pipeline parallelism",
        ),
    ],
)
def test_engines_and_layouts_it_cannot_run_are_refused_before_start(
    layout: dict, message: str
) -> None:
    config = LaunchConfig(num_processes=4, fault_tolerance_config={"replica_groups": 2}, **layout)
    with pytest.raises(ConfigError, match=message):
        validate(config)


def _refused_with_fault_tolerance(engine: str) -> str:
    from slipstream import Accelerator, DeepSpeedPlugin, ParallelismConfig

    layout: dict = (
        {"deepspeed_plugin": DeepSpeedPlugin(zero_stage=1)}
        if engine == "deepspeed"
        else {"parallelism_config": ParallelismConfig(pp_size=2)}
    )
    options = FaultToleranceKwargs(lighthouse="http://127.0.0.1:1", replica_id="replica_0")
    try:
        Accelerator(fault_tolerance=options, **layout)
    except ConfigError as error:
        return str(error)
    return "no error"


def test_the_accelerator_refuses_deepspeed_and_pipelines_with_fault_tolerance() -> None:
    pytest.importorskip("torchft")
    from tests.distributed import run_distributed

    said = run_distributed(_refused_with_fault_tolerance, "pipeline")
    assert all("does not run with pipeline parallelism (pp_size=2)" in s for s in said), said
    pytest.importorskip("deepspeed")
    said = run_distributed(_refused_with_fault_tolerance, "deepspeed", world_size=1)
    assert "does not run with DeepSpeed" in said[0], said


def test_semi_synchronous_options_name_what_to_change() -> None:
    from slipstream import SemiSyncKwargs

    with pytest.raises(ConfigError, match="choose 'local_sgd'"):
        SemiSyncKwargs("localsgd")
    with pytest.raises(ConfigError, match="sync_every must be an integer >= 1"):
        SemiSyncKwargs("diloco", sync_every=0)
    with pytest.raises(ConfigError, match="sync_every must be a multiple of fragments"):
        SemiSyncKwargs("diloco", sync_every=6, fragments=4)
    with pytest.raises(ConfigError, match="lower fragment_sync_delay"):
        SemiSyncKwargs("diloco", sync_every=8, fragments=2, fragment_sync_delay=4)
    with pytest.raises(ConfigError, match="use method='diloco'"):
        SemiSyncKwargs("local_sgd", fragments=2)
    with pytest.raises(ConfigError, match="between 0 and 1"):
        SemiSyncKwargs("diloco", fragment_update_alpha=1.5)
    assert SemiSyncKwargs("diloco", sync_every=8, fragments=4).steps_between_syncs == 2
    # A method name is enough; the config block's keys make the same object.
    assert FaultToleranceKwargs(semi_sync="local_sgd").semi_sync == SemiSyncKwargs("local_sgd")
    block = {"semi_sync": "diloco", "sync_every": 32, "outer_lr": 0.5, "fragments": 4}
    options = FaultToleranceKwargs.from_config(block)
    assert options.semi_sync == SemiSyncKwargs("diloco", sync_every=32, outer_lr=0.5, fragments=4)


def test_the_launch_flags_and_config_keys_of_semi_synchronous_training() -> None:
    from slipstream.cli import build_parser
    from slipstream.cli.launch import resolve_config

    flags = ["--fault_tolerance", "--ft_semi_sync", "diloco", "--ft_sync_every", "16"]
    arguments = build_parser().parse_args(["launch", "--cpu", "-n", "2", *flags, "train.py"])
    config, _ = resolve_config(arguments)
    block = config.fault_tolerance_config
    assert (block["semi_sync"], block["sync_every"]) == ("diloco", 16)
    with pytest.raises(ConfigError, match="sync_every set without semi_sync"):
        validate(LaunchConfig(num_processes=2, fault_tolerance_config={"sync_every": 8}))
    with pytest.raises(ConfigError, match=r"fault_tolerance_config: .*lower fragment_sync_delay"):
        validate(
            LaunchConfig(
                num_processes=2,
                fault_tolerance_config={
                    "semi_sync": "diloco",
                    "sync_every": 4,
                    "fragments": 2,
                    "fragment_sync_delay": 2,
                },
            )
        )


def test_fragments_are_runs_of_about_equal_size() -> None:
    from torch import nn

    from slipstream.fault_tolerance.semi_sync import split

    params = [nn.Parameter(torch.zeros(n)) for n in (10, 10, 1, 30, 9)]
    runs = split(params, 2)
    assert [[p.numel() for p in run] for run in runs] == [[10, 10, 1], [30, 9]]
    sizes = [[p.numel() for p in run] for run in split(params, 3)]
    assert sizes == [[10, 10], [1, 30], [9]]
    # Too many fragments for the sizes leaves one empty (refused when the job builds them).
    assert [[p.numel() for p in run] for run in split(params, 5)][2] == []
