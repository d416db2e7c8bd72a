"""What one client may ask of the service, so that no client starves the others.

Two kinds of limits, both answered `LimitExceeded` (code `limit`, the limit's name first in the
message), checked before any work is done for the request:

- *Sizes* (`check_size`): a request that is too big as sent (a batch, an id list, a prompt, its
  hash bytes) is refused, not retryable: sending it again cannot succeed, the caller must split
  it. Every operation has one, `release` included (5 M ids in one call kept Redis busy for
  seconds, every other client answered BUSY meanwhile).
- *Quotas* (`ClientQuota`, one per client connection): requests held (planned and not released),
  the pages they pin and their prompts' tokens (Redis holds their hashes meanwhile: 30 unreleased
  10^7-token prompts grew it by 556 MB), and the rate of `stats`. Over a quota is retryable: the
  client's own releases, or time, free it.
- *Shares* (`PrincipalQuota`, one per principal: a credential's role and identity, every
  connection of it together): its open connections, and the requests, pages and tokens its
  client connections hold (one credential once opened 1,022 idle connections and locked every
  new client out). `ConnectionShares` also keeps the last `reserved_connections` of
  `max_connections` for agents and the admin, so no flood of client connections locks them out.
  Over a share is retryable too.
- *Frames* (`frame_bound`): after the hello a client's frame holds at most what the largest legal
  call needs, in bytes and in msgpack objects, for the service's pools' geometry; an agent's at
  most `agent_max_frame` bytes (its registration, its acks). `framing.FramedStream` checks both
  before it builds anything (an 8 MiB frame of empty arrays once took the service from 238 to
  825 MB and held every client for 3.4 s).

The quota's table of held requests is connection state like `fleet.PoolAgents`: it is kept from
the replies this service sent, so it is an upper bound of what the client holds in Redis (a
request the service itself released after a failed step never enters it; one the client never
releases leaves it when its lease runs out, as the reaper releases it; an epoch bump of its pool
voids the older epochs' entries). It is bounded by the quota itself. A closed connection's table
stays in its principal's share until its requests' leases run out: Redis holds them until the
reaper releases them, so reconnecting frees no share.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cachetier.config import CacheSpec, Config
from cachetier.credentials import Principal, Role
from cachetier.errors import LimitExceeded
from cachetier.wire.framing import FrameBound
from cachetier.wire.protocol import (Commit, Handoff, Pin, Plan, PlanReply, Release, Route,
                                     Stats)
from index.hashing import hash_len
from index.prefix import PinnedPrefix
from index.records import CommitItem, ReleaseResult, RequestPlan, StepRequest


@dataclass(frozen=True)
class ServiceLimits:
    """Every limit of the service; `serve --limit NAME=VALUE` sets one."""

    # connections
    hello_max_frame: int = 4096  # bytes, for every frame before the hello is accepted
    agent_max_frame: int = 64 << 10  # bytes, for an agent's frames after it (register, acks)
    max_connections: int = 1024  # clients and agents together; past it a connection is refused
    reserved_connections: int = 64  # of those, the last ones: for agents and the admin only
    max_principal_connections: int = 512  # one credential's connections together
    max_handshaking: int = 128  # connections not authenticated yet (each has its deadline)
    idle_timeout_s: float | None = 600.0  # a connection with no call in flight; None: never
    calls_in_flight: int = 64  # per connection; past it the service stops reading from it
    # sizes of one call (not retryable)
    max_release_ids: int = 4096
    max_prompt_tokens: int = 1 << 20  # per request of a plan, a pin, a route or a hand-off
    max_hash_bytes: int = 16 << 20  # per call, every request's hashes together
    max_rid_bytes: int = 256
    max_route_pools: int = 64
    # quotas of one connection (retryable)
    max_held_requests: int = 4096  # planned or pinned and not released
    max_pinned_pages: int = 1 << 16  # pages those requests hold (cached, allocated, restored)
    max_held_tokens: int = 1 << 24  # their prompts' tokens (Redis keeps their hashes meanwhile)
    stats_per_s: float = 200.0  # `stats` calls, with a burst of as many (a poller: ~100/s)
    # shares of one principal, all its connections together (retryable)
    max_principal_held_requests: int = 1 << 16
    max_principal_pinned_pages: int = 1 << 20
    max_principal_held_tokens: int = 1 << 26  # what `run.redis_memory` sizes Redis for

    def __post_init__(self) -> None:
        for name in ("hello_max_frame", "agent_max_frame", "max_connections",
                     "max_principal_connections", "max_handshaking", "calls_in_flight",
                     "max_release_ids", "max_prompt_tokens", "max_hash_bytes", "max_rid_bytes",
                     "max_route_pools", "max_held_requests", "max_pinned_pages",
                     "max_held_tokens", "max_principal_held_requests",
                     "max_principal_pinned_pages", "max_principal_held_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"limit {name} must be >= 1")
        if not 0 <= self.reserved_connections < self.max_connections:
            raise ValueError("limit reserved_connections must be in 0..max_connections - 1")
        if self.stats_per_s <= 0 or (self.idle_timeout_s is not None and self.idle_timeout_s <= 0):
            raise ValueError("stats_per_s and idle_timeout_s must be > 0")


def parse_limits(items: Sequence[str]) -> ServiceLimits:
    """`serve --limit NAME=VALUE` (repeatable): the defaults with those changed; ValueError names
    an unknown limit or a bad value (`none` for a limit that may be off)."""
    fields = {f.name: f for f in dataclasses.fields(ServiceLimits)}
    changes: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or name not in fields:
            raise ValueError(f"{item!r}: expected NAME=VALUE, NAME one of {sorted(fields)}")
        kind = float if name in ("idle_timeout_s", "stats_per_s") else int
        try:
            changes[name] = None if (name, text) == ("idle_timeout_s", "none") else kind(text)
        except ValueError:
            raise ValueError(f"{item!r}: {text!r} is not a {kind.__name__}") from None
    return ServiceLimits(**changes)


def _too_big(limit: str, what: str, size: int, most: int) -> LimitExceeded:
    return LimitExceeded(limit, f"{what} is {size}, at most {most} per call: split it",
                         retryable=False)


def check_size(msg: Any, limits: ServiceLimits, config: Config) -> None:
    """Refuse a call too big as sent (see the module docstring); `config` is its pool's."""
    if isinstance(msg, Plan):
        _check_count("max_batch", "the plan's batch", len(msg.requests), config.cache.max_batch)
        for r in msg.requests:
            _check_rid(r.rid, limits)
            if r.prompt_tokens is not None:
                _check_prompt(r.prompt_tokens, limits)
        _check_hashes(sum(len(r.hashes or b"") for r in msg.requests), limits)
    elif isinstance(msg, Commit):
        _check_count("max_batch", "the commit's batch", len(msg.items), config.cache.max_batch)
    elif isinstance(msg, Release):
        _check_count("max_release_ids", "the release's id list", len(msg.rids),
                     limits.max_release_ids)
    elif isinstance(msg, Pin):
        _check_rid(msg.reader, limits)
        _check_prompt(msg.prompt_tokens, limits)
        _check_hashes(len(msg.hashes), limits)
    elif isinstance(msg, (Route, Handoff)):
        if isinstance(msg, Route):
            _check_count("max_route_pools", "the route's pool list", len(msg.pools),
                         limits.max_route_pools)
        _check_prompt(msg.prompt_tokens, limits)
        _check_hashes(len(msg.hashes), limits)


