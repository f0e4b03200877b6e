"""``slipstream estimate-memory``: parameter counting, the ZeRO accounting, output, errors."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Iterator

import pytest

from slipstream.cli import estimate_memory
from slipstream.cli.estimate_memory import (
    DTYPES,
    STRATEGIES,
    ParameterCounts,
    build_model,
    count_parameters,
    estimate,
    format_bytes,
    inference_bytes,
)
from slipstream.config import ConfigError
from tests.distributed import run_cli

FACTORIES = "tests.core.cli.model_factories"
SMALL = f"{FACTORIES}:make_small"
SMALL_COUNTS = ParameterCounts(total=165, trainable=165, buffers=0, largest_unit=110)


def _run(*argv: str) -> int:
    """The subcommand through its own parser, as ``slipstream`` would call it."""
    parser = argparse.ArgumentParser(prog="slipstream")
    estimate_memory.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["estimate-memory", *argv])
    return int(args.run(args))


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
    header = capsys.readouterr().out.splitlines()[2]
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
    result = run_cli("estimate-memory", "no_colon_here")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "module:callable" in result.stderr
