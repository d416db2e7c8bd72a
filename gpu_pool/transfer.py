"""Agent-to-agent page transfer over TCP: a source rank serves its pages, a destination rank pulls.

One connection carries any number of requests, one after the other:

- puller -> source: one `framing` frame, `StreamRequest` {token, streams}: the (page, layer slot,
  byte run) streams of `gpu_pool.streams.plan_fetch`, as rows
  `[src_page, slot, src_offset, nbytes, dst_page, dst_offset]`;
- source -> puller: a reply frame (`StreamsAccepted`, or an error frame), then for each stream in
  order a fixed `STREAM_HEADER` (destination page, layer slot, byte offset in the slot, nbytes)
  followed by its payload, sent from the source pool's memory (`sockio.send_buffers`).

The source checks the whole request against its own layout before its first byte, so a refusal is
one error frame and the connection stays usable. The puller checks every header against its
destination layout and against the stream it asked for at that position before it reads the
payload, straight into the destination page (`sockio.recv_into`): a peer out of step or sending
what was not asked for gets `BadStreamHeader`, and no byte outside the planned ranges is written.

A transfer counts only once its last byte has arrived: a source that goes away before makes
`fetch` raise `TransferFailed` (retryable). The pages it partly wrote are private pages of the
destination pool, which the service releases without confirming them (invariant 2), so partial
data is never matched. On CUDA the bytes pass through a pinned host buffer on both sides; the
destination copies it to the device only after the last byte.
"""

from __future__ import annotations

import asyncio
import hmac
import struct
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass
from typing import Any, ClassVar

import torch

from cachetier.errors import (AgentUnavailable, BrokenStream, ConnectionLost, TransferFailed,
                              Unauthorized, error_info)
from cachetier.wire.framing import DEFAULT_MAX_FRAME, Endpoint, encode_frame
from cachetier.wire.protocol import (error_frame, ok_frame, op_table, parse_reply, parse_request,
                                     request_frame, request_id, result_of)
from cachetier.wire.sockio import (SocketServer, connect, read_frame, recv_into, send_buffers,
                                   send_frame)
from gpu_pool.layout import ByteRange, PageLayout
from gpu_pool.pool import PagedPool
from gpu_pool.streams import PageMove, Stream, plan_fetch

STREAM_HEADER = struct.Struct(">IIQQ")  # destination page, layer slot, offset in the slot, nbytes
# `sock_recv_into` returns without suspending while data is waiting, so a long transfer would hold
# the event loop (the agent's service connections included) until its last byte: yield this often.
YIELD_BYTES = 4 * 2**20

StreamRow = tuple[int, int, int, int, int, int]


@dataclass(frozen=True)
class StreamsAccepted:
    streams: int
    nbytes: int


@dataclass(frozen=True)
class StreamRequest:
    op: ClassVar[str] = "streams"
    reply: ClassVar[Any] = StreamsAccepted
    token: str
    streams: list[StreamRow]


STREAM_OPS = op_table(StreamRequest)


class BadStreamHeader(BrokenStream):
    """The source sent a stream header that is not the next stream asked for."""


