"""Bulk bytes on raw non-blocking sockets driven by the event loop, without copies.

asyncio's streams copy twice: a `StreamReader` buffers what it receives before handing it over,
and in Python 3.11 a transport copies whatever one `send` could not take into its own buffer.
Page data must go from the source pool's memory to the destination pool's memory with the kernel's
copies only, so the data path reads with `sock_recv_into` straight into a memoryview of the
destination and writes many (header, payload) pairs with one scatter-gather `sendmsg` from the
source's own memory. Control frames on the same socket use the project's framing (`framing`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import os
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from cachetier.errors import BrokenStream, PeerClosed
from cachetier.wire.framing import HEADER, Endpoint, decode_body, encode_frame

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024

SocketHandler = Callable[[socket.socket], Awaitable[None]]


async def connect(endpoint: Endpoint) -> socket.socket:
    loop = asyncio.get_running_loop()
    if endpoint.scheme == "unix":
        sock, address = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), endpoint.path
    else:
        info = await loop.getaddrinfo(endpoint.host, endpoint.port, type=socket.SOCK_STREAM)
        family, _, _, _, address = info[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, address)
    except BaseException:
        sock.close()
        raise
    _tune(sock)
    return sock


def _tune(sock: socket.socket) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` exactly; `PeerClosed` if the peer closed before its first byte, `BrokenStream`
    if it closed after."""
    loop = asyncio.get_running_loop()
    total = len(view)
    while view:
        n = await loop.sock_recv_into(sock, view)
        if n == 0:
            if len(view) == total:
                raise PeerClosed("the peer closed the connection")
            raise BrokenStream(f"connection closed {total - len(view)} bytes into {total}")
        view = view[n:]


async def send_buffers(sock: socket.socket, buffers: Sequence[memoryview | bytes]) -> None:
    """Send every buffer in order with as few `sendmsg` calls as the socket allows; the buffers
    are read in place, never joined."""
    pending = collections.deque(memoryview(b).cast("B") for b in buffers if len(b))
    while pending:
        batch = list(itertools.islice(pending, IOV_MAX))
        try:
            sent = sock.sendmsg(batch)
        except (BlockingIOError, InterruptedError):
            sent = 0
        full = sent == sum(len(b) for b in batch)
        while sent:
            head = pending[0]
            if len(head) <= sent:
                sent -= len(head)
                pending.popleft()
            else:
                pending[0], sent = head[sent:], 0
        if pending and not full:
            await _writable(sock)


async def _writable(sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    fd = sock.fileno()
    loop.add_writer(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_writer(fd)


async def read_frame(sock: socket.socket, max_frame: int) -> Any:
    """One `framing` frame read from a raw socket, with the same length check before the body."""
    header = bytearray(HEADER.size)
    await recv_into(sock, memoryview(header))
    (size,) = HEADER.unpack(header)
    if not 0 < size <= max_frame:
        raise BrokenStream(f"frame length {size} outside 1..{max_frame}")
    body = bytearray(size)
    try:
        await recv_into(sock, memoryview(body))
    except PeerClosed:
        raise BrokenStream(f"connection closed inside a {size}-byte frame") from None
    return decode_body(bytes(body))


async def send_frame(sock: socket.socket, message: Any, max_frame: int) -> None:
    await send_buffers(sock, [encode_frame(message, max_frame)])


class SocketServer:
    """Accepts connections on a raw listening socket and runs `handler` on each, closing the
    socket when the handler returns; `close()` stops accepting and cancels the handlers."""

    def __init__(self, handler: SocketHandler) -> None:
        self.handler = handler
        self.url = ""
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, listen: str) -> str:
        endpoint = Endpoint.parse(listen)
        if endpoint.scheme == "unix":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(endpoint.path)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(endpoint.path)
        else:
            listener = socket.create_server((endpoint.host, endpoint.port))
            endpoint = Endpoint("tcp", host=endpoint.host, port=listener.getsockname()[1])
        listener.listen(128)
        listener.setblocking(False)
        self._listener = listener
        self.url = endpoint.url
        self._tasks.add(asyncio.create_task(self._accept(listener)))
        return self.url

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(listener)
            conn.setblocking(False)
            _tune(conn)
            task = asyncio.create_task(self._serve(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, conn: socket.socket) -> None:
        try:
            await self.handler(conn)
        except (OSError, PeerClosed, BrokenStream):
            pass  # the peer left or broke the stream: nobody to answer
        finally:
            conn.close()
