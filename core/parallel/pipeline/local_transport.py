"""Transfers between pipeline stages on one machine over Unix sockets, instead of gloo's.

Over gloo a transfer is a rendezvous run by each process's I/O thread: posting a receive
sends an announcement to the peer, the data goes out once the announcement is known, and
the receiver's I/O thread reads it before waking the computing thread. With as many
processes as cores (the CPU case), each of those wake-ups takes a core from a computation
and each hand-over waits for one. Here the two processes of a pair share one Unix stream
socket: a send writes the tensor's bytes from the computing thread without blocking (what
the socket cannot take at once goes to a writer thread of that socket, behind which that
peer's later sends queue), and a wait reads them, in the computing thread, straight into the receive
buffer. A pair's messages arrive in the order they were sent, as gloo matches them; each
carries its length, so a mismatch fails loudly rather than filling a buffer with another
message. The bytes are the tensor's own: results are bitwise those over gloo.

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
import ctypes
import os
import queue
import secrets
import socket
import struct
import sys
import threading
import weakref
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

_HEADER = struct.Struct("<q")
_CLOSED = "the peer pipeline stage closed its connection (its process ended)"

#: Channels per pipeline group (and the process that connected them: a forked child has
#: none): connected once, used by every schedule built on the group since; dropped, and
#: their sockets closed, with the group.
_CONNECTED: weakref.WeakKeyDictionary[Any, tuple[int, LocalChannels | None]] = (
    weakref.WeakKeyDictionary()
)


def _byte_view(tensor: torch.Tensor) -> memoryview:
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(
            "local pipeline transfers take contiguous CPU tensors; got one on "
            f"{tensor.device} (contiguous: {tensor.is_contiguous()})"
        )
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())  # (writable: a receive reads into it)
    # A view of the tensor's memory (the caller keeps the tensor alive while it is used).
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def _read_exactly(sock: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        count = sock.recv_into(view)
        if count == 0:
            raise ConnectionError(_CLOSED)
        view = view[count:]


class _Receive:
    """A posted receive: read (with every earlier one from the same peer) when waited on."""

    __slots__ = ("channel", "done", "tensor")

    def __init__(self, channel: _Channel, tensor: torch.Tensor) -> None:
        self.channel, self.tensor, self.done = channel, tensor, False

    def read(self) -> None:
        sock, header, view = self.channel.sock, bytearray(_HEADER.size), _byte_view(self.tensor)
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
    """The part of a send the socket could not take at once, written by the channel's
    writer thread."""

    __slots__ = ("future",)

    def __init__(self, future: Future[None]) -> None:
        self.future = future

    def wait(self, timeout: Any = None) -> bool:
        self.future.result()
        return True


class _Channel:
    """One socket to one peer."""

    def __init__(self, sock: socket.socket, peer: int) -> None:
        self.sock, self.peer = sock, peer
        # One writer thread per socket (made when first needed): a write blocked until this
        # peer reads never holds back a send to another peer, so no chain of processes
        # waiting on each other's reads can close into a cycle.
        self.writer: _Writer | None = None
        self.pending: collections.deque[_Receive] = collections.deque()
        self.reading = threading.Lock()
        self.backlog: Future[None] | None = None

    def send(self, tensor: torch.Tensor) -> _Backlog | None:
        data = _byte_view(tensor)
        parts = [memoryview(_HEADER.pack(data.nbytes)), data]
        if self.backlog is None or self.backlog.done():
            if self.backlog is not None:
                self.backlog.result()  # raise what the writer thread met
            parts = _send_without_blocking(self.sock, parts)
            if not parts:
                return None
        if self.writer is None:
            self.writer = _Writer(self.sock, self.peer)
        # Queued behind this peer's earlier backlog (the writer runs in order).
        self.backlog = self.writer.submit(parts, tensor)
        return _Backlog(self.backlog)

    def read_until(self, receive: _Receive) -> None:
        with self.reading:
            while not receive.done:
                # Taken off the queue once read: a read that fails part way leaves it there,
                # so the next step sees that the stream no longer lines up.
                self.pending[0].read()
                self.pending.popleft()


class _Writer:
    """A daemon thread writing one socket's backlogs in order (a daemon: a process ending
    while its peer no longer reads must not wait for it at exit)."""

    def __init__(self, sock: socket.socket, peer: int) -> None:
        self.sock = sock
        self.queue: queue.SimpleQueue[tuple[Future[None], list[memoryview], torch.Tensor]] = (
            queue.SimpleQueue()
        )
        threading.Thread(target=self._run, name=f"slipstream-pp-to-{peer}", daemon=True).start()

    def submit(self, parts: list[memoryview], tensor: torch.Tensor) -> Future[None]:
        """Write ``parts`` (views of ``tensor``, held until they are written)."""
        future: Future[None] = Future()
        self.queue.put((future, parts, tensor))
        return future

    def _run(self) -> None:
        while True:
            future, parts, _tensor = self.queue.get()
            try:
                for part in parts:
                    self.sock.sendall(part)
            except BaseException as error:  # handed to whoever waits on the send
                future.set_exception(error)
            else:
                future.set_result(None)


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
        channel = self.channels[peer]
        receive = _Receive(channel, tensor)
        channel.pending.append(receive)
        return receive

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
    dist.all_gather_object(everyone, here, group=group)
    if not all(entry[2] for entry in everyone) or len({entry[:2] for entry in everyone}) != 1:
        return None
    pid, channels = _CONNECTED.get(group, (None, None))
    if pid != os.getpid():
        channels = _connect(group)
        _CONNECTED[group] = (os.getpid(), channels)
    return channels


def _namespace() -> str:
    """This process's network namespace (abstract Unix addresses are per namespace)."""
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError:
        return ""


def _connect(group: Any) -> LocalChannels | None:
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
    everyone = [None] * len(ranks)
    dist.all_gather_object(everyone, connected, group=group)
    if not all(everyone):
        for sock in sockets.values():
            sock.close()
        return None
    return LocalChannels({peer: _Channel(sock, peer) for peer, sock in sockets.items()})