def _check_count(limit: str, what: str, size: int, most: int) -> None:
    if size > most:
        raise _too_big(limit, what, size, most)


def _check_rid(rid: str, limits: ServiceLimits) -> None:
    size = len(rid.encode())
    if size > limits.max_rid_bytes:
        raise _too_big("max_rid_bytes", "a request id's length in bytes", size,
                       limits.max_rid_bytes)


def _check_prompt(tokens: int, limits: ServiceLimits) -> None:
    if tokens > limits.max_prompt_tokens:
        raise LimitExceeded("max_prompt_tokens", f"a prompt of {tokens} tokens, at most "
                            f"{limits.max_prompt_tokens} per request", retryable=False)


def _check_hashes(size: int, limits: ServiceLimits) -> None:
    if size > limits.max_hash_bytes:
        raise _too_big("max_hash_bytes", "the call's hash bytes", size, limits.max_hash_bytes)


# What one frame may hold after the hello (`frame_bound`). A client's is the largest legal call of
# any pool the service serves; every term is an upper bound of what msgpack writes:
#   bytes = ENVELOPE_BYTES + max(
#     plan:      max_batch x (record(StepRequest) + rid) + min(max_hash_bytes, max_batch x hashes),
#     commit:    max_batch x (record(CommitItem) + rid),
#     release:   max_release_ids x rid,
#     route:     max_route_pools x (STR_HEADER + POOL_ID_BYTES) + hashes,
#     pin, hand-off: rid + hashes)
#   rid = STR_HEADER + max_rid_bytes; hashes (one request's) = min(max_hash_bytes,
#     max_prompt_tokens // hash_block_tokens x hash_len): one per complete block of its prompt;
#   record(R) = STR_HEADER + sum over R's fields of (STR_HEADER + len(name) + SCALAR_BYTES)
#   objects = ENVELOPE_OBJECTS + max(max_batch x (1 + 2 x fields of StepRequest or CommitItem),
#     max_release_ids, max_route_pools): a record is a map, its keys and values one object each
# The tiny preset gives 16.2 MiB and 5,440 objects (its 16-token blocks let 256 requests reach
# `max_hash_bytes`), kimi-k3 8.2 MiB (512-token blocks); both were 64 MiB, objects uncounted.
ENVELOPE_BYTES = 4096  # a request's op, id, pool ids and headers beside its lists (~300 used)
ENVELOPE_OBJECTS = 64  # its map's keys and values beside its lists (13 at most used)
STR_HEADER = 5  # the widest header of a msgpack string, binary, array or map
SCALAR_BYTES = 16  # a record's widest value but its strings' bytes (an int64: 9, a kind: 13)
POOL_ID_BYTES = 128  # `index.store`'s pool ids
AGENT_OBJECTS = 64  # an agent's registration or ack: one map of a few fields (19 at most used)


