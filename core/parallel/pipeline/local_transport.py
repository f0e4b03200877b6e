"""Transfers between pipeline stages on one machine through shared memory and Unix sockets,
instead of gloo's.

Over gloo a transfer is a rendezvous run by each process's I/O thread: posting a receive
sends an announcement to the peer, the data goes out once the announcement is known, and
the receiver's I/O thread reads it before waking the computing thread. With as many
processes as cores (the CPU case), each of those wake-ups takes a core from a computation
and each hand-over waits for one. Here the two processes of a pair share a channel, used
by the computing threads themselves: on x86-64 Linux a shared-memory ring each way
(shared_ring.py: a send copies the tensor's bytes into the ring, a wait copies them out
into the receive buffer), beside one Unix stream socket, which carries what is too large
for a ring and tells a reader when its peer's process ends; elsewhere the socket carries
everything (a send writes the bytes without blocking, a wait reads them straight into the
receive buffer). What a channel cannot take at once goes to its writer thread, behind which
that peer's later sends queue. A pair's messages arrive in the order they were sent, as
gloo matches them; each carries its length, so a mismatch fails loudly rather than filling
a buffer with another message. The bytes are the tensor's own: results are bitwise those
over gloo. A send into a ring does not notice that the peer's process has ended (a socket
write did); the next wait on that peer, or a send that finds its ring full, fails instead
(every pipeline process waits on each of its neighbours within a step).

Used by slipstream's pipeline runner over gloo when every process of the pipeline group
runs on this machine and runs the runner (``PipelineRuntime`` decides, collectively, when
it is built); everything else keeps gloo.

Example::

    channels = local_channels(group, wanted=True)  # collective over the pipeline group
    works = channels.post(receive_ops)             # nothing is read yet
    channels.post(send_ops)                        # (on the peer)
    for work in works: work.wait()                 # the tensors hold the peer's bytes
"""

from __future__ import annotations

import collections
import functools
import os
import queue
import secrets
import select
import socket
import struct
import sys
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from . import shared_ring
from .shared_ring import CLOSED as _CLOSED
from .shared_ring import SharedRing, byte_view

_HEADER = struct.Struct("<q")

#: Channels per pipeline group (and the process that connected them: a forked child has
#: none): connected once, used by every schedule built on the group since; dropped, and
#: their sockets closed, with the group.
_CONNECTED: weakref.WeakKeyDictionary[Any, tuple[int, LocalChannels | None]] = (
    weakref.WeakKeyDictionary()
)


def _place(tensor: torch.Tensor) -> tuple[int, int]:
    """The address and length of a contiguous CPU tensor's bytes."""
    if not tensor.is_cpu or not tensor.is_contiguous():
        raise ValueError(
            "local pipeline transfers take contiguous CPU tensors; got one on "
            f"{tensor.device} (contiguous: {tensor.is_contiguous()})"
        )
    return tensor.data_ptr(), tensor.nbytes


class _ByteViews:
    """Views of tensors' bytes for the socket, by address and length: made once per place
    in memory.

    Made between two computations, on the pipeline's critical path, where code the
    computation pushed out of the caches runs 10-20 times slower than in a loop: building
    a view (ctypes, then memoryview's cast) took ~10-20 µs a transfer there, against ~1 µs
    in a loop. A receive reads into the same buffers every step, so it looks its view up
    instead. A view is only an address and a length (it owns nothing), so one made for an
    earlier tensor at the same address is a view of the tensor there now.
    """

    #: Beyond this many places, the views are dropped and made again as needed.
    LIMIT = 256

    def __init__(self) -> None:
        self.views: dict[tuple[int, int], tuple[memoryview, memoryview]] = {}

    def at(self, address: int, nbytes: int) -> tuple[memoryview, memoryview]:
        """(the bytes at ``address``, their message header: the length); whoever holds
        the memory keeps it alive while the view is used."""
        key = (address, nbytes)
        found = self.views.get(key)
        if found is None:
            if len(self.views) >= self.LIMIT:
                self.views.clear()
            found = self.views[key] = (byte_view(address, nbytes), memoryview(_HEADER.pack(nbytes)))
        return found


