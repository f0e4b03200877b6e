"""Every example runs, in its quick mode, the way its header says to run it; every training
example visibly learns: it prints its held-out loss and accuracy before training (chance
level) and after training, and the loss falls while the accuracy rises by a clear margin."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.distributed import REPO, run_cli, run_python

TRAIN = str(REPO / "examples" / "train.py")
# The one format every training example prints its evaluations in.
EVALUATION = re.compile(
    r"^(before training|epoch \d+|step \d+): held-out loss (\d+\.\d+), accuracy (\d\.\d+)",
    re.MULTILINE,
)


# One thread per process, as the launcher gives the workers of a job that fills the machine.
# A lone `python` run would get torch's default, a thread per core, whose idle threads spin
# waiting for work: on a loaded 2-core machine that doubles the CPU the run costs.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def learning_curve(stdout: str) -> list[tuple[str, float, float]]:
    """(when, held-out loss, accuracy) for each evaluation the example printed."""
    return [
        (when, float(loss), float(accuracy)) for when, loss, accuracy in EVALUATION.findall(stdout)
    ]


def assert_learns(stdout: str, rise: float = 0.3) -> list[tuple[str, float, float]]:
    """The first evaluation is before training, printed once (by the main process only); by
    the last the held-out loss has fallen by a quarter and the accuracy risen by ``rise``."""
    curve = learning_curve(stdout)
    assert len(curve) >= 2 and curve[0][0] == "before training", stdout
    assert [when for when, _, _ in curve].count("before training") == 1, stdout
    (_, first_loss, first_accuracy), (_, last_loss, last_accuracy) = curve[0], curve[-1]
    assert last_loss < 0.75 * first_loss, curve
    assert last_accuracy >= first_accuracy + rise, curve
    return curve


@pytest.mark.slow
def test_train_example_on_two_cpu_processes(tmp_path: Path):
    weights, chart = tmp_path / "weights.pt", tmp_path / "loss.png"
    result = run_cli(
        "launch", "--num_processes", "2", "--cpu", TRAIN, "--quick", "--save", str(weights),
        "--plot", str(chart),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    curve = assert_learns(result.stdout)
    assert [when for when, _, _ in curve] == ["before training", "epoch 0", "epoch 1"]
    assert curve[-1][2] > 0.85, curve
    lines = [line for line in result.stdout.splitlines() if "held-out loss" in line]
    assert all(line.endswith("on 1001 samples (2 processes, cpu)") for line in lines), lines
    state = torch.load(weights, weights_only=True)
    assert set(state) == {"0.weight", "0.bias", "3.weight", "3.bias"}
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_example_on_one_process():
    result = run_python(TRAIN, "--quick", env=ONE_THREAD)
    assert result.returncode == 0, result.stderr
    assert_learns(result.stdout)
    assert "on 1001 samples (1 process, cpu)" in result.stdout


@pytest.mark.slow
def test_evaluate_metrics_example_is_exact_on_two_processes():
    example = str(REPO / "examples" / "evaluate_metrics.py")
    one = run_python(example, env=ONE_THREAD)
    two = run_cli("launch", "--num_processes", "2", "--cpu", example)
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    line_one = next(line for line in one.stdout.splitlines() if "accuracy" in line)
    line_two = next(line for line in two.stdout.splitlines() if "accuracy" in line)
    assert line_one.replace("(1 processes)", "") == line_two.replace("(2 processes)", "")


def example(name: str) -> str:
    return str(REPO / "examples" / name)


@pytest.mark.slow
def test_resume_example_continues_where_it_stopped(tmp_path: Path):
    project = str(tmp_path / "run")
    straight = run_cli(
        "launch",
        "-n",
        "2",
        "--cpu",
        example("resume.py"),
        "--quick",
        "--project_dir",
        str(tmp_path / "straight"),
    )
    stopped = run_cli(
        "launch",
        "-n",
        "2",
        "--cpu",
        example("resume.py"),
        "--quick",
        "--project_dir",
        project,
        "--stop_after",
        "10",
    )
    resumed = run_cli(
        "launch", "-n", "2", "--cpu", example("resume.py"), "--quick", "--project_dir", project
    )
    assert straight.returncode == stopped.returncode == resumed.returncode == 0, resumed.stderr
    assert [when for when, _, _ in assert_learns(straight.stdout)] == ["before training", "step 30"]
    assert "stopping at step 10" in stopped.stdout
    assert "resumed from" in resumed.stdout and "at step 8" in resumed.stdout
    final = [line for line in straight.stdout.splitlines() if "checksum" in line]
    assert final and final == [line for line in resumed.stdout.splitlines() if "checksum" in line]
    assert learning_curve(resumed.stdout) == learning_curve(straight.stdout)[-1:]


@pytest.mark.slow
def test_distributed_inference_example():
    result = run_cli("launch", "-n", "2", "--cpu", example("distributed_inference.py"), "--quick")
    assert result.returncode == 0, result.stderr
    assert "101 answers from 2 processes" in result.stdout


@pytest.mark.slow
def test_fsdp_example(tmp_path: Path):
    result = run_cli(
        "launch",
        "-n",
        "2",
        "--cpu",
        example("fsdp_train.py"),
        "--quick",
        "--plugin",
        "--save",
        str(tmp_path / "w"),
    )
    assert result.returncode == 0, result.stderr
    assert_learns(result.stdout)
    assert "(FSDP, 2 processes)" in result.stdout
    assert (tmp_path / "w" / "model.safetensors").exists()


@pytest.mark.slow
def test_deepspeed_example(tmp_path: Path):
    pytest.importorskip("deepspeed")
    result = run_cli(
        "launch",
        "-n",
        "2",
        "--cpu",
        example("deepspeed_zero3.py"),
        "--quick",
        "--save",
        str(tmp_path / "w"),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert_learns(result.stdout)
    assert "(ZeRO-3, 2 processes)" in result.stdout and "16-bit weights saved" in result.stdout
    assert "is deprecated" not in result.stderr, "DeepSpeed's deprecation warnings are hidden"


@pytest.mark.slow
def test_tensor_parallel_example_on_four_processes(tmp_path: Path):
    result = run_cli(
        "launch", "-n", "4", "--cpu", example("tensor_parallel.py"), "--quick",
        "--save", str(tmp_path / "w"), timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "(dp_replicate=1, dp_shard=2, tp=2)" in result.stdout, "dp_shard: what tp leaves"
    assert_learns(result.stdout)
    lines = [line for line in result.stdout.splitlines() if "held-out loss" in line]
    assert all("on 203 samples (4 processes)" in line for line in lines), "every sample once"
    assert (tmp_path / "w" / "model.safetensors").exists()


@pytest.mark.slow
def test_tensor_parallel_example_with_a_transformers_model():
    pytest.importorskip("transformers")
    result = run_cli(
        "launch", "-n", "2", "--cpu", example("tensor_parallel.py"), "--quick", "--llama",
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "(dp_replicate=1, dp_shard=1, tp=2)" in result.stdout
    assert "on 203 samples (2 processes)" in result.stdout
    assert_learns(result.stdout)


@pytest.mark.slow
def test_moe_example_learns_with_experts_over_two_of_four_processes(tmp_path: Path):
    transformers = pytest.importorskip("transformers")
    result = run_cli(
        "launch", "-n", "4", "--cpu", example("moe.py"), "--quick",
        "--save", str(tmp_path / "w"), timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "transformers Qwen3-MoE; layout dp_shard=4 (experts over ep=2)" in result.stdout
    losses = [
        float(line.split("training loss ")[1])
        for line in result.stdout.splitlines()
        if "training loss" in line
    ]
    assert losses[0] > 3.0 and losses[-1] < 1.0, result.stdout  # it learns as it goes
    assert assert_learns(result.stdout)[-1][2] > 0.9, result.stdout
    # Every expert in the consolidated weights, which transformers loads.
    model = transformers.Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / "w"))
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 4


@pytest.mark.slow
def test_moe_example_with_a_plain_module():
    result = run_cli(
        "launch", "-n", "2", "--cpu", example("moe.py"), "--quick", "--plain", timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "plain module; layout dp_shard=2 (experts over ep=2)" in result.stdout
    assert assert_learns(result.stdout)[-1][2] == 1.0, result.stdout


@pytest.mark.slow
def test_pipeline_example_is_the_same_script_with_and_without_a_pipeline(tmp_path: Path):
    pipelined = run_cli(
        "launch", "-n", "2", "--cpu", example("pipeline_parallel.py"), "--quick",
        "--save", str(tmp_path / "w"), timeout=300,
    )  # fmt: skip
    alone = run_python(
        example("pipeline_parallel.py"), "--quick", "--pp", "1", timeout=300, env=ONE_THREAD
    )
    assert pipelined.returncode == 0 and alone.returncode == 0, pipelined.stderr + alone.stderr
    assert "pipeline stage 0" in pipelined.stdout and "pipeline stage 1" in pipelined.stdout
    # The same held-out loss and accuracy, before and after training, with or without stages.
    assert assert_learns(pipelined.stdout) == learning_curve(alone.stdout)
    assert (tmp_path / "w" / "model.safetensors").exists()


@pytest.mark.slow
def test_pipeline_example_on_four_processes_shards_each_stage_without_being_told():
    """4 processes and 2 stages: the data-parallel size left unset takes the other 2 (FSDP2
    inside each stage); here with a transformers model, split by its own layers."""
    pytest.importorskip("transformers")
    result = run_cli(
        "launch", "-n", "4", "--cpu", example("pipeline_parallel.py"), "--quick", "--llama",
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "layout pp=2 x dp_shard=2" in result.stdout
    stages = re.findall(r"process (\d): pipeline stage (\d)", result.stdout)
    assert stages == [("0", "0"), ("1", "0"), ("2", "1"), ("3", "1")], result.stdout
    assert assert_learns(result.stdout)[-1][2] > 0.8, result.stdout


@pytest.mark.slow
def test_lightning_example_learns_on_two_processes(tmp_path: Path):
    pytest.importorskip("lightning")
    result = run_python(
        example("lightning_train.py"), "--quick", "--output", str(tmp_path), timeout=150
    )
    assert result.returncode == 0, result.stderr[-4000:]
    curve = assert_learns(result.stdout)
    assert [when for when, _, _ in curve] == ["before training", "epoch 0", "epoch 1"]
    assert "validation accuracy" in result.stdout and (tmp_path / "weights").is_dir()
    assert "it is recommended to use `Trainer(devices=1" not in result.stderr


@pytest.mark.slow
def test_big_model_inference_example_on_two_processes(tmp_path: Path):
    pytest.importorskip("transformers")
    result = run_cli(
        "launch", "-n", "2", "--cpu", example("big_model_inference.py"), "--quick", "--check",
        "--checkpoint", str(tmp_path / "llama"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "answers equal the in-memory model's" in result.stdout
    assert "5 answers from 2 processes" in result.stdout
    assert "the rest on disk" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "llama", "llama-offload-0", "llama-offload-1",
    ]  # fmt: skip
    assert [p.name for p in (tmp_path / "llama-offload-0").iterdir()] == ["index.json"]


@pytest.mark.slow
def test_fault_tolerant_example_learns_over_two_replica_groups():
    pytest.importorskip("torchft")
    result = run_cli(
        "launch", "--cpu", "-n", "2", "--fault_tolerance",
        example("fault_tolerant.py"), "--quick",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert_learns(result.stdout)
    # The cosine schedule ends at 0 (stepped once per process of both groups per step, its
    # horizon counts them: it does not reach 0 halfway and climb back).
    final = re.search(r"learning rate at the end: (\d+\.\d+)", result.stdout)
    assert final is not None and float(final.group(1)) < 1e-4, result.stdout
    # One summary line per group from the launcher (a group may join a step late).
    for group in (0, 1):
        pattern = rf"slipstream launch: replica group replica_{group}: finished at step 60; "
        assert re.search(pattern + r"\d+ steps committed, 0 discarded", result.stderr), (
            result.stderr[-3000:]
        )


@pytest.mark.slow
def test_trainer_example_learns_with_tensor_parallelism_on_two_processes(tmp_path: Path):
    # transformers' Trainer with one import changed; --tp splits the Llama with its own plan.
    result = run_cli(
        "launch", "-n", "2", "--cpu", example("trainer.py"), "--quick", "--tp",
        "--save", str(tmp_path / "model"), timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    curve = assert_learns(result.stdout)
    assert [when for when, _, _ in curve] == ["before training", "epoch 0", "epoch 1"]
    assert all(
        "(2 processes, cpu)" in line for line in result.stdout.splitlines() if "held-out" in line
    )
    from transformers import LlamaForCausalLM

    saved = LlamaForCausalLM.from_pretrained(tmp_path / "model")  # whole, gathered weights
    assert saved.model.layers[0].self_attn.q_proj.weight.shape == (64, 64)
