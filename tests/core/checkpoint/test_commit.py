"""Atomic commits (kill -9 mid-save), rotation, hooks, and clear errors on bad checkpoints."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from slipstream import Accelerator, ProjectConfiguration
from slipstream.checkpoint import CheckpointError
from tests.distributed import run_cli, run_distributed

KILLED_MID_SAVE = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    from slipstream import Accelerator, ProjectConfiguration

    class Bomb:
        armed = False
        def state_dict(self):
            if Bomb.armed and self.rank == 0:
                os.kill(os.getpid(), signal.SIGKILL)  # after the weights are written
            return {}
        def load_state_dict(self, state):
            pass

    project, explicit = sys.argv[1], sys.argv[2]
    acc = Accelerator(project_config=ProjectConfiguration(
        project_dir=project, automatic_checkpoint_naming=True))
    model = acc.prepare(torch.nn.Linear(2, 2))
    bomb = Bomb()
    bomb.rank = acc.process_index
    acc.register_for_checkpointing(bomb)
    with torch.no_grad():
        acc.unwrap_model(model).weight.fill_(1.0)
    acc.save_state()          # checkpoint_0
    acc.save_state(explicit)  # a checkpoint at an explicit path
    Bomb.armed = True
    with torch.no_grad():
        acc.unwrap_model(model).weight.fill_(7.0)
    target = explicit if os.environ.get("OVERWRITE") else None
    acc.save_state(target)    # killed on rank 0 in the middle
    print("unreachable")
    """
)


def _restore(project: str, path: str | None = None) -> tuple[float, str]:
    acc = Accelerator(
        project_config=ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True)
    )
    model = acc.prepare(nn.Linear(2, 2))

    class Sink:
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    acc.register_for_checkpointing(Sink())
    where = acc.load_state(path)
    return acc.unwrap_model(model).weight[0, 0].item(), where


@pytest.mark.parametrize("overwrite", [False, True], ids=["new-folder", "same-path"])
def test_kill_9_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path: Path, overwrite: bool):
    script = tmp_path / "killed.py"
    script.write_text(KILLED_MID_SAVE)
    project, explicit = tmp_path / "project", tmp_path / "explicit"
    env = {"OVERWRITE": "1"} if overwrite else {}
    result = run_cli(
        "launch", "-n", "2", "--cpu", str(script), str(project), str(explicit), env=env
    )
    assert result.returncode != 0 and "unreachable" not in result.stdout
    checkpoints = project / "checkpoints"
    if overwrite:
        value, where = _restore(str(project), str(explicit))
        assert value == 1.0 and where == str(explicit), "the old checkpoint at that path"
    else:
        assert sorted(os.listdir(checkpoints))[0].startswith(".checkpoint_1.incomplete-")
        value, where = _restore(str(project))
        assert value == 1.0 and where.endswith("checkpoint_0")
        with pytest.raises(CheckpointError, match="does not exist"):
            _restore(str(project), str(checkpoints / "checkpoint_1"))
        # The next save reuses the number and clears the interrupted attempt.
        acc = Accelerator(
            project_config=ProjectConfiguration(
                project_dir=str(project), automatic_checkpoint_naming=True
            )
        )
        acc.prepare(nn.Linear(2, 2))
        assert acc.save_state().endswith("checkpoint_1")
        assert sorted(os.listdir(checkpoints)) == ["checkpoint_0", "checkpoint_1"]


def test_rotation_keeps_the_newest_and_numbering_survives_restarts(tmp_path: Path):
    config = ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2
    )
    acc = Accelerator(project_config=config)
    model = acc.prepare(nn.Linear(2, 2))
    for value in range(4):
        with torch.no_grad():
            acc.unwrap_model(model).weight.fill_(value)
        acc.save_state()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_2", "checkpoint_3"]
    assert acc.save_iteration == 4
    again = Accelerator(
        project_config=ProjectConfiguration(
            project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2
        )
    )
    restored = again.prepare(nn.Linear(2, 2))
    assert again.load_state().endswith("checkpoint_3")
    assert again.unwrap_model(restored).weight[0, 0].item() == 3.0
    assert again.save_state().endswith("checkpoint_4")


def _saved(tmp_path: Path, **kwargs) -> str:
    acc = Accelerator(**kwargs)
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    acc.prepare(model, optimizer)
    return acc.save_state(str(tmp_path / "ckpt"))


