"""Semi-synchronous training (LocalSGD, streaming DiLoCo) on real replica groups launched
with ``slipstream launch --fault_tolerance``: bitwise parity with hand-written loops on
torchft's own ``Manager`` and ``torchft.local_sgd`` classes, a checkpoint taken inside an
interval, and a group killed between two syncs (semi_sync_job.py logs every step)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from slipstream.fault_tolerance import Lighthouse
from tests.core.fault_tolerance.semi_sync_job import (
    BATCH,
    OUTER_LR,
    OUTER_MOMENTUM,
    build_model,
    data,
)
from tests.distributed import run_fault_tolerant_job

pytest.importorskip("torchft")

JOB = Path(__file__).with_name("semi_sync_job.py")
STEPS = 16


def _logs(out: Path) -> dict[str, list[dict[str, Any]]]:
    return {
        path.stem: [json.loads(line) for line in path.read_text().splitlines()]
        for path in sorted(out.glob("replica*.jsonl"))
    }


def _run(out: Path, *args: str, **kwargs: Any) -> Any:
    out.mkdir(parents=True, exist_ok=True)
    result = run_fault_tolerant_job(JOB, out, [str(STEPS), *args], processes=2, groups=2, **kwargs)
    assert result.returncode == 0, result.stdout[-3000:]
    return result


def _lines(output: str) -> list[str]:
    prefix = "slipstream launch: "
    return [line[len(prefix) :] for line in output.splitlines() if line.startswith(prefix)]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_local_sgd_and_streaming_diloco_equal_torchft_and_resume_inside_an_interval(
    tmp_path: Path,
) -> None:
    # Both groups are in every quorum (--ft_min_replicas 2), so each mode must equal the
    # same training hand-written on torchft, which each process runs first (on a
    # lighthouse of its own): LocalSGD every 4 steps, and DiLoCo in 2 fragments synced in
    # turn every 2 steps, each fragment's all-reduce started one step early; the inner
    # optimizer SGD with momentum, the scheduler StepLR.
    both = ("--ft_min_replicas", "2")
    common = ("--sync-every", "4", "--momentum", "0.9")
    streaming = ("--fragments", "2", "--delay", "1")
    with Lighthouse(min_replicas=2) as lighthouse:
        _run(
            tmp_path / "local_sgd",
            *("--method", "local_sgd", "--reference", lighthouse.address),
            *common,
            launch_args=both,
        )
    # Each group saves its checkpoint at step 5, one step into the interval [4, 6).
    with Lighthouse(min_replicas=2) as lighthouse:
        result = _run(
            tmp_path / "diloco",
            *("--method", "diloco", "--reference", lighthouse.address),
            *common,
            *streaming,
            *("--save-at", "5"),
            launch_args=both,
        )
    said = [line for line in _lines(result.stdout) if "joined late" not in line]
    for index, line in enumerate(said):
        assert re.fullmatch(
            rf"replica group replica_{index}: finished at step {STEPS}; 9 syncs committed, 0 "
            r"discarded, [01] recover(y|ies) from a peer, 0 restarts",
            line,
        ), said
    for method in ("local_sgd", "diloco"):
        logs = _logs(tmp_path / method)
        ends = {name: rows[-1] for name, rows in logs.items()}
        for replica in (0, 1):
            torchft = json.loads(
                (tmp_path / method / f"reference-replica{replica}.json").read_text()
            )
            end = ends[f"replica{replica}-life0"]
            # Bitwise: the same arithmetic in the same order.
            assert end["trained"] == torchft["final"], (method, replica)
            assert end["steps"] == STEPS
        # end_training synced what each group trained since its last sync: every group
        # ends with the same weights.
        assert ends["replica0-life0"]["final"] == ends["replica1-life0"]["final"]
    # LocalSGD's groups differ only inside an interval (16 = 4 x 4: in sync at the end).
    local = _logs(tmp_path / "local_sgd")["replica0-life0"]
    assert local[-1]["trained"] == local[-1]["final"]
    # The resumed job starts at the interval's start (step 4, interval 2: the checkpoint
    # holds the state it started from) and ends exactly as the uninterrupted one.
    resumed_out = tmp_path / "resumed"
    resumed_out.mkdir()
    for replica in (0, 1):
        checkpoint = f"checkpoint-replica{replica}"
        (tmp_path / "diloco" / checkpoint).rename(resumed_out / checkpoint)
    _run(resumed_out, "--method", "diloco", *common, *streaming, "--resume", launch_args=both)
    first = _logs(tmp_path / "diloco")
    for name, rows in _logs(resumed_out).items():
        assert (rows[0]["step"], rows[0]["interval"]) == (4, 2), rows[0]
        original = next(r for r in first[name] if r.get("step") == 4)
        assert rows[0]["weights"] == original["weights"]
        assert rows[-1]["final"] == first[name][-1]["final"]


def _intervals(logs: dict[str, list[dict[str, Any]]]) -> dict[int, dict[int, list[dict]]]:
    """The committed intervals: for each, every data-parallel rank's inner steps."""
    committed: dict[int, dict[int, list[dict[str, Any]]]] = {}
    for rows in logs.values():
        current: list[dict[str, Any]] = []
        for row in rows:
            if "step" in row:
                current.append(row)
            elif "end" in row:
                if row["committed"]:
                    for step in current:
                        assert step["interval"] == row["end"]
                        ranks = committed.setdefault(row["end"], {})
                        ranks.setdefault(step["rank"], []).append(step)
                current = []
    return committed


