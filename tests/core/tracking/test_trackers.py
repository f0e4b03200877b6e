"""Trackers write what they should, on the main process only."""

from __future__ import annotations

import csv
import os

import pytest
import torch

from slipstream import Accelerator
from slipstream.tracking import GeneralTracker
from tests.distributed import run_distributed


class Recorder(GeneralTracker):
    name = "recorder"

    def __init__(self) -> None:
        super().__init__()
        self.config: dict = {}
        self.logged: list = []
        self.finished = False

    def store_init_configuration(self, values):
        self.config = values

    def log(self, values, step=None, **kwargs):
        self.logged.append((step, values))

    def finish(self):
        self.finished = True


def test_csv_and_tensorboard_files_are_readable_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = Accelerator(log_with=["csv", "tensorboard"], project_dir=str(tmp_path))
    acc.init_trackers("run1", config={"lr": 0.1, "layers": [1, 2]})
    for step in range(3):
        acc.log({"loss": torch.tensor(1.0 / (step + 1)), "lr": 0.1}, step=step)
    acc.log({"accuracy": 0.5}, step=3)  # a new column later on
    acc.end_training()
    with open(tmp_path / "run1" / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["step"] for r in rows] == ["0", "1", "2", "3"]
    assert (
        float(rows[1]["loss"]) == 0.5 and rows[3]["accuracy"] == "0.5" and rows[0]["accuracy"] == ""
    )
    assert "lr: 0.1" in (tmp_path / "run1" / "hparams.yaml").read_text()
    events = EventAccumulator(str(tmp_path / "run1"))
    events.Reload()
    assert [round(e.value, 3) for e in events.Scalars("loss")] == [1.0, 0.5, 0.333]
    assert [e.step for e in events.Scalars("loss")] == [0, 1, 2]


def test_custom_tracker_objects_and_get_tracker():
    recorder = Recorder()
    acc = Accelerator(log_with=recorder)
    acc.init_trackers("custom", config={"a": 1})
    acc.log({"x": 2}, step=7)
    assert acc.get_tracker("recorder") is recorder and recorder.config == {"a": 1}
    assert recorder.logged == [(7, {"x": 2})]
    with pytest.raises(ValueError, match="no tracker named 'csv' was started"):
        acc.get_tracker("csv")
    acc.end_training()
    assert recorder.finished


def test_bad_tracker_configuration():
    with pytest.raises(ValueError, match="unknown tracker 'tensorbored'"):
        Accelerator(log_with="tensorbored")
    # A tracker that writes files needs a folder: refused when the Accelerator is made.
    with pytest.raises(ValueError, match=r"`csv` requires a `logging_dir`: give Accelerator\("):
        Accelerator(log_with="csv")


class Opened(Recorder):
    """Opens what it writes to in start(), as Accelerate's trackers do."""

    name = "opened"
    requires_logging_directory = False

    def __init__(self, run_name: str = "", **kwargs) -> None:
        super().__init__()
        self.run_name, self.options, self.events = run_name, kwargs, []

    def start(self):
        self.events.append("start")

    def store_init_configuration(self, values):
        self.events.append(("config", values))


def test_trackers_are_started_before_anything_is_recorded():
    opened = Opened()
    acc = Accelerator(log_with=opened)
    acc.init_trackers("run", config={"lr": 1})
    assert opened.events == ["start", ("config", {"lr": 1})]


def test_a_registered_tracker_class_is_started_by_name(tmp_path):
    from slipstream.tracking import LOGGER_TYPE_TO_CLASS, register_tracker_class

    try:
        register_tracker_class(Opened)
        acc = Accelerator(log_with="opened")
        acc.init_trackers("run", init_kwargs={"opened": {"tag": "x"}})
        tracker = acc.get_tracker("opened")
        assert isinstance(tracker, Opened) and tracker.run_name == "run"
        assert tracker.options == {"tag": "x"} and tracker.events == ["start"]
        with pytest.warns(UserWarning, match="'opened' is registered already"):
            register_tracker_class(Opened)
        for bad, message in ((dict, "subclass of GeneralTracker"), (Recorder, "must set")):
            with pytest.raises(ValueError, match=message):
                register_tracker_class(bad)
    finally:
        LOGGER_TYPE_TO_CLASS.pop("opened", None)


def _two_processes(folder: str) -> list:
    acc = Accelerator(log_with="csv", project_dir=folder)
    acc.init_trackers("shared")
    acc.log({"rank": acc.process_index}, step=0)
    acc.end_training()
    return sorted(os.listdir(os.path.join(folder, "shared")))


def test_only_the_main_process_writes(tmp_path):
    listings = run_distributed(_two_processes, str(tmp_path))
    assert listings[0] == ["metrics.csv"]
    with open(tmp_path / "shared" / "metrics.csv") as handle:
        assert list(csv.DictReader(handle)) == [{"step": "0", "rank": "0"}]
