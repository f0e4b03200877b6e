"""One direction of a pipeline transfer channel in shared memory: a ring of records that one
process writes and the other reads, with an eventfd as its doorbell.

Between two computations of a pipeline step every system call and every line of Python
that the computation pushed out of the caches is idle time on the critical path. Over a
Unix socket a 64 KB transfer took ~35 µs to write and ~35 µs to read there (the kernel
copies the bytes twice, in pieces); through a shared ring the writer copies them once into
the ring and the reader copies them out, each one ``memmove`` between addresses, and the
doorbell is an 8-byte eventfd write.

A record is a 16-byte header (the payload's length and its kind) and, for an inline record,
the payload, padded to 64 bytes; a record that does not fit before the ring's end is
preceded by a wrap record that fills the rest. A payload larger than a quarter of the ring
goes over the pair's socket instead, announced by a record of its own, so that the reader
takes every message in the order it was sent. The writer publishes a record by storing its
new write count after the record's bytes, and the reader frees the room by storing its
read count after copying them out: x86's stores become visible in the order they were
made (total store order), so a count seen means bytes seen — which is why these rings are
used only on x86-64 (local_transport.py keeps the socket elsewhere). A reader with nothing
to read sleeps on the doorbell, which the writer rings after every record (an eventfd
counts the rings until they are read, so none is lost between the reader's last look and
its sleep), and on the socket, which wakes it if the writer's process ends.

A pair sets its rings up over its socket: each process makes the rings it will read from
(:func:`make_inboxes`) and hands each to its peer (:func:`exchange_rings`, memfds and
eventfds passed with ``SCM_RIGHTS``); local_transport.py does both, and falls back to the
socket alone where a process cannot make them.

Example (the reader's process made ``memory`` and ``doorbell`` and handed them over)::

    writer = SharedRing(memory, doorbell, sock)
    writer.put(tensor.data_ptr(), tensor.nbytes)  # False: no room now (the reader is behind)
    reader = SharedRing(memory, doorbell, sock)
    reader.take(buffer.data_ptr(), buffer.nbytes, read_socket)  # the next payload
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import select
import socket
import struct
import weakref
from collections.abc import Callable

from ...runtime.shared_memory_all_reduce import possible as stores_seen_in_order

_COUNT = struct.Struct("<q")
_HEADER = struct.Struct("<qq")
#: Where the writer's and the reader's counts sit (each on a cache line of its own), and
#: where the records start.
_WRITTEN, _READ, _RECORDS = 0, 64, 128
_ALIGN = 64
INLINE, ON_SOCKET, WRAP = 0, 1, 2

CLOSED = "the peer pipeline stage closed its connection (its process ended)"


def ring_memory(capacity: int) -> tuple[int, mmap.mmap]:
    """A new shared ring of ``capacity`` bytes of records (a multiple of 64): the memfd
    to hand to the peer, and this process's mapping of it."""
    if capacity <= 0 or capacity % _ALIGN:
        raise ValueError(f"a ring's capacity is a positive multiple of {_ALIGN}; got {capacity}")
    fd = os.memfd_create("slipstream-pipeline-ring", os.MFD_CLOEXEC)
    os.ftruncate(fd, _RECORDS + capacity)
    return fd, mmap.mmap(fd, _RECORDS + capacity)