def _replay(intervals: dict[int, dict[int, list[dict[str, Any]]]]) -> list[float]:
    """One process replaying DiLoCo: each committed interval's ranks train copies of the
    last synced weights on the samples they logged (plain SGD, the logged rates), then
    SGD with Nesterov momentum applies the mean change."""
    assert sorted(intervals) == list(range(len(intervals))), "a committed sync is missing"
    x, y = data().tensors
    model = build_model()
    synced = [p.detach().clone() for p in model.parameters()]
    momentum: list[torch.Tensor] | None = None
    for index in sorted(intervals):
        ranks = intervals[index]
        assert {len(steps) for steps in ranks.values()} == {4}, index
        assert {s["world"] for steps in ranks.values() for s in steps} == {len(ranks)}
        changes = [torch.zeros_like(t) for t in synced]
        for steps in ranks.values():
            local = build_model()
            with torch.no_grad():
                for param, value in zip(local.parameters(), synced, strict=True):
                    param.copy_(value)
            for step in sorted(steps, key=lambda s: s["step"]):
                assert len(step["indices"]) == BATCH
                rows = torch.tensor(step["indices"])
                local.zero_grad()
                nn.functional.mse_loss(local(x[rows]), y[rows]).backward()
                with torch.no_grad():
                    for param in local.parameters():
                        param -= step["lr_used"] * param.grad
            for change, start, param in zip(changes, synced, local.parameters(), strict=True):
                change += start - param.detach()
        grads = [change / len(ranks) for change in changes]
        if momentum is None:
            momentum = [g.clone() for g in grads]
        else:
            momentum = [OUTER_MOMENTUM * m + g for m, g in zip(momentum, grads, strict=True)]
        for start, grad, buffer in zip(synced, grads, momentum, strict=True):
            start -= OUTER_LR * (grad + OUTER_MOMENTUM * buffer)
    return [v for t in synced for v in t.reshape(-1).tolist()]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_diloco_survives_a_kill_between_syncs(tmp_path: Path) -> None:
    # DiLoCo syncs every 4 steps; replica 1 is SIGKILLed after step 6, between two syncs.
    # The survivor's sync at step 8 fails, the interval [4, 8) is discarded (its weights,
    # scheduler, step count and samples go back) and redone alone; the restarted group
    # copies the survivor's state at an interval's start and trains on with it.
    result = run_fault_tolerant_job(
        JOB,
        tmp_path,
        [
            str(STEPS),
            *("--method", "diloco", "--die-at", "6", "--until-rejoined", "--step-sleep", "0.05"),
        ],
        processes=2,
        groups=2,
        kill_when=tmp_path / "victim-ready",
    )
    assert result.returncode == 0, result.stdout[-3000:]
    logs = _logs(tmp_path)
    assert sorted(logs) == ["replica0-life0", "replica1-life0", "replica1-life1"], sorted(logs)
    survivor, reborn = logs["replica0-life0"], logs["replica1-life1"]
    finals = [survivor[-1]["final"], reborn[-1]["final"]]
    assert finals[0] == finals[1]
    intervals = _intervals(logs)
    assert finals[0] == pytest.approx(_replay(intervals), abs=1e-5)
    # The survivor lost one interval, the one the victim died in.
    assert [r["end"] for r in survivor if "end" in r and not r["committed"]] == [1]
    # The rates follow committed steps (StepLR(10, 0.9), stepped by both groups' count).
    for ranks in intervals.values():
        for steps in ranks.values():
            for step in steps:
                assert step["lr_used"] == pytest.approx(0.05 * 0.9 ** (step["step"] * 2 // 10))
    # The restarted group starts from the survivor's weights at that interval's start.
    first = reborn[0]
    same = [
        r for r in survivor if r.get("step") == first["step"] and r["interval"] == first["interval"]
    ]
    assert same and first["weights"] == same[-1]["weights"]
    # Within an epoch no committed sample twice, and a finished epoch saw every sample.
    by_epoch: dict[int, list[int]] = {}
    for ranks in intervals.values():
        for steps in ranks.values():
            for step in steps:
                by_epoch.setdefault(step["epoch"], []).extend(step["indices"])
    assert max(by_epoch) > 0
    for epoch, samples in by_epoch.items():
        assert len(samples) == len(set(samples)), f"epoch {epoch} repeated a sample"
        if epoch < max(by_epoch):
            assert sorted(samples) == list(range(96)), f"epoch {epoch} dropped samples"
    said = [line for line in _lines(result.stdout) if "joined late" not in line]
    assert said[0] == "replica group replica_1 lost (SIGKILL) at step 6; restart 1/1", said
    assert re.fullmatch(
        r"replica group replica_1 rejoined at step \d+, state copied from replica_0 in "
        r"\d+\.\d s",
        said[1],
    ), said
    assert re.fullmatch(
        r"replica group replica_0: finished at step \d+; \d+ syncs committed, 1 discarded, "
        r"[01] recover(y|ies) from a peer, 0 restarts",
        said[2],
    ), said
