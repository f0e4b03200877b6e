"""torchdata's StatefulDataLoader: prepared loaders stay StatefulDataLoaders, and a stateful
stream resumes from its own saved state (nothing re-read) through save_state/load_state,
on one process and on two."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from slipstream import Accelerator, DataLoaderConfiguration
from tests.distributed import run_distributed

StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader
pytestmark = pytest.mark.filterwarnings("ignore:.*set_vital.*:UserWarning")


class CountingStream(IterableDataset[torch.Tensor]):
    """Samples 0..n-1, resumable from its position (torchdata's Stateful protocol); counts
    the samples it reads."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.position = 0
        self.reads = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        while self.position < self.n:
            value = self.position
            self.position += 1
            self.reads += 1
            yield torch.tensor([float(value)])
        self.position = 0  # the next epoch starts over

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


class PlainStream(CountingStream):
    """The same samples without a state: resumes by re-reading and skipping."""

    state_dict = None  # type: ignore[assignment]
    load_state_dict = None  # type: ignore[assignment]


def _values(batches: Any) -> list[list[float]]:
    return [batch[:, 0].tolist() for batch in batches]


def test_prepared_stateful_loader_resumes_from_the_dataset_state() -> None:
    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(StatefulDataLoader(CountingStream(11), batch_size=2))
    assert isinstance(loader, StatefulDataLoader)
    batches = iter(loader)
    head = _values([next(batches), next(batches)])
    state = loader.state_dict()  # after two batches, although the loader looked ahead
    tail = _values(batches)
    assert head + tail == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10]]

    stream = CountingStream(11)
    resumed = accelerator.prepare(StatefulDataLoader(stream, batch_size=2))
    resumed.load_state_dict(state)
    assert _values(resumed) == tail
    assert stream.reads == 7  # samples 4..10 only
    assert resumed.batches_yielded == 0 and resumed.epoch == 1
    assert _values(resumed) == head + tail  # the next epoch is whole


def test_use_stateful_dataloader_makes_plain_loaders_stateful() -> None:
    config = DataLoaderConfiguration(use_stateful_dataloader=True)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    assert accelerator.use_stateful_dataloader
    loader = accelerator.prepare(DataLoader(list(range(8)), batch_size=2, shuffle=True))
    assert isinstance(loader, StatefulDataLoader)
    assert sorted(v for b in loader for v in b.tolist()) == list(range(8))


def test_stream_without_state_resumes_by_position() -> None:
    config = DataLoaderConfiguration(use_stateful_dataloader=True)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    loader = accelerator.prepare(DataLoader(PlainStream(7), batch_size=2))
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    assert state["process_state"] is None
    tail = _values(batches)
    stream = PlainStream(7)
    resumed = accelerator.prepare(DataLoader(stream, batch_size=2))
    resumed.load_state_dict(state)
    assert _values(resumed) == tail
    assert stream.reads == 7  # re-read from the start, the first batch skipped


def _train_save_resume(folder: str, stateful_stream: bool) -> dict[str, Any]:
    """Two processes read a 13-sample stream in global batches of 4 (the last one completed);
    save after two batches, finish; then resume in a fresh Accelerator."""
    config = DataLoaderConfiguration(use_stateful_dataloader=True)
    accelerator = Accelerator(dataloader_config=config, project_dir=folder)
    make = CountingStream if stateful_stream else PlainStream
    loader = accelerator.prepare(DataLoader(make(13), batch_size=2))
    batches = iter(loader)
    _values([next(batches), next(batches)])
    accelerator.save_state(f"{folder}/ckpt")
    tail = _values(batches)
    tail_gathered = []

    fresh = Accelerator(dataloader_config=config, project_dir=folder)
    stream = make(13)
    resumed = fresh.prepare(DataLoader(stream, batch_size=2))
    fresh.load_state(f"{folder}/ckpt")
    resumed_tail = []
    for batch in resumed:
        resumed_tail.append(batch[:, 0].tolist())
        tail_gathered += fresh.gather_for_metrics(batch)[:, 0].tolist()
    return {
        "tail": tail,
        "resumed": resumed_tail,
        "reads": stream.reads,
        "gathered": sorted(tail_gathered),
        "files": sorted(p.name for p in Path(folder, "ckpt").iterdir()),
    }


@pytest.mark.parametrize("stateful_stream", [True, False], ids=["stateful", "plain"])
def test_save_state_keeps_each_process_stream_state(tmp_path: Path, stateful_stream: bool) -> None:
    results = run_distributed(_train_save_resume, str(tmp_path), stateful_stream)
    for rank, result in enumerate(results):
        assert result["resumed"] == result["tail"], rank
        # samples 8..12 (not 0..7 again); a plain stream re-reads everything
        assert result["reads"] == (5 if stateful_stream else 13)
        assert result["gathered"] == [8.0, 9.0, 10.0, 11.0, 12.0]
        saved_states = any(name.startswith("dataloader_states_") for name in result["files"])
        assert saved_states == stateful_stream


def test_missing_torchdata_says_what_to_install() -> None:
    script = (
        "import sys; sys.modules['torchdata'] = None\n"
        "from torch.utils.data import DataLoader\n"
        "from slipstream import Accelerator, DataLoaderConfiguration\n"
        "config = DataLoaderConfiguration(use_stateful_dataloader=True)\n"
        "Accelerator(cpu=True, dataloader_config=config).prepare(DataLoader([1, 2]))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode != 0
    assert "pip install torchdata" in done.stderr


@pytest.mark.parametrize("stateful", [True, False])
def test_loader_with_workers_resumes_exactly_after_a_finished_pass(
    tmp_path: Path, stateful: bool
) -> None:
    """Saved mid-epoch, restored after the pass ran to its end: the next pass yields exactly
    the batches after the checkpoint (worker iterators make an iterator of the batch
    sampler and drop it unused; the skip belongs to the one that runs). Regression: with
    num_workers=2 the whole epoch came back (10 batches where 7 remain)."""
    from torch.utils.data import TensorDataset

    config = DataLoaderConfiguration(use_stateful_dataloader=stateful)
    accelerator = Accelerator(dataloader_config=config)
    data = TensorDataset(torch.arange(30.0))
    loader = accelerator.prepare(DataLoader(data, batch_size=3, num_workers=2, shuffle=True))
    seen = []
    for step, (batch,) in enumerate(loader):
        if step == 2:
            accelerator.save_state(str(tmp_path / "state"))
        if step >= 3:
            seen.append(batch.tolist())
    accelerator.load_state(str(tmp_path / "state"))
    assert [batch.tolist() for (batch,) in loader] == seen and len(seen) == 7
