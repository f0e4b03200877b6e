"""Pipeline schedules as the planner walks them: micro-batches held, and bubbles."""

from __future__ import annotations

import pytest

from slipstream.planning.schedules import actions, bubble, most_in_flight


@pytest.mark.parametrize(("pp", "microbatches"), [(2, 2), (2, 8), (4, 4), (4, 8)])
def test_one_f_one_b_holds_at_most_pp_minus_rank(pp, microbatches):
    for rank in range(pp):
        order = actions("1f1b", pp, rank, microbatches)
        assert sorted(order) == sorted(
            [("F", 0, i) for i in range(microbatches)] + [("B", 0, i) for i in range(microbatches)]
        )
        assert most_in_flight("1f1b", pp, rank, microbatches) == min(microbatches, pp - rank)


def test_gpipe_holds_every_micro_batch():
    assert most_in_flight("gpipe", 4, 3, 8) == 8


def test_interleaved_holds_megatrons_warm_up_plus_one():
    # (v - 1) pp + 2 (pp - rank - 1) warm-up chunk forwards, then one more before a backward.
    assert most_in_flight("interleaved_1f1b", 2, 0, 4, chunks=2) == 2 + 2 + 1
    assert most_in_flight("interleaved_1f1b", 4, 3, 8, chunks=2) == 4 + 0 + 1
    assert len(actions("interleaved_1f1b", 4, 0, 8, chunks=2)) == 2 * 8 * 2


def test_bubbles():
    assert bubble("1f1b", 1, 4) == 0.0
    assert bubble("1f1b", 4, 4) == pytest.approx(3 / 7)
    assert bubble("gpipe", 2, 8) == pytest.approx(1 / 9)
    assert bubble("interleaved_1f1b", 4, 8, chunks=2) == pytest.approx(3 / 19)
