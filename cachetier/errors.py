"""Errors that cross the wire: each has a code, a message and whether a retry may succeed.

A server turns any failure into an `ErrorInfo` (an error frame); a client turns an error frame back
into a `RemoteError` with the same three fields, so a scheduler can decide on `retryable` alone
and log `code` without parsing messages. Local failures of a connection (`ConnectionLost`,
`RequestTimeout`, `BrokenStream`) use the same shape, so callers catch one base class.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar, Sequence


class ErrorCode(enum.StrEnum):
    BAD_FRAME = "bad_frame"  # a frame that is not a msgpack map; the stream is still in step
    BROKEN_STREAM = "broken_stream"  # a bad length prefix or an oversized frame; connection closed
    BAD_REQUEST = "bad_request"  # a field missing, of the wrong type or out of range
    UNKNOWN_OP = "unknown_op"
    HANDSHAKE = "handshake"  # the first frame was not a hello
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"  # a valid credential whose role may not do this
    VERSION = "version"
    TOO_LARGE = "too_large"  # a reply that would exceed the peer's frame limit
    CONFLICT = "conflict"  # a pool exists with another geometry
    UNKNOWN_POOL = "unknown_pool"
    UNKNOWN = "unknown"  # an unknown request or ticket (released, confirmed, invalidated)
    STALE_EPOCH = "stale_epoch"
    CORRUPT = "corrupt"
    AGENT_UNAVAILABLE = "agent_unavailable"  # a rank of the pool has no agent registered here
    AGENT_LOST = "agent_lost"
    COPY_FAILED = "copy_failed"
    COPY_TIMEOUT = "copy_timeout"
    WRITER_STALLED = "writer_stalled"  # a late in-place writer keeps pages a step claims
    TRANSFER_FAILED = "transfer_failed"  # a page transfer between agents ended before its last byte
    REDIS_UNAVAILABLE = "redis_unavailable"
    RECOVERING = "recovering"  # the pool's storage went back in time or lost it: starting over
    LIMIT = "limit"  # a request over one of the service's limits, named in the message
    CAPACITY = "capacity"  # the index's storage is full (Redis maxmemory): retry later
    CONNECTION_LOST = "connection_lost"
    TIMEOUT = "timeout"
    INTERNAL = "internal"


@dataclass(frozen=True)
class ErrorInfo:
    """The body of an error frame."""

    code: str
    message: str
    retryable: bool


class CacheTierError(Exception):
    """An error with a wire code; `retryable` says whether the same call may succeed later."""

    code: ClassVar[str] = ErrorCode.INTERNAL
    retryable: ClassVar[bool] = False

    def info(self) -> ErrorInfo:
        return ErrorInfo(str(self.code), str(self), self.retryable)


class CodedError(CacheTierError):
    """An error whose code and retryable come from an `ErrorInfo` rather than from its class."""

    def __init__(self, info: ErrorInfo) -> None:
        super().__init__(info.message)
        self.code = info.code  # type: ignore[misc]  # per instance
        self.retryable = info.retryable  # type: ignore[misc]


class RemoteError(CodedError):
    """What the peer answered with an error frame."""


class BadFrame(CacheTierError, ValueError):
    code = ErrorCode.BAD_FRAME


class BrokenStream(CacheTierError):
    """The byte stream cannot be resynchronised: the connection has to go."""

    code = ErrorCode.BROKEN_STREAM


class BadMessage(CacheTierError, ValueError):
    code = ErrorCode.BAD_REQUEST


class UnknownOp(BadMessage):
    code = ErrorCode.UNKNOWN_OP


class TooLarge(BadMessage):
    code = ErrorCode.TOO_LARGE


class HandshakeRequired(CacheTierError):
    code = ErrorCode.HANDSHAKE


class Unauthorized(CacheTierError):
    code = ErrorCode.UNAUTHORIZED


class Forbidden(CacheTierError):
    """The credential is good but its role may not do what was asked (`service.access`)."""

    code = ErrorCode.FORBIDDEN


class VersionMismatch(CacheTierError):
    code = ErrorCode.VERSION


class ConnectionLost(CacheTierError, ConnectionError):
    code = ErrorCode.CONNECTION_LOST
    retryable = True


class PeerClosed(ConnectionLost):
    """The peer closed the connection between two frames: the normal end of a connection."""


class IdleTimeout(CacheTierError):
    """The service closes a connection that sent nothing for its idle timeout (with nothing in
    flight); the client's next call connects again."""

    code = ErrorCode.CONNECTION_LOST
    retryable = True


class RequestTimeout(CacheTierError, TimeoutError):
    code = ErrorCode.TIMEOUT
    retryable = True


class AgentUnavailable(CacheTierError):
    code = ErrorCode.AGENT_UNAVAILABLE
    retryable = True


class PoolRecovering(CacheTierError):
    """The pool's storage went back in time or lost it: the service is starting it over in a
    fresh epoch; the same call succeeds once it has (`cachetier.service.recovery`)."""

    code = ErrorCode.RECOVERING
    retryable = True


class AgentLost(CacheTierError):
    """The agents of `ranks` cannot be trusted with the pool any more (gone, or too slow)."""

    code = ErrorCode.AGENT_LOST
    retryable = True

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = list(ranks)


class CopyTimeout(AgentLost):
    """A rank that misses a copy deadline may still be copying: it is treated as lost."""

    code = ErrorCode.COPY_TIMEOUT


class StaleOrder(CacheTierError):
    """A copy or a write planned in an epoch the pool's agent has fenced off: its pages may
    belong to another request now (`gpu_pool.fence`). Planning again gets current pages."""

    code = ErrorCode.STALE_EPOCH
    retryable = True


class CopyFailed(CacheTierError):
    code = ErrorCode.COPY_FAILED
    retryable = True


class WriterStalled(CacheTierError):
    """A writer of a request that is over keeps in its section pages a step hands out
    (`gpu_pool.claims`): the pool needs a new epoch, which moves it away from that writer."""

    code = ErrorCode.WRITER_STALLED
    retryable = True


class TransferFailed(CacheTierError):
    """A transfer between agents did not deliver every byte: what it wrote is not valid data."""

    code = ErrorCode.TRANSFER_FAILED
    retryable = True


class LimitExceeded(CacheTierError):
    """A request over one of the service's limits (`cachetier.service.limits`); the message
    starts with the limit's name. Not retryable when the request itself is too big (the caller
    must split it), retryable when it is over a quota that waiting frees (its own releases, a
    rate)."""

    code = ErrorCode.LIMIT

    def __init__(self, limit: str, message: str, *, retryable: bool) -> None:
        super().__init__(f"limit {limit}: {message}")
        self.limit = limit
        self.retryable = retryable  # type: ignore[misc]  # per instance


class StorageFull(CacheTierError):
    """The index's Redis refused a write at its `maxmemory`: nothing was written; the same call
    may succeed once requests are released or pools evicted."""

    code = ErrorCode.CAPACITY
    retryable = True


def error_info(exc: BaseException) -> ErrorInfo:
    """The error frame for a failure: ours keep their code, other bad input is `bad_request`."""
    if isinstance(exc, CacheTierError):
        return exc.info()
    if isinstance(exc, ValueError):
        return ErrorInfo(ErrorCode.BAD_REQUEST, str(exc), False)
    return ErrorInfo(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}", False)
