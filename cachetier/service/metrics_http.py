"""`GET /metrics` over HTTP/1.0 on the service's own event loop (`serve --metrics-port`).

prometheus_client's own server runs in a thread, where the pools' stats (an asyncio Redis
client) cannot be read; this one is a few lines of asyncio instead: one request per connection,
its head bounded in size and time, the body `ServiceMetrics.exposition()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Self

from prometheus_client import CONTENT_TYPE_LATEST

from cachetier.service.metrics import ServiceMetrics

logger = logging.getLogger("cachetier.service.metrics_http")

_HEAD_LIMIT = 8192  # bytes of request line and headers
_HEAD_TIMEOUT_S = 5.0


class MetricsEndpoint:
    """`async with MetricsEndpoint(metrics, host, port) as endpoint:` serves on `endpoint.url`
    (port 0: any free port) until the block ends."""

    def __init__(self, metrics: ServiceMetrics, host: str = "127.0.0.1", port: int = 0) -> None:
        self.metrics = metrics
        self.host = host
        self.port = port
        self.url = ""
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._serve, self.host, self.port,
                                                  limit=_HEAD_LIMIT)
        port = self._server.sockets[0].getsockname()[1]
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{host}:{port}/metrics"
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
            if method != b"GET":
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


async def _respond(writer: asyncio.StreamWriter, status: bytes, body: bytes,
                   content_type: bytes = b"text/plain; charset=utf-8") -> None:
    writer.write(b"HTTP/1.0 " + status + b"\r\nContent-Type: " + content_type +
                 b"\r\nContent-Length: " + str(len(body)).encode() +
                 b"\r\nConnection: close\r\n\r\n" + body)
    await writer.drain()
