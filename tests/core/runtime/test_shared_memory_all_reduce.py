"""The shared-memory all-reduce: real processes, sums against gloo's, a peer that ends or
never comes, and DDP training with it against DDP with gloo's all-reduce."""

from __future__ import annotations

import copy
import mmap
import multiprocessing
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from slipstream import Accelerator, DistributedDataParallelKwargs
from slipstream.runtime import shared_memory_all_reduce as shared
from tests.distributed import run_distributed

pytestmark = pytest.mark.skipif(not shared.possible(), reason="x86-64 Linux only")

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
#: Element counts around the 4 KiB slot the tests use: empty, one, odd, exactly one slot of
#: fp32, one element over, several pieces.
COUNTS = (0, 1, 7, 1024, 1025, 5000)


def _exchanges(slot_bytes: int) -> dict[str, object]:
    Accelerator(cpu=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    reducer = shared.shared_memory_all_reduce(slot_bytes=slot_bytes)
    assert reducer is not None
    assert shared.shared_memory_all_reduce(slot_bytes=slot_bytes) is reducer  # made once
    generator = torch.Generator().manual_seed(rank)
    sums, mismatches = [], []
    for dtype in DTYPES:
        for count in COUNTS:
            mine = torch.randn(count, generator=generator).to(dtype)
            everyone = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(everyone, mine)
            in_rank_order = everyone[0].clone()
            for other in everyone[1:]:
                in_rank_order += other
            total = mine.clone()
            reducer.all_reduce(total)
            if not torch.equal(total, in_rank_order):
                mismatches.append(f"{dtype} x {count}: not the rank-order sum")
            if dtype is torch.float32:
                by_gloo = mine.clone()
                dist.all_reduce(by_gloo)
                if world == 2 and not torch.equal(total, by_gloo):
                    mismatches.append(f"{count}: not gloo's sum")
                torch.testing.assert_close(total, by_gloo)
            sums.append(total)
    # Many exchanges back to back, of changing sizes: the two slot sets alternate under a
    # process that runs ahead.
    sizes = torch.randint(0, 3000, (300,), generator=torch.Generator().manual_seed(7))
    back_to_back = []
    for size in sizes.tolist():
        tensor = torch.full((size,), float(rank + 1)) * torch.arange(size)
        reducer.all_reduce(tensor)
        back_to_back.append(
            bool(torch.equal(tensor, torch.arange(size) * (world * (world + 1) / 2)))
        )
    matrix = torch.ones(4, 4) * (rank + 1)
    reducer.all_reduce(matrix)  # contiguous, any shape
    try:
        reducer.all_reduce(torch.ones(4, 4).t()[:, :2])
        refused = "no error"
    except ValueError as error:
        refused = str(error)
    try:
        reducer.all_reduce(torch.ones(10 + rank))  # processes that disagree are told so
        disagreement = "no error"
    except RuntimeError as error:
        disagreement = str(error)
    after = torch.ones(3)
    reducer.all_reduce(after)  # and the exchanges still line up afterwards
    return {
        "disagreement": disagreement,
        "after": after,
        "sums": sums,
        "mismatches": mismatches,
        "back_to_back": all(back_to_back),
        "matrix": matrix,
        "refused": refused,
        "spins": reducer.spins,
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_sums_are_the_rank_order_sums_on_every_process(world_size: int) -> None:
    results = run_distributed(_exchanges, 4096, world_size=world_size)
    for result in results:
        assert result["mismatches"] == []
        assert result["back_to_back"]
        assert torch.equal(result["matrix"], torch.full((4, 4), world_size * (world_size + 1) / 2))
        assert "contiguous CPU tensor" in result["refused"]
        assert "run different backward passes" in result["disagreement"]
        assert torch.equal(result["after"], torch.full((3,), float(world_size)))
        for mine, first in zip(result["sums"], results[0]["sums"], strict=True):
            assert torch.equal(mine, first)  # the same bits everywhere
    if world_size > len(os.sched_getaffinity(0)):
        assert results[0]["spins"] == 0  # more processes than cores: every wait sleeps


def _one_cannot_take_part() -> bool:
    Accelerator(cpu=True)
    if dist.get_rank() == 1:
        shared.possible = lambda: False  # type: ignore[assignment]  # this process only
    return shared.shared_memory_all_reduce() is None


def test_everyone_keeps_gloo_when_one_process_cannot_take_part() -> None:
    assert run_distributed(_one_cannot_take_part) == [True, True]


def test_a_mapping_that_is_not_the_creators_is_refused() -> None:
    fd, memory, offer = shared._create(4096)
    assert memory is not None and offer is not None
    try:
        pid, descriptor, token = offer
        opened = shared._open(pid, descriptor, token, 4096)
        assert opened is not None and opened[:16] == token
        opened.close()
        assert shared._open(pid, descriptor, bytes(16), 4096) is None
        assert shared._open(pid, 10_000, token, 4096) is None  # no such descriptor
    finally:
        os.close(fd)
        memory.close()


def _peer(memory: mmap.mmap, pids: list[int], exchanges: int) -> None:
    reducer = shared.SharedMemoryAllReduce(memory, 1, pids, timeout=30.0, slot_bytes=4096)
    for _ in range(exchanges):
        reducer.all_reduce(torch.ones(100))
    os._exit(0)


def test_a_peer_that_ends_is_reported_not_waited_for() -> None:
    memory = mmap.mmap(-1, shared.SharedMemoryAllReduce.mapping_bytes(2, 4096))
    context = multiprocessing.get_context("fork")
    pids = [os.getpid(), 0]
    # The peer takes part in two exchanges and ends before the third.
    peer = context.Process(target=_peer, args=(memory, pids, 2))
    peer.start()
    pids[1] = peer.pid
    reducer = shared.SharedMemoryAllReduce(memory, 0, pids, timeout=30.0, slot_bytes=4096)
    for _ in range(2):
        total = torch.ones(100)
        reducer.all_reduce(total)
        assert torch.equal(total, torch.full((100,), 2.0))
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"process 1 \(pid {peer.pid}\) ended"):
        reducer.all_reduce(torch.ones(100))
    assert time.monotonic() - started < 5
    peer.join()


def test_a_peer_that_never_comes_times_out() -> None:
    memory = mmap.mmap(-1, shared.SharedMemoryAllReduce.mapping_bytes(2, 4096))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        reducer = shared.SharedMemoryAllReduce(
            memory, 0, [os.getpid(), sleeper.pid], timeout=0.3, slot_bytes=4096
        )
        with pytest.raises(RuntimeError, match=r"did not reach .* within the process group's"):
            reducer.all_reduce(torch.ones(10))
    finally:
        sleeper.kill()
        sleeper.wait()


# -- DDP ----------------------------------------------------------------------------------
def _train(shared_memory: bool) -> dict[str, object]:
    # bucket_cap_mb=1 and ~3 MB of gradients: several buckets, each its own exchange.
    kwargs = DistributedDataParallelKwargs(bucket_cap_mb=1, shared_memory_all_reduce=shared_memory)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, kwargs_handlers=[kwargs])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 512), nn.Linear(512, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator().manual_seed(100 + accelerator.process_index)
    for _ in range(4):  # two optimizer steps of two micro-batches (the first under no_sync)
        with accelerator.accumulate(model):
            x, y = torch.randn(8, 512, generator=generator), torch.randn(8, 4, generator=generator)
            accelerator.backward(F.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    copy.deepcopy(model)  # a copy rebuilds its reducer without hooks: nothing to carry over
    return {
        "class": type(model).__name__,
        "weights": [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()],
    }


def _both() -> list[dict[str, object]]:
    return [_train(True), _train(False)]


def test_ddp_trains_bitwise_as_with_gloo() -> None:
    for with_shared, with_gloo in run_distributed(_both):
        assert with_shared["class"] == "SharedMemoryDDP"
        assert with_gloo["class"] == "DistributedDataParallel"
        for a, b in zip(with_shared["weights"], with_gloo["weights"], strict=True):
            assert torch.equal(a, b)


def _hooks_and_copies() -> dict[str, object]:
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = accelerator.prepare(nn.Linear(4, 4))
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(accelerator.process_index))
    copied = copy.deepcopy(model)  # a new reducer: the copy gets the slot again
    model(x).sum().backward()
    copied(x).sum().backward()
    copies_average = all(
        torch.equal(a.grad, b.grad)
        for a, b in zip(model.parameters(), copied.parameters(), strict=True)
    )
    calls = []

    def zeros(state, bucket):  # type: ignore[no-untyped-def]  # (DDP refuses string annotations)
        calls.append(state)
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(torch.zeros_like(bucket.buffer()))
        return future

    model.register_comm_hook("mine", zeros)  # the script's own hook replaces the mean
    model.zero_grad()
    model(x).sum().backward()
    zeroed = all(not p.grad.any() for p in model.parameters())
    try:
        model.register_comm_hook(None, zeros)
        twice = "no error"
    except RuntimeError as error:
        twice = str(error)
    try:
        with model.join(divide_by_initial_world_size=False):
            joined = "no error"
    except ValueError as error:
        joined = str(error)
    builtin = accelerator.prepare(nn.Linear(4, 4))
    builtin._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    builtin(x).sum().backward()
    # Sparse gradients go over gloo (every process alike), as without the shared memory.
    sparse = {}
    for shared_memory in (True, False):
        options = DistributedDataParallelKwargs(shared_memory_all_reduce=shared_memory)
        torch.manual_seed(0)
        embedding = nn.Embedding(10, 3, sparse=True)
        prepared = Accelerator(cpu=True, kwargs_handlers=[options]).prepare(embedding)
        indices = torch.tensor([accelerator.process_index, 5])
        prepared(indices).sum().backward()
        sparse[shared_memory] = prepared.module.weight.grad.to_dense()
    return {
        "joined": joined,
        "builtin": [hook.__name__ for hook, _ in builtin._comm_hooks],
        "builtin_grad": builtin.module.weight.grad.clone(),
        "sparse_equal": torch.equal(sparse[True], sparse[False]),
        "copies_average": copies_average,
        "calls": calls,
        "zeroed": zeroed,
        "twice": twice,
        "name": model._get_ddp_logging_data().get("comm_hook"),
    }


def test_a_scripts_own_hook_replaces_the_mean_and_copies_keep_it() -> None:
    results = run_distributed(_hooks_and_copies)
    for result in results:
        assert result["copies_average"]
        assert result["calls"] == ["mine"] and result["zeroed"]
        assert "can only be called once" in result["twice"]
        assert "zeros" in result["name"]
        assert "shared_memory_all_reduce=False" in result["joined"]
        assert result["builtin"] == ["allreduce_hook"]
        assert torch.equal(result["builtin_grad"], results[0]["builtin_grad"])
        assert result["sparse_equal"]


def _alone() -> bool:
    dist.init_process_group("gloo")  # (an Accelerator on one process makes no group)
    try:
        return shared.shared_memory_all_reduce() is None
    finally:
        dist.destroy_process_group()


def test_one_process_has_nothing_to_share() -> None:
    assert run_distributed(_alone, world_size=1) == [True]