def test_loading_the_wrong_thing_fails_clearly_and_changes_nothing(tmp_path: Path):
    path = _saved(tmp_path)
    acc = Accelerator()
    model = nn.Linear(2, 2)
    other = nn.Linear(2, 2)
    before = model.weight.detach().clone()
    model, _, _ = acc.prepare(model, other, torch.optim.SGD(model.parameters(), 0.1))
    with pytest.raises(CheckpointError, match=r"holds 1 model\(s\) but 2 are prepared"):
        acc.load_state(path)
    assert torch.equal(model.weight, before), "nothing was loaded"

    acc = Accelerator()
    wide = acc.prepare(nn.Linear(2, 3), torch.optim.SGD(nn.Linear(2, 3).parameters(), 0.1))[0]
    with pytest.raises(
        ValueError, match=r"do not fit Linear: different shapes \['weight \(2, 2\) vs \(3, 2\)'"
    ):
        acc.load_state(path)
    assert wide.weight.shape == (3, 2)

    acc = Accelerator(mixed_precision="fp16")
    acc.prepare(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), 0.1))
    with pytest.raises(CheckpointError, match="without an fp16 loss scaler"):
        acc.load_state(path)


def test_not_a_checkpoint_and_incomplete_checkpoints(tmp_path: Path):
    acc = Accelerator()
    acc.prepare(nn.Linear(2, 2))
    folder = tmp_path / "random"
    folder.mkdir()
    (folder / "notes.txt").write_text("hi")
    with pytest.raises(CheckpointError, match=r"checkpoint.json is missing .* contains: notes.txt"):
        acc.load_state(str(folder))
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint folder"):
        acc.load_state(str(folder / "notes.txt"))
    with pytest.raises(CheckpointError, match="needs a path"):
        acc.load_state()
    with pytest.raises(CheckpointError, match="needs a path"):
        acc.save_state()
    path = _saved(tmp_path)
    os.remove(os.path.join(path, "optimizer.bin"))
    acc = Accelerator()
    acc.prepare(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), 0.1))
    with pytest.raises(CheckpointError, match=r"is incomplete: \['optimizer.bin'\]"):
        acc.load_state(path)


def test_register_for_checkpointing_rejects_plain_objects():
    with pytest.raises(ValueError, match=r"have not: Item at index 1 \(int\)"):
        Accelerator().register_for_checkpointing(torch.optim.SGD([torch.zeros(1)], 0.1), 3)


def test_save_and_load_hooks_customise_model_saving(tmp_path: Path):
    acc = Accelerator()
    model = acc.prepare(nn.Linear(2, 2))
    with torch.no_grad():
        model.weight.fill_(5.0)

    def save_hook(models, weights, output_dir):
        torch.save(weights.pop(0), os.path.join(output_dir, "custom_model.pt"))
        models.pop(0)

    def load_hook(models, input_dir):
        state = torch.load(os.path.join(input_dir, "custom_model.pt"), weights_only=True)
        models.pop(0).load_state_dict(state)

    handle = acc.register_save_state_pre_hook(save_hook)
    acc.register_load_state_pre_hook(load_hook)
    path = acc.save_state(str(tmp_path / "hooked"))
    assert sorted(os.listdir(path)) == ["checkpoint.json", "custom_model.pt", "random_states_0.pkl"]
    with torch.no_grad():
        model.weight.zero_()
    acc.load_state(path)
    assert model.weight[0, 0].item() == 5.0
    handle.remove()
    assert "model.safetensors" in os.listdir(acc.save_state(str(tmp_path / "plain")))


def _position_on_one_process(folder: str) -> str:
    acc = Accelerator()
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(40)), batch_size=2))
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    return acc.save_state(folder)


def _resume_on_two(folder: str) -> str:
    acc = Accelerator()
    acc.prepare(DataLoader(TensorDataset(torch.arange(40)), batch_size=2))
    try:
        acc.load_state(folder)
    except ValueError as error:
        return str(error)
    return "loaded"


def test_a_position_that_cannot_map_to_another_process_count_is_refused(tmp_path: Path):
    path = _position_on_one_process(str(tmp_path / "one"))
    messages = run_distributed(_resume_on_two, path)
    assert all(
        "stopped mid-epoch after 3 batches on each of 1 data-parallel processes" in m
        for m in messages
    )


def _async_save(folder: str) -> dict:
    acc = Accelerator()
    model = nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    acc.backward(model(torch.ones(2, 64)).sum())
    optimizer.step()
    at_save = acc.unwrap_model(model).weight.detach().clone()
    location = acc.save_state(folder, async_save=True)
    visible_before_commit = os.path.exists(os.path.join(folder, "checkpoint.json"))
    for _ in range(3):  # training goes on while the files are written
        acc.backward(model(torch.ones(2, 64)).sum())
        optimizer.step()
    committed = acc.wait_for_checkpoint()
    acc.load_state(folder)
    return {
        "location": location,
        "committed": committed,
        "visible_before_commit": visible_before_commit,
        "restored": torch.equal(acc.unwrap_model(model).weight, at_save),
    }


def test_async_save_snapshots_now_and_commits_later(tmp_path: Path):
    folder = str(tmp_path / "async")
    for result in run_distributed(_async_save, folder):
        assert result["location"] == result["committed"] == folder
        assert not result["visible_before_commit"], "invisible until committed"
        assert result["restored"], "the checkpoint holds the weights at the time of the call"
