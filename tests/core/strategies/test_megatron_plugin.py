"""Accelerate's Megatron-LM options on slipstream's own parallelism: the plugin -> layout
mapping and its errors (one process), and an Accelerate ``megatron_lm_config`` file launched
on 4 CPU processes (tp 2 x pp 2) against the same layout from a ``parallelism_config`` file."""

from __future__ import annotations

import json
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from slipstream import ParallelismConfig
from slipstream.strategies.megatron_plugin import MegatronLMConfigError, MegatronLMPlugin
from slipstream.utils import MegatronLMPlugin as ExportedPlugin
from tests.distributed import run_cli, run_distributed

pytest.importorskip("transformers")


def test_the_plugin_is_accelerates_name_in_slipstream_utils():
    assert ExportedPlugin is MegatronLMPlugin


def test_degrees_map_onto_a_parallelism_config():
    plugin = MegatronLMPlugin(
        tp_degree=2, pp_degree=2, num_micro_batches=4, sequence_parallelism=True
    )
    config = plugin.to_parallelism_config()
    assert (config.tp_size, config.pp_size, config.pp_microbatches) == (2, 2, 4)
    assert config.sequence_parallel and config.pp_schedule == "1f1b"
    assert config.resolve(8).describe() == "pp=2 x dp_replicate=2 x tp=2"
    assert plugin.batch_factor == 4 and plugin.gradient_clipping == 1.0


def test_fewer_micro_batches_than_stages_run_as_megatron_runs_them():
    # Accelerate's questionnaire writes num_micro_batches 1; torch's 1F1B refuses fewer
    # micro-batches than stages, GPipe computes the same gradients with a larger bubble.
    config = MegatronLMPlugin(pp_degree=2, num_micro_batches=1).to_parallelism_config()
    assert (config.pp_schedule, config.pp_microbatches) == ("gpipe", 1)
    default = MegatronLMPlugin(pp_degree=4).to_parallelism_config()
    assert (default.pp_schedule, default.pp_microbatches) == ("gpipe", 1)


def test_the_distributed_optimizer_shards_over_the_data_parallel_processes():
    sharded = MegatronLMPlugin(tp_degree=2, use_distributed_optimizer=True)
    assert sharded.to_parallelism_config().resolve(8).describe() == "dp_shard=4 x tp=2"
    experts = MegatronLMPlugin(expert_model_parallel_size=2).to_parallelism_config()
    assert experts.resolve(4).describe() == "dp_shard=4 (experts over ep=2)"


def test_accelerates_defaults_are_one_process_group_of_replicas():
    plugin = MegatronLMPlugin()
    assert plugin.to_parallelism_config().resolve(4).describe() == "dp_replicate=4"
    assert (plugin.num_micro_batches, plugin.recompute_activations) == (1, False)
    assert plugin.ignored_message() is None


def test_a_config_block_reads_accelerates_keys():
    block = {
        "megatron_lm_tp_degree": 2,
        "megatron_lm_pp_degree": "2",
        "megatron_lm_num_micro_batches": 2,
        "megatron_lm_sequence_parallelism": "false",
        "megatron_lm_recompute_activations": True,
        "megatron_lm_use_distributed_optimizer": True,
        "megatron_lm_gradient_clipping": 0.5,
    }
    plugin = MegatronLMPlugin.from_config(block)
    assert (plugin.tp_degree, plugin.pp_degree, plugin.gradient_clipping) == (2, 2, 0.5)
    assert plugin.recompute_activations and not plugin.sequence_parallelism
    assert plugin.to_parallelism_config() == ParallelismConfig(
        dp_shard_size=-1, tp_size=2, pp_size=2, pp_microbatches=2
    )


def test_options_without_an_equivalent_are_named_in_one_warning():
    plugin = MegatronLMPlugin(hidden_dropout=0.1, train_iters=100, recompute_granularity="full")
    message = plugin.ignored_message()
    assert message is not None
    assert "ignored: hidden_dropout, train_iters (" in message, message


