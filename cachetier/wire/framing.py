"""Length-prefixed msgpack frames over asyncio streams, and the URLs that name a stream.

A frame is a 4-byte big-endian body length followed by that many bytes of msgpack. The length is
checked before the body is read, so a peer can never make us buffer more than the read bound's
bytes (`FrameBound`: `max_frame` unless the owner sets a tighter one). A bad length leaves the
stream out of step, so the reader gives up on the connection (`BrokenStream`); a well-framed body
that is not msgpack, or holds more objects than the bound, only costs that one frame (`BadFrame`).
A body over `INLINE_BYTES` is read and decoded a chunk at a time (`chunked`), the event loop free
between chunks, so a large frame never holds up the other connections for long.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import stat
import struct
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Literal
from urllib.parse import parse_qs, quote, urlsplit

import msgpack

from cachetier.errors import BadFrame, BrokenStream, PeerClosed, TooLarge
from cachetier.wire.chunked import ChunkedDecoder

HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME = 64 * 2**20
# A body this small is decoded in one go: whatever it holds costs little (16 Ki empty maps, the
# worst, decode in ~2 ms into ~1 MB); larger ones a chunk at a time, awaiting between chunks.
INLINE_BYTES = 16 << 10
CHUNK_BYTES = 64 << 10  # asyncio's stream reader limit (it pauses the socket at twice this)


@dataclass(frozen=True)
class FrameBound:
    """The most one frame read may hold: `max_bytes` of body (checked on its header, before a
    byte of the body is read) and, for a body over `INLINE_BYTES`, `max_objects` msgpack objects
    (maps, arrays and scalars, keys included; counted before any is built; None: not counted)."""

    max_bytes: int
    max_objects: int | None = None


def encode_frame(message: Any, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    if len(body) > max_frame:
        raise TooLarge(f"a {len(body)}-byte frame exceeds the {max_frame}-byte limit")
    return HEADER.pack(len(body)) + body


def decode_body(body: bytes) -> Any:
    try:
        return msgpack.unpackb(body, raw=False)
    # Truncated data, trailing bytes, bad UTF-8, unhashable or non-string keys, nesting too deep:
    # msgpack reports each differently; to a server they all mean this frame is not a message.
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise BadFrame(f"frame body is not valid msgpack: {exc}") from None


class FramedStream:
    """A connection that reads and writes whole frames: sends are bounded by `max_frame`, reads
    by `bound` (None: `max_frame` bytes, objects not counted)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 max_frame: int = DEFAULT_MAX_FRAME, bound: FrameBound | None = None) -> None:
        self.reader = reader
        self.writer = writer
        self.max_frame = max_frame
        self.bound = bound

    @property
    def read_bound(self) -> FrameBound:
        return self.bound or FrameBound(self.max_frame)

    async def read(self) -> Any:
        """The next frame's decoded body; `PeerClosed` when the peer closed between frames."""
        try:
            header = await self.reader.readexactly(HEADER.size)
        except asyncio.IncompleteReadError as exc:
            if not exc.partial:
                raise PeerClosed("the peer closed the connection") from None
            raise BrokenStream("connection closed inside a frame header") from None
        (size,) = HEADER.unpack(header)
        bound = self.read_bound
        if not 0 < size <= bound.max_bytes:
            raise BrokenStream(f"frame length {size} outside 1..{bound.max_bytes}")
        if size <= INLINE_BYTES:
            return decode_body(await self._exactly(size, size))
        return await self._read_chunked(size, bound.max_objects)

    async def _read_chunked(self, size: int, max_objects: int | None) -> Any:
        """A large body, a chunk at a time (see the module docstring): each chunk is counted and
        decoded as it arrives, then the loop serves the others before the next one."""
        decoder = ChunkedDecoder(size, max_objects)
        left = size
        while left:
            chunk = await self._exactly(min(CHUNK_BYTES, left), size)
            decoder.feed(chunk)
            left -= len(chunk)
            await asyncio.sleep(0)  # the chunk may have been buffered already: yield anyway
        return decoder.value()

    async def _exactly(self, n: int, size: int) -> bytes:
        try:
            return await self.reader.readexactly(n)
        except asyncio.IncompleteReadError:
            raise BrokenStream(f"connection closed inside a {size}-byte frame") from None

    async def send(self, message: Any) -> None:
        """Write one frame; a message over the limit raises `TooLarge` and writes nothing."""
        self.writer.write(encode_frame(message, self.max_frame))
        await self.writer.drain()

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@dataclass(frozen=True)
class Endpoint:
    """`tcp://HOST:PORT`, `unix:///absolute/path`, or TCP with TLS:
    `tls://HOST:PORT?ca=PATH` to connect (the server verified against the CA in PATH; without
    it, against the system's), `tls://HOST:PORT?cert=PATH&key=PATH[&ca=PATH]` to listen. The URL
    of a listening endpoint keeps only `ca`: it is what its clients connect with."""

    scheme: Literal["tcp", "unix", "tls"]
    host: str = ""
    port: int = 0
    path: str = ""
    ca: str = ""
    cert: str = ""
    key: str = ""

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        parts = urlsplit(url)
        if parts.scheme == "unix" and parts.path.startswith("/") and not parts.netloc:
            return cls("unix", path=parts.path)
        if parts.scheme == "tcp" and parts.hostname and parts.port is not None:
            return cls("tcp", host=parts.hostname, port=parts.port)
        if parts.scheme == "tls" and parts.hostname and parts.port is not None:
            query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
            if set(query) - {"ca", "cert", "key"} or ("cert" in query) != ("key" in query):
                raise ValueError(f"bad endpoint {url!r}: tls takes ?ca=PATH, or cert and key")
            return cls("tls", host=parts.hostname, port=parts.port, **query)
        raise ValueError(f"bad endpoint {url!r}: expected tcp://HOST:PORT, tls://HOST:PORT or "
                         "unix:///PATH")

    @property
    def url(self) -> str:
        if self.scheme == "unix":
            return f"unix://{self.path}"
        ca = f"?ca={quote(self.ca)}" if self.ca else ""
        return f"{self.scheme}://{self.host}:{self.port}{ca}"

    async def connect(self, max_frame: int = DEFAULT_MAX_FRAME) -> FramedStream:
        if self.scheme == "unix":
            reader, writer = await asyncio.open_unix_connection(self.path)
        elif self.scheme == "tls":
            context = ssl.create_default_context(cafile=self.ca or None)
            reader, writer = await asyncio.open_connection(self.host, self.port, ssl=context)
        else:
            reader, writer = await asyncio.open_connection(self.host, self.port)
        return FramedStream(reader, writer, max_frame)

    async def listen(self, handler: Handler) -> tuple[asyncio.Server, Endpoint]:
        """Start serving; returns the server and the bound endpoint (port 0 made real)."""
        if self.scheme == "unix":
            _remove_stale_socket(self.path)
            return await asyncio.start_unix_server(handler, self.path), self
        context = None
        if self.scheme == "tls":
            if not self.cert:
                raise ValueError("listening with tls needs ?cert=PATH&key=PATH")
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(self.cert, self.key)
        server = await asyncio.start_server(handler, self.host, self.port, ssl=context)
        port = server.sockets[0].getsockname()[1]
        return server, Endpoint(self.scheme, host=self.host, port=port, ca=self.ca)


def _remove_stale_socket(path: str) -> None:
    """A socket file left by a killed server would make bind fail; anything else is not ours."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)
