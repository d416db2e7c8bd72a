"""Decoding one large frame body a chunk at a time, its msgpack objects counted before any is built.

Decoding a whole body in one call holds the event loop for as long as it takes, and what it
builds is up to ~70 times the body's size: 8 MiB of empty arrays took 3 s and 590 MB. So a large
body is fed as it arrives (`ChunkedDecoder.feed`, one chunk between two awaits of the reader):
`ObjectCounter` first walks the chunk's msgpack headers (no object is built; a string's or a
binary's bytes are skipped, not looked at) and refuses a body with more objects than its bound,
then msgpack's streaming `Unpacker` decodes the chunk, carrying its partial state to the next.
What a frame costs is then bounded by its objects and its bytes, and is paid a chunk at a time.
"""

from __future__ import annotations

import enum
from typing import Any

import msgpack

from cachetier.errors import BadFrame


class _Kind(enum.Enum):
    SCALAR = 0  # followed by a payload of `size` bytes (a string's, a number's, ...)
    ARRAY = 1  # followed by `size` objects
    MAP = 2  # followed by 2 x `size` objects
    INVALID = 3  # 0xc1, which msgpack never uses


def _headers() -> list[tuple[_Kind, int, int]]:
    """Per first byte: its kind, the width of the length field after it (0: none), and the size
    it implies (added to that length: an ext's type byte)."""
    table = [(_Kind.INVALID, 0, 0)] * 256
    for first in (*range(0x00, 0x80), *range(0xe0, 0x100), 0xc0, 0xc2, 0xc3):
        table[first] = (_Kind.SCALAR, 0, 0)  # fixints, nil, false, true
    for first in range(0x80, 0x90):
        table[first] = (_Kind.MAP, 0, first & 0x0f)
    for first in range(0x90, 0xa0):
        table[first] = (_Kind.ARRAY, 0, first & 0x0f)
    for first in range(0xa0, 0xc0):
        table[first] = (_Kind.SCALAR, 0, first & 0x1f)  # fixstr
    fixed = {0xca: 4, 0xcb: 8, 0xcc: 1, 0xcd: 2, 0xce: 4, 0xcf: 8, 0xd0: 1, 0xd1: 2, 0xd2: 4,
             0xd3: 8, 0xd4: 2, 0xd5: 3, 0xd6: 5, 0xd7: 9, 0xd8: 17}  # numbers, fixext
    for first, size in fixed.items():
        table[first] = (_Kind.SCALAR, 0, size)
    sized = {0xc4: (1, 0), 0xc5: (2, 0), 0xc6: (4, 0), 0xd9: (1, 0), 0xda: (2, 0), 0xdb: (4, 0),
             0xc7: (1, 1), 0xc8: (2, 1), 0xc9: (4, 1)}  # bin, str, ext (+ its type byte)
    for first, (width, extra) in sized.items():
        table[first] = (_Kind.SCALAR, width, extra)
    for first, kind, width in ((0xdc, _Kind.ARRAY, 2), (0xdd, _Kind.ARRAY, 4),
                               (0xde, _Kind.MAP, 2), (0xdf, _Kind.MAP, 4)):
        table[first] = (kind, width, 0)
    return table


_HEADERS = _headers()


class ObjectCounter:
    """The msgpack objects of one body (maps, arrays, scalars, keys included), counted chunk by
    chunk; `BadFrame` once they pass `most`, or once what it has seen is not one msgpack object
    (a body that stops short is `ChunkedDecoder.value`'s to tell)."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.objects = 0
        self._left = 1  # objects still to come: the body is one
        self._skip = 0  # payload bytes still to skip, past the chunk fed last
        self._head = b""  # a header the last chunk cut

    def feed(self, chunk: bytes) -> None:
        data = self._head + chunk if self._head else chunk
        self._head, pos, end = b"", self._skip, len(data)
        while pos < end:
            if not self._left:
                raise BadFrame("frame body is not valid msgpack: bytes after its message")
            kind, width, size = _HEADERS[data[pos]]
            if kind is _Kind.INVALID:
                raise BadFrame(f"frame body is not valid msgpack: byte 0x{data[pos]:02x}")
            if pos + 1 + width > end:  # the length field is in the next chunk
                self._head, pos = data[pos:], end
                break
            if width:
                size += int.from_bytes(data[pos + 1:pos + 1 + width], "big")
            pos += 1 + width
            self._count()
            if kind is _Kind.SCALAR:
                pos += size
            else:
                self._left += size if kind is _Kind.ARRAY else 2 * size
        self._skip = pos - end

    def _count(self) -> None:
        self._left -= 1
        self.objects += 1
        if self.objects > self.most:
            raise BadFrame(f"frame body holds more than {self.most} msgpack objects, more "
                           "than any call needs")


_NOTHING = object()


class ChunkedDecoder:
    """One body's value, fed chunk by chunk (see the module docstring; `max_objects` None: not
    counted, for peers trusted with any frame). A chunk that breaks the body (too many objects,
    not msgpack) only stops the decoding: the caller still reads the body to its end, so the
    stream stays in step, and `value()` raises `BadFrame`."""

    def __init__(self, size: int, max_objects: int | None) -> None:
        self._size = size
        self._counter = None if max_objects is None else ObjectCounter(max_objects)
        self._unpacker = msgpack.Unpacker(raw=False, max_buffer_size=size)
        self._value: Any = _NOTHING
        self._failure: BadFrame | None = None

    def feed(self, chunk: bytes) -> None:
        if self._failure is not None or self._value is not _NOTHING:
            return  # what follows the value is bytes after it: `value()` says so
        try:
            if self._counter is not None:
                self._counter.feed(chunk)
            self._unpacker.feed(chunk)
            self._value = self._unpacker.unpack()
        except msgpack.OutOfData:
            pass  # the object goes on in the next chunk
        except BadFrame as exc:
            self._failure = exc
        # as `framing.decode_body`: bad UTF-8, unhashable or non-string keys, nesting too deep
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            self._failure = BadFrame(f"frame body is not valid msgpack: {exc}")

    def value(self) -> Any:
        """The body's value once every chunk was fed; `BadFrame` for a body that was not one."""
        if self._failure is not None:
            raise self._failure
        if self._value is _NOTHING:
            raise BadFrame("frame body is not valid msgpack: it ends inside its message")
        if self._unpacker.tell() != self._size:
            raise BadFrame("frame body is not valid msgpack: bytes after its message")
        return self._value
