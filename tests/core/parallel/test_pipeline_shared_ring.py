"""The pipeline's shared-memory rings (core/parallel/pipeline/shared_ring.py) and the
channels that use them (local_transport.py): every message arrives whole and in order
through wraps, a full ring, payloads sent over the socket and a sleeping reader; a message
of another size and a peer that ends fail loudly."""

from __future__ import annotations

import mmap
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from slipstream.parallel.pipeline import local_transport
from slipstream.parallel.pipeline.local_transport import _read_exactly
from slipstream.parallel.pipeline.shared_ring import SharedRing, ring_memory, rings_possible

pytestmark = pytest.mark.skipif(not rings_possible(), reason="shared rings need x86-64 Linux")


class Pair:
    """A ring written on one side of a socket pair and read on the other, as two processes
    hold it (two mappings of one memfd)."""

    def __init__(self, capacity: int) -> None:
        self.ours, self.theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fd, memory = ring_memory(capacity)
        doorbell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.reader = SharedRing(memory, doorbell, self.theirs)
        self.writer = SharedRing(mmap.mmap(fd, os.fstat(fd).st_size), os.dup(doorbell), self.ours)
        os.close(fd)

    def put(self, data: bytes, inline: bool = True) -> bool:
        source = _tensor(data)
        return self.writer.put(source.data_ptr(), len(data), inline)

    def take(self, nbytes: int) -> bytes:
        into = torch.empty(nbytes, dtype=torch.uint8)
        self.reader.take(into.data_ptr(), nbytes, _read_exactly)
        return bytes(into.tolist())

    def close(self) -> None:
        self.ours.close()
        self.theirs.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    made = Pair(4096)
    yield made
    made.close()


def _tensor(data: bytes) -> torch.Tensor:
    return torch.tensor(list(data), dtype=torch.uint8)


def _payload(nbytes: int, seed: int) -> bytes:
    return bytes((seed * 31 + i) % 251 for i in range(nbytes))


def test_messages_wrap_around_the_ring_whole_and_in_order(pair: Pair) -> None:
    sizes = [0, 1, 15, 16, 17, 63, 64, 65, 1000, 1008] * 12  # ~26 KB through a 4 KB ring
    sent: list[bytes] = []
    for seed, nbytes in enumerate(sizes):
        data = _payload(nbytes, seed)
        assert pair.put(data)
        sent.append(data)
        if seed % 3 == 2:  # the reader lags behind by up to three messages
            while sent:
                expected = sent.pop(0)
                assert pair.take(len(expected)) == expected
    for expected in sent:
        assert pair.take(len(expected)) == expected
    assert pair.writer.position == pair.reader.position > 4096


def test_a_full_ring_takes_nothing_until_the_reader_frees_room(pair: Pair) -> None:
    data = _payload(1000, 7)
    puts = 0
    while pair.put(data):
        puts += 1
    assert puts == 4  # 4096 bytes of records, each 1024 (1000 + the 16-byte header, padded)
    assert not pair.put(data)
    assert pair.take(1000) == data
    assert pair.put(data)
    for _ in range(4):
        assert pair.take(1000) == data


def test_a_payload_over_a_quarter_of_the_ring_goes_over_the_socket(pair: Pair) -> None:
    small, large = _payload(100, 1), _payload(5000, 2)
    assert pair.writer.fits_inline(len(small)) and not pair.writer.fits_inline(len(large))
    assert pair.put(small)
    assert pair.put(large, inline=False)  # its record only
    pair.ours.sendall(large)
    assert pair.put(small)
    assert [pair.take(100), pair.take(5000), pair.take(100)] == [small, large, small]


def test_a_sleeping_reader_wakes_for_a_record(pair: Pair) -> None:
    data = _payload(300, 3)

    def later() -> None:
        time.sleep(0.2)
        pair.put(data)

    writer = threading.Thread(target=later)
    started = time.monotonic()
    writer.start()
    assert pair.take(300) == data
    assert time.monotonic() - started >= 0.2
    writer.join()