def _read_exactly(sock: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        count = sock.recv_into(view)
        if count == 0:
            raise ConnectionError(_CLOSED)
        view = view[count:]


class _Receive:
    """A posted receive: read (with every earlier one from the same peer) when waited on."""

    __slots__ = ("address", "channel", "done", "nbytes", "tensor")

    def __init__(
        self, channel: _Channel, tensor: torch.Tensor, place: tuple[int, int] | None = None
    ) -> None:
        self.channel, self.tensor, self.done = channel, tensor, False
        self.address, self.nbytes = _place(tensor) if place is None else place

    def read(self) -> None:
        inbox = self.channel.inbox
        if inbox is not None:
            inbox.take(self.address, self.nbytes, _read_exactly)
            self.done = True
            return
        # (Reads are one at a time per channel: its header buffer is reused.)
        channel = self.channel
        sock, header = channel.sock, channel.header
        view = channel.views.at(self.address, self.nbytes)[0]
        # Header and data in one call when both are there (as a rule, by the time of the
        # wait). A message of another size fails here, before any further read, rather than
        # waiting for bytes that never come (what this call took may include the next
        # message's bytes: the stream no longer lines up either way).
        count = sock.recvmsg_into([header, view])[0]
        if count == 0:
            raise ConnectionError(_CLOSED)
        if count < _HEADER.size:
            _read_exactly(sock, memoryview(header)[count:])
        (length,) = _HEADER.unpack(header)
        if length != view.nbytes:
            raise RuntimeError(
                f"a pipeline transfer of {length} bytes arrived for a {view.nbytes}-byte "
                "receive: the stages disagree on the order or shapes of their messages"
            )
        _read_exactly(sock, view[max(0, count - _HEADER.size) :])
        self.done = True

    def wait(self, timeout: Any = None) -> bool:
        if not self.done:
            self.channel.read_until(self)
        return True


class _Backlog:
    """A send the channel could not complete at once, finished by its writer thread."""

    __slots__ = ("future",)

    def __init__(self, future: Future[None]) -> None:
        self.future = future

    def wait(self, timeout: Any = None) -> bool:
        self.future.result()
        return True


class _Channel:
    """One peer: a socket, and where the machine allows, a shared-memory ring each way
    (shared_ring.py) that carries the messages (the socket then carries only payloads too
    large for a ring, and tells when the peer's process ends)."""

    def __init__(
        self,
        sock: socket.socket,
        peer: int,
        inbox: SharedRing | None = None,
        outbox: SharedRing | None = None,
    ) -> None:
        self.sock, self.peer = sock, peer
        self.inbox, self.outbox = inbox, outbox
        # One writer thread per channel (made when first needed): a write blocked until this
        # peer reads never holds back a send to another peer, so no chain of processes
        # waiting on each other's reads can close into a cycle.
        self.writer: _Writer | None = None
        self.pending: collections.deque[_Receive] = collections.deque()
        self.reading = threading.Lock()
        self.header = bytearray(_HEADER.size)  # what a socket read's header goes into
        self.backlog: Future[None] | None = None
        self.views = _ByteViews()

    def send(self, tensor: torch.Tensor) -> _Backlog | None:
        outbox, (address, nbytes) = self.outbox, _place(tensor)
        if outbox is None:
            data, header = self.views.at(address, nbytes)
        else:
            inline = outbox.fits_inline(nbytes)
        if self.backlog is None or self.backlog.done():
            if self.backlog is not None:
                self.backlog.result()  # raise what the writer thread met
            if outbox is None:
                parts = _send_without_blocking(self.sock, [header, data])
                if not parts:
                    return None
                job = functools.partial(_write_all, self.sock, parts)
            elif not outbox.put(address, nbytes, inline):
                job = functools.partial(self._put_when_room, address, nbytes, inline)
            elif inline:
                return None
            else:  # the record is out; the payload follows over the socket
                parts = _send_without_blocking(self.sock, [byte_view(address, nbytes)])
                if not parts:
                    return None
                job = functools.partial(_write_all, self.sock, parts)
        elif outbox is None:
            job = functools.partial(_write_all, self.sock, [header, data])
        else:
            job = functools.partial(self._put_when_room, address, nbytes, inline)
        if self.writer is None:
            self.writer = _Writer(self.peer)
        # Queued behind this peer's earlier backlog (the writer runs in order).
        self.backlog = self.writer.submit(job, tensor)
        return _Backlog(self.backlog)

    def receive(self, tensor: torch.Tensor, place: tuple[int, int] | None = None) -> _Receive:
        """Post a receive into ``tensor`` (``place``: the address and length of its bytes,
        when known); it is read when waited on, after the earlier ones."""
        receive = _Receive(self, tensor, place)
        self.pending.append(receive)
        return receive

    def _put_when_room(self, address: int, nbytes: int, inline: bool) -> None:
        """(The writer thread.) Publish the bytes at ``address`` once the peer has read
        enough of the ring (over the socket after their record when not ``inline``),
        looking again after a wait that doubles from 0.2 to 5 ms; raises once the peer's
        process has ended (its end of the socket hung up: the room never comes)."""
        assert self.outbox is not None
        # (Not by reading the socket: it also carries the peer's payloads, which only the
        # computing thread reads.)
        ended = select.poll()  # (poll, not select: any file number)
        ended.register(self.sock, select.POLLRDHUP)
        wait = 0.2
        while not self.outbox.put(address, nbytes, inline):
            if ended.poll(wait):  # (milliseconds) only a hang-up or an error wakes it
                raise ConnectionError(_CLOSED)
            wait = min(2 * wait, 5.0)
        if not inline:
            self.sock.sendall(byte_view(address, nbytes))

    def read_until(self, receive: _Receive) -> None:
        with self.reading:
            while not receive.done:
                # Taken off the queue once read: a read that fails part way leaves it there,
                # so the next step sees that the stream no longer lines up.
                self.pending[0].read()
                self.pending.popleft()


def _write_all(sock: socket.socket, parts: list[memoryview]) -> None:
    for part in parts:
        sock.sendall(part)


class _Writer:
    """A daemon thread finishing one channel's sends in order (a daemon: a process ending
    while its peer no longer reads must not wait for it at exit)."""

    def __init__(self, peer: int) -> None:
        self.queue: queue.SimpleQueue[tuple[Future[None], Callable[[], None], torch.Tensor]] = (
            queue.SimpleQueue()
        )
        threading.Thread(target=self._run, name=f"slipstream-pp-to-{peer}", daemon=True).start()

    def submit(self, job: Callable[[], None], tensor: torch.Tensor) -> Future[None]:
        """Run ``job`` (a write of ``tensor``'s bytes, which is held until it is done)."""
        future: Future[None] = Future()
        self.queue.put((future, job, tensor))
        return future

    def _run(self) -> None:
        while True:
            future, job, tensor = self.queue.get()
            try:
                job()
            except BaseException as error:  # handed to whoever waits on the send
                future.set_exception(error)
            else:
                future.set_result(None)
            # Nothing kept while idle: a job holds its channel (and the channel its socket
            # and rings), which go with the pipeline group.
            del future, job, tensor


def _send_without_blocking(sock: socket.socket, parts: list[memoryview]) -> list[memoryview]:
    """Write what the socket takes now; the parts left (none when all was written)."""
    try:
        sent = sock.sendmsg(parts, [], socket.MSG_DONTWAIT)
    except BlockingIOError:
        return parts
    left = []
    for part in parts:
        if sent >= part.nbytes:
            sent -= part.nbytes
        else:
            left.append(part[sent:])
            sent = 0
    return left


class LocalChannels:
    """A socket to every other process of a pipeline group; keys are global ranks."""

    def __init__(self, channels: dict[int, _Channel]) -> None:
        self.channels = channels

    def post(self, ops: list[Any]) -> list[Any]:
        """``torch.distributed.P2POp``s of one kind, as torch's ``_batch_p2p`` takes them:
        receives are recorded (and read when waited on), sends are written now; returns
        what to wait on."""
        works: list[Any] = []
        for op in ops:
            work = (self.receive if op.op is dist.irecv else self.send)(op.peer, op.tensor)
            if work is not None:
                works.append(work)
        return works

    def send(self, peer: int, tensor: torch.Tensor) -> _Backlog | None:
        """Write ``tensor`` to global rank ``peer`` now, without blocking; what is left to
        wait on (None: all written)."""
        return self.channels[peer].send(tensor)

    def receive(self, peer: int, tensor: torch.Tensor) -> _Receive:
        """Post a receive into ``tensor`` from global rank ``peer`` (read when waited on,
        after the peer's earlier messages)."""
        return self.channels[peer].receive(tensor)

    def check_drained(self) -> None:
        """Raise if a receive of an earlier step is still unread (that step stopped part
        way): its message would be taken for this step's."""
        if any(channel.pending for channel in self.channels.values()):
            raise RuntimeError(
                "a pipeline step starts while an earlier one left receives unread (it "
                "stopped part way, e.g. on an exception): the stages' messages no longer "
                "line up; restart the processes (or resume from a checkpoint)"
            )


def local_channels(group: Any, wanted: bool) -> LocalChannels | None:
    """The channels of ``group`` (None: gloo stays) — a collective over the group, on every
    process of it, each saying whether it ``wanted`` them; used only when all do and all run
    on this machine."""
    group = group if group is not None else dist.group.WORLD
    # Abstract Unix addresses (no file on disk) exist on Linux only.
    here = (socket.gethostname(), _namespace(), bool(wanted) and sys.platform == "linux")
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (*here, shared_ring.rings_possible()), group=group)
    if not all(entry[2] for entry in everyone) or len({entry[:2] for entry in everyone}) != 1:
        return None
    pid, channels = _CONNECTED.get(group, (None, None))
    if pid != os.getpid():
        channels = _connect(group, rings=all(entry[3] for entry in everyone))
        _CONNECTED[group] = (os.getpid(), channels)
    return channels