def frame_bound(limits: ServiceLimits, configs: Iterable[Config]) -> FrameBound:
    """What a client's frame may hold after its hello, for pools of each of `configs` (see the
    formula above); check_size then refuses a call too big for its own pool."""
    caches = [config.cache for config in configs]
    return FrameBound(max(_call_bytes(limits, cache) for cache in caches),
                      max(_call_objects(limits, cache) for cache in caches))


def agent_frame_bound(limits: ServiceLimits) -> FrameBound:
    """An agent sends a registration, then acks (an int, None or an error): never a list."""
    return FrameBound(limits.agent_max_frame, AGENT_OBJECTS)


def _call_bytes(limits: ServiceLimits, cache: CacheSpec) -> int:
    rid = STR_HEADER + limits.max_rid_bytes
    hashes = min(limits.max_hash_bytes, limits.max_prompt_tokens // cache.hash_block_tokens
                 * hash_len(cache.hash_algo))
    batch = cache.max_batch
    return ENVELOPE_BYTES + max(
        batch * (_record_bytes(StepRequest) + rid) + min(limits.max_hash_bytes, batch * hashes),
        batch * (_record_bytes(CommitItem) + rid),
        limits.max_release_ids * rid,
        limits.max_route_pools * (STR_HEADER + POOL_ID_BYTES) + hashes,
        rid + hashes)


def _call_objects(limits: ServiceLimits, cache: CacheSpec) -> int:
    record = 1 + 2 * max(len(dataclasses.fields(StepRequest)), len(dataclasses.fields(CommitItem)))
    return ENVELOPE_OBJECTS + max(cache.max_batch * record, limits.max_release_ids,
                                  limits.max_route_pools)


@functools.cache
def _record_bytes(record: type) -> int:
    return STR_HEADER + sum(STR_HEADER + len(f.name) + SCALAR_BYTES
                            for f in dataclasses.fields(record))


@dataclass
class _Held:
    epoch: int
    pages: int
    tokens: int
    renewed: float


@dataclass
class _Totals:
    """Requests held, the pages they pin and their prompts' tokens: what a connection holds, or
    a principal (all its connections together), or the most either may hold."""

    requests: int = 0
    pages: int = 0
    tokens: int = 0

    def add(self, held: _Held, sign: int) -> None:
        self.requests += sign
        self.pages += sign * held.pages
        self.tokens += sign * held.tokens

    def refusal(self, new: int, tokens: int, most: _Totals, prefix: str,
                whose: str) -> LimitExceeded | None:
        """Why `new` more requests of `tokens` prompt tokens may not start, if they may not;
        `prefix` names the limits (`max_held_requests`, `max_principal_held_requests`)."""
        if self.requests + new > most.requests:
            return LimitExceeded(f"{prefix}held_requests", f"{self.requests} requests held "
                                 f"{whose}, {new} more asked, at most {most.requests}: release "
                                 "some first", retryable=True)
        if self.pages >= most.pages:
            return LimitExceeded(f"{prefix}pinned_pages", f"{self.pages} pages pinned {whose}, "
                                 f"at most {most.pages}: release some first", retryable=True)
        if self.tokens + tokens > most.tokens:
            return LimitExceeded(f"{prefix}held_tokens", f"{self.tokens} prompt tokens held "
                                 f"{whose}, {tokens} more asked, at most {most.tokens}: release "
                                 "some first", retryable=True)
        return None


