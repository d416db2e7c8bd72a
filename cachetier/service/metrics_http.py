"""`GET /metrics` over HTTP/1.0 on the service's own event loop (`serve --metrics-port`).

prometheus_client's own server runs in a thread, where the pools' stats (an asyncio Redis
client) cannot be read; this one is a few lines of asyncio instead: one request per connection,
its head bounded in size and time, the body `ServiceMetrics.exposition()`.

It binds loopback unless told otherwise. With a `token`, a request without the header
`Authorization: Bearer <token>` gets 401 and nothing else (Prometheus: `authorization:
credentials_file:`); the series name every pool and its traffic, which a service bound on a
public address should not tell anyone who asks.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import logging
from typing import Self

from prometheus_client import CONTENT_TYPE_LATEST

from cachetier.service.metrics import ServiceMetrics

logger = logging.getLogger("cachetier.service.metrics_http")

_HEAD_LIMIT = 8192  # bytes of request line and headers
_HEAD_TIMEOUT_S = 5.0


class MetricsEndpoint:
    """`async with MetricsEndpoint(metrics, host, port) as endpoint:` serves on `endpoint.url`
    (port 0: any free port) until the block ends; with `token`, to its bearers only."""

    def __init__(self, metrics: ServiceMetrics, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None) -> None:
        self.metrics = metrics
        self.host = host
        self.port = port
        self.url = ""
        self._token = None if token is None else token.encode()
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._serve, self.host, self.port,
                                                  limit=_HEAD_LIMIT)
        port = self._server.sockets[0].getsockname()[1]
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{host}:{port}/metrics"
        if self._token is None and not _is_loopback(self.host):
            logger.warning("metrics on %s answer anyone: give them a token", self.url)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(_HEAD_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
            method, _, rest = head.partition(b" ")
            path = rest.partition(b" ")[0].partition(b"?")[0]
            if not self._authorized(head):
                await _respond(writer, b"401 Unauthorized", b"bearer token required\n",
                               extra=b"WWW-Authenticate: Bearer\r\n")
            elif method != b"GET":
                await _respond(writer, b"405 Method Not Allowed", b"GET /metrics\n")
            elif path != b"/metrics":
                await _respond(writer, b"404 Not Found", b"GET /metrics\n")
            else:
                body = await self.metrics.exposition()
                await _respond(writer, b"200 OK", body, CONTENT_TYPE_LATEST.encode())
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ConnectionError) as exc:
            logger.debug("metrics request dropped: %s", exc)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


    def _authorized(self, head: bytes) -> bool:
        """No token, or the head's Authorization is `Bearer <token>` (the scheme in any case,
        compared in constant time)."""
        if self._token is None:
            return True
        scheme, _, credential = _header(head, b"authorization").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(credential.strip(),
                                                                   self._token)


def _header(head: bytes, name: bytes) -> bytes:
    """The value of the first header `name` (lower case) in a request head; b"" if none."""
    for line in head.split(b"\r\n")[1:]:
        key, colon, value = line.partition(b":")
        if colon and key.strip().lower() == name:
            return value.strip()
    return b""


def _is_loopback(host: str) -> bool:
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_loopback
    return host == "localhost"


async def _respond(writer: asyncio.StreamWriter, status: bytes, body: bytes,
                   content_type: bytes = b"text/plain; charset=utf-8", extra: bytes = b"") -> None:
    """`extra`: more header lines, each ending in CRLF."""
    writer.write(b"HTTP/1.0 " + status + b"\r\nContent-Type: " + content_type +
                 b"\r\nContent-Length: " + str(len(body)).encode() +
                 b"\r\n" + extra + b"Connection: close\r\n\r\n" + body)
    await writer.drain()