@pytest.mark.parametrize(
    "make,expected",
    [
        (
            lambda: MegatronLMPlugin(custom_loss_function=lambda *a: None),
            "remove them: custom_loss_function (compute the loss in your script",
        ),
        (
            lambda: MegatronLMPlugin(megatron_dataset_flag=True),
            "megatron_dataset_flag (Megatron-LM's indexed datasets are not read",
        ),
        (lambda: MegatronLMPlugin(tp_degree=0), "tp_degree must be a positive integer, got 0"),
        (lambda: MegatronLMPlugin(gradient_clipping=-1), "gradient_clipping must be >= 0"),
        (
            lambda: MegatronLMPlugin.from_config({"megatron_lm_pp_degre": 2}),
            "megatron_lm_config: unknown key 'megatron_lm_pp_degre' (did you mean "
            "'megatron_lm_pp_degree'?)",
        ),
        (
            lambda: MegatronLMPlugin.from_config({"megatron_lm_num_micro_batches": "two"}),
            "megatron_lm_config: megatron_lm_num_micro_batches must be an integer, got 'two'",
        ),
        (
            lambda: MegatronLMPlugin.from_config({"megatron_lm_tp_degree": -2}),
            "megatron_lm_config: megatron_lm_tp_degree must be a positive integer, got -2",
        ),
    ],
    ids=["custom-loss", "dataset-flag", "degree", "clipping", "typo", "not-int", "negative"],
)
def test_bad_options_are_refused_naming_what_to_change(make, expected):
    with pytest.raises(MegatronLMConfigError) as raised:
        make()
    assert expected in str(raised.value)


def test_the_accelerator_refuses_a_second_layout():
    from slipstream import Accelerator

    with pytest.raises(MegatronLMConfigError, match="both describe the layout; keep one"):
        Accelerator(megatron_lm_plugin=MegatronLMPlugin(), parallelism_config=ParallelismConfig())
    with pytest.raises(TypeError, match="megatron_lm_plugin takes a slipstream MegatronLMPlugin"):
        Accelerator(megatron_lm_plugin={"tp_degree": 2})  # type: ignore[arg-type]


def test_one_process_warns_about_ignored_options_and_scales_the_batches():
    from torch.utils.data import DataLoader

    from slipstream import Accelerator

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator = Accelerator(
            megatron_lm_plugin=MegatronLMPlugin(num_micro_batches=3, eval_iters=5)
        )
    assert [str(w.message) for w in caught if "eval_iters" in str(w.message)]
    loader = accelerator.prepare(DataLoader(torch.arange(12), batch_size=2))
    assert [len(batch) for batch in loader] == [6, 6]