@dataclass(eq=False)
class PrincipalQuota:
    """One principal's share (see the module docstring): its open connections, and what the
    tables of its client connections hold together, those of its closed connections included
    until their requests' leases run out."""

    principal: Principal
    limits: ServiceLimits
    connections: int = 0
    totals: _Totals = field(default_factory=_Totals)
    tables: list[ClientQuota] = field(default_factory=list)

    @property
    def most(self) -> _Totals:
        limits = self.limits
        return _Totals(limits.max_principal_held_requests, limits.max_principal_pinned_pages,
                       limits.max_principal_held_tokens)

    @property
    def idle(self) -> bool:
        """Nothing left to count: no connection open, no table holding a request."""
        return not self.connections and not self.tables

    def expire(self) -> None:
        """Every table's requests not stepped for a lease; closed tables left empty go."""
        for table in self.tables:
            table.expire()
        self.tables = [t for t in self.tables if not t.closed or t.totals.requests]


_RESERVED_ROLES = frozenset({Role.AGENT, Role.ADMIN})


@dataclass
class ConnectionShares:
    """The service's connections by principal (see the module docstring): `admit` once a hello
    is verified, `leave` when its connection ends."""

    limits: ServiceLimits
    _principals: dict[Principal, PrincipalQuota] = field(default_factory=dict)

    def admit(self, principal: Principal, open_connections: int) -> PrincipalQuota:
        """The principal's share, this connection counted in it; `open_connections` is every
        connection open now, this one and those not authenticated yet included."""
        limits = self.limits
        share = self._principals.get(principal) or PrincipalQuota(principal, limits)
        if share.connections >= limits.max_principal_connections:
            raise LimitExceeded("max_principal_connections", f"{principal.describe()} holds "
                                f"{share.connections} connections, at most "
                                f"{limits.max_principal_connections}: close some first",
                                retryable=True)
        room = limits.max_connections - limits.reserved_connections
        if principal.role not in _RESERVED_ROLES and open_connections > room:
            raise LimitExceeded("reserved_connections", f"{open_connections - 1} connections "
                                f"open: the last {limits.reserved_connections} of "
                                f"{limits.max_connections} are kept for agents and the admin",
                                retryable=True)
        share.connections += 1
        self._principals[principal] = share
        return share

    def leave(self, share: PrincipalQuota) -> None:
        """Its connection ended (after its `ClientQuota.close`, for a client's)."""
        share.connections -= 1
        if share.idle:
            self._principals.pop(share.principal, None)


