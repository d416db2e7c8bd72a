"""The scheduler's one face to the cache tier (STYLE 1): step plans and results, never Redis keys.

    async with CacheTierClient("tcp://127.0.0.1:7400", token=credential) as tier:
        step = await tier.plan("pool-0", requests)      # StepPlan | StepRefusal
        ...                                              # forward pass on the planned pages
        done = await tier.commit("pool-0", items)
        await tier.confirm("pool-0", done.ticket)

`credential` is a scheduler's (role client) token, as `cachetier up` writes it to
`credentials/client` in its run directory (`cachetier.credentials`); an admin's does the same and
may `invalidate`, an observer's only `health`.

One round trip per operation, whatever the batch: `plan` returns once every rank has run the
step's copies and the plan is confirmed. Requests from many tasks share one connection, matched by
id (`channel.Channel`): a call that is cancelled or times out abandons only its own reply, and the
connection is never left half-read. A dropped connection is reopened by the next call.

Errors are `cachetier.errors.CacheTierError`s: `RemoteError` (the service's code and message),
`ConnectionLost`, `RequestTimeout`; `retryable` says whether planning again may work. A `plan` that
failed with a connection error or a timeout may still have happened on the service: release its
request ids (releasing unknown ids is harmless) before planning them again, as
`index.lifecycle.RequestLifecycle` does (and the service, for a plan whose Redis reply it lost).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import secrets
import ssl
from typing import Any, Sequence

from cachetier.errors import BrokenStream, ConnectionLost
from cachetier.wire.channel import Channel, exchange
from cachetier.wire.framing import DEFAULT_MAX_FRAME, Endpoint
from cachetier.wire.protocol import (PROTOCOL_VERSION, Commit, Confirm, Handoff, HandoffReply,
                                     Health, HealthReport, Hello, Invalidate, Pin, Plan,
                                     PlanReply, PoolStats, Release, Route, RouteReply, Stats,
                                     Welcome)
from index.prefix import PinnedPrefix, PrefixProbe
from index.records import (CommitItem, CommitResult, IndexStats, ReleaseResult, StepPlan,
                           StepRefusal, StepRequest)


class CacheTierClient:
    def __init__(self, url: str, *, token: str, timeout: float = 30.0,
                 connect_timeout: float = 5.0, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.endpoint = Endpoint.parse(url)
        self.token = token
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.max_frame = max_frame
        self.server: Welcome | None = None
        # the requests this client plans are its own, on every connection it opens (the
        # service scopes their ids by it: `cachetier.service.ownership`)
        self._session = secrets.token_hex(16)
        self._channel: Channel | None = None
        self._connecting = asyncio.Lock()

    async def __aenter__(self) -> CacheTierClient:
        await self._open_channel()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.shield(self.close())

    async def close(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()

    def pool(self, pool: str) -> TierPool:
        """One pool of the tier behind the index's face (`index.face.Index`)."""
        return TierPool(self, pool)

    async def plan(self, pool: str, requests: Sequence[StepRequest]) -> StepPlan | StepRefusal:
        """Plan one scheduling step: pins, allocations and the copies done on every rank."""
        reply: PlanReply = await self._call(Plan(pool, list(requests)))
        return reply.outcome

    async def commit(self, pool: str, items: Sequence[CommitItem]) -> CommitResult:
        return await self._call(Commit(pool, list(items)))

    async def confirm(self, pool: str, ticket: int) -> int:
        """Returns how many of the ticket's requests were still active."""
        return await self._call(Confirm(pool, ticket))

    async def release(self, pool: str, rids: Sequence[str]) -> ReleaseResult:
        return await self._call(Release(pool, list(rids)))

    async def stats(self, pool: str) -> PoolStats:
        return await self._call(Stats(pool))

    async def health(self) -> HealthReport:
        return await self._call(Health())

    async def invalidate(self, pool: str) -> int:
        """Start `pool` over in a new epoch (admin credentials only); returns the epoch."""
        return await self._call(Invalidate(pool))

    async def route(self, pools: Sequence[str], prompt_tokens: int,
                    hashes: bytes) -> list[PrefixProbe]:
        """Each pool's usable prefix of the prompt, longest first (read-only: for routing)."""
        reply: RouteReply = await self._call(Route(list(pools), prompt_tokens, hashes))
        return reply.probes

    async def pin(self, pool: str, reader: str, prompt_tokens: int,
                  hashes: bytes) -> PinnedPrefix:
        """Pin the prompt's longest usable prefix under `reader` for this caller to read the pages
        itself (an engine's connector); `release(pool, [reader])` unpins it."""
        return await self._call(Pin(pool, reader, prompt_tokens, hashes))

    async def handoff(self, src_pool: str, dst_pool: str, prompt_tokens: int,
                      hashes: bytes) -> HandoffReply:
        """Copy the prompt's prefix cached in `src_pool` into `dst_pool` (prefill -> decode)."""
        return await self._call(Handoff(src_pool, dst_pool, prompt_tokens, hashes))

    async def _call(self, message: Any) -> Any:
        channel = await self._open_channel()
        return await channel.request(message, timeout=self.timeout)

    async def _open_channel(self) -> Channel:
        async with self._connecting:  # one reconnection for all the callers that need it
            if self._channel is None or not self._channel.is_open:
                self._channel = await self._connect()
            return self._channel

    async def _connect(self) -> Channel:
        """Connect and handshake, retrying refused connections with backoff until
        `connect_timeout`; a refused handshake (token, version, a server certificate the
        client's CA did not sign) is not retried."""
        delay = 0.02
        try:
            async with asyncio.timeout(self.connect_timeout):
                while True:
                    try:
                        return await self._handshake()
                    except ssl.SSLCertVerificationError:
                        raise
                    except (OSError, ConnectionLost, BrokenStream):
                        await asyncio.sleep(delay * random.uniform(0.5, 1.0))
                        delay = min(2 * delay, 1.0)
        except TimeoutError:
            raise ConnectionLost(f"cannot reach {self.endpoint.url} within "
                                 f"{self.connect_timeout:g} s") from None

    async def _handshake(self) -> Channel:
        stream = await self.endpoint.connect(self.max_frame)
        try:
            self.server = await exchange(stream, 0, Hello(PROTOCOL_VERSION, self.token,
                                                          session=self._session))
        except BaseException:
            await stream.close()
            raise
        return Channel(stream, f"service {self.endpoint.url}")


