"""Request/reply on a framed connection, from both ends.

- `exchange`: one request and its reply, read in line: only for handshakes, before anything else
  can be in flight on the connection.
- `Channel`: the requesting end, many requests in flight, replies matched by id. One reader task
  owns every read, so a caller that is cancelled or times out only abandons its id (a late reply is
  dropped): no caller can leave a half-read frame for the next one (STYLE 6 in its multiplexed
  form). Anything wrong with the stream itself fails every pending request and closes the channel
  for good; its owner opens a new connection.
- `serve_requests`: the answering end. Each request runs in its own task, so a slow step does not
  hold up a `stats`; a frame that is not a message costs an error frame, a broken stream ends the
  connection.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, Awaitable, Callable, Mapping

from cachetier.errors import (BadFrame, BrokenStream, CacheTierError, ConnectionLost, ErrorInfo,
                              IdleTimeout, PeerClosed, RemoteError, RequestTimeout, TooLarge)
from cachetier.wire.framing import FramedStream
from cachetier.wire.protocol import (Reply, error_frame, ok_frame, parse_reply, parse_request,
                                     request_frame, request_id, result_of)

Describe = Callable[[BaseException], ErrorInfo]
_STREAM_ERRORS = (OSError, CacheTierError)


async def exchange(stream: FramedStream, rid: int, message: Any) -> Any:
    """Send one request and read its reply in line; the typed result or the peer's error."""
    await stream.send(request_frame(rid, message))
    return result_of(message, parse_reply(await stream.read()))


class Channel:
    """The requesting end of a connection; see the module docstring."""

    def __init__(self, stream: FramedStream, name: str = "") -> None:
        self.stream = stream
        self.name = name
        self._pending: dict[int, asyncio.Future[Reply]] = {}
        self._ids = itertools.count(1)
        self._failure: CacheTierError | None = None
        self._reader = asyncio.create_task(self._read_replies(), name=f"channel {name}")

    @property
    def is_open(self) -> bool:
        return self._failure is None

    async def request(self, message: Any, *, timeout: float | None = None) -> Any:
        """The typed result of `message`; `RemoteError`, `ConnectionLost` or `RequestTimeout`."""
        if self._failure is not None:
            raise self._failure
        rid = next(self._ids)
        waiter: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._pending[rid] = waiter
        try:
            async with asyncio.timeout(timeout):
                await self._send(request_frame(rid, message))
                reply = await waiter
        except TimeoutError:
            raise RequestTimeout(f"{message.op}: no reply within {timeout:g} s") from None
        finally:
            self._pending.pop(rid, None)
            if waiter.done() and not waiter.cancelled():
                waiter.exception()  # failed by `_fail` while we were not awaiting it: retrieved
        return result_of(message, reply)

    async def wait_closed(self) -> None:
        await asyncio.shield(self._reader)

    async def close(self) -> None:
        """Fail what is pending and close the connection (idempotent)."""
        self._reader.cancel()
        await asyncio.wait({self._reader})

    async def _send(self, frame: dict[str, Any]) -> None:
        try:
            await self.stream.send(frame)
        except OSError as exc:
            self._fail(ConnectionLost(f"{self.name}: send failed: {exc}"))
            raise self._failure from None  # type: ignore[misc]

    async def _read_replies(self) -> None:
        try:
            while True:
                self._route(parse_reply(await self.stream.read()))
        except asyncio.CancelledError:  # `close()`: the reader's normal end, not an interruption
            self._fail(ConnectionLost(f"{self.name}: channel closed"))
        except RemoteError as exc:
            self._fail(exc)
        except _STREAM_ERRORS as exc:
            self._fail(ConnectionLost(f"{self.name}: {exc}"))
        finally:
            await self.stream.close()

    def _route(self, reply: Reply) -> None:
        if reply.id is None:  # an error about the connection itself, not about one request
            raise RemoteError(reply.error or ErrorInfo("internal", "reply without an id", False))
        waiter = self._pending.get(reply.id)
        if waiter is not None and not waiter.done():
            waiter.set_result(reply)  # no waiter: its caller gave up (cancelled or timed out)

    def _fail(self, failure: CacheTierError) -> None:
        if self._failure is None:
            self._failure = failure
        for waiter in self._pending.values():
            if not waiter.done():
                waiter.set_exception(self._failure)


