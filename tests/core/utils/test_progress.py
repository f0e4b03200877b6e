"""tqdm: one progress bar per machine, drawn by its main process."""

from __future__ import annotations

import pytest

from slipstream.utils.progress import tqdm
from tests.distributed import run_distributed

pytest.importorskip("tqdm")


def _disabled_bars() -> tuple[bool, bool, bool]:
    shown = tqdm(range(3))
    everyone = tqdm(range(3), main_process_only=False)
    asked_off = tqdm(range(3), main_process_only=False, disable=True)
    return shown.disable, everyone.disable, asked_off.disable


def test_only_each_machines_main_process_draws():
    rank0, rank1 = run_distributed(_disabled_bars)
    assert rank0 == (False, False, True)
    assert rank1 == (True, False, True)


def test_the_bar_iterates_and_refuses_a_flag_first():
    assert list(tqdm(range(3), disable=True)) == [0, 1, 2]
    with pytest.raises(ValueError, match="pass main_process_only as a keyword"):
        tqdm(True, range(3))


def test_a_bar_written_to_a_log_is_lines_not_carriage_returns():
    import io

    from slipstream.runtime.progress import LOG_REFRESH_SECONDS, bar_options

    log = io.StringIO()  # not a terminal
    bar = tqdm(range(5), desc="epoch 0", file=log, mininterval=0)
    assert list(bar) == [0, 1, 2, 3, 4]
    bar.close()
    text = log.getvalue()
    assert "\r" not in text and text.endswith("\n"), repr(text)
    lines = text.splitlines()
    assert lines[-1].startswith("epoch 0: 100%") and all(lines), lines
    # Left alone: a stream that is a terminal, and the caller's own interval.
    assert bar_options({})["mininterval"] == LOG_REFRESH_SECONDS  # (pytest's stderr)
    assert bar_options({"mininterval": 1})["mininterval"] == 1
