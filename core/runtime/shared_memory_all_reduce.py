"""An all-reduce through shared memory, for CPU processes on one machine (DDP's gradients).

Over gloo a small all-reduce between two CPU processes on one machine takes ~300 µs: each
process's gloo thread wakes, the bytes cross the loopback TCP stack both ways, and the
calling thread is woken again. On a tiny model that is two thirds of a DDP step. Here every
process copies its tensor into its own slot of one shared mapping, says so by storing a
count in its own cache line, and, once every other process's count has moved, adds all
slots up in rank order itself — ~45 µs for the same 8 KB, ~2.7 ms for 24 MB (gloo ~15 ms).

Every process adds the same slots in the same order, so all of them hold the same sum, bit
for bit (what data parallelism needs: the replicas stay identical); with two processes it
is also gloo's sum bit for bit (``a + b``). Two sets of slots alternate: a process writes
set ``k % 2`` for its ``k``-th exchange only after every process has arrived at its
``(k - 1)``-th, that is, has finished reading set ``k % 2`` at its ``(k - 2)``-th, so one
barrier per exchange suffices. A tensor larger than a slot goes in slot-sized pieces.

Each process also stores the size it reduces beside its count: processes that disagree (they
run different backward passes) get an error naming both sizes rather than a wrong sum.

A process waiting for a count spins briefly (when there are no more processes than cores),
then sleeps on the count's futex, which the writer wakes after every store. The stores are
published by x86's total store order (a count seen means the slot's bytes seen), so this is
used only on x86-64 Linux; elsewhere DDP keeps gloo. A wait checks every 50 ms that its
peers' processes still exist, and gives up after the process group's timeout, as gloo does.

Example (a collective: every process of the group calls it; None where it cannot be used)::

    reducer = shared_memory_all_reduce()
    if reducer is not None:
        reducer.all_reduce(flat)  # sum in place, contiguous tensor
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import secrets
import socket
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .flight import describe_data, report_timeout

#: Bytes of each process's slot in each of the two sets (a larger tensor goes in pieces).
SLOT_BYTES = 4 << 20
_LINE = 64  # a count per cache line, so that no two writers share one
_TOKEN_BYTES = 16
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not _PRIVATE): the futex lives in a shared mapping
_SYS_FUTEX_X86_64 = 202
#: How long a sleeping wait lasts before it looks at its peers' processes again.
_CHECK_SECONDS = 0.05
#: Reads of a count before sleeping (~0.3 ms), where every process can have a core: on a
#: tiny model's 2-process step (benchmarks/README.md) 5000 gave 165 µs, none 180-190 µs, and
#: 1000 (~65 µs, often just short of the peer) 213-219 µs.
_SPINS = 5000


class _Timespec(ctypes.Structure):
    _fields_ = [("seconds", ctypes.c_long), ("nanoseconds", ctypes.c_long)]


_futex: Any = None
if sys.platform == "linux":  # (the C library's handle; elsewhere this module is not used)
    _futex = ctypes.CDLL(None, use_errno=True).syscall
    _futex.restype = ctypes.c_long
    _futex.argtypes = [
        ctypes.c_long,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
    ]
_CHECK_AFTER = _Timespec(0, int(_CHECK_SECONDS * 1e9))
_CHECK_AFTER_ADDRESS = ctypes.addressof(_CHECK_AFTER)


def possible() -> bool:
    """Whether this process can share memory whose stores other processes see in order:
    x86-64 Linux (its total store order, memfd, futex). Also the pipeline's rings' test."""
    return (
        sys.platform == "linux"
        and platform.machine().lower() in ("x86_64", "amd64")
        and hasattr(os, "memfd_create")
    )


class SharedMemoryAllReduce:
    """The processes of one group on one machine, summing tensors through one mapping.

    Built by :func:`shared_memory_all_reduce` (a collective); :meth:`all_reduce` is one too.
    """

    def __init__(
        self,
        memory: mmap.mmap,
        rank: int,
        pids: list[int],
        timeout: float,
        slot_bytes: int = SLOT_BYTES,
    ) -> None:
        self.rank, self.world = rank, len(pids)
        self.pids = pids
        self.timeout = timeout
        self.slot_bytes = slot_bytes
        self.memory = memory
        base = ctypes.addressof(ctypes.c_char.from_buffer(memory))
        #: Each process's count (and its futex) sits on a line of its own after the token's.
        self.addresses = [base + _LINE * (1 + r) for r in range(self.world)]
        self.counts = [ctypes.c_int32.from_address(a) for a in self.addresses]
        #: Each process's bytes in each slot set (after its count): the processes must agree.
        self.sizes = [
            [ctypes.c_int64.from_address(a + 8 + 8 * s) for s in range(2)] for a in self.addresses
        ]
        whole = torch.frombuffer(memory, dtype=torch.uint8)
        start = _LINE * (1 + self.world)
        self.slots = [
            [
                whole[start + (s * self.world + r) * slot_bytes :][:slot_bytes]
                for r in range(self.world)
            ]
            for s in range(2)
        ]
        #: Exchanges entered so far (all processes count alike: a collective's number), the
        #: tensor of the last call and whether the process sleeps waiting for a peer: what a
        #: hang report reads (:func:`collectives`).
        self.exchanges = 0
        self.last: torch.Tensor | None = None
        self.waiting = False
        self.spins = _SPINS if self.world <= len(os.sched_getaffinity(0)) else 0

    @staticmethod
    def mapping_bytes(world: int, slot_bytes: int = SLOT_BYTES) -> int:
        return _LINE * (1 + world) + 2 * world * slot_bytes

    def all_reduce(self, flat: torch.Tensor) -> None:
        """Sum ``flat`` (contiguous, on the CPU) over the processes, in place; every process
        ends with the same bits."""
        if not flat.is_contiguous() or flat.device.type != "cpu":
            raise ValueError(
                "the shared-memory all-reduce takes a contiguous CPU tensor; got "
                f"{'a non-contiguous' if not flat.is_contiguous() else 'a ' + flat.device.type}"
                " one"
            )
        self.last = flat
        data = flat.reshape(-1).view(torch.uint8)
        for start in range(0, data.numel(), self.slot_bytes):
            piece = data[start : start + self.slot_bytes]
            nbytes = piece.numel()
            which = self.exchanges & 1
            slots = self.slots[which]
            slots[self.rank][:nbytes].copy_(piece)
            # (A peer's size for this set cannot change before this process arrives again.)
            self.sizes[self.rank][which].value = nbytes
            self._arrive_and_wait()
            for peer, sizes in enumerate(self.sizes):
                if sizes[which].value != nbytes:
                    raise RuntimeError(
                        f"process {peer} all-reduces {sizes[which].value} bytes where this "
                        f"process ({self.rank}) all-reduces {nbytes}: the processes run "
                        "different backward passes (other models, or in another order)"
                    )
            total = piece.view(flat.dtype)
            torch.add(
                slots[0][:nbytes].view(flat.dtype), slots[1][:nbytes].view(flat.dtype), out=total
            )
            for slot in slots[2:]:
                total.add_(slot[:nbytes].view(flat.dtype))

    def _arrive_and_wait(self) -> None:
        before = self.exchanges & 0x7FFFFFFF
        self.exchanges += 1
        self.counts[self.rank].value = self.exchanges & 0x7FFFFFFF
        _futex(_SYS_FUTEX_X86_64, self.addresses[self.rank], _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)
        deadline = 0.0  # (the group's timeout counts once per exchange, from the first sleep)
        for peer, count in enumerate(self.counts):
            # A peer's count is `before` until it arrives; it can be one further already
            # (it arrived, saw everyone, and went on to its next exchange), never two.
            if peer == self.rank or count.value != before:
                continue
            spins = self.spins
            while spins and count.value == before:
                spins -= 1
            if count.value == before:
                deadline = deadline or time.monotonic() + self.timeout
                self._sleep_until_moved(peer, before, deadline)

    def _sleep_until_moved(self, peer: int, before: int, deadline: float) -> None:
        self.waiting = True
        try:
            self._sleep(peer, before, deadline)
        finally:
            self.waiting = False

    def _sleep(self, peer: int, before: int, deadline: float) -> None:
        count, address = self.counts[peer], self.addresses[peer]
        while count.value == before:
            _futex(_SYS_FUTEX_X86_64, address, _FUTEX_WAIT, before, _CHECK_AFTER_ADDRESS, None, 0)
            if count.value != before:
                return
            if not _running(self.pids[peer]):
                raise RuntimeError(
                    f"process {peer} (pid {self.pids[peer]}) ended during the shared-memory "
                    "all-reduce of the gradients: see its own error above"
                )
            if time.monotonic() > deadline:
                reason = (
                    f"process {peer} did not reach the shared-memory all-reduce of the "
                    f"gradients within the process group's timeout ({self.timeout:g} s): "
                    "it stopped elsewhere, or took another path (a backward the others did "
                    "not run)"
                )
                report_timeout(reason)  # the hang watchdog reports for the whole job
                raise RuntimeError(reason)

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        # A copied or unpickled DDP model rebuilds its reducer without its hooks (torch's
        # __setstate__), so what it keeps of this object is never called: nothing to carry.
        return _left_behind, ()


def _left_behind() -> None:
    return None


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie has ended)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (ProcessLookupError, FileNotFoundError):
        return False
    except OSError:
        return True  # not ours to look at: assume it runs


def _timeout(group: Any) -> float:
    try:
        timeout = group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        timeout = timedelta(minutes=30)  # gloo's default
    return float(timeout.total_seconds())


_MADE: dict[Any, tuple[int, SharedMemoryAllReduce | None]] = {}


def shared_memory_all_reduce(
    group: Any = None, slot_bytes: int = SLOT_BYTES
) -> SharedMemoryAllReduce | None:
    """The group's shared-memory all-reduce (made once per group and process), or None where
    some process cannot take part: on another machine (or pid namespace), not x86-64
    Linux, or unable to map another's memory. A collective over ``group`` (default: all
    processes); every process gets the same answer."""
    group = group if group is not None else dist.group.WORLD
    made = _made_here(group)
    if made is None:
        made = _MADE[group] = (os.getpid(), _make(group, slot_bytes))
    return made[1]


def cached(group: Any = None) -> SharedMemoryAllReduce | None:
    """The all-reduce :func:`shared_memory_all_reduce` made for ``group`` in this process,
    if any (not a collective)."""
    made = _made_here(group if group is not None else dist.group.WORLD)
    return made[1] if made is not None else None


def _made_here(group: Any) -> tuple[int, SharedMemoryAllReduce | None] | None:
    """What this process made for ``group`` (a forked child made nothing yet)."""
    made = _MADE.get(group)
    return made if made is not None and made[0] == os.getpid() else None


def collectives() -> list[dict[str, Any]]:
    """This process's shared-memory all-reduces as a hang report reads collectives: per
    reducer its last exchange, pending while the process sleeps waiting for a peer (read
    only when a report is made: the exchanges themselves record nothing)."""
    records = []
    for pid, reducer in list(_MADE.values()):
        if pid == os.getpid() and reducer is not None and reducer.exchanges:
            records.append(
                {
                    "seq": reducer.exchanges,
                    "op": "all_reduce (shared memory)",
                    "group": "shared memory",
                    "group_desc": "DDP's gradients",
                    "data": describe_data(reducer.last),
                    "pending": reducer.waiting,
                }
            )
    return records


def _make(group: Any, slot_bytes: int) -> SharedMemoryAllReduce | None:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world < 2:
        return None
    here = (_machine(), _pid_namespace(), possible(), os.getpid())
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, here, group=group)
    if not all(entry[2] for entry in everyone) or len({entry[:2] for entry in everyone}) != 1:
        return None
    size = SharedMemoryAllReduce.mapping_bytes(world, slot_bytes)
    fd, memory, offer = -1, None, None
    if rank == 0:
        fd, memory, offer = _create(size)
    offers = [offer]
    dist.broadcast_object_list(offers, group_src=0, group=group)
    if rank != 0 and offers[0] is not None:
        memory = _open(*offers[0], size)
    ready: list[Any] = [None] * world
    dist.all_gather_object(ready, memory is not None, group=group)
    if fd >= 0:
        os.close(fd)  # everyone has mapped it (or given up): the mappings keep it alive
    if not all(ready):
        if memory is not None:
            memory.close()
        return None
    assert memory is not None
    pids = [entry[3] for entry in everyone]
    return SharedMemoryAllReduce(memory, rank, pids, _timeout(group), slot_bytes)


def _create(size: int) -> tuple[int, mmap.mmap | None, tuple[int, int, bytes] | None]:
    try:
        fd = os.memfd_create("slipstream-all-reduce", os.MFD_CLOEXEC)
    except OSError:
        return -1, None, None
    try:
        os.ftruncate(fd, size)
        memory = mmap.mmap(fd, size)
    except OSError:
        os.close(fd)
        return -1, None, None
    token = secrets.token_bytes(_TOKEN_BYTES)
    memory[:_TOKEN_BYTES] = token
    return fd, memory, (os.getpid(), fd, token)


def _open(pid: int, fd: int, token: bytes, size: int) -> mmap.mmap | None:
    """The creator's mapping, through its descriptor in /proc (None where this process may
    not open it, or it is not the creator's: the token differs)."""
    try:
        mine = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        memory = mmap.mmap(mine, size)
    except (OSError, ValueError):
        return None
    finally:
        os.close(mine)
    if memory[:_TOKEN_BYTES] != token:
        memory.close()
        return None
    return memory


def _machine() -> str:
    """This machine: its host name and its boot (containers may share a host name)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return f"{socket.gethostname()} {boot.read().strip()}"
    except OSError:
        return socket.gethostname()


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
