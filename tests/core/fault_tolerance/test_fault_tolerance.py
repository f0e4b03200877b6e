"""Per-step fault tolerance (torchft) on real processes: replica groups launched with
``slipstream launch --fault_tolerance``, one of them killed with SIGKILL mid-training and
restarted by its agent. Each job logs one JSON line per step and process (ft_job.py)."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.core.fault_tolerance.ft_job import build_model, data, weights
from tests.distributed import run_fault_tolerant_job

#: Starts its own processes for every test: left out of `pytest -m "not slow"`.
pytestmark = pytest.mark.slow

pytest.importorskip("torchft")

JOB = Path(__file__).with_name("ft_job.py")
HEARTBEAT = 2.0  # --ft_heartbeat_timeout in run_fault_tolerant_job
TRUE_WEIGHTS = [i / 8 for i in range(1, 9)]


def _logs(out: Path) -> dict[str, list[dict[str, Any]]]:
    return {
        path.stem: [json.loads(line) for line in path.read_text().splitlines()]
        for path in sorted(out.glob("*.jsonl"))
    }


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return (
        Path(f"/proc/{pid}/status").exists()
        and "zombie" not in Path(f"/proc/{pid}/status").read_text()
    )


def _replay(logs: dict[str, list[dict[str, Any]]], hidden: int) -> list[float]:
    """The reference: one process applying the job's committed steps in order, each on the
    samples every data-parallel process of its quorum trained on (gradients averaged over
    them, as the job does)."""
    batches: dict[int, dict[int, list[int]]] = {}
    rates: dict[int, float] = {}
    for rows in logs.values():
        for r in rows:
            if r.get("committed"):
                step = batches.setdefault(r["step"], {})
                # Tensor-parallel peers share their data-parallel rank and batch.
                assert step.setdefault(r["rank"], r["trained"]) == r["trained"]
                # The schedule follows committed steps: StepLR(10, 0.9) stepped once per
                # process of the whole job (groups x data-parallel processes) per step.
                lr = 0.1 * 0.9 ** (r["step"] * r["scheduler_steps"] // 10)
                assert r["lr_used"] == pytest.approx(lr, rel=1e-6), r
                rates[r["step"]] = r["lr_used"]
    assert sorted(batches) == list(range(len(batches))), "a committed step is missing"
    model = build_model(hidden)
    x, y = data().tensors
    for step in sorted(batches):
        model.zero_grad()
        losses = [nn.functional.mse_loss(model(x[i]), y[i]) for i in batches[step].values()]
        (sum(losses) / len(losses)).backward()
        with torch.no_grad():
            for param in model.parameters():
                param -= rates[step] * param.grad
    return weights(model)


def _check_job(
    out: Path,
    victims: tuple[str, ...],
    groups: int,
    ranks: int = 1,
    hidden: int = 0,
    tensor_parallel: int = 1,
    solved: bool = True,
) -> None:
    """The promises of fault tolerance, read from the logs of a job that lost each of
    ``victims`` (``replica{N}``) once; ``ranks`` processes per group."""
    logs = _logs(out)
    survivors = {k: v for k, v in logs.items() if not k.startswith(victims)}
    assert survivors, f"no group survived: {sorted(logs)}"
    reborn = {k: v for k, v in logs.items() if k.startswith(victims) and k.endswith("life1")}
    for victim in victims:
        back = [k for k in reborn if k.startswith(victim)]
        assert len(back) == ranks, f"{victim} did not come back: {sorted(logs)}"
    finals = [rows[-1]["final"] for rows in [*survivors.values(), *reborn.values()]]
    # Every live group ends with the same model: the one a single process gets from the
    # committed steps and their samples (a discarded step left no trace), and (``solved``:
    # the long runs of the linear model) close to the solution.
    reference = _replay(logs, hidden)
    for final in finals:
        assert final == pytest.approx(finals[0], abs=1e-6)
        assert final == pytest.approx(reference, abs=1e-5)
        if solved:
            assert final[:8] == pytest.approx(TRUE_WEIGHTS, abs=0.08)
    for name, rows in survivors.items():
        steps = [r for r in rows if "step" in r]
        discarded = [r for r in steps if not r["committed"]]
        # At most one step lost per group that died.
        assert len(discarded) <= len(victims), f"{name} lost {len(discarded)} steps"
        # The step after a peer dies waits at most the heartbeat timeout (+2 s).
        gaps = [b["time"] - a["time"] for a, b in itertools.pairwise(steps)]
        assert max(gaps) <= HEARTBEAT + 2.0, f"{name} stalled {max(gaps):.2f} s"
        # Committed steps count up one by one: the scheduler and counters follow them (a
        # group that started late joins at the others' step).
        committed = [r["step"] for r in steps if r["committed"]]
        assert committed == list(range(committed[0], committed[0] + len(committed)))
    # A restarted group starts from the survivors' weights at that very step (every
    # process logs the whole model, gathered from its shards).
    survivor = next(iter(survivors.values()))
    for rows in reborn.values():
        first = rows[0]
        same_step = [r for r in survivor if r.get("step") == first["step"]]
        assert same_step, f"the survivor never ran step {first['step']}"
        assert first["weights"] == same_step[-1]["weights"]
        assert first["step"] > 0 and first["lr_used"] == pytest.approx(same_step[-1]["lr_used"])
        assert first["scheduler_steps"] == groups * ranks // tensor_parallel
    _check_epochs(logs)
    # Nothing left running.
    for pid_file in out.glob("*.pid"):
        assert not _alive(int(pid_file.read_text())), f"{pid_file.stem} still runs"


def _check_epochs(logs: dict[str, list[dict[str, Any]]], *, finishes_one: bool = True) -> None:
    """Epoch accounting: within an epoch, committed batches never share a sample, and a
    finished epoch saw every sample exactly once (``finishes_one``: the job got past one)."""
    by_epoch: dict[int, list[int]] = {}
    seen_steps: set[tuple[int, int, int]] = set()
    for rows in logs.values():
        for r in rows:
            if r.get("committed") and (r["step"], r["rank"], r["epoch"]) not in seen_steps:
                seen_steps.add((r["step"], r["rank"], r["epoch"]))
                by_epoch.setdefault(r["epoch"], []).extend(r["indices"])
    last = max(by_epoch)
    assert last > 0 or not finishes_one, "the job did not finish an epoch"
    for epoch, samples in by_epoch.items():
        assert len(samples) == len(set(samples)), f"epoch {epoch} repeated a sample"
        if epoch < last:
            assert sorted(samples) == list(range(96)), f"epoch {epoch} dropped samples"


@pytest.fixture(scope="module")
def three_groups_lose_two(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """One job of 3 replica groups that loses two of them, each in its own way: replica 1
    dies (SIGKILL) inside backward at step 3 while the others wait in the gradient
    all-reduce; replica 2 is killed from outside between steps, after step 6. Each agent
    restarts its group, which rejoins from a live group's state."""
    out = tmp_path_factory.mktemp("three_groups")
    job = [
        "40", "--die-at", "3", "--die-mode", "allreduce", "--also-die", "2:6:wait",
        "--step-sleep", "0.2", "--until-rejoined",
    ]  # fmt: skip
    result = run_fault_tolerant_job(
        JOB, out, job, processes=3, groups=3, kill_when=out / "victim-ready", timeout=180
    )
    assert result.returncode == 0, result.stdout[-3000:]
    return out, result


