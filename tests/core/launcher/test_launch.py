"""`slipstream launch` and plain torchrun, with real processes on 127.0.0.1."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from slipstream.launcher.config import LaunchConfig
from slipstream.launcher.launch import LaunchRequest, torchrun_arguments, torchrun_namespace
from tests.distributed import REPO, free_port, run_cli, run_cli_here, run_python

PROBE = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist
    from slipstream import Accelerator

    accelerator = Accelerator()
    total = torch.tensor([accelerator.process_index + 1])
    if dist.is_initialized():
        dist.all_reduce(total)
    report = {
        "rank": accelerator.process_index,
        "world": accelerator.num_processes,
        "local_rank": accelerator.local_process_index,
        "sum": int(total),
        "type": accelerator.distributed_type.value,
        "precision": accelerator.mixed_precision,
        "dynamo": accelerator.dynamo_plugin.backend,
        "device": str(accelerator.device),
        "argv": sys.argv[1:],
        "main": __name__,
    }
    out = sys.argv[1]
    with open(os.path.join(out, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump(report, f)
    """
)


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    (tmp_path / "out").mkdir()
    return script


def reports(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]


def assert_one_group(found: list[dict], world: int = 2) -> None:
    assert [r["rank"] for r in found] == list(range(world))
    expected = world * (world + 1) // 2
    assert all(r["world"] == world and r["sum"] == expected for r in found), found