def byte_view(address: int, nbytes: int) -> memoryview:
    """A writable view of ``nbytes`` bytes at ``address`` (it owns nothing: whoever holds
    the memory keeps it alive while the view is used)."""
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class SharedRing:
    """One side of a ring: :meth:`put` on the writing process, :meth:`take` on the reading
    one (each process holds its own ``SharedRing`` over the same memory, and the pair's
    socket). The ring closes its ``doorbell`` when it is dropped."""

    def __init__(self, memory: mmap.mmap, doorbell: int, sock: socket.socket) -> None:
        self.memory, self.sock = memory, sock
        # Closed with the ring, not at exit (a daemon writer thread may still ring it).
        weakref.finalize(self, os.close, doorbell).atexit = False
        self.view = memoryview(memory)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
        self.capacity = len(memory) - _RECORDS
        #: Payloads above this go over the socket (a ring holds at least four of them).
        self.largest_inline = self.capacity // 4 - _HEADER.size
        self.doorbell = doorbell
        #: Bytes of records this side has written (writer) or read (reader) so far.
        self.position = 0
        self._sleep: select.poll | None = None  # (the reader's: on the doorbell and socket)

    # The writing process.

    def put(self, address: int, nbytes: int, inline: bool = True) -> bool:
        """Publish a record of the ``nbytes`` bytes at ``address`` (``inline=False``: only
        their length; the bytes go over the socket after it) if the ring has room now;
        whether it did. (Copied by address, not through views: this runs between two
        computations, where making a view of a tensor's bytes took ~10-20 µs.)"""
        size = _padded(_HEADER.size + nbytes) if inline else _ALIGN
        view, capacity = self.view, self.capacity
        at = self.position % capacity
        waste = capacity - at if capacity - at < size else 0
        if self.position + waste + size - _COUNT.unpack_from(view, _READ)[0] > capacity:
            return False
        if waste:
            _HEADER.pack_into(view, _RECORDS + at, 0, WRAP)
            at = 0
        start = _RECORDS + at
        _HEADER.pack_into(view, start, nbytes, INLINE if inline else ON_SOCKET)
        if inline and nbytes:
            ctypes.memmove(self.address + start + _HEADER.size, address, nbytes)
        self.position += waste + size
        _COUNT.pack_into(view, _WRITTEN, self.position)  # published (after the bytes)
        os.eventfd_write(self.doorbell, 1)
        return True

    def fits_inline(self, nbytes: int) -> bool:
        return nbytes <= self.largest_inline

    # The reading process.

    def take(
        self,
        address: int,
        nbytes: int,
        read_socket: Callable[[socket.socket, memoryview], None],
    ) -> None:
        """Read the next record's payload into the ``nbytes`` bytes at ``address`` (waiting
        for it); a payload sent over the socket is read with ``read_socket``. A record of
        another length fails here, before anything is written there."""
        view, capacity = self.view, self.capacity
        while True:
            if _COUNT.unpack_from(view, _WRITTEN)[0] <= self.position:
                self._wait()
            at = self.position % capacity
            start = _RECORDS + at
            length, kind = _HEADER.unpack_from(view, start)
            if kind != WRAP:
                break
            self.position += capacity - at
            _COUNT.pack_into(view, _READ, self.position)
        if length != nbytes:
            raise RuntimeError(
                f"a pipeline transfer of {length} bytes arrived for a {nbytes}-byte "
                "receive: the stages disagree on the order or shapes of their messages"
            )
        if kind == INLINE:
            if nbytes:
                ctypes.memmove(address, self.address + start + _HEADER.size, nbytes)
            self.position += _padded(_HEADER.size + nbytes)
        else:
            read_socket(self.sock, byte_view(address, nbytes))
            self.position += _ALIGN
        _COUNT.pack_into(view, _READ, self.position)  # the writer may reuse the room

    def _wait(self) -> None:
        """Until a record is published: asleep on the doorbell (and on the socket, which
        wakes when the peer's process ends)."""
        view, position, sock = self.view, self.position, self.sock
        if self._sleep is None:
            self._sleep = select.poll()  # (poll, not select: any file number)
            self._sleep.register(self.doorbell, select.POLLIN)
            self._sleep.register(sock, select.POLLIN)
        sleep, doorbell = self._sleep.poll, self.doorbell
        while _COUNT.unpack_from(view, _WRITTEN)[0] <= position:
            # The writer rings after every record, so a record published after this check
            # wakes the poll below (the doorbell counts rings until they are read).
            for fd, _ in sleep():
                if fd == doorbell:
                    with contextlib.suppress(BlockingIOError):
                        os.eventfd_read(doorbell)
                # Nothing is written to the socket before its record: only the peer's end.
                elif _COUNT.unpack_from(view, _WRITTEN)[0] <= position and not sock.recv(
                    1, socket.MSG_PEEK
                ):
                    raise ConnectionError(CLOSED)


#: Bytes of records in each shared ring (a payload over a quarter of it goes over the socket).
RING_BYTES = 4 << 20


def rings_possible() -> bool:
    """Whether this process can share rings (memory whose stores the peer sees in order,
    and an eventfd)."""
    return stores_seen_in_order() and hasattr(os, "eventfd")


#: Per peer: (memfd, mapping, doorbell) of the ring this process reads from.
Inboxes = dict[int, tuple[int, mmap.mmap, int]]


def make_inboxes(peers: list[int]) -> Inboxes | None:
    """(memfd, mapping, doorbell) of the ring this process reads from, per peer; None (and
    nothing left open) where they cannot be made, e.g. at the limit of open files."""
    made: Inboxes = {}
    try:
        for peer in peers:
            fd, memory = ring_memory(RING_BYTES)
            made[peer] = (fd, memory, -1)
            made[peer] = (fd, memory, os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC))
    except OSError:
        close_inboxes(made)
        return None
    return made


def close_inboxes(made: Inboxes) -> None:
    """Close what :func:`make_inboxes` made (when the rings will not be used)."""
    for fd, memory, doorbell in made.values():
        for descriptor in (fd, doorbell):
            if descriptor >= 0:
                os.close(descriptor)
        memory.close()


def exchange_rings(
    sockets: dict[int, socket.socket], made: Inboxes
) -> dict[int, tuple[SharedRing, SharedRing]]:
    """(inbox, outbox) per peer: each process hands the ring it reads from and that ring's
    doorbell to the peer over their socket, and maps the peer's. Raises OSError (with
    nothing left open) if a peer did not hand its over within 60 s."""
    theirs: dict[int, tuple[mmap.mmap, int]] = {}
    try:
        try:
            for peer, sock in sockets.items():
                sock.settimeout(60.0)  # a peer that failed part way must not leave us waiting
                fd, _, doorbell = made[peer]
                socket.send_fds(sock, [b"R"], [fd, doorbell])
        finally:
            for fd, _, _ in made.values():
                os.close(fd)  # (handed over, or not needed: the mapping keeps the memory)
        for peer, sock in sockets.items():
            _, fds, _, _ = socket.recv_fds(sock, 1, 2, socket.MSG_CMSG_CLOEXEC)
            try:
                if len(fds) != 2:
                    raise OSError("a pipeline peer did not hand over its shared ring")
                theirs[peer] = (mmap.mmap(fds[0], os.fstat(fds[0]).st_size), fds[1])
            except (OSError, ValueError):
                for descriptor in fds:
                    os.close(descriptor)
                raise
            os.close(fds[0])
            sock.settimeout(None)
    except (OSError, ValueError):
        for memory, doorbell in theirs.values():
            memory.close()
            os.close(doorbell)
        for _, memory, doorbell in made.values():
            memory.close()
            os.close(doorbell)
        raise
    return {
        peer: (
            SharedRing(made[peer][1], made[peer][2], sock),
            SharedRing(theirs[peer][0], theirs[peer][1], sock),
        )
        for peer, sock in sockets.items()
    }