def _summaries(said: list[str]) -> dict[str, str]:
    """Each group's summary line from the launcher, by group."""
    found = [re.match(r"replica group (replica_\d+): (finished|stopped)", line) for line in said]
    return {m.group(1): line for m, line in zip(found, said, strict=True) if m}


def _counted(logs: dict[str, list[dict[str, Any]]], group: str) -> tuple[int, int]:
    """The steps a group committed and discarded, from its own logs, over the lives that
    ended (a killed life leaves no summary, so the launcher does not count its steps)."""
    rows = [
        r
        for name, life in logs.items()
        if name.startswith(group.replace("_", "") + "-") and life and "final" in life[-1]
        for r in life
        if "step" in r
    ]
    return sum(r["committed"] for r in rows), sum(not r["committed"] for r in rows)


@pytest.mark.timeout(200)
def test_a_group_killed_during_the_gradient_all_reduce_rejoins(
    three_groups_lose_two: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    out, result = three_groups_lose_two
    # What the user sees: one line per event, from the launcher, and a summary per group;
    # not torchelastic's lines nor the HTTP access log of the state transfer.
    said = _launcher_lines(result.stdout)
    # (Besides these, a group that started a step late says it joined late.)
    said = [line for line in said if "joined late" not in line]
    summaries = _summaries(said)
    events = [line for line in said if line not in summaries.values()]
    assert said[-3:] == list(summaries.values()) and len(summaries) == 3, said
    assert "replica group replica_1 lost (SIGKILL) at step 3; restart 1/1" in events, said
    assert [line for line in events if "replica_2 lost" in line] == [
        "replica group replica_2 lost (SIGKILL) at step 6; restart 1/1"
    ], said
    for group in ("replica_1", "replica_2"):
        rejoined = [line for line in events if line.startswith(f"replica group {group} rejoined")]
        assert len(rejoined) == 1, said
        assert re.fullmatch(
            rf"replica group {group} rejoined at step \d+, state copied from replica_[012] in "
            r"\d+\.\d s",
            rejoined[0],
        ), said
    assert len(events) == 4, said
    # (A group may start a step late and copy the other's state: a recovery at the start.)
    assert re.fullmatch(
        r"replica group replica_0: finished at step \d+; \d+ steps committed, [012] "
        r"discarded, [01] recover(y|ies) from a peer, 0 restarts",
        summaries["replica_0"],
    ), said
    for group in ("replica_1", "replica_2"):
        assert re.fullmatch(
            rf"replica group {group}: finished at step \d+; \d+ steps? committed, [01] "
            r"discarded, [12] recover(y|ies) from a peer, 1 restart",
            summaries[group],
        ), said
    # Each summary counts exactly the steps the group's logs show as committed and discarded.
    logs = _logs(out)
    for group, line in summaries.items():
        counts = re.search(r"(\d+) steps? committed, (\d+) discarded", line)
        assert counts and tuple(map(int, counts.groups())) == _counted(logs, group), (group, said)
    assert "GET /checkpoint" not in result.stdout and "exitcode" not in result.stdout
    # `ps` names each worker's group, and each group's agent.
    shown = (out / "replica1-rank0-life1.ps").read_text().splitlines()
    assert "slipstream.launcher.worker --replica_group replica_1 " in shown[0], shown
    assert "slipstream.launcher.group_agent replica_1 " in shown[1], shown


def _launcher_lines(output: str) -> list[str]:
    prefix = "slipstream launch: "
    return [line[len(prefix) :] for line in output.splitlines() if line.startswith(prefix)]


@pytest.mark.timeout(200)
def test_three_groups_survive_a_kill_between_steps(
    three_groups_lose_two: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    # The same job: replica 0 survives both losses; both victims come back.
    out, _ = three_groups_lose_two
    _check_job(out, ("replica1", "replica2"), groups=3)


@pytest.mark.timeout(150)
def test_hsdp_two_groups_of_two_survive_a_kill_during_the_gradient_all_reduce(
    tmp_path: Path,
) -> None:
    # HSDP 2x2: FSDP2 shards inside each group of 2 processes, the groups are replicas.
    # Both processes of replica 1 die inside backward at step 3 while replica 0 waits in
    # the all-reduce of its gradient shards; the agent restarts the group.
    result = run_fault_tolerant_job(
        JOB,
        tmp_path,
        [
            "16",
            "--die-at",
            "3",
            "--die-mode",
            "allreduce",
            "--step-sleep",
            "0.2",
            "--until-rejoined",
        ],
        processes=4,
        groups=2,
        launch_args=("--use_fsdp",),
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert {r["strategy"] for r in _logs(tmp_path)["replica0-rank0-life0"] if "step" in r} == {
        "fsdp"
    }
    _check_job(tmp_path, ("replica1",), groups=2, ranks=2, solved=False)


@pytest.mark.timeout(150)
def test_tensor_parallel_groups_survive_a_kill_between_steps(tmp_path: Path) -> None:
    # TP 2 inside each of 2 replica groups (4 processes): a process of replica 1 is killed
    # from outside after step 3; its TP peer goes down with it and the group is restarted.
    result = run_fault_tolerant_job(
        JOB,
        tmp_path,
        [
            "24",
            "--hidden",
            "4",
            "--die-at",
            "3",
            "--die-mode",
            "wait",
            "--step-sleep",
            "0.2",
            "--until-rejoined",
        ],
        processes=4,
        groups=2,
        launch_args=(
            "--parallelism_config_tp_size",
            "2",
            "--parallelism_config_tp_plan",
            "0=colwise,1=rowwise",
        ),
        kill_when=tmp_path / "victim-ready",
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert {r["strategy"] for r in _logs(tmp_path)["replica0-rank0-life0"] if "step" in r} == {
        "model_parallel"
    }
    _check_job(
        tmp_path, ("replica1",), groups=2, ranks=2, hidden=4, tensor_parallel=2, solved=False
    )


@pytest.mark.timeout(150)
def test_a_group_restarted_after_the_training_finished_stops(tmp_path: Path) -> None:
    # replica 1 is killed after the last step, once replica 0 has finished and left the
    # quorum: the restarted group finds no one to recover from and the "finished" mark, so
    # it stops instead of training again from step 0 alone. Replica 0's process stays 10 s
    # after it left (--linger): its agent, and so the launcher, see it end only then, so
    # the mark the restarted group reads is the one replica 0 left when its script ended.
    result = run_fault_tolerant_job(
        JOB,
        tmp_path,
        ["4", "--die-at", "4", "--die-mode", "wait", "--linger", "10"],
        processes=2,
        groups=2,
        kill_when=tmp_path / "victim-ready",
    )
    assert result.returncode == 0, result.stdout[-3000:]
    logs = _logs(tmp_path)
    assert [r["step"] for r in logs["replica0-rank0-life0"] if "step" in r] == [0, 1, 2, 3]
    assert logs["replica1-rank0-life1"] == [], "the restarted group trained again"
    said = [line for line in _launcher_lines(result.stdout) if "joined late" not in line]
    assert said[0] == "replica group replica_1 lost (SIGKILL) at step 4; restart 1/1", said
    assert said[1].startswith("replica group replica_1 restarted after another group finished")
    assert said[1].endswith("nothing is left to do, so it stops here (exit 0)")
    assert said[2].startswith("replica group replica_0: finished at step 4; "), said
    assert said[3] == (
        "replica group replica_1: stopped after its restart: the others had finished the "
        "training; 0 steps committed, 0 discarded, 0 recoveries from a peer, 1 restart"
    ), said
    for pid_file in tmp_path.glob("*.pid"):
        assert not _alive(int(pid_file.read_text())), f"{pid_file.stem} still runs"


@pytest.mark.timeout(150)
def test_losing_every_group_falls_back_to_the_checkpoint(tmp_path: Path) -> None:
    # Both groups die inside backward at step 5; no peer is left to recover from, so the
    # restarted groups resume from the latest checkpoint (step 4, saved by replica 0 every
    # 2 steps and loaded by the script's load_state) and the job's step count follows it.
    checkpoints = tmp_path / "checkpoints"
    job = [
        "16", "--die-at", "5", "--die-replica", "-1", "--die-mode", "allreduce",
        "--checkpoint", str(checkpoints), "--checkpoint-every", "2", "--resume",
    ]  # fmt: skip
    result = run_fault_tolerant_job(JOB, tmp_path, job, processes=2, groups=2)
    assert result.returncode == 0, result.stdout[-3000:]
    logs = _logs(tmp_path)
    assert sorted(logs) == [f"replica{g}-rank0-life{life}" for g in (0, 1) for life in (0, 1)]
    first_life = [r for r in logs["replica0-rank0-life0"] if "step" in r]
    assert [r["step"] for r in first_life if r["committed"]] == [0, 1, 2, 3, 4]
    restarted = {k: [r for r in v if "step" in r] for k, v in logs.items() if "life1" in k}
    # The groups start again at the checkpoint's step, from its weights: what the first
    # life had before step 4 (its step 4 is lost with it).
    checkpointed = next(r for r in first_life if r["step"] == 4)
    # (A group restarted after the other has finished the training stops without a step.)
    starts = sorted(rows[0]["step"] for rows in restarted.values() if rows)
    assert starts[0] == 4, starts
    for rows in restarted.values():
        if rows and rows[0]["step"] == 4:
            assert rows[0]["weights"] == checkpointed["weights"]
            assert rows[0]["lr_used"] == pytest.approx(checkpointed["lr_used"])
    # The final model is the one a single process gets from the committed steps up to the
    # checkpoint and those after the restart.
    kept = {k: [r for r in v if "life1" in k or r.get("step", 99) < 4] for k, v in logs.items()}
    reference = _replay(kept, hidden=0)
    for rows in logs.values():
        if rows and "final" in rows[-1]:
            assert rows[-1]["final"] == pytest.approx(reference, abs=1e-5)
    # Both groups back from step 4 get through the first epoch (96 samples, 8 a step); a
    # group that restarts late (the machine busy) leaves the other alone at 4 a step, short
    # of it by the last step.
    _check_epochs(kept, finishes_one=starts == [4, 4])
    for pid_file in tmp_path.glob("*.pid"):
        assert not _alive(int(pid_file.read_text())), f"{pid_file.stem} still runs"