Handle = Callable[[Any], Awaitable[Any]]
_OVER = object()  # `_next_frame`: the connection is over (a frame may decode to None)


async def serve_requests(stream: FramedStream, ops: Mapping[str, type], handle: Handle,
                         describe: Describe, *, limit: int = 64,
                         idle_s: float | None = None) -> None:
    """Answer requests until the peer leaves or breaks the stream; returns once every request
    already read has been answered (or its answer could not be delivered).

    At most `limit` requests are in flight, and no frame is read while the replies already
    written wait in the transport's buffer past its high-water mark: a peer that does not read
    its replies stops being read, so it holds a bounded amount of the service's memory and time.
    A connection with no request in flight that sends no whole frame for `idle_s` is told so and
    closed (a frame begun and never finished counts as nothing sent)."""
    slots = asyncio.Semaphore(limit)  # bounds the memory one connection can hold
    tasks: set[asyncio.Task[None]] = set()
    idle = _IdleDeadline(idle_s, tasks)
    try:
        while True:
            await slots.acquire()
            await stream.writer.drain()  # backpressure: the peer reads its replies first
            frame = await idle.bounded(_next_frame(stream, describe))
            if frame is _OVER:
                break
            task = asyncio.create_task(_answer(stream, frame, ops, handle, describe))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            task.add_done_callback(lambda _: slots.release())
            task.add_done_callback(lambda _: idle.maybe_idle())
    except TimeoutError:
        await send_error(stream, None, IdleTimeout(f"no request for {idle_s:g} s: closing"),
                         describe)
    except asyncio.CancelledError:
        for task in tasks:
            task.cancel()
        raise
    finally:
        await asyncio.gather(*tasks, return_exceptions=True)


class _IdleDeadline:
    """The deadline of the frame being read: `idle_s` from when the last request in flight was
    answered (or from the read's start, with none in flight); none while a request is in flight."""

    def __init__(self, idle_s: float | None, tasks: set[asyncio.Task[None]]) -> None:
        self.idle_s = idle_s
        self.tasks = tasks
        self._timeout: asyncio.Timeout | None = None

    async def bounded(self, read: Awaitable[Any]) -> Any:
        if self.idle_s is None:
            return await read
        async with asyncio.timeout(None) as self._timeout:
            self.maybe_idle()
            try:
                return await read
            finally:
                self._timeout = None

    def maybe_idle(self) -> None:
        if self._timeout is not None and self.idle_s is not None and not self.tasks:
            self._timeout.reschedule(asyncio.get_running_loop().time() + self.idle_s)


async def _next_frame(stream: FramedStream, describe: Describe) -> Any:
    """The next frame that may be a request; `_OVER` when the connection is over. A frame that
    is not msgpack is answered here; a broken stream is answered and ends the connection."""
    while True:
        try:
            return await stream.read()
        except PeerClosed:
            return _OVER
        except BadFrame as exc:
            await send_error(stream, None, exc, describe)
        except BrokenStream as exc:
            await send_error(stream, None, exc, describe)
            return _OVER


async def _answer(stream: FramedStream, frame: Any, ops: Mapping[str, type], handle: Handle,
                  describe: Describe) -> None:
    rid = request_id(frame)
    try:
        result = await handle(parse_request(frame, ops))
    except Exception as exc:
        await send_error(stream, rid, exc, describe)
        return
    try:
        await stream.send(ok_frame(rid, result))
    except TooLarge as exc:
        await send_error(stream, rid, exc, describe)
    except OSError:
        pass  # the peer left; there is no one to answer


async def send_error(stream: FramedStream, rid: int | None, exc: BaseException,
                     describe: Describe) -> None:
    try:
        await stream.send(error_frame(rid, describe(exc)))
    except OSError:
        pass