@dataclass(eq=False)
class ClientQuota:
    """One connection's quotas (see the module docstring), counted in its principal's share too;
    `admit` before a call, `account` with its result, `close` when the connection ends.
    `lease_s` is the service's request lease (None: requests never expire)."""

    principal: PrincipalQuota
    lease_s: float | None = None
    clock: Callable[[], float] = time.monotonic
    totals: _Totals = field(default_factory=_Totals)
    closed: bool = False
    _held: dict[tuple[str, str], _Held] = field(default_factory=dict)  # (pool, rid)
    _epochs: dict[str, int] = field(default_factory=dict)  # the newest epoch seen per pool
    _stats_tokens: float = -1.0  # stats calls the bucket holds; -1: full, not started
    _filled: float = 0.0
    _refusing: asyncio.Lock = field(default_factory=asyncio.Lock)  # refused stats, in turn

    def __post_init__(self) -> None:
        self.principal.tables.append(self)

    @property
    def limits(self) -> ServiceLimits:
        return self.principal.limits

    async def admit(self, msg: Any) -> None:
        if isinstance(msg, Stats):
            await self._take_stats_token()
        elif isinstance(msg, Plan):
            new = [r for r in msg.requests if r.is_new and (msg.pool, r.rid) not in self._held]
            self._check_holdings(len(new), sum(r.prompt_tokens or 0 for r in new))
        elif isinstance(msg, Pin) and (msg.pool, msg.reader) not in self._held:
            self._check_holdings(1, msg.prompt_tokens)

    def account(self, msg: Any, result: Any) -> None:
        if isinstance(msg, Plan) and isinstance(result, PlanReply) and result.plan is not None:
            self._new_epoch(msg.pool, result.plan.epoch)
            tokens = {r.rid: r.prompt_tokens for r in msg.requests if r.prompt_tokens}
            for r in result.plan.requests:
                held = self._held.get((msg.pool, r.rid))
                self._hold(msg.pool, r.rid, result.plan.epoch, _plan_pages(r),
                           tokens.get(r.rid, held.tokens if held else 0))
        elif isinstance(msg, Pin) and isinstance(result, PinnedPrefix):
            self._new_epoch(msg.pool, result.epoch)
            if result.hit_tokens:
                pages = sum(map(len, result.mla_pages)) + len(result.checkpoint_pages)
                self._hold(msg.pool, msg.reader, result.epoch, pages, 0)
        elif isinstance(msg, Release) and isinstance(result, ReleaseResult):
            for rid in msg.rids:
                self._drop((msg.pool, rid))

    def close(self) -> None:
        """The connection ended: its requests stay the principal's until their leases run out
        (the reaper's then), or for good without a lease, when nothing will ever release them
        and counting them would lock the principal out."""
        self.closed = True
        if self.lease_s is None:
            for key in list(self._held):
                self._drop(key)
        if not self.totals.requests:
            self.principal.tables.remove(self)

    def _check_holdings(self, new: int, tokens: int) -> None:
        if not new:
            return  # continuing requests: the quota bounds what a client starts
        if self._refusal(new, tokens) is not None:
            self.principal.expire()  # only then: the walk costs one step per request held
        refusal = self._refusal(new, tokens)
        if refusal is not None:
            raise refusal

    def _refusal(self, new: int, tokens: int) -> LimitExceeded | None:
        limits, principal = self.limits, self.principal
        mine = _Totals(limits.max_held_requests, limits.max_pinned_pages, limits.max_held_tokens)
        return self.totals.refusal(new, tokens, mine, "max_", "by this connection") \
            or principal.totals.refusal(new, tokens, principal.most, "max_principal_",
                                        "by its credential's connections")

    async def _take_stats_token(self) -> None:
        """A token bucket (`stats_per_s`, a burst of as many). A refusal is answered only after
        1 / `stats_per_s`, one refusal at a time: a client pipelining `stats` without waiting for
        them gets at most that many refusals a second besides its answers, and its other calls
        queue behind them, so the service soon stops reading it (`serve_requests`' slots)."""
        now, rate = self.clock(), self.limits.stats_per_s
        burst = max(1.0, rate)
        if self._stats_tokens < 0:
            self._stats_tokens = burst
        else:
            self._stats_tokens = min(burst, self._stats_tokens + (now - self._filled) * rate)
        self._filled = now
        if self._stats_tokens >= 1:
            self._stats_tokens -= 1
            return
        async with self._refusing:
            await asyncio.sleep(1 / rate)
        raise LimitExceeded("stats_per_s", f"at most {rate:g} stats calls per second per "
                            "connection", retryable=True)

    def _hold(self, pool: str, rid: str, epoch: int, pages: int, tokens: int) -> None:
        self._drop((pool, rid))
        held = self._held[(pool, rid)] = _Held(epoch, pages, tokens, self.clock())
        self.totals.add(held, 1)
        self.principal.totals.add(held, 1)

    def _drop(self, key: tuple[str, str]) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            self.totals.add(held, -1)
            self.principal.totals.add(held, -1)

    def _new_epoch(self, pool: str, epoch: int) -> None:
        """An epoch bump voided every request of the pool's older epochs."""
        if epoch > self._epochs.get(pool, epoch):
            for key in [k for k, h in self._held.items() if k[0] == pool and h.epoch < epoch]:
                self._drop(key)
        self._epochs[pool] = max(epoch, self._epochs.get(pool, 0))

    def expire(self) -> None:
        """Requests not stepped for a lease are the reaper's: no longer the client's."""
        if self.lease_s is None:
            return
        deadline = self.clock() - self.lease_s
        for key in [k for k, h in self._held.items() if h.renewed < deadline]:
            self._drop(key)


def _plan_pages(r: RequestPlan) -> int:
    return sum(map(len, r.mla_pages)) + len(r.state_pages) + len(r.checkpoint_pages)
