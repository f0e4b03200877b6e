"""synchronize_rng_state(s) gives every process rank 0's generator states, for real over gloo;
wait_for_everyone; the errors for generators slipstream cannot synchronise."""

from __future__ import annotations

import os

import pytest
import torch

from slipstream.options.choices import RNGType
from slipstream.runtime.synchronize import (
    synchronize_rng_state,
    synchronize_rng_states,
    wait_for_everyone,
)
from tests.distributed import run_distributed


def _draws_after_synchronising() -> dict[str, list[float]]:
    rank = int(os.environ["RANK"])
    torch.manual_seed(100 + rank)
    generator = torch.Generator().manual_seed(200 + rank)
    unsynchronised = torch.Generator().manual_seed(300 + rank)
    synchronize_rng_states(["torch", RNGType.GENERATOR], generator=generator)
    wait_for_everyone()
    return {
        "torch": torch.rand(3).tolist(),
        "generator": torch.rand(3, generator=generator).tolist(),
        "other": torch.rand(3, generator=unsynchronised).tolist(),
    }


def test_every_process_draws_what_rank_0_draws():
    rank0, rank1 = run_distributed(_draws_after_synchronising)
    assert rank0["torch"] == rank1["torch"]
    assert rank0["generator"] == rank1["generator"]
    assert rank0["other"] != rank1["other"], "only the named generators are synchronised"
    # Rank 0's own states were kept (not some other process's).
    assert rank0["torch"] == torch.rand(3, generator=torch.Generator().manual_seed(100)).tolist()
    assert (
        rank0["generator"] == torch.rand(3, generator=torch.Generator().manual_seed(200)).tolist()
    )


def test_on_one_process_the_state_is_kept():
    torch.manual_seed(7)
    expected = torch.rand(2)
    torch.manual_seed(7)
    synchronize_rng_state()
    wait_for_everyone()
    assert torch.equal(torch.rand(2), expected)


def test_generators_that_cannot_be_synchronised():
    with pytest.raises(ValueError, match="needs generator="):
        synchronize_rng_state(RNGType.GENERATOR)
    with pytest.raises(ValueError, match="slipstream runs on CPUs and CUDA GPUs"):
        synchronize_rng_states(["xla"])
    with pytest.raises(ValueError, match="'tpu' is not a valid RNGType"):
        synchronize_rng_state("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no GPU"):
            synchronize_rng_state("cuda")