def _namespace() -> str:
    """This process's network namespace (abstract Unix addresses are per namespace)."""
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError:
        return ""


def _connect(group: Any, rings: bool = False) -> LocalChannels | None:
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank()
    token: list[Any] = [secrets.token_hex(8)]
    dist.broadcast_object_list(token, group_src=0, group=group)
    address = f"\0slipstream-pipeline-{token[0]}-{{}}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(address.format(me))  # abstract (leading NUL): nothing left on disk
        listener.listen(len(ranks))
        listener.settimeout(60.0)  # a peer that failed to connect must not leave us waiting
        listening = True
    except OSError:
        listening = False
    everyone: list[Any] = [None] * len(ranks)
    dist.all_gather_object(everyone, listening, group=group)
    sockets: dict[int, socket.socket] = {}
    try:
        if not all(everyone):
            raise OSError("a process of the pipeline could not listen")
        for peer in ranks:
            if peer < me:  # the higher rank connects and says who it is
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(60.0)
                sock.connect(address.format(peer))
                sock.settimeout(None)
                sock.sendall(_HEADER.pack(me))
                sockets[peer] = sock
        for _ in range(sum(peer > me for peer in ranks)):
            sock, _address = listener.accept()
            sock.settimeout(None)
            header = bytearray(_HEADER.size)
            _read_exactly(sock, memoryview(header))
            sockets[_HEADER.unpack(header)[0]] = sock
        connected = True
    except OSError:
        connected = False
    finally:
        listener.close()
    shared: dict[int, tuple[SharedRing, SharedRing]] = {}
    if connected and rings:
        # Made everywhere first: where some process cannot, every process keeps the
        # sockets alone, whose streams are still clean.
        made = shared_ring.make_inboxes(list(sockets))
        everyone = [None] * len(ranks)
        dist.all_gather_object(everyone, made is not None, group=group)
        if made is not None and not all(everyone):
            shared_ring.close_inboxes(made)
        elif made is not None:
            try:
                shared = shared_ring.exchange_rings(sockets, made)
            except (OSError, ValueError):  # handed over part way: the streams would not
                connected = False  # line up, so gloo stays
    everyone = [None] * len(ranks)
    dist.all_gather_object(everyone, connected, group=group)
    if not all(everyone):
        for sock in sockets.values():
            sock.close()
        return None
    channels = {}
    for peer, sock in sockets.items():
        inbox, outbox = shared.get(peer, (None, None))
        channels[peer] = _Channel(sock, peer, inbox, outbox)
    return LocalChannels(channels)
