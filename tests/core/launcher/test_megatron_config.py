"""The launch configuration's ``megatron_lm_config`` block (Accelerate's keys): accepted with
``distributed_type: MEGATRON_LM``, handed to the workers, and refused before any process
starts when it cannot work, naming the key to change."""

from __future__ import annotations

from pathlib import Path

import pytest

from slipstream.launcher.config import ConfigError, config_from_dict, load_config

BLOCK = {
    "megatron_lm_tp_degree": 2,
    "megatron_lm_pp_degree": 2,
    "megatron_lm_num_micro_batches": 2,
    "megatron_lm_gradient_clipping": 1.0,
}


def _values(processes: int = 4, block: dict | None = None, **extra: object) -> dict:
    return {
        "distributed_type": "MEGATRON_LM",
        "num_processes": processes,
        "megatron_lm_config": dict(BLOCK if block is None else block),
        **extra,
    }


def test_an_accelerate_megatron_file_loads_and_reaches_the_workers(tmp_path: Path):
    path = tmp_path / "accelerate_cfg.yaml"
    path.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MEGATRON_LM\nnum_processes: 8\n"
        "megatron_lm_config:\n  megatron_lm_tp_degree: 2\n  megatron_lm_pp_degree: 2\n"
        "  megatron_lm_use_distributed_optimizer: true\n"
    )
    config, notes = load_config(path)
    assert notes == [] and config.distributed_type == "MEGATRON_LM"
    assert config.parallel_layout() == "pp=2 x dp_shard=2 x tp=2"
    assert config.worker_settings()["megatron_lm_config"]["megatron_lm_tp_degree"] == 2


def test_distributed_type_alone_means_accelerates_defaults():
    config, _ = config_from_dict({"distributed_type": "MEGATRON_LM", "num_processes": 2})
    assert config.parallel_layout() == "dp_replicate=2"


@pytest.mark.parametrize(
    "values,message",
    [
        (
            _values(6),
            "f.yaml: megatron_lm_config: megatron_lm_tp_degree=2 x megatron_lm_pp_degree=2 do "
            "not divide num_processes=6",
        ),
        (
            _values(block={"megatron_lm_tp_dgree": 2}),
            "f.yaml: megatron_lm_config: unknown key 'megatron_lm_tp_dgree' (did you mean "
            "'megatron_lm_tp_degree'?)",
        ),
        (
            _values(block={"megatron_lm_recompute_activations": "maybe"}),
            "megatron_lm_config: megatron_lm_recompute_activations must be true or false",
        ),
        (
            _values(parallelism_config={"parallelism_config_tp_size": 2}),
            "f.yaml: megatron_lm_config and parallelism_config both describe the layout; keep one",
        ),
        (
            _values(deepspeed_config={"zero_stage": 2}),
            "f.yaml: megatron_lm_config cannot be combined with DeepSpeed",
        ),
    ],
    ids=["sizes", "typo", "bool", "two-layouts", "deepspeed"],
)
def test_a_block_that_cannot_work_is_refused_naming_the_key(values: dict, message: str):
    with pytest.raises(ConfigError) as raised:
        config_from_dict(values, where="f.yaml")
    assert message in str(raised.value)