def test_launch_forms_one_gloo_group_and_passes_settings(probe: Path):
    out = probe.parent / "out"
    result = run_cli(
        "launch", "--num-processes", "2", "--cpu", "--mixed_precision", "bf16",
        "--dynamo_backend", "eager", str(probe), str(out), "--extra",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    found = reports(out)
    assert_one_group(found)
    assert all(r["type"] == "MULTI_CPU" and r["precision"] == "bf16" for r in found)
    assert all(r["dynamo"] == "eager" for r in found)
    assert all(r["device"] == "cpu" and r["main"] == "__main__" for r in found)
    assert found[0]["argv"] == [str(out), "--extra"]
    assert "terminate called" not in result.stderr


@pytest.mark.slow
def test_plain_torchrun_forms_one_group(probe: Path):
    out = probe.parent / "out"
    result = run_python(
        "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
        str(probe), str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    found = reports(out)
    assert_one_group(found)
    assert all(r["precision"] == "no" for r in found)


#: Script arguments that prefix (or spell) torchrun's own flags: torchrun's parser accepts
#: abbreviations, so each of these used to be read as a launcher flag or refused as ambiguous.
LOOKALIKES = [
    "--start", "0", "--num", "3", "--nnodes", "4", "--nproc", "8", "--rdzv", "x",
    "--rdzv-backend", "c10d", "--rdzv_endpoint=h:1", "--max", "1", "--max_restarts", "7",
    "-m", "mod", "--standalone", "--node_rank=3", "--monitor", "0.5", "--", "--after",
]  # fmt: skip


@pytest.mark.slow
def test_script_arguments_that_look_like_torchrun_flags_reach_the_script_verbatim(probe: Path):
    out = probe.parent / "out"
    result = run_cli("launch", "-n", "2", "--cpu", str(probe), str(out), *LOOKALIKES)
    assert result.returncode == 0, result.stderr
    found = reports(out)
    assert_one_group(found)
    assert [r["argv"] for r in found] == [[str(out), *LOOKALIKES]] * 2


def test_torchrun_reads_only_the_launchers_own_flags():
    config = LaunchConfig(num_processes=2, max_restarts=1, monitor_interval=0.5)
    namespace = torchrun_namespace(LaunchRequest(config, "t.py", LOOKALIKES))
    assert namespace.training_script == "slipstream.launcher.worker" and namespace.module
    assert namespace.training_script_args == ["t.py", *LOOKALIKES]
    assert (namespace.nproc_per_node, namespace.nnodes, namespace.max_restarts) == ("2", "1", 1)
    assert namespace.standalone and namespace.start_method == "spawn"
    module = torchrun_namespace(LaunchRequest(config, "pkg.train", ["-m", "x"], module=True))
    assert module.training_script_args == ["--module", "pkg.train", "-m", "x"]
    binary = torchrun_namespace(LaunchRequest(config, "/bin/echo", ["--start"], no_python=True))
    assert binary.no_python and binary.training_script == "/bin/echo"
    assert binary.training_script_args == ["--start"]


@pytest.mark.slow
def test_config_file_with_flag_override(probe: Path):
    out = probe.parent / "out"
    config = probe.parent / "config.yaml"
    config.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\n"
        "num_processes: 2\nuse_cpu: true\nmixed_precision: fp16\nrdzv_backend: static\n"
        "same_network: true\ntpu_env: []\n"
    )
    result = run_cli(
        "launch", "--config_file", str(config), "--mixed-precision", "bf16", str(probe), str(out)
    )
    assert result.returncode == 0, result.stderr
    found = reports(out)
    assert_one_group(found)
    assert all(r["precision"] == "bf16" for r in found), "the flag beats the file"


@pytest.mark.slow
def test_fsdp_from_flags_and_from_an_accelerate_config(probe: Path):
    out = probe.parent / "out"
    result = run_cli(
        "launch", "-n", "2", "--cpu", "--use_fsdp", "--fsdp_state_dict_type", "SHARDED_STATE_DICT",
        str(probe), str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert [r["type"] for r in reports(out)] == ["FSDP", "FSDP"]
    config = probe.parent / "fsdp.yaml"
    config.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nnum_processes: 2\n"
        "use_cpu: true\nmixed_precision: bf16\nfsdp_config:\n  fsdp_version: 2\n"
        "  fsdp_auto_wrap_policy: SIZE_BASED_WRAP\n  fsdp_min_num_params: 1000\n"
        "  fsdp_offload_params: false\n  fsdp_state_dict_type: FULL_STATE_DICT\n"
        "  fsdp_use_orig_params: true\n"
    )
    result = run_cli("launch", "--config_file", str(config), str(probe), str(out))
    assert result.returncode == 0, result.stderr
    assert all(r["type"] == "FSDP" and r["precision"] == "bf16" for r in reports(out))


@pytest.mark.slow
def test_deepspeed_from_an_accelerate_config(probe: Path):
    pytest.importorskip("deepspeed")
    out = probe.parent / "out"
    fixture = REPO / "tests" / "core" / "cli" / "accelerate_configs" / "deepspeed_zero3.yaml"
    result = run_cli("launch", "--config_file", str(fixture), "--cpu", str(probe), str(out))
    assert result.returncode == 0, result.stderr
    assert all(r["type"] == "DEEPSPEED" and r["precision"] == "bf16" for r in reports(out))


@pytest.mark.slow
def test_module_mode(probe: Path):
    out = probe.parent / "out"
    (probe.parent / "probe_module.py").write_text(PROBE)
    result = run_cli("launch", "-n", "2", "--cpu", "-m", "probe_module", str(out), cwd=probe.parent)
    assert result.returncode == 0, result.stderr
    assert_one_group(reports(out))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["c10d", "static"])