# -- 4 processes, launched as users launch ---------------------------------------------------
SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    import transformers
    from torch.utils.data import DataLoader, TensorDataset
    from slipstream import Accelerator, set_seed
    from slipstream.parallel.pipeline import pipeline_of

    micro_batch, clip, out = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    set_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(config)
    tokens = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(1))
    accelerator = Accelerator()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(TensorDataset(tokens), batch_size=micro_batch)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, norms = [], []
    for (x,) in loader:
        losses.append(float(accelerator.forward_backward(model, {"input_ids": x, "labels": x})))
        if clip:  # the ParallelismConfig run clips as Megatron's optimizer does
            norms.append(float(accelerator.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
        optimizer.zero_grad()
    state = accelerator.get_state_dict(model)
    report = {
        "layout": accelerator.parallelism_config.resolve(accelerator.num_processes).describe(),
        "batches": len(losses),
        "recomputed": sum(
            type(m).__name__ == "CheckpointWrapper"
            for stage in pipeline_of(model).stages
            for m in stage.submod.modules()
        ),
        "losses": losses,
        "norms": norms,
    }
    if accelerator.is_main_process:
        torch.save(state, out + ".pt")
    with open(f"{out}.{accelerator.process_index}.json", "w") as f:
        json.dump(report, f)
    """
)
MEGATRON_FILE = {
    "compute_environment": "LOCAL_MACHINE",
    "distributed_type": "MEGATRON_LM",
    "downcast_bf16": "no",
    "machine_rank": 0,
    "main_training_function": "main",
    "mixed_precision": "no",
    "num_machines": 1,
    "num_processes": 4,
    "rdzv_backend": "static",
    "same_network": True,
    "use_cpu": True,
    "megatron_lm_config": {
        "megatron_lm_tp_degree": 2,
        "megatron_lm_pp_degree": 2,
        "megatron_lm_num_micro_batches": 2,
        "megatron_lm_sequence_parallelism": False,
        "megatron_lm_recompute_activations": True,
        "megatron_lm_use_distributed_optimizer": True,
        "megatron_lm_gradient_clipping": 0.5,
    },
}
PARALLELISM_FILE = {
    "distributed_type": "MULTI_CPU",
    "num_processes": 4,
    "use_cpu": True,
    "parallelism_config": {
        "parallelism_config_tp_size": 2,
        "parallelism_config_pp_size": 2,
        "parallelism_config_pp_microbatches": 2,
    },
}


def _launch(tmp_path: Path, name: str, config: dict, *script_args: str) -> list[dict]:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    out = str(tmp_path / name)
    result = run_cli(
        "launch", "--config_file", str(path), str(tmp_path / "train.py"), *script_args, out,
        timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(4)]


@pytest.mark.slow
def test_a_megatron_config_file_trains_as_the_same_parallelism_config(tmp_path: Path):
    (tmp_path / "train.py").write_text(SCRIPT)
    started = time.monotonic()
    # Accelerate's Megatron path: the DataLoader's batch size is the micro-batch size, and
    # clipping (megatron_lm_gradient_clipping) happens inside the optimizer step.
    megatron = _launch(tmp_path, "megatron", MEGATRON_FILE, "2", "0")
    plain = _launch(tmp_path, "plain", PARALLELISM_FILE, "4", "0.5")
    print(f"two 4-process launches: {time.monotonic() - started:.1f}s")
    assert {r["layout"] for r in megatron + plain} == {"pp=2 x tp=2"}
    assert [r["batches"] for r in megatron] == [2] * 4 == [r["batches"] for r in plain]
    assert all(r["recomputed"] > 0 for r in megatron), megatron  # every stage's blocks
    assert not any(r["recomputed"] for r in plain)
    assert [r["losses"] for r in megatron] == [r["losses"] for r in plain]
    assert min(plain[0]["norms"]) > 0.5, "the clipping must bite for the comparison to count"
    left = torch.load(tmp_path / "megatron.pt")
    right = torch.load(tmp_path / "plain.pt")
    assert left.keys() == right.keys() and len(left) > 10
    for key, value in left.items():
        torch.testing.assert_close(value, right[key], rtol=0, atol=1e-6, msg=key)


def _sequence_parallel_llama() -> dict:
    import transformers

    from slipstream import Accelerator
    from slipstream.parallel.errors import ParallelismConfigError

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    plugin = MegatronLMPlugin(tp_degree=2, sequence_parallelism=True)
    accelerator = Accelerator(megatron_lm_plugin=plugin)
    try:
        accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    except ParallelismConfigError as error:
        return {"error": str(error), "forwards": len(forwards)}
    return {"error": None, "forwards": len(forwards)}


def test_sequence_parallelism_on_a_transformers_llama_is_refused_at_prepare():
    for result in run_distributed(_sequence_parallel_llama):
        assert result["forwards"] == 0
        message = result["error"]
        assert message is not None and "cannot run LlamaForCausalLM" in message
        assert "sequence_parallelism: true" in message and "not per-token" in message
        assert "megatron_lm_sequence_parallelism: false" in message


def test_options_the_launcher_named_are_not_warned_about_again():
    from types import SimpleNamespace

    from slipstream.accelerator.megatron import megatron_layout

    plugin = MegatronLMPlugin(eval_iters=5)
    state = SimpleNamespace(is_main_process=True)
    launched = {"megatron_lm_config": {"megatron_lm_eval_iters": 5}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        megatron_layout(plugin, None, None, state, launched)  # the launcher's note said it
        assert caught == []
        megatron_layout(plugin, None, None, state, {})  # built in the script: one warning
    assert [w for w in caught if "eval_iters" in str(w.message)]
