"""get_logger (slipstream.logging), find_executable_batch_size, notebook_launcher and
debug_launcher."""

from __future__ import annotations

import io
import json
import logging
import textwrap

import pytest
import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

import slipstream.logging
from slipstream import (
    Accelerator,
    debug_launcher,
    find_executable_batch_size,
    get_logger,
    notebook_launcher,
)
from tests.distributed import run_distributed, run_python


def _log_lines() -> str:
    Accelerator()
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = get_logger("slipstream.test", log_level="INFO")
    logger.logger.addHandler(handler)
    logger.info("once")
    logger.info("everyone", main_process_only=False)
    logger.info("in turn", main_process_only=False, in_order=True)
    logger.logger.removeHandler(handler)
    return stream.getvalue()


def test_logger_prints_once_unless_asked_per_process():
    r0, r1 = run_distributed(_log_lines)
    assert r0 == "[rank 0] once\n[rank 0] everyone\n[rank 0] in turn\n"
    assert r1 == "[rank 1] everyone\n[rank 1] in turn\n"


def test_find_executable_batch_size_reduces_after_out_of_memory():
    tried = []

    @find_executable_batch_size(starting_batch_size=128)
    def train(batch_size, factor):
        tried.append(batch_size)
        if batch_size > 100:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch_size * factor

    assert train(2) == 184 and tried == [128, 115, 103, 92]  # 90% each time, as Accelerate

    @find_executable_batch_size(starting_batch_size=128, reduce_batch_size_fn=lambda b: b // 2)
    def halving(batch_size):
        tried.append(batch_size)
        if batch_size > 16:
            raise torch.cuda.OutOfMemoryError("out of memory")

    tried.clear()
    halving()
    assert tried == [128, 64, 32, 16]

    @find_executable_batch_size(starting_batch_size=8, reduce_batch_size_fn=lambda: 8)
    def stuck(batch_size):
        raise torch.cuda.OutOfMemoryError("out of memory")

    with pytest.raises(ValueError, match="returned 8 after batch_size=8 ran out of memory"):
        stuck()

    @find_executable_batch_size(starting_batch_size=4)
    def never_fits(batch_size):
        raise torch.cuda.OutOfMemoryError("out of memory")

    with pytest.raises(RuntimeError, match="even with batch_size=1"):
        never_fits()

    @find_executable_batch_size(starting_batch_size=4)
    def other_error(batch_size):
        raise ValueError("not memory")

    with pytest.raises(ValueError, match="not memory"):
        other_error()
    with pytest.raises(TypeError, match="must take batch_size as its first argument"):
        find_executable_batch_size(lambda size: size)


def launched(scale):
    acc = Accelerator()
    total = acc.reduce(torch.tensor([float(acc.process_index + 1)]), "sum")
    return {"rank": acc.process_index, "world": acc.num_processes, "sum": total.item() * scale}


def test_notebook_launcher_runs_a_function_on_two_processes():
    results = notebook_launcher(launched, (10,), num_processes=2, use_cpu=True)
    assert results == [{"rank": 0, "world": 2, "sum": 30.0}, {"rank": 1, "world": 2, "sum": 30.0}]


def failing():
    raise ValueError("inside the notebook function")


def test_notebook_launcher_reports_a_failure():
    # As in Accelerate: torch's error, naming the failed processes and their error.
    with pytest.raises(ChildFailedError, match="ValueError: inside the notebook function"):
        notebook_launcher(failing, num_processes=2, use_cpu=True)


_DEBUG_LAUNCHER_SCRIPT = textwrap.dedent(
    """
    import json, os
    import torch
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from slipstream import Accelerator, debug_launcher

    def main():
        offset = 5  # a closure: the processes are forked, nothing is pickled

        def local(scale):
            acc = Accelerator()
            total = acc.reduce(torch.tensor([float(acc.process_index + offset)]), "sum")
            return acc.process_index, acc.device.type, total.item() * scale

        def failing():
            raise ValueError("boom")

        results = debug_launcher(local, (2,))
        try:
            debug_launcher(failing, num_processes=2)
            failure = None
        except ChildFailedError as error:
            failure = str(error)
        print(json.dumps({
            "results": results, "failure": failure,
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "config": os.environ.get("SLIPSTREAM_LAUNCH_CONFIG"),
        }))

    main()
    """
)


def test_debug_launcher_runs_any_function_on_cpu_processes():
    # A fresh interpreter: the workers are forked, and this test process may hold a group.
    result = run_python("-c", _DEBUG_LAUNCHER_SCRIPT, env={"CUDA_VISIBLE_DEVICES": "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["results"] == [[0, "cpu", 22.0], [1, "cpu", 22.0]]
    assert "failing FAILED" in report["failure"] and "ValueError: boom" in report["failure"]
    assert report["visible"] == "0", "the caller's environment is restored"
    assert report["config"] is None


def test_forking_from_a_process_with_a_group_is_refused_before_starting_anything():
    made_group = not torch.distributed.is_initialized()
    if made_group:
        store = torch.distributed.HashStore()
        torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match=r"already has a torch\.distributed process group"):
            debug_launcher(failing, num_processes=2)
    finally:
        if made_group:
            torch.distributed.destroy_process_group()


def test_warning_once_logs_a_message_once(caplog):
    logger = slipstream.logging.get_logger("slipstream.test.once", log_level="INFO")
    with caplog.at_level(logging.WARNING, logger="slipstream.test.once"):
        for _ in range(3):
            logger.warning_once("deprecated: %s", "x")
        logger.warning_once("deprecated: %s", "y")
    assert caplog.messages == ["[rank 0] deprecated: x", "[rank 0] deprecated: y"]
    assert caplog.records[0].filename == "test_logger_memory_notebook.py"


def test_log_level_from_the_environment(monkeypatch):
    root_level = logging.getLogger().level
    try:
        monkeypatch.setenv("ACCELERATE_LOG_LEVEL", "error")
        assert get_logger("slipstream.test.level").logger.level == logging.ERROR
        monkeypatch.setenv("SLIPSTREAM_LOG_LEVEL", "debug")
        assert get_logger("slipstream.test.level").logger.level == logging.DEBUG
        assert get_logger("slipstream.test.level", log_level="WARNING").getEffectiveLevel() == (
            logging.WARNING
        )
    finally:
        logging.getLogger().setLevel(root_level)
        logging.getLogger("slipstream.test.level").setLevel(logging.NOTSET)