def test_two_machines_on_localhost(probe: Path, backend: str):
    out = probe.parent / "out"
    port = str(free_port())
    machines = []
    for machine_rank in (0, 1):
        command = [
            sys.executable, "-m", "slipstream.cli", "launch", "--num_processes", "2",
            "--num_machines", "2", "--machine_rank", str(machine_rank), "--main_process_ip",
            "127.0.0.1", "--main_process_port", port, "--rdzv_backend", backend, "--cpu",
            str(probe), str(out),
        ]  # fmt: skip
        machines.append(
            subprocess.Popen(
                command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outputs = [m.communicate(timeout=120) for m in machines]
    assert [m.returncode for m in machines] == [0, 0], outputs
    found = reports(out)
    assert_one_group(found)
    assert [r["local_rank"] for r in found] == [0, 0], "one process on each machine"


@pytest.mark.slow
def test_a_crashing_rank_ends_the_job_with_its_traceback(tmp_path: Path):
    script = tmp_path / "crash.py"
    script.write_text(
        "import time\nfrom slipstream import Accelerator\n"
        "accelerator = Accelerator()\n"
        "if accelerator.process_index == 1:\n"
        "    raise RuntimeError('boom on rank one')\n"
        "accelerator.wait_for_everyone()\n"
        "time.sleep(600)\n"
    )
    start = time.monotonic()
    result = run_cli("launch", "-n", "2", "--cpu", str(script), timeout=90)
    elapsed = time.monotonic() - start
    assert result.returncode == 1
    assert elapsed < 45, f"the job took {elapsed:.0f}s to stop"
    assert result.stderr.startswith("slipstream launch: rank 1 of 2 failed (exit code 1):")
    assert "RuntimeError: boom on rank one" in result.stderr
    assert result.stderr.count("RuntimeError: boom on rank one") == 1, (
        "the traceback is printed once"
    )
    assert "runpy" not in result.stderr, "bootstrap frames are hidden"


@pytest.mark.slow
def test_exit_code_of_the_script_is_the_exit_code_of_the_job(tmp_path: Path):
    script = tmp_path / "exit3.py"
    script.write_text("import sys\nsys.exit(3)\n")
    assert run_cli("launch", "-n", "2", "--cpu", str(script)).returncode == 3


@pytest.mark.parametrize(
    "arguments,message",
    [
        (["-n", "0", "{script}"], "num_processes must be at least 1"),
        (["-n", "2", "missing.py"], "training script 'missing.py' does not exist"),
        (["--num_machines", "2", "{script}"], "needs main_process_ip"),
        (["--config_file", "{bad}", "{script}"], "not valid YAML"),
        (
            ["--config_file", "{typo}", "{script}"],
            "unknown key 'num_proceses' (did you mean 'num_processes'?)",
        ),
        (["--config_file", "{fsdp}", "{script}"], "fsdp_config: unknown key 'fsdp_wrap'"),
    ],
    ids=[
        "zero-processes",
        "missing-script",
        "no-main-ip",
        "bad-yaml",
        "unknown-key",
        "no-strategy",
    ],
)
def test_launch_errors_are_one_clear_line(tmp_path: Path, arguments: list[str], message: str):
    script = tmp_path / "ok.py"
    script.write_text("print('should not run')\n")
    (tmp_path / "bad.yaml").write_text("num_processes: [1\n")
    (tmp_path / "typo.yaml").write_text("num_proceses: 2\n")
    (tmp_path / "fsdp.yaml").write_text(
        "distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_wrap: 1\n"
    )
    paths = {name: tmp_path / f"{name}.yaml" for name in ("bad", "typo", "fsdp")}
    paths["script"] = script
    result = run_cli_here("launch", *[a.format(**paths) for a in arguments])
    assert result.returncode == 2
    assert message in result.stderr
    assert "should not run" not in result.stdout
    assert len(result.stderr.strip().splitlines()) <= 3


def test_torchrun_arguments():
    single = torchrun_arguments(LaunchRequest(LaunchConfig(num_processes=4), "t.py", ["a"]))
    assert "--standalone" in single and "--nproc_per_node=4" in single
    assert single[-4:] == ["--module", "slipstream.launcher.worker", "t.py", "a"]
    fixed = torchrun_arguments(
        LaunchRequest(LaunchConfig(num_processes=2, main_process_port=1234), "t.py")
    )
    assert "--master_port=1234" in fixed and "--standalone" not in fixed
    multi = LaunchConfig(
        num_processes=8, num_machines=2, machine_rank=1, main_process_ip="10.1.1.1",
        main_process_port=29400,
    )  # fmt: skip
    c10d = torchrun_arguments(LaunchRequest(multi, "m", [], module=True))
    assert "--nproc_per_node=4" in c10d and "--rdzv_endpoint=10.1.1.1:29400" in c10d
    assert "--rdzv_conf=is_host=false" in c10d and c10d[-3:] == [
        "slipstream.launcher.worker",
        "--module",
        "m",
    ]
    static = torchrun_arguments(LaunchRequest(multi.replace(rdzv_backend="static"), "t.py"))
    assert "--node_rank=1" in static and "--master_addr=10.1.1.1" in static