class TierPool:
    """One pool of the service as an `index.face.Index`: the same verbs as `PrefixIndex`, so the
    request lifecycle runs unchanged over the service (whose `plan` also runs the step's copies on
    every rank and confirms them before it answers)."""

    def __init__(self, tier: CacheTierClient, pool: str) -> None:
        self.tier = tier
        self.pool_id = pool
        self._epoch = 0

    @property
    def epoch(self) -> int:
        return self._epoch

    async def plan_step(self, requests: Sequence[StepRequest]) -> StepPlan | StepRefusal:
        outcome = await self.tier.plan(self.pool_id, requests)
        if isinstance(outcome, StepPlan):
            self._epoch = outcome.epoch
        return outcome

    async def commit(self, items: Sequence[CommitItem]) -> CommitResult:
        return await self.tier.commit(self.pool_id, items)

    async def confirm(self, ticket: int) -> int:
        return await self.tier.confirm(self.pool_id, ticket)

    async def release(self, rids: Sequence[str]) -> ReleaseResult:
        return await self.tier.release(self.pool_id, rids)

    async def probe(self, prompt_tokens: int, hashes: bytes) -> PrefixProbe:
        [probe] = await self.tier.route([self.pool_id], prompt_tokens, hashes)
        return probe

    async def stats(self) -> IndexStats:
        stats = await self.tier.stats(self.pool_id)
        fields = dataclasses.fields(IndexStats)
        return IndexStats(**{f.name: getattr(stats, f.name) for f in fields})
