"""The launch configuration's ``parallelism_config`` block: file round trips, what the workers
receive, and the checks against num_processes and DeepSpeed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from slipstream.launcher.config import ConfigError, config_from_dict, load_config, save_config

LAYOUT = {
    "parallelism_config_dp_replicate_size": 1,
    "parallelism_config_dp_shard_size": 2,
    "parallelism_config_tp_size": 2,
    "parallelism_config_cp_size": 1,
    "parallelism_config_tp_plan": {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"},
    "parallelism_config_sequence_parallel": True,
}


def job(processes: int, extra: dict[str, Any] | None = None, **block: Any) -> dict[str, Any]:
    """Config values: ``processes`` processes and a block of ``parallelism_config_*`` keys."""
    keys = {f"parallelism_config_{key}": value for key, value in block.items()}
    return {"num_processes": processes, "parallelism_config": keys, **(extra or {})}


DEEPSPEED = {"distributed_type": "DEEPSPEED"}


def test_the_block_round_trips_through_a_config_file(tmp_path: Path):
    config, notes = config_from_dict(
        {"distributed_type": "MULTI_CPU", "num_processes": 4, "parallelism_config": LAYOUT}
    )
    assert notes == [] and config.parallelism_config == LAYOUT
    path = save_config(config, tmp_path / "c.yaml")
    written = yaml.safe_load(path.read_text())
    assert written["parallelism_config"] == LAYOUT, "Accelerate's top-level key and key names"
    assert load_config(path)[0] == config
    assert config.worker_settings()["parallelism_config"] == LAYOUT
    assert config.parallel_layout() == "dp_shard=2 x tp=2"


@pytest.mark.parametrize("block", [{}, None])
def test_an_empty_block_means_no_parallelism(tmp_path: Path, block: Any):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"num_processes": 3, "parallelism_config": block}))
    config, _ = load_config(path)
    assert config.parallelism_config == {} and config.parallel_layout() is None
    assert config.worker_settings()["parallelism_config"] == {}


@pytest.mark.parametrize(
    "block,layout",
    [
        (
            {"parallelism_config_dp_shard_size": -1, "parallelism_config_tp_size": 2},
            "dp_shard=4 x tp=2",
        ),
        ({"dp_replicate_size": 2, "dp_shard_size": 4}, "dp_replicate=2 x dp_shard=4"),
        ({"parallelism_config_sequence_parallel": "true"}, "dp_replicate=8"),
    ],
    ids=["rest", "unprefixed-keys", "no-sizes"],
)
def test_sizes_resolve_against_num_processes(block: dict[str, Any], layout: str):
    config, _ = config_from_dict({"num_processes": 8, "parallelism_config": block})
    assert config.parallel_layout() == layout


@pytest.mark.parametrize(
    "deepspeed",
    [{"distributed_type": "DEEPSPEED"}, {"deepspeed_config": {"zero_stage": 2}}],
    ids=["distributed_type", "block"],
)
@pytest.mark.parametrize("size", ["dp_shard_size", "dp_replicate_size"])
def test_deepspeed_takes_a_plain_data_parallel_layout(deepspeed: dict[str, Any], size: str):
    config, _ = config_from_dict(job(4, deepspeed, **{size: 4}))
    assert config.parallelism_config == {f"parallelism_config_{size}": 4}


@pytest.mark.parametrize(
    "values,message",
    [
        (
            job(2, dp_shard_size=2, tp_size=2),
            "c.yaml: parallelism_config: parallelism_config_dp_shard_size=2 x "
            "parallelism_config_tp_size=2 does not fit num_processes=2; the sizes must "
            "multiply to num_processes",
        ),
        (
            job(4, dp_shard_size=-1, tp_size=3),
            "parallelism_config_dp_shard_size=-1 x parallelism_config_tp_size=3 does not fit "
            "num_processes=4",
        ),
        (
            job(2, tp_sise=2),
            "c.yaml: parallelism_config: unknown key 'parallelism_config_tp_sise' (did you mean "
            "'parallelism_config_tp_size'?)",
        ),
        (
            job(2, tp_size=0),
            "c.yaml: parallelism_config: parallelism_config_tp_size must be a positive integer",
        ),
        (
            job(2, tp_size="two"),
            "parallelism_config: parallelism_config_tp_size must be an integer (or -1), got 'two'",
        ),
        (job(4, tp_size=-1, dp_shard_size=-1), "only one parallel size may be -1"),
        (
            job(2, cp_comm_strategy="ring"),
            "c.yaml: parallelism_config: Invalid parallelism_config_cp_comm_strategy: ring; use "
            "one of allgather, alltoall",
        ),
        (job(2, sequence_dim="x"), "parallelism_config_sequence_dim must be an integer"),
        (
            job(2, tp_size=2, tp_plan={"up": "colwize"}),
            "parallelism_config_tp_plan: 'up' has unknown style 'colwize' (did you mean "
            "'colwise'?)",
        ),
        (
            job(2, tp_plan="colwise"),
            "parallelism_config_tp_plan must map module-name patterns to styles",
        ),
        (
            job(4, DEEPSPEED, dp_shard_size=2, tp_size=2),
            "c.yaml: parallelism_config: parallelism_config_tp_size=2 cannot be combined with "
            "DeepSpeed (distributed_type: DEEPSPEED)",
        ),
        (
            job(4, {"deepspeed_config": {"zero_stage": 3}}, dp_replicate_size=2, dp_shard_size=2),
            "parallelism_config_dp_replicate_size=2, parallelism_config_dp_shard_size=2 cannot "
            "be combined with DeepSpeed (deepspeed_config)",
        ),
        (
            {"num_processes": 2, "parallelism_config": ["tp", 2]},
            "c.yaml: key 'parallelism_config' must be a mapping",
        ),
    ],
    ids=[
        "product",
        "rest-does-not-divide",
        "unknown-key",
        "zero",
        "not-a-number",
        "two-rests",
        "comm-strategy",
        "sequence-dim",
        "tp-style",
        "tp-plan-not-a-mapping",
        "deepspeed-tp",
        "deepspeed-hsdp",
        "not-a-block",
    ],
)
def test_a_bad_block_is_one_config_error_naming_the_key(values: dict[str, Any], message: str):
    with pytest.raises(ConfigError) as raised:
        config_from_dict(values, where="c.yaml")
    assert message in str(raised.value)
    assert str(raised.value).startswith("c.yaml: ") and "\n" not in str(raised.value)


def test_the_fix_is_named_too():
    with pytest.raises(ConfigError) as raised:
        config_from_dict(job(2, DEEPSPEED, tp_size=2))
    assert "use FSDP2 (distributed_type: FSDP) instead of DeepSpeed" in str(raised.value)
    with pytest.raises(ConfigError) as raised:
        config_from_dict({"num_processes": 3, "parallelism_config": {"tp_size": 2}})
    assert "change the sizes or num_processes" in str(raised.value)


def test_preemption_keys_reach_the_workers_and_the_launcher():
    from slipstream.launcher.launch import worker_variables

    config, _ = config_from_dict(
        {
            "num_processes": 2,
            "save_on_preemption": True,
            "preemption_signals": "SIGUSR2,SIGTERM",
            "termination_grace_period": 120,
        }
    )
    settings = config.worker_settings()
    assert settings["save_on_preemption"] is True
    assert settings["preemption_signals"] == "SIGUSR2,SIGTERM"
    assert worker_variables(config)["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "120"


@pytest.mark.parametrize(
    "values,message",
    [
        ({"preemption_signals": "SIGKILL"}, "preemption_signals: 'SIGKILL' is not a signal"),
        ({"termination_grace_period": -1}, "termination_grace_period must be >= 0 seconds"),
    ],
)
def test_bad_preemption_keys_are_config_errors(values: dict[str, Any], message: str):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"num_processes": 2, **values})


def test_parallelism_messages_in_config_terms_keep_their_grammar():
    from slipstream.launcher.config_blocks import _parallelism_message

    text = _parallelism_message("ep_size=3: choose an ep_size that divides 4")
    assert text == (
        "parallelism_config: parallelism_config_ep_size=3: choose a "
        "parallelism_config_ep_size that divides 4"
    )
