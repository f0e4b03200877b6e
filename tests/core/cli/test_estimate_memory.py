"""``slipstream estimate-memory``: parameter counting, the ZeRO accounting, output, errors."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Iterator

import pytest
from torch import nn

from slipstream.cli import estimate_memory
from slipstream.cli.estimate_memory import (
    DTYPES,
    STRATEGIES,
    ParameterCounts,
    build_model,
    count_parameters,
    estimate,
    estimate_layouts,
    format_bytes,
    inference_bytes,
    split_parameters,
)
from slipstream.cli.estimate_memory_parallel import ParallelLayout, ProcessShare
from slipstream.launcher.config import ConfigError
from tests.distributed import run_cli, run_cli_here

FACTORIES = "tests.core.cli.model_factories"
SMALL = f"{FACTORIES}:make_small"
SMALL_COUNTS = ParameterCounts(total=165, trainable=165, buffers=0, largest_unit=110)
TINY_LLAMA = "tests.core.cli.test_estimate_memory:make_tiny_llama"


def make_tiny_llama(tie_word_embeddings: bool = False) -> nn.Module:
    """embed 32x8 = 256; per layer q, k, v, o 4 * 8x8 = 256, gate, up, down 3 * 16x8 = 384,
    two norms 16 (656); norm 8; lm_head 32x8 = 256. N = 256 + 2 * 656 + 8 + 256 = 1,832.
    Its plan splits all but the norms (40): 1,792."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=4,
        tie_word_embeddings=tie_word_embeddings,
    )
    return transformers.LlamaForCausalLM(config)


def _run(*argv: str) -> int:
    """The subcommand through its own parser, as ``slipstream`` would call it."""
    parser = argparse.ArgumentParser(prog="slipstream")
    estimate_memory.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["estimate-memory", *argv])
    return int(args.run(args))


@pytest.fixture(autouse=True)
def _no_saved_config(monkeypatch, tmp_path) -> None:
    """A configuration saved on this machine would choose the job; the tests choose it."""
    monkeypatch.setenv("SLIPSTREAM_CONFIG_FILE", str(tmp_path / "no-saved-config.yaml"))