class PageServer:
    """Serves one rank's pages to the agents that pull them. `pool` and `token` are read at each
    request, so the server can listen before the agent has built its pool and learnt the token
    peers present (from its registration: requests then get a retryable refusal)."""

    def __init__(self, pool: Callable[[], PagedPool | None], token: Callable[[], str],
                 max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self._pool = pool
        self._token = token
        self._max_frame = max_frame
        self._server = SocketServer(self._serve)

    @property
    def url(self) -> str:
        return self._server.url

    async def start(self, listen: str = "tcp://127.0.0.1:0") -> str:
        """Listen; returns the URL peers pull from (port 0 made real)."""
        return await self._server.start(listen)

    async def close(self) -> None:
        await self._server.close()

    async def _serve(self, conn: Any) -> None:
        while True:
            frame = await read_frame(conn, self._max_frame)
            rid = request_id(frame)
            try:
                request: StreamRequest = parse_request(frame, STREAM_OPS)
                views = self._source_views(request)
            except Exception as exc:
                await send_frame(conn, error_frame(rid, error_info(exc)), self._max_frame)
                continue
            total = sum(row[3] for row in request.streams)
            accepted = StreamsAccepted(len(request.streams), total)
            buffers: list[memoryview | bytes] = [encode_frame(ok_frame(rid, accepted))]
            for (_, slot, _, nbytes, dst_page, dst_offset), view in zip(request.streams, views):
                buffers += [STREAM_HEADER.pack(dst_page, slot, dst_offset, nbytes), view]
            await send_buffers(conn, buffers)

    def _source_views(self, request: StreamRequest) -> list[memoryview]:
        """Every stream checked against this rank's layout before the first byte is sent."""
        token = self._token()
        if token and not hmac.compare_digest(request.token.encode(), token.encode()):
            raise Unauthorized("bad token")
        pool = self._pool()
        if pool is None or not token:
            raise AgentUnavailable("this agent has no pool yet (not registered)")
        ranges = [Stream(*row).src_range(pool.layout) for row in request.streams]
        return _host_source(pool.buffer, ranges)


async def fetch(url: str, token: str, streams: Sequence[Stream], dst: PagedPool, *,
                max_frame: int = DEFAULT_MAX_FRAME) -> int:
    """Pull `streams` from the page server at `url` into `dst`; returns the bytes received.

    `TransferFailed` if the source cannot be reached or goes away before the last byte,
    `BadStreamHeader` if it sends what was not asked for, `RemoteError` if it refuses."""
    landing = _Landing(dst.buffer, [s.dst_range(dst.layout) for s in streams])
    total = sum(s.nbytes for s in streams)
    try:
        sock = await connect(Endpoint.parse(url))
    except OSError as exc:
        raise TransferFailed(f"cannot reach source {url}: {exc}") from None
    received = 0
    try:
        request = StreamRequest(token, [astuple(s) for s in streams])
        await send_frame(sock, request_frame(1, request), max_frame)
        accepted = result_of(request, parse_reply(await read_frame(sock, max_frame)))
        if (accepted.streams, accepted.nbytes) != (len(streams), total):
            raise BadStreamHeader(f"source {url} accepted {accepted}, not the {len(streams)} "
                                  f"streams of {total} bytes asked for")
        header = bytearray(STREAM_HEADER.size)
        unyielded = 0
        for index, (stream, view) in enumerate(zip(streams, landing.views)):
            await recv_into(sock, memoryview(header))
            check_header(dst.layout, STREAM_HEADER.unpack(header), stream, index)
            await recv_into(sock, view)
            received += stream.nbytes
            unyielded += stream.nbytes
            if unyielded >= YIELD_BYTES:
                unyielded = 0
                await asyncio.sleep(0)
    except BadStreamHeader:
        raise
    except (OSError, ConnectionLost, BrokenStream) as exc:
        raise TransferFailed(f"source {url} went away after {received} of {total} bytes: "
                             f"{exc}") from None
    finally:
        sock.close()
    landing.finish()
    return received


async def pull(dst: PagedPool, dst_rank: int, src: PageLayout, sources: Sequence[str],
               moves: Sequence[PageMove], token: str, *, max_frame: int = DEFAULT_MAX_FRAME) -> int:
    """Receive `moves` into this rank's pool from every source rank that holds a part of them
    (`sources[r]` is source rank r's page server), all at once; returns the bytes received.
    The first failure cancels the other pulls and is raised."""
    if len(sources) != src.model.tp_degree:
        raise ValueError(f"{len(sources)} source URLs for a source pool of tp_degree "
                         f"{src.model.tp_degree}")
    plan = plan_fetch(src, dst.layout, dst_rank, moves)
    tasks = [asyncio.create_task(fetch(sources[rank], token, streams, dst, max_frame=max_frame))
             for rank, streams in plan.items()]
    try:
        return sum(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def check_header(layout: PageLayout, header: tuple[int, int, int, int], expected: Stream,
                 index: int) -> None:
    """A header must lie inside the destination layout and be the stream asked for at `index`."""
    page, slot, offset, nbytes = header
    try:
        layout.buffer_range(page, slot, ByteRange(offset, nbytes))
    except ValueError as exc:
        raise BadStreamHeader(f"stream {index}: header (page {page}, slot {slot}, offset "
                              f"{offset}, {nbytes} bytes) outside the destination layout: "
                              f"{exc}") from None
    wanted = (expected.dst_page, expected.slot, expected.dst_offset, expected.nbytes)
    if header != wanted:
        raise BadStreamHeader(f"stream {index}: header {header} is not the stream asked for "
                              f"{wanted}")


def _host_source(buffer: torch.Tensor, ranges: list[ByteRange]) -> list[memoryview]:
    """Host memory holding each range: the pool's own on CPU, a pinned gather of it on CUDA."""
    flat = buffer.view(-1)
    if not flat.is_cuda:
        host = memoryview(flat.numpy())
        return [host[r.offset:r.end] for r in ranges]
    staging = torch.empty(sum(r.size for r in ranges), dtype=torch.uint8, pin_memory=True)
    at = 0
    for r in ranges:
        staging[at:at + r.size].copy_(flat[r.offset:r.end], non_blocking=True)
        at += r.size
    torch.cuda.current_stream(flat.device).synchronize()
    return _split(memoryview(staging.numpy()), ranges)


class _Landing:
    """Where received payloads go: the pool's own memory on CPU; on CUDA a pinned host buffer
    copied to the device by `finish`, so the device never holds a partial transfer."""

    def __init__(self, buffer: torch.Tensor, ranges: list[ByteRange]) -> None:
        self._flat = buffer.view(-1)
        self._ranges = ranges
        if self._flat.is_cuda:
            self._staging = torch.empty(sum(r.size for r in ranges), dtype=torch.uint8,
                                        pin_memory=True)
            self.views = _split(memoryview(self._staging.numpy()), ranges)
        else:
            host = memoryview(self._flat.numpy())
            self.views = [host[r.offset:r.end] for r in ranges]

    def finish(self) -> None:
        if not self._flat.is_cuda:
            return
        at = 0
        for r in self._ranges:
            self._flat[r.offset:r.end].copy_(self._staging[at:at + r.size], non_blocking=True)
            at += r.size
        torch.cuda.current_stream(self._flat.device).synchronize()


def _split(host: memoryview, ranges: list[ByteRange]) -> list[memoryview]:
    views, at = [], 0
    for r in ranges:
        views.append(host[at:at + r.size])
        at += r.size
    return views