def test_a_message_of_another_size_fails_before_it_is_read(pair: Pair) -> None:
    assert pair.put(_payload(16, 0))
    into = torch.full((32,), 255, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="16 bytes arrived for a 32-byte receive"):
        pair.reader.take(into.data_ptr(), 32, _read_exactly)
    assert into.tolist() == [255] * 32


def test_a_reader_waiting_on_a_peer_that_ended_fails(pair: Pair) -> None:
    threading.Timer(0.1, pair.ours.close).start()
    with pytest.raises(ConnectionError, match="closed its connection"):
        pair.take(8)


def test_a_ring_capacity_is_a_positive_multiple_of_64() -> None:
    with pytest.raises(ValueError, match="multiple of 64"):
        ring_memory(1000)


@pytest.mark.parametrize("ring_bytes", [4096, 1 << 16])
def test_channels_over_rings_deliver_every_size_in_order(ring_bytes: int) -> None:
    """Through a channel: small messages inline, large ones over the socket (one larger
    than the socket's buffer), more than the ring holds before the reader reads (the rest
    by the writer thread, in order)."""
    pair = Pair(ring_bytes)
    sender = local_transport._Channel(pair.ours, 1, outbox=pair.writer)
    receiver = local_transport._Channel(pair.theirs, 0, inbox=pair.reader)
    generator = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(count, generator=generator)
        for count in (0, 1, 200, 5, 3000, *[250] * 80, 40000, 7, 1 << 19, *[250] * 5)
    ]
    buffers = [torch.full_like(tensor, -1) for tensor in tensors]
    works = [local_transport._Receive(receiver, buffer) for buffer in buffers]
    receiver.pending.extend(works)
    backlogs = [sender.send(tensor) for tensor in tensors]
    assert any(backlog is not None for backlog in backlogs)  # the ring filled up
    works[-1].wait()  # reads the earlier messages first
    for backlog in backlogs:
        if backlog is not None:
            backlog.wait()
    assert all(torch.equal(a, b) for a, b in zip(tensors, buffers, strict=True))
    assert not receiver.pending
    pair.close()


def test_a_send_waiting_for_room_fails_once_the_reader_is_gone() -> None:
    pair = Pair(4096)
    sender = local_transport._Channel(pair.ours, 1, outbox=pair.writer)
    backlogs = [sender.send(torch.zeros(200)) for _ in range(8)]  # 4 fit
    waiting = [backlog for backlog in backlogs if backlog is not None]
    assert waiting
    pair.theirs.close()
    with pytest.raises(ConnectionError, match="closed its connection"):
        waiting[-1].wait()
    pair.ours.close()


def test_a_send_waiting_for_room_ignores_the_peers_payloads_and_sees_its_end() -> None:
    """The socket also carries the peer's payloads, read only by the computing thread: a
    send waiting for room must neither take them for the peer's end nor miss that end."""
    pair = Pair(4096)
    sender = local_transport._Channel(pair.ours, 1, outbox=pair.writer)
    pair.theirs.sendall(b"a payload of the peer's, unread here")
    backlogs = [sender.send(torch.zeros(200)) for _ in range(6)]  # 4 fit
    waiting = [backlog for backlog in backlogs if backlog is not None]
    assert len(waiting) == 2
    time.sleep(0.05)
    assert not waiting[0].future.done()  # still waiting for room, not failed
    for _ in range(2):  # the reader frees room for both
        pair.take(800)
    for backlog in waiting:
        backlog.wait()
    more = [sender.send(torch.zeros(200)) for _ in range(4)]  # the ring is full again
    assert more[-1] is not None
    pair.theirs.close()  # the peer ends with its payload still unread here
    with pytest.raises(ConnectionError, match="closed its connection"):
        more[-1].future.result(timeout=10)  # (a timeout, not a hang, if it were missed)
    pair.ours.close()
