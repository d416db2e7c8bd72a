"""The connector's link to the service: one asyncio loop on a daemon thread of the vLLM process.

vLLM calls its connector from synchronous code (the scheduler loop, the worker's forward pass);
the client is asyncio. A private loop keeps the two apart: the scheduler submits a lookup and reads
its future on a later step, never waiting on the network, and the worker waits on a future only
where it must (its saves after the forward pass, its epoch check around a load).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from cachetier.client import CacheTierClient

T = TypeVar("T")


class TierThread:
    def __init__(self, url: str, token: str, *, timeout_s: float = 30.0) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="cachetier-tier",
                                        daemon=True)
        self._thread.start()
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._pending_lock = threading.Lock()  # submitted from vLLM's threads and the loop's
        self.client: CacheTierClient = self.run(self._make_client(url, token, timeout_s))

    @staticmethod
    async def _make_client(url: str, token: str, timeout_s: float) -> CacheTierClient:
        return CacheTierClient(url, token=token, timeout=timeout_s)

    def submit(self,
               call: Callable[[CacheTierClient], Awaitable[T]]) -> concurrent.futures.Future[T]:
        """Start `call(client)` on the loop; the future holds its result or its error. Calls still
        running when the connector shuts down are waited for (`close`): a release is never lost."""
        future = asyncio.run_coroutine_threadsafe(_as_coroutine(call(self.client)), self._loop)
        with self._pending_lock:
            self._pending.add(future)
        future.add_done_callback(self._settled)
        return future

    def _settled(self, future: concurrent.futures.Future[Any]) -> None:
        with self._pending_lock:
            self._pending.discard(future)

    def call(self, call: Callable[[CacheTierClient], Awaitable[T]],
             timeout_s: float | None = None) -> T:
        """`submit`, then wait for it (the worker's synchronous steps)."""
        return self.submit(call).result(timeout_s)

    def run(self, coroutine: Awaitable[T]) -> T:
        return asyncio.run_coroutine_threadsafe(_as_coroutine(coroutine), self._loop).result()

    def close(self, drain_s: float = 10.0) -> None:
        if not self._loop.is_running():
            return
        with self._pending_lock:
            pending = list(self._pending)
        concurrent.futures.wait(pending, timeout=drain_s)
        try:
            self.run(self.client.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5.0)


async def _as_coroutine(awaitable: Awaitable[T]) -> T:
    return await awaitable
