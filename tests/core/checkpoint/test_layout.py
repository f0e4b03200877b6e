"""Checkpoints in folders the processes do not share: a folder per process (Accelerate's
``save_state(f"ckpt_{rank}")``) and one path on machine-local disks (simulated with
``memory://``, which every process holds privately), resumed exactly, rotated, refused
where the strategy needs one shared folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from slipstream import Accelerator, FullyShardedDataParallelPlugin, ProjectConfiguration, set_seed
from slipstream.checkpoint import CheckpointError, Storage
from slipstream.checkpoint.layout import FolderLayout
from tests.distributed import run_distributed


def _setup(project: str | None = None, total_limit: int | None = None) -> tuple:
    config = ProjectConfiguration(
        project_dir=project,
        automatic_checkpoint_naming=project is not None,
        total_limit=total_limit,
    )
    acc = Accelerator(project_config=config)
    set_seed(0)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(40, 6, generator=generator), torch.randn(40, 1, generator=generator)
    )
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    loader = DataLoader(data, batch_size=4, shuffle=True)
    return acc, *acc.prepare(model, optimizer, loader, scheduler)


def _train(acc, model, optimizer, loader, scheduler, until: int, each=None) -> None:
    """Train up to optimizer step ``until`` in one continuous pass over the epochs (a
    resumed loader continues its saved epoch); ``each(step, loss)`` after every step."""
    while acc.step < until:
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            acc.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if each is not None:
                each(acc.step, loss.detach())
            if acc.step == until:
                break


def _state(acc, model) -> dict:
    return {
        "weights": [p.detach().clone() for p in acc.unwrap_model(model).parameters()],
        "rng": torch.rand(2),
    }


def _own_project(root: str) -> str:
    return os.path.join(root, f"rank{int(os.environ['RANK'])}")


def _train_per_process(root: str, total: int, stop_at: int | None, resume: bool) -> dict:
    acc, *objects = _setup(_own_project(root), total_limit=2)
    if resume:
        assert acc.load_state().startswith(_own_project(root))

    def save_every_two(step: int, _: torch.Tensor) -> None:
        if stop_at is not None and step % 2 == 0:
            saved = acc.save_state()
            assert saved.startswith(_own_project(root)), "each process names its own folder"

    _train(acc, *objects, until=stop_at or total, each=save_every_two)
    return _state(acc, objects[0])


def test_a_folder_per_process_resumes_exactly_and_rotates(tmp_path: Path):
    # 40 samples, batch 4, 2 processes: 5 steps per epoch; the save at step 6 is mid-epoch.
    straight = run_distributed(_train_per_process, str(tmp_path / "a"), 10, None, False)
    run_distributed(_train_per_process, str(tmp_path / "b"), 10, 6, False)
    for rank in range(2):
        project = tmp_path / "b" / f"rank{rank}" / "checkpoints"
        assert sorted(os.listdir(project)) == ["checkpoint_1", "checkpoint_2"], "total_limit=2"
        folder = project / "checkpoint_2"
        manifest = json.loads((folder / "checkpoint.json").read_text())
        assert list(manifest["files"]) == [str(rank)], "a folder lists its own files"
        assert f"random_states_{rank}.pkl" in os.listdir(folder)
        assert {"model.safetensors", "optimizer.bin", "scheduler.bin"} <= set(os.listdir(folder))
    resumed = run_distributed(_train_per_process, str(tmp_path / "b"), 10, None, True)
    for a, b in zip(straight, resumed, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"], strict=True))
        assert torch.equal(a["rng"], b["rng"])


def _same_path_unshared(url: str) -> dict:
    # memory:// is private to each process: the same URL names two folders, as one path
    # does on the local disks of two machines.
    acc, *objects = _setup()
    where, after_save, replayed = [], [], []

    def save_then_record(step: int, loss: torch.Tensor) -> None:
        if step == 3:
            where.append(acc.save_state(url))
        elif step > 3:
            after_save.append(loss)

    _train(acc, *objects, until=7, each=save_then_record)
    expected = _state(acc, objects[0])
    acc.load_state(url)
    _train(acc, *objects, until=7, each=lambda step, loss: replayed.append(loss))
    got = _state(acc, objects[0])
    storage = Storage.for_url(url)
    manifest = json.loads(storage.read_text(storage.join(storage.root, "checkpoint.json")))
    return {
        "where": where,
        "files": sorted(storage.listdir(storage.root)),
        "listed": sorted(manifest["files"]),
        "same_losses": len(after_save) == 4
        and all(torch.equal(a, b) for a, b in zip(after_save, replayed, strict=True)),
        "same_weights": all(
            torch.equal(a, b) for a, b in zip(expected["weights"], got["weights"], strict=True)
        ),
        "same_rng": torch.equal(expected["rng"], got["rng"]),
    }


def test_one_path_that_the_processes_do_not_share_is_committed_by_each():
    results = run_distributed(_same_path_unshared, "memory://node-local/ckpt")
    for rank, result in enumerate(results):
        assert [w.replace("///", "//") for w in result["where"]] == ["memory://node-local/ckpt"]
        assert result["listed"] == [str(rank)]
        assert f"random_states_{rank}.pkl" in result["files"]
        assert f"random_states_{1 - rank}.pkl" not in result["files"]
        assert "model.safetensors" in result["files"], "each folder holds the shared files"
        assert not any(name.startswith(".") for name in result["files"])
        assert result["same_losses"] and result["same_weights"] and result["same_rng"]


def _data_only(root: str, iterable: bool) -> bool:
    # Accelerate's test_distributed_data_loop.py: save mid-epoch into a per-process
    # temporary folder, finish the epoch, load, and get the same remaining batches.
    acc = Accelerator()
    folder = os.path.join(root, f"tmp{acc.process_index}")
    data = TensorDataset(torch.arange(64.0))
    loader = acc.prepare(DataLoader(data, batch_size=4, shuffle=True))
    untrained = []
    for step, batch in enumerate(loader):
        if step == 2:
            acc.save_state(folder)
        if step > 2:
            untrained.append(batch[0])
    acc.load_state(folder)
    resumed = [batch[0] for batch in loader]
    return len(untrained) == len(resumed) > 0 and all(
        torch.equal(a, b) for a, b in zip(untrained, resumed, strict=True)
    )


def test_dataloader_positions_in_per_process_temporary_folders(tmp_path: Path):
    assert run_distributed(_data_only, str(tmp_path), False) == [True, True]


def _fsdp_into_own_folders(root: str) -> str:
    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    model = acc.prepare(nn.Linear(4, 4))
    try:
        acc.save_state(os.path.join(root, f"r{acc.process_index}"))
    except CheckpointError as error:
        return str(error)
    finally:
        del model
    return "saved"


def test_a_strategy_writing_one_folder_jointly_refuses_separate_folders(tmp_path: Path):
    messages = run_distributed(_fsdp_into_own_folders, str(tmp_path))
    for message in messages:
        assert "folders they do not share" in message and "fsdp strategy" in message
        assert f"{tmp_path}/r0 on processes 0; {tmp_path}/r1 on processes 1" in message
    assert os.listdir(tmp_path) == [], "nothing written, no probe left behind"


def _load_missing_on_one(root: str) -> str:
    acc, *_ = _setup()
    acc.save_state(os.path.join(root, "shared"))
    target = os.path.join(root, "shared" if acc.process_index == 0 else "missing")
    try:
        acc.load_state(target)
    except CheckpointError as error:
        return str(error)
    return "loaded"


def test_a_load_failing_on_one_process_raises_on_every_process(tmp_path: Path):
    messages = run_distributed(_load_missing_on_one, str(tmp_path))
    assert messages[0] == messages[1]
    assert messages[0].startswith("process 1: CheckpointError: no checkpoint at ")


def _resume_newest_common(root: str) -> tuple[str, int]:
    acc, *_ = _setup(_own_project(root))
    with pytest.warns(UserWarning, match="checkpoint_1 is not complete in every"):
        where = acc.load_state()
    return os.path.basename(where), acc.step


def _save_twice(root: str) -> None:
    acc, *objects = _setup(_own_project(root))
    _train(acc, *objects, until=2, each=lambda step, _: acc.save_state())


def test_automatic_loading_picks_the_newest_checkpoint_complete_everywhere(tmp_path: Path):
    run_distributed(_save_twice, str(tmp_path))
    # Process 1's machine lost its newest checkpoint: both resume from the older one.
    (tmp_path / "rank1" / "checkpoints" / "checkpoint_1" / "checkpoint.json").unlink()
    assert run_distributed(_resume_newest_common, str(tmp_path)) == [("checkpoint_0", 1)] * 2


def test_layout_description_names_folders_and_processes():
    layout = FolderLayout((0, 0, 2, 2, 2, 5), ("/c",) * 5 + ("/d",))
    assert not layout.shared and layout.members(3) == [2, 3, 4]
    assert layout.describe() == (
        "/c on processes 0-1; /c (another folder at the same path) on processes 2-4; "
        "/d on processes 5"
    )
    assert FolderLayout((0, 0), ("/c", "/c")).shared


def _load_the_other_folder(root: str) -> str:
    acc, *_ = _setup()
    acc.save_state(os.path.join(root, f"r{acc.process_index}"))
    try:
        acc.load_state(os.path.join(root, f"r{1 - acc.process_index}"))
    except CheckpointError as error:
        return str(error)
    return "loaded"


def test_a_process_refuses_a_folder_holding_another_process_state(tmp_path: Path):
    messages = run_distributed(_load_the_other_folder, str(tmp_path))
    assert messages[0] == messages[1]
    assert messages[0].startswith(f"process 0: CheckpointError: {tmp_path}/r1 holds the state of")
    assert "process 1: CheckpointError: " in messages[0] and "not of process 1" in messages[0]