@pytest.fixture
def isolated_imports(monkeypatch) -> Iterator[None]:
    """Undo what importing a model from a temporary folder adds to sys.path and sys.modules."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    for name in ("my_model", "needs_missing"):
        sys.modules.pop(name, None)


def _totals(counts: ParameterCounts, processes: int, dtype: str) -> dict[str, int]:
    return {row.strategy: row.total for row in estimate(counts, processes, [dtype])}


# Counting


def test_counts_of_a_small_model():
    assert count_parameters(build_model(SMALL)) == SMALL_COUNTS


def test_frozen_parameters_are_counted_apart():
    counts = count_parameters(build_model(f"{FACTORIES}:make_frozen"))
    assert (counts.total, counts.trainable, counts.frozen) == (165, 55, 110)


def test_tied_weights_count_once():
    assert count_parameters(build_model(f"{FACTORIES}:make_tied")).total == 120


def test_units_open_containers_and_buffers_are_counted():
    counts = count_parameters(build_model(f"{FACTORIES}:make_net"))
    # Each block of the ModuleList is one unit (Linear 272 + BatchNorm 32), not the list.
    expected = ParameterCounts(
        total=112 + 2 * 304 + 17, trainable=737, buffers=66, largest_unit=304
    )
    assert counts == expected


def test_root_parameters_are_a_unit_and_a_leaf_model_is_one_unit():
    assert count_parameters(build_model(f"{FACTORIES}:make_root_parameter")).largest_unit == 1000
    assert count_parameters(build_model(f"{FACTORIES}:make_huge")).largest_unit == 2_500_050_000


def test_a_huge_model_is_built_on_the_meta_device_without_memory():
    resource = pytest.importorskip("resource")
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    start = time.monotonic()
    model = build_model(f"{FACTORIES}:make_huge")  # 10 GB in fp32 if it were materialised
    counts = count_parameters(model)
    assert time.monotonic() - start < 5
    assert all(p.is_meta for p in model.parameters())
    assert counts.total == 50000 * 50000 + 50000
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before < 512 * 1024


# Accounting


def test_one_process_training_is_16_bytes_per_parameter_at_every_dtype():
    for dtype in DTYPES:
        totals = _totals(SMALL_COUNTS, 1, dtype)
        assert [totals[s] for s in STRATEGIES[:4]] == [16 * 165] * 4
    # FSDP adds one gathered largest unit (110 parameters) in the compute dtype.
    assert _totals(SMALL_COUNTS, 1, "fp32")["FSDP"] == 16 * 165 + 4 * 110
    assert _totals(SMALL_COUNTS, 1, "bf16")["FSDP"] == 16 * 165 + 2 * 110


def test_breakdown_of_each_part():
    rows = {(r.strategy, r.dtype): r for r in estimate(SMALL_COUNTS, 1)}
    fp32, bf16 = rows["DDP", "fp32"], rows["DDP", "bf16"]
    assert (fp32.weights, fp32.gradients, fp32.optimizer_states) == (4 * 165, 4 * 165, 8 * 165)
    assert (bf16.weights, bf16.gradients, bf16.optimizer_states) == (2 * 165, 2 * 165, 12 * 165)
    assert rows["FSDP", "fp16"].gathered_unit == 2 * 110 and fp32.gathered_unit == 0


def test_sharding_divides_by_the_number_of_processes():
    # N = 165 = 5 * 33, so each shard holds exactly 33 elements.
    assert _totals(SMALL_COUNTS, 5, "fp32") == {
        "DDP": 16 * 165,
        "ZeRO-1": 4 * 165 + 4 * 165 + 8 * 33,
        "ZeRO-2": 4 * 165 + 4 * 33 + 8 * 33,
        "ZeRO-3": 16 * 33,
        "FSDP": 16 * 33 + 4 * 110,
    }
    assert _totals(SMALL_COUNTS, 5, "bf16") == {
        "DDP": 16 * 165,
        "ZeRO-1": 2 * 165 + 2 * 165 + 12 * 33,
        "ZeRO-2": 2 * 165 + 2 * 33 + 12 * 33,
        "ZeRO-3": 16 * 33,
        "FSDP": 16 * 33 + 2 * 110,
    }


@pytest.mark.parametrize("processes", [1, 2, 3, 4, 7, 8, 64])
def test_shards_round_up_like_padded_flat_parameters(processes):
    assert _totals(SMALL_COUNTS, processes, "fp32")["ZeRO-3"] == 16 * math.ceil(165 / processes)


def test_frozen_parameters_are_weights_only():
    counts = ParameterCounts(total=165, trainable=55, buffers=0, largest_unit=110)
    assert _totals(counts, 1, "fp32")["DDP"] == 4 * 165 + 4 * 55 + 8 * 55
    assert _totals(counts, 5, "fp32")["ZeRO-2"] == 4 * 165 + 4 * 11 + 8 * 11
    assert _totals(counts, 5, "bf16")["ZeRO-3"] == 2 * 33 + 2 * 11 + 12 * 11


def test_inference_is_weights_only():
    assert inference_bytes(SMALL_COUNTS) == {"fp32": 660, "bf16": 330, "fp16": 330}
    assert inference_bytes(SMALL_COUNTS, ["fp16"]) == {"fp16": 330}


def test_format_bytes_uses_binary_units():
    assert [format_bytes(n) for n in (0, 1023, 1024, 1536 * 1024, 1.5 * 1024**3)] == [
        "0 B",
        "1023 B",
        "1.00 KB",
        "1.50 MB",
        "1.50 GB",
    ]
    assert format_bytes(2 * 1024**4) == "2.00 TB"


# Output


def test_table_names_every_strategy_inference_and_the_assumptions(capsys):
    assert _run(SMALL, "--num_processes", "2") == 0
    out = capsys.readouterr().out
    assert all(name in out for name in (*STRATEGIES, *DTYPES, "Inference (weights only)"))
    assert "165 parameters (165 trainable, 0 frozen)" in out and "per process of 2" in out
    assert "1 KB = 1024 B" in out
    assert "activations, buffers of the data pipeline and framework overhead not included" in out
    assert "2.58 KB" in out and "660 B" in out  # DDP at 16 * 165 B; fp32 inference


def test_json_output_parses_with_exact_bytes(capsys):
    assert _run(SMALL, "--num-processes", "5", "--dtypes", "bf16", "bf16", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_processes"] == 5 and report["unit"] == "bytes"
    assert report["parameters"]["total"] == 165 and report["parameters"]["largest_unit"] == 110
    assert report["inference"] == {"bf16": 330}
    training = {(r["strategy"], r["dtype"]): r for r in report["training"]}
    assert set(training) == {(s, "bf16") for s in STRATEGIES}  # repeated dtype listed once
    assert training["ZeRO-3", "bf16"]["total"] == 16 * 33


def test_dtypes_pick_the_columns(capsys):
    _run(SMALL, "--dtypes", "fp16", "fp32")
    header = next(line for line in capsys.readouterr().out.splitlines() if "Training" in line)
    assert header.split()[-2:] == ["fp16", "fp32"] and "bf16" not in header


def test_a_file_path_model(tmp_path, monkeypatch, isolated_imports):
    (tmp_path / "my_model.py").write_text(
        "from torch import nn\n\ndef build():\n    return nn.Linear(4, 4)\n"
    )
    assert count_parameters(build_model(f"{tmp_path}/my_model.py:build")).total == 20
    monkeypatch.chdir(tmp_path)  # relative paths and plain module names from the cwd
    assert count_parameters(build_model("my_model.py:build")).total == 20
    assert count_parameters(build_model("my_model:build")).total == 20


# Errors


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("tests.core.cli.model_factories", "must be 'module:callable' or 'path/to/file.py"),
        (":make_small", "must be 'module:callable'"),
        (f"{FACTORIES}:", "must be 'module:callable'"),
        ("tests.core.cli.no_such_module:f", "cannot import module 'tests.core.cli.no_such_module'"),
        ("no_such_file.py:f", "cannot import 'no_such_file.py': no such file"),
        (f"{FACTORIES}:NOT_CALLABLE", "is 'int', not callable"),
        (f"{FACTORIES}:make_number", "returned 'int', not a torch.nn.Module"),
        (f"{FACTORIES}:make_broken", "failed on the meta device: RuntimeError: checkpoint not"),
    ],
)
def test_errors_name_what_to_change(model, message):
    with pytest.raises(ConfigError) as error:
        build_model(model)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_missing_attribute_lists_the_module_callables():
    with pytest.raises(ConfigError) as error:
        build_model(f"{FACTORIES}:make_nothing")
    text = str(error.value)
    assert f"{FACTORIES} has no attribute 'make_nothing'" in text
    assert "make_small" in text and "Net" in text
    assert "nn" not in text.split(": ", 1)[1].split(", ")  # imports are not listed


def test_a_failing_import_inside_the_module_names_it(tmp_path, monkeypatch, isolated_imports):
    (tmp_path / "needs_missing.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="importing module 'needs_missing' failed: Module"):
        build_model("needs_missing:f")
    with pytest.raises(ConfigError, match="no_such_dependency_xyz"):
        build_model("needs_missing.py:f")


def test_num_processes_must_be_positive():
    with pytest.raises(ConfigError, match="--num_processes must be at least 1, got 0"):
        _run(SMALL, "--num_processes", "0")
    with pytest.raises(ConfigError, match="--num_processes must be at least 1, got -2"):
        estimate(SMALL_COUNTS, -2)
    with pytest.raises(ConfigError, match="--dtypes must be among"):
        estimate(SMALL_COUNTS, 1, ["int8"])


# Tensor, pipeline and context parallelism


def _steps(spec: str, dtype: str, **sizes: int) -> list[dict[str, int]]:
    """Totals per strategy for each step of the layout (data parallel only first)."""
    model = build_model(spec)
    layout = ParallelLayout(**sizes)
    split = split_parameters(model, layout.tp)
    steps = estimate_layouts(count_parameters(model), split, layout, [dtype])
    return [{row.strategy: row.total for row in step.training} for step in steps]


def test_layout_sizes_and_steps():
    layout = ParallelLayout(16, tp=2, pp=2, cp=2, dp_replicate=2)
    assert (layout.dp_shard, layout.shard_group) == (1, 2)
    assert layout.describe() == "dp_replicate 2 x dp_shard 1 x tp 2 x pp 2 x cp 2"
    assert [step.describe() for step in ParallelLayout(8, tp=2, pp=2).steps()] == [
        "dp 8",
        "dp 4 x tp 2",
        "dp 2 x tp 2 x pp 2",
    ]
    assert ParallelLayout(8, pp=2, cp=2).shard_group == 4  # dp 2 x cp 2
    assert ParallelLayout(8).data_parallel_only


def test_without_a_plan_every_linear_weight_stands_in():
    split = split_parameters(build_model(SMALL), tp=2)
    assert not split.from_plan and split.modules == 2
    assert split.split_elements == 100 + 50  # the biases (10 + 5) stay whole
    assert split.per_process(1, 1) == ProcessShare(165, 165, 110)  # as count_parameters
    # Units: Linear(10, 10) 50 + 10 = 60, Linear(10, 5) 25 + 5 = 30.
    assert split.per_process(2, 1) == ProcessShare(90, 90, 60)
    # A stage holds about half; it still gathers its largest unit whole.
    assert split.per_process(2, 2) == ProcessShare(45, 45, 60)
    assert split.per_process(3, 1).total == 34 + 17 + 15  # split weights pad to whole shards


def test_tensor_and_pipeline_parallel_arithmetic_of_a_plain_module():
    dp8, tp2, pp2 = _steps(SMALL, "fp32", num_processes=8, tp=2, pp=2)
    assert dp8 == _totals(SMALL_COUNTS, 8, "fp32")  # the table without the options
    # dp 4 x tp 2: 90 parameters per process (largest unit 60), sharded over 4.
    assert tp2 == {
        "DDP": 16 * 90,
        "ZeRO-1": 4 * 90 + 4 * 90 + 8 * 23,
        "ZeRO-2": 4 * 90 + 4 * 23 + 8 * 23,
        "ZeRO-3": 16 * 23,
        "FSDP": 16 * 23 + 4 * 60,
    }
    # dp 2 x tp 2 x pp 2: 45 parameters per process, sharded over 2.
    assert pp2 == {
        "DDP": 16 * 45,
        "ZeRO-1": 4 * 45 + 4 * 45 + 8 * 23,
        "ZeRO-2": 4 * 45 + 4 * 23 + 8 * 23,
        "ZeRO-3": 16 * 23,
        "FSDP": 16 * 23 + 4 * 60,
    }


def test_frozen_parameters_are_split_too():
    split = split_parameters(build_model(f"{FACTORIES}:make_frozen"), tp=2)
    assert split.per_process(2, 1) == ProcessShare(90, 30, 60)  # trainable: 25 + 5
    assert _steps(f"{FACTORIES}:make_frozen", "fp32", num_processes=2, tp=2)[1]["DDP"] == (
        4 * 90 + 4 * 30 + 8 * 30
    )


def test_context_parallel_joins_the_shard_group_and_keeps_weights_whole():
    dp8, cp2 = _steps(SMALL, "bf16", num_processes=8, cp=2)
    assert cp2 == dp8  # dp 4 x cp 2 shards over 8, like dp 8
    # dp 2 x tp 2 x cp 2 shards 90 parameters over 4: like dp 4 x tp 2.
    assert _steps(SMALL, "fp32", num_processes=8, tp=2, cp=2)[2]["ZeRO-3"] == 16 * 23


def test_replicas_shard_within_one_replica():
    dp8, hsdp = _steps(SMALL, "fp32", num_processes=8, dp_replicate=2)
    assert hsdp["DDP"] == dp8["DDP"] == 16 * 165
    assert hsdp["ZeRO-3"] == 16 * 42  # ceil(165 / 4), not ceil(165 / 8)
    assert hsdp["FSDP"] == 16 * 42 + 4 * 110


def test_a_transformers_model_splits_by_its_own_plan():
    model = build_model(TINY_LLAMA)
    split = split_parameters(model, tp=2)
    assert split.from_plan and split.modules == 2 * 7 + 2  # 7 per layer, embed, lm_head
    assert (sum(p.elements for p in split.parameters), split.split_elements) == (1832, 1792)
    # Units: the base model (1,576: 1,536 split + 40 norms) and lm_head (256).
    assert split.per_process(2, 1) == ProcessShare(896 + 40, 896 + 40, 768 + 40)
    assert split.per_process(2, 2) == ProcessShare(468, 468, 808)
    dp8, tp2, pp2 = _steps(TINY_LLAMA, "bf16", num_processes=8, tp=2, pp=2)
    assert dp8["ZeRO-3"] == 16 * 229  # ceil(1832 / 8)
    assert tp2["DDP"] == 16 * 936 and tp2["FSDP"] == 16 * 234 + 2 * 808
    assert pp2["ZeRO-2"] == 2 * 468 + 2 * 234 + 12 * 234


def test_tied_weights_split_once():
    model = make_tiny_llama(tie_word_embeddings=True)  # lm_head shares the embedding
    split = split_parameters(model, tp=2)
    assert (sum(p.elements for p in split.parameters), split.split_elements) == (1576, 1536)


def test_styles_split_weights_and_column_wise_biases():
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 5))
    model.tp_plan = {"0": "colwise", "1": "rowwise"}
    split = split_parameters(model, tp=2)
    assert split.split_elements == 110 + 50  # a row-wise layer's bias stays whole
    assert split.per_process(2, 1).total == 55 + 25 + 5
    model.tp_plan = {"0": "local_colwise", "1": "replicate"}
    assert split_parameters(model, tp=2).split_elements == 110  # named like colwise


def test_parallel_table_shows_each_step_and_its_assumptions(capsys):
    assert _run(SMALL, "--num_processes", "8", "--tp_size", "2", "--pp-size", "2") == 0
    out = capsys.readouterr().out
    assert "8 processes = dp 2 x tp 2 x pp 2; ZeRO and FSDP shard over 2 of them" in out
    assert "Sequential has no tp_plan; as a stand-in every nn.Linear weight is split" in out
    assert "150 of 165 parameters" in out
    assert "(assumes stages balanced by parameter count)" in out
    lines = out.splitlines()
    ddp = lines.index(next(line for line in lines if line.startswith("DDP")))
    assert lines[ddp].split()[1:3] == ["dp", "8"] and "2.58 KB" in lines[ddp]
    assert lines[ddp + 1].split()[:5] == ["dp", "4", "x", "tp", "2"]
    assert "1.41 KB" in lines[ddp + 1]  # 16 * 90 B
    assert lines[ddp + 2].split()[-2:] == ["720", "B"]  # 16 * 45 B, fp16 column
    assert any(line.startswith("Inference, tp 2 x pp 2") and "180 B" in line for line in lines)
    assert all(name in out for name in (*STRATEGIES, "Inference (weights only)", "1 KB = 1024 B"))


def test_context_parallel_and_replicas_are_explained(capsys):
    _run(TINY_LLAMA, "--num_processes", "8", "--cp_size", "2", "--dp_replicate_size", "2")
    out = capsys.readouterr().out
    assert "8 processes = dp_replicate 2 x dp_shard 2 x cp 2" in out
    assert "cp 2: splits sequences, not weights" in out and "(HSDP)" in out
    assert "tp_plan" not in out and "Inference," not in out  # weights stay whole


def test_sizes_of_one_keep_the_plain_table(capsys):
    _run(SMALL, "--num_processes", "4")
    plain = capsys.readouterr().out
    _run(SMALL, "--num_processes", "4", "--tp-size", "1", "--pp_size", "1", "--cp-size", "1")
    assert capsys.readouterr().out == plain


def test_parallel_json_is_complete(capsys):
    argv = (SMALL, "--num_processes", "8", "--tp_size", "2", "--pp_size", "2", "--dtypes", "fp32")
    assert _run(*argv, "--json") == 0
    report = json.loads(capsys.readouterr().out)
    _run(SMALL, "--num_processes", "8", "--dtypes", "fp32", "--json")
    plain = json.loads(capsys.readouterr().out)
    parallel = report.pop("parallel")
    assert report == plain  # the data-parallel figures keep their meaning
    assert parallel["layout"] == {
        "description": "dp 2 x tp 2 x pp 2",
        "dp_replicate": 1,
        "dp_shard": 2,
        "tp": 2,
        "pp": 2,
        "cp": 1,
        "ep": 1,
        "shard_group": 2,
    }
    assert parallel["experts"] == {"parameters": 0, "ep": 1}
    assert parallel["tensor_parallel"] == {
        "plan": "nn.Linear weights (stand-in)",
        "split_parameters": 150,
        "split_modules": 2,
    }
    assert any("balanced by parameter count" in note for note in parallel["notes"])
    steps = parallel["steps"]
    assert [step["layout"]["description"] for step in steps] == [
        "dp 8",
        "dp 4 x tp 2",
        "dp 2 x tp 2 x pp 2",
    ]
    assert steps[0]["training"] == plain["training"]
    last = steps[-1]
    assert last["parameters_per_process"] == {
        "total": 45,
        "trainable": 45,
        "frozen": 0,
        "largest_unit": 60,
    }
    training = {row["strategy"]: row for row in last["training"]}
    assert training["ZeRO-1"]["optimizer_states"] == 8 * 23 and training["DDP"]["total"] == 720
    assert last["inference"] == {"fp32": 180}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--tp_size", "0"), "--tp_size must be at least 1, got 0"),
        (("--pp_size", "-2"), "--pp_size must be at least 1, got -2"),
        (("--tp_size", "3"), "--tp_size 3 does not divide --num_processes 8; choose sizes"),
        (
            ("--tp_size", "2", "--dp_replicate_size", "3"),
            "--tp_size 2 x --dp_replicate_size 3 = 6 does not divide --num_processes 8",
        ),
    ],
)
def test_parallel_sizes_are_checked_before_building_the_model(argv, message):
    # make_broken would fail to build: the sizes are checked first.
    with pytest.raises(ConfigError) as error:
        _run(f"{FACTORIES}:make_broken", "--num_processes", "8", *argv)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_tp_size_the_plan_cannot_split_is_an_error():
    with pytest.raises(ConfigError, match="tp_size=3 does not divide") as error:
        _run(TINY_LLAMA, "--num_processes", "3", "--tp_size", "3")
    assert "\n" not in str(error.value)


# The ``slipstream`` command, end to end


def _registered() -> bool:
    from slipstream.cli import build_parser

    actions = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return any("estimate-memory" in a.choices for a in actions)


needs_registration = pytest.mark.skipif(
    not _registered(), reason="estimate-memory is not yet in slipstream.cli._COMMANDS"
)


@needs_registration
def test_cli_prints_the_table():
    result = run_cli("estimate-memory", SMALL, "--num-processes", "2")
    assert result.returncode == 0, result.stderr
    assert all(name in result.stdout for name in STRATEGIES)


@needs_registration
def test_cli_errors_exit_2_with_one_line():
    result = run_cli_here("estimate-memory", "no_colon_here")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "module:callable" in result.stderr


@needs_registration
def test_cli_parallel_size_errors_exit_2_with_one_line():
    result = run_cli_here("estimate-memory", SMALL, "--num-processes", "8", "--pp-size", "3")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "--pp_size 3 does not divide --num_processes 8" in result.stderr


# Expert parallelism

QWEN_MOE = f"{FACTORIES}:make_tiny_qwen3_moe"


def test_experts_split_over_ep_and_shard_over_the_rest():
    pytest.importorskip("transformers")
    model = build_model(QWEN_MOE)
    counts = count_parameters(model)
    assert counts.total == 1912
    split = split_parameters(model, tp=1, ep=2)
    assert split.expert_elements == 768  # 2 layers x 4 experts x (8x8 + 8x4)
    # Per process: 1,144 dense + 768 / 2 experts; each experts module (192 here) is a unit
    # of its own, so the largest unit is the base model without its experts (1,656 - 768).
    assert split.per_process(1, 1, 2) == ProcessShare(1528, 1528, 888, 384, 384)
    dp4, ep2 = estimate_layouts(counts, split, ParallelLayout(4, ep=2), ["fp32"])
    assert ep2.layout.describe() == "dp 4 (experts over ep 2)"
    rows = {row.strategy: row for row in ep2.training}
    # Dense weights shard over 4, experts over 2 (the processes holding the same experts):
    # the same bytes at rest under ZeRO-3 / FSDP, a smaller unit to gather, less without it.
    assert rows["ZeRO-3"].total == 16 * (286 + 192) == 16 * math.ceil(1912 / 4)
    assert rows["FSDP"].gathered_unit == 4 * 888 < 4 * 1656
    assert rows["DDP"].total == 16 * 1528
    assert ep2.inference["fp32"] == 4 * 1528
    assert {r.strategy: r.total for r in dp4.training}["DDP"] == 16 * 1912


def test_the_ep_step_is_shown_with_its_note(capsys):
    pytest.importorskip("transformers")
    assert _run(QWEN_MOE, "--num_processes", "8", "--tp_size", "2", "--ep_size", "4") == 0
    out = capsys.readouterr().out
    assert "8 processes = dp 4 x tp 2 (experts over ep 4)" in out
    assert "ep 4: 768 of 1,912 parameters are experts (2 experts modules)" in out
    assert "Inference, tp 2 x ep 4" in out
    assert _run(QWEN_MOE, "--num_processes", "4", "--ep_size", "2", "--json") == 0
    report = json.loads(capsys.readouterr().out)["parallel"]
    assert report["experts"] == {"parameters": 768, "ep": 2}
    assert [s["layout"]["ep"] for s in report["steps"]] == [1, 2]


def test_ep_sizes_and_plans_are_checked():
    with pytest.raises(ConfigError, match="--ep_size 3 does not divide the 4 processes"):
        _run(f"{FACTORIES}:make_broken", "--num_processes", "4", "--ep_size", "3")
    with pytest.raises(ConfigError, match="no experts were found in Sequential"):
        _run(SMALL, "--num_processes", "2", "--ep_size", "2")
    pytest.importorskip("transformers")
    with pytest.raises(ConfigError, match="ep_size=3 does not divide the 4 experts"):
        _run(QWEN_MOE, "--num_processes", "6", "--ep_size", "3")
    # A plan on the command line: the small model's second Linear as "experts" is refused
    # (it holds no stacked experts), naming the module.
    with pytest.raises(ConfigError, match="which holds no experts"):
        _run(SMALL, "--num_processes", "2", "--ep_size", "2", "--ep_plan", "1")


# The job: a saved configuration, flags, or one process

FSDP_ON_4 = (
    "distributed_type: FSDP\nnum_processes: 4\nuse_cpu: true\nmixed_precision: bf16\n"
    "fsdp_config: {fsdp_version: 2}\nparallelism_config: {parallelism_config_tp_size: 2}\n"
)


@needs_registration
def test_the_job_comes_from_a_config_file(tmp_path):
    config = tmp_path / "fsdp.yaml"
    config.write_text(FSDP_ON_4)
    result = run_cli_here("estimate-memory", SMALL, "--config_file", str(config))
    assert result.returncode == 0, result.stderr
    first = result.stdout.splitlines()[0]
    assert first == (
        f"Estimated for 4 processes (dp 2 x tp 2), from {config}, which trains with FSDP in "
        "bf16 (flags override it)"
    )
    assert "Training, per process of 4" in result.stdout and "dp 2 x tp 2" in result.stdout


def test_the_saved_config_is_the_default_and_flags_override_it(tmp_path, monkeypatch, capsys):
    saved = tmp_path / "default_config.yaml"
    saved.write_text(
        "distributed_type: DEEPSPEED\nnum_processes: 8\nuse_cpu: true\n"
        "deepspeed_config: {zero_stage: 3}\n"
    )
    monkeypatch.setenv("SLIPSTREAM_CONFIG_FILE", str(saved))
    assert _run(SMALL, "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_processes"] == 8
    assert report["job"] == {"config_file": str(saved), "strategy": "ZeRO-3", "dtype": "fp32"}
    training = {(r["strategy"], r["dtype"]): r["total"] for r in report["training"]}
    assert training["ZeRO-3", "fp32"] == 16 * math.ceil(165 / 8)
    # A size flag overrides the file's layout; its process count stays.
    assert _run(SMALL, "--tp_size", "2") == 0
    assert "Estimated for 8 processes (dp 4 x tp 2), from" in capsys.readouterr().out
    # --num_processes describes the job itself: the saved file is not read.
    assert _run(SMALL, "--num_processes", "2") == 0
    assert capsys.readouterr().out.splitlines()[0] == "Estimated for 2 processes"


def test_without_a_config_or_flags_it_says_how_to_give_the_job(capsys):
    assert _run(SMALL) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("Estimated for 1 process; no saved configuration: pass --num_processes")


def test_a_broken_config_file_is_named(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("num_procesess: 4\n")
    with pytest.raises(ConfigError, match="unknown key 'num_procesess'"):
        _run(SMALL, "--config_file", str(config))
