"""`cachetier serve`: the stateless control plane between schedulers, Redis and the agents.

It holds no metadata: every decision is one Lua script in Redis (`index.store.PrefixIndex`).
What it keeps in memory is only about live connections (`fleet.PoolAgents`: which agent serves
each (pool, rank) here, and which steps wait on them), so several replicas can run side by side,
each agent connected to all of them, and a restarted replica rebuilds everything from the
agents' registrations.

A step (`plan`) is: the plan script; the first time in its epoch, a fence on every rank's agent
(`fleet.fence_links`: no writer of an older epoch can still touch the pages it hands out); the
copy list to every rank's agent; their acks; the confirm script; the answer. Anything failing
after the plan script, or a plan script whose reply was lost (it may have run), releases the
step's requests and answers a retryable error (`index.lifecycle`). An agent whose connection
drops, times out or is reported dead (`agent_lost`, also called by the liveness watcher) fails
its pool's steps in flight here and starts a new epoch: nothing cached before can be matched
against bytes that may be gone.
Requests hold leases (`request_lease_s`), renewed by each step; the reaper (`reaper`) releases
those of schedulers that disappeared between plan and release.
Storage that went back in time or lost the pool is detected on the next call and the pool
started over in a fresh epoch (`recovery`), the callers meanwhile told to retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Awaitable, Callable, Sequence, TypeVar

from redis.exceptions import RedisError

from cachetier.config import Config
from cachetier.credentials import Principal, Role, peer_token, verify
from cachetier.errors import (AgentLost, BadMessage, CacheTierError, CodedError, ErrorCode,
                              ErrorInfo, HandshakeRequired, LimitExceeded, StorageFull,
                              VersionMismatch, WriterStalled, error_info)
from cachetier.service import access
from cachetier.service.batching import (CommitCoalescer, ConfirmCoalescer, PlanCoalescer,
                                        ReleaseCoalescer)
from cachetier.service.fleet import (AgentLink, PoolAgents, StepGuard, fence_links, run_copies,
                                     step_order)
from cachetier.service.handoff import PoolSide, hand_off
from cachetier.service.limits import (ClientQuota, ConnectionShares, PrincipalQuota,
                                      ServiceLimits, agent_frame_bound, check_size, frame_bound)
from cachetier.service.reaper import ReaperSettings, run_reaper
from cachetier.service.observer import ServiceObserver
from cachetier.service.ownership import Owner
from cachetier.service.recovery import PoolRecovery
from cachetier.wire.channel import Channel, send_error, serve_requests
from cachetier.wire.framing import DEFAULT_MAX_FRAME, Endpoint, FrameBound, FramedStream
from cachetier.wire.protocol import (CLIENT_OPS, PROTOCOL_VERSION, Commit, Confirm,
                                     Handoff, HandoffReply, Health, HealthReport, Hello,
                                     Invalidate, Pin,
                                     Plan, PlanReply, PoolStats, Register, Registered, Release,
                                     Route, RouteReply, Stats, Welcome, ok_frame, op_table,
                                     parse_request, request_id)
from index.errors import (BadRequest, CacheIndexError, CorruptState, PoolConflict, StaleEpoch,
                          StorageLost, StorageRollback, UnknownEntity, UnknownPool)
from index.execution import ReplicaAcks
from index.hashing import hash_len
from index.identity import PoolView
from index.lifecycle import MAYBE_RAN, RequestLifecycle
from index.placement import ShardPlacement
from index.prefix import PinnedPrefix
from index.records import (CommitItem, CommitResult, ReleaseResult, StepPlan, StepRefusal,
                           StepRequest)
from index.redis_link import (RedisClient, RedisTarget, WriteNotAcknowledged, is_full,
                              is_transient)
from index.redis_link import close as close_redis
from index.redis_link import connect as connect_redis
from index.routing import probe_pools
from index.store import PrefixIndex

logger = logging.getLogger("cachetier.service.server")
MAX_SESSION_CHARS = 128  # a client's session id (`Hello.session`): 32 hex digits are drawn
T = TypeVar("T")

_INDEX_CODES: dict[type[CacheIndexError], ErrorCode] = {
    BadRequest: ErrorCode.BAD_REQUEST, PoolConflict: ErrorCode.CONFLICT,
    UnknownPool: ErrorCode.UNKNOWN_POOL, UnknownEntity: ErrorCode.UNKNOWN,
    StaleEpoch: ErrorCode.STALE_EPOCH, CorruptState: ErrorCode.CORRUPT,
    StorageRollback: ErrorCode.RECOVERING, StorageLost: ErrorCode.RECOVERING,
}


@dataclass(frozen=True)
class ServiceSettings:
    redis_url: str  # "" with `redis_cluster`
    secret: str  # the cluster secret every credential derives from (`cachetier.credentials`)
    config: Config
    listen: str = "tcp://127.0.0.1:0"
    copy_timeout_s: float = 10.0
    handshake_timeout_s: float = 10.0
    max_frame: int = DEFAULT_MAX_FRAME
    redis_connections: int = 64
    redis_wait_s: float = 10.0  # for a free connection of the pool, under load
    # plans of one pool arriving within this tick share one step (`batching`); 0: each alone
    batch_tick_s: float = 0.001
    # a request (or pinned reader) not stepped for this long is released by the reaper
    # (`reaper`): its scheduler is taken for gone; None: requests live until released
    request_lease_s: float | None = 300.0
    reaper: ReaperSettings = field(default_factory=ReaperSettings)
    # pools whose geometry differs from `config` (e.g. a decode pool of another TP degree)
    pool_configs: dict[str, Config] = field(default_factory=dict)
    server_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    redis_cluster: str = ""  # host:port,...: a Redis Cluster instead of `redis_url`
    # replicas that must hold a plan, commit, pin, creation or invalidation before the caller
    # acts on it (`index.execution`); None: 1 on a cluster, 0 (no WAIT) on one server
    redis_acks: int | None = None
    redis_ack_timeout_ms: int = 100
    # `route` reads its probes on the shards' replicas (`index.routing`); a cluster only
    route_from_replicas: bool = False
    limits: ServiceLimits = field(default_factory=ServiceLimits)  # per connection and call
    # the ACL user the service logs in to Redis as (`run.redis_auth`); None: the default user
    redis_user: str | None = None
    redis_password: str | None = field(default=None, repr=False)
    redis_tls_ca: str | None = None  # a cluster's nodes speak TLS, verified against this CA

    def redis_target(self) -> RedisTarget:
        bounds = {"max_connections": self.redis_connections, "wait_s": self.redis_wait_s,
                  "username": self.redis_user, "password": self.redis_password}
        if self.redis_cluster:
            return RedisTarget.cluster(self.redis_cluster, tls_ca=self.redis_tls_ca, **bounds)
        return RedisTarget(url=self.redis_url, **bounds)

    def replica_acks(self) -> ReplicaAcks | None:
        acks = (1 if self.redis_cluster else 0) if self.redis_acks is None else self.redis_acks
        return ReplicaAcks(acks, self.redis_ack_timeout_ms) if acks else None


@dataclass(frozen=True)
class Admitted:
    """A connection past its hello: who it is, the session its client drew (`ownership`) and
    its principal's share of the limits (`limits.ConnectionShares`)."""

    principal: Principal
    session: str
    share: PrincipalQuota


@dataclass(eq=False)
class _Pool:
    index: PrefixIndex
    agents: PoolAgents
    config: Config
    recovery: PoolRecovery
    plans: PlanCoalescer | None = None  # None: `batch_tick_s` is 0
    commits: CommitCoalescer | None = None
    confirms: ConfirmCoalescer | None = None
    releases: ReleaseCoalescer | None = None


def describe(exc: BaseException) -> ErrorInfo:
    """The error frame for any failure of a request: index errors keep their `retryable`."""
    info = classify(exc)
    if info.code == ErrorCode.INTERNAL:
        logger.error("request failed", exc_info=exc)
    return info


def classify(exc: BaseException) -> ErrorInfo:
    """`describe` without the log line (for the observer, which sees every failure too)."""
    if isinstance(exc, CacheIndexError):
        return ErrorInfo(_INDEX_CODES.get(type(exc), ErrorCode.INTERNAL), str(exc), exc.retryable)
    if is_full(exc):  # Redis at its maxmemory refused the write (`noeviction`)
        return StorageFull(f"redis: {exc}").info()
    if is_transient(exc):  # a server down, a failover, a write no replica confirmed in time
        return ErrorInfo(ErrorCode.REDIS_UNAVAILABLE, f"redis: {exc}", True)
    return error_info(exc)


def step_failed(exc: Exception) -> CodedError:
    """Whatever broke a step after its plan script, or lost the script's reply (it may have run),
    the step was released: planning it again may succeed, so the error is retryable whatever its
    cause (its code says the cause)."""
    info = describe(exc)
    return CodedError(ErrorInfo(info.code, f"step released: {info.message}", True))


class CacheTierService:
    """See the module docstring. `async with CacheTierService(settings) as service:` serves on
    `service.url` until the block ends."""

    def __init__(self, settings: ServiceSettings, observer: ServiceObserver | None = None) -> None:
        self.settings = settings
        self.config = settings.config
        self.observer = observer or ServiceObserver()
        self.url = ""
        self._endpoint: Endpoint | None = None
        self._redis: RedisClient | None = None
        self._placement: ShardPlacement | None = None  # each pool's hash tag (its shard)
        self._server: asyncio.Server | None = None
        self._pools: dict[str, _Pool] = {}
        self._connections: set[asyncio.Task[None]] = set()
        self._handshaking = 0  # connections whose hello is not accepted yet
        self._shares = ConnectionShares(settings.limits)
        self._client_bound = _client_bound(settings)
        self._losses: set[asyncio.Task[None]] = set()
        self._reaper: asyncio.Task[None] | None = None
        self._registering = asyncio.Lock()  # registrations are rare: one at a time, all pools
        self._handlers: dict[type, Callable[[Any], Awaitable[Any]]] = {
            Plan: self._plan, Commit: self._commit, Confirm: self._confirm,
            Release: self._release, Stats: self._stats, Health: self._health,
            Route: self._route, Pin: self._pin, Handoff: self._handoff,
            Invalidate: self._invalidate_pool,
        }

    @property
    def redis(self) -> RedisClient:
        if self._redis is None:
            raise RuntimeError("the service is not started")
        return self._redis

    @property
    def placement(self) -> ShardPlacement:
        if self._placement is None:
            raise RuntimeError("the service is not started")
        return self._placement

    async def start(self) -> str:
        """Connect to Redis and listen; returns the URL clients and agents connect to."""
        self._redis = connect_redis(self.settings.redis_target())
        self._placement = ShardPlacement(self._redis, self.settings.replica_acks())
        self._server, self._endpoint = await Endpoint.parse(self.settings.listen).listen(
            self._connected)
        self.url = self._endpoint.url
        if self.settings.request_lease_s is not None:
            self._reaper = asyncio.create_task(run_reaper(
                lambda: [(name, state.index) for name, state in self._pools.items()],
                self.observer.released, self.settings.reaper))
        return self.url

    async def close(self) -> None:
        """Stop listening, drop every connection (agents included) and the Redis pool."""
        if self._server is not None:
            self._server.close()
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, *self._losses, return_exceptions=True)
        for state in self._pools.values():
            await state.recovery.close()
            for coalescer in (state.plans, state.commits, state.confirms, state.releases):
                if coalescer is not None:
                    await coalescer.close()
        if self._redis is not None:
            await close_redis(self._redis)
        if self._endpoint is not None and self._endpoint.scheme == "unix":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._endpoint.path)
        self._server = self._redis = self._endpoint = self._reaper = self._placement = None

    async def __aenter__(self) -> CacheTierService:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.shield(self.close())

    async def agent_lost(self, pool: str, rank: int, agent_id: str | None = None) -> None:
        """The agent of (`pool`, `rank`) is gone: fail the pool's steps in flight here and start a
        new epoch. With `agent_id` (the liveness watcher's report), a report about a process this
        replica already stopped using, or about an earlier process of the rank than the one
        registered here, changes nothing."""
        state = self._pools.get(pool)
        if state is None or agent_id in state.agents.gone:
            return  # never served here (a replica that did acts on it), or handled already
        link = state.agents.links.get(rank)
        if link is None:
            await self._invalidate(state, AgentLost(f"pool {pool}: agent of rank {rank} lost",
                                                    [rank]))
        elif agent_id in (None, link.identity.agent_id):
            await self._lose(state, link, "reported dead")

    def knows_agent(self, pool: str, rank: int, agent_id: str) -> bool:
        """Whether `agent_id` serves (`pool`, `rank`) here: the liveness watcher believes only
        statuses of such agents (anyone on the broker could publish others)."""
        state = self._pools.get(pool)
        link = state.agents.links.get(rank) if state is not None else None
        return link is not None and link.identity.agent_id == agent_id

    # connections

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        limits = self.settings.limits
        # nothing is buffered or decoded for a peer that has not authenticated beyond a frame
        # that can only be a hello (a 16 MiB one of empty arrays once took the service to 1.5 GB)
        stream = FramedStream(reader, writer, limits.hello_max_frame)
        share: PrincipalQuota | None = None
        quota: ClientQuota | None = None
        try:
            admitted = await self._admitted(stream)
            principal, share = admitted.principal, admitted.share
            stream.max_frame = self.settings.max_frame
            if principal.role is Role.AGENT:
                stream.bound = agent_frame_bound(limits)
                await self._serve_agent(stream, principal)
            else:
                stream.bound = self._client_bound
                quota = ClientQuota(share, self.settings.request_lease_s)
                owner = Owner.of(principal, admitted.session, self.settings.secret)
                await serve_requests(stream, CLIENT_OPS,
                                     functools.partial(self._client_call, principal, owner,
                                                       quota),
                                     describe, limit=limits.calls_in_flight,
                                     idle_s=limits.idle_timeout_s)
        except (CacheTierError, OSError, TimeoutError) as exc:
            logger.debug("connection ended: %s", exc)
        except asyncio.CancelledError:
            pass  # `close()`; ending cancelled would make 3.11's stream callback log an error
        finally:
            self._connections.discard(task)
            if quota is not None:
                quota.close()
            if share is not None:
                self._shares.leave(share)
            await stream.close()

    async def _admitted(self, stream: FramedStream) -> Admitted:
        """The hello of a connection within the connection limits (`limits`): its principal,
        session and principal's share; one past them is answered a retryable `LimitExceeded`
        and closed, before anything is read for the connection limits, before the welcome for
        the share."""
        limits = self.settings.limits
        refusal = None
        if len(self._connections) > limits.max_connections:
            refusal = LimitExceeded("max_connections", f"{limits.max_connections} connections "
                                    "open", retryable=True)
        elif self._handshaking >= limits.max_handshaking:
            refusal = LimitExceeded("max_handshaking", f"{limits.max_handshaking} connections "
                                    "not authenticated yet", retryable=True)
        if refusal is not None:
            self.observer.quota_rejected(None, refusal.limit)
            await send_error(stream, None, refusal, describe)
            raise refusal
        self._handshaking += 1
        try:
            return await self._handshake(stream)
        finally:
            self._handshaking -= 1

    async def _handshake(self, stream: FramedStream) -> Admitted:
        """The first frame must be a hello with our version and a credential for the role it
        asks, whose share has room; any failure is answered with an error frame and ends the
        connection."""
        frame = None
        try:
            frame = await self._first_frame(stream)
            hello = self._check_hello(frame)
            principal = verify(self.settings.secret, hello.token)
            access.check_connection(principal, hello.role)
            share = self._share_of(principal)
            try:
                await stream.send(ok_frame(request_id(frame), Welcome(PROTOCOL_VERSION,
                                                                      self.settings.server_id)))
            except BaseException:
                self._shares.leave(share)
                raise
            return Admitted(principal, hello.session, share)
        except CacheTierError as exc:
            await send_error(stream, request_id(frame), exc, describe)
            raise

    async def _first_frame(self, stream: FramedStream) -> Any:
        """A peer that connects must speak first, and soon."""
        try:
            async with asyncio.timeout(self.settings.handshake_timeout_s):
                return await stream.read()
        except TimeoutError:
            raise HandshakeRequired("nothing received within "
                                    f"{self.settings.handshake_timeout_s:g} s") from None

    def _share_of(self, principal: Principal) -> PrincipalQuota:
        """Count the connection in its principal's share (`limits.ConnectionShares`)."""
        try:
            return self._shares.admit(principal, len(self._connections))
        except LimitExceeded as exc:
            self.observer.quota_rejected(None, exc.limit)
            raise

    @staticmethod
    def _check_hello(frame: Any) -> Hello:
        if not isinstance(frame, dict) or frame.get("op") != "hello":
            raise HandshakeRequired("the first frame must be {op: 'hello', id, version, token}")
        hello: Hello = parse_request(frame, op_table(Hello))
        if hello.version != PROTOCOL_VERSION:
            raise VersionMismatch(f"protocol version {hello.version} is not {PROTOCOL_VERSION}")
        if len(hello.session) > MAX_SESSION_CHARS:
            raise BadMessage(f"a session id holds at most {MAX_SESSION_CHARS} characters")
        return hello

    async def _client_call(self, principal: Principal, owner: Owner, quota: ClientQuota,
                           message: Any) -> Any:
        """A client's call within its role and limits (`access`, `limits`): the role, sizes,
        quotas, then the call on its owner's requests (`ownership`); every answer, refusals
        included, reaches the observer."""
        started = time.perf_counter()
        pool = getattr(message, "pool", None)
        try:
            access.check_op(principal, message.op)
            config = self.config_for(pool) if pool else self.config
            try:
                check_size(message, self.settings.limits, config)
                await quota.admit(message)
            except LimitExceeded as exc:
                self.observer.quota_rejected(pool, exc.limit)
                raise
            scoped = owner.inbound(message, hash_len(config.cache.hash_algo))
            reply = owner.outbound(await self._dispatch(scoped))
        except Exception as exc:
            self.observer.answered(message, None, classify(exc), time.perf_counter() - started)
            raise
        quota.account(message, reply)
        self.observer.answered(message, reply, None, time.perf_counter() - started)
        return reply

    async def _dispatch(self, message: Any) -> Any:
        try:
            return await self._handlers[type(message)](message)
        except Exception as exc:
            self._storage_failed(exc)
            raise

    def _storage_failed(self, exc: BaseException) -> None:
        """A call that found a pool's storage behind this replica (anywhere in the chain of
        causes) starts its recovery and is answered `PoolRecovering`; one that lost Redis
        leaves every pool to be verified again before its next call."""
        cause: BaseException | None = exc
        seen: set[int] = set()
        while cause is not None and id(cause) not in seen:  # a chain may loop
            seen.add(id(cause))
            if isinstance(cause, StorageRollback) and cause.pool in self._pools:
                raise self._pools[cause.pool].recovery.start(cause) from exc
            if is_transient(cause):  # a server down or failing over: it may come back older
                for state in self._pools.values():
                    state.recovery.verified = False
            cause = cause.__cause__ or cause.__context__

    # agents

    async def _serve_agent(self, stream: FramedStream, principal: Principal) -> None:
        """Register the agent (for its credential's pool and rank only), then push it copy
        batches until its connection ends."""
        frame = None
        try:
            frame = await self._first_frame(stream)
            register: Register = parse_request(frame, op_table(Register))
            access.check_registration(principal, register)
            state, registered = await self._register(register)
        except Exception as exc:
            await send_error(stream, request_id(frame), exc, describe)
            return
        await stream.send(ok_frame(request_id(frame), registered))
        name = f"agent {register.pool}/{register.rank}"
        link = AgentLink(register.identity, Channel(stream, name), register.data_url)
        state.agents.attach(link)
        try:
            await link.channel.wait_closed()
        except asyncio.CancelledError:  # this replica is stopping; the agent is not lost
            state.agents.detach(link)
            await link.channel.close()
            raise
        await self._lose(state, link, "connection closed")

    def indexes(self) -> dict[str, PrefixIndex]:
        """The index of every pool this replica knows (for monitors: read-only calls only)."""
        return {name: state.index for name, state in self._pools.items()}

    def config_for(self, pool: str) -> Config:
        return self.settings.pool_configs.get(pool, self.config)

    async def _register(self, msg: Register) -> tuple[_Pool, Registered]:
        tp = self.config_for(msg.pool).model.tp_degree
        if msg.tp_degree != tp or not 0 <= msg.rank < tp:
            raise BadMessage(f"rank {msg.rank} of tp_degree {msg.tp_degree} does not fit this "
                             f"service's model (tp_degree {tp})")
        async with self._registering:
            if msg.pool not in self._pools:
                await self.placement.resolve(msg.pool, create=True)
            state = self._pools.get(msg.pool) or self._new_pool(msg.pool)
            seen = state.index.view
            await state.index.create()  # a pool of another geometry is refused here
            restarted = await state.recovery.reconcile(seen.merge(PoolView(msg.epoch or 0,
                                                                           msg.writes)))
            self._pools[msg.pool] = state
            previous = state.agents.links.get(msg.rank)
            if previous is not None:
                await self._lose(state, previous, "replaced by a new registration")
            elif msg.epoch is None and not restarted:  # new bytes: what the pool holds is gone
                await self._invalidate(state, AgentLost(f"pool {msg.pool}: rank {msg.rank} "
                                                        "restarted", [msg.rank]))
        return state, Registered(state.index.epoch, state.config.model, state.config.cache,
                                 state.index.writes, peer_token(self.settings.secret))

    async def _lose_failed(self, state: _Pool, links: list[AgentLink],
                           cause: BaseException) -> None:
        """Drop the agents a failed step says it lost (the others stay)."""
        if isinstance(cause, AgentLost):
            for link in links:
                if link.rank in cause.ranks:
                    await self._lose(state, link, str(cause))

    async def _lose(self, state: _Pool, link: AgentLink, why: str) -> None:
        """Stop using `link` and start a new epoch, once per link: every caller (its connection
        ending, a step that saw it fail, a liveness report) waits for that same invalidation,
        so a failed step is answered only once its pool's epoch has moved on."""
        if link.loss is None:
            link.loss = asyncio.create_task(self._forget(state, link, why))
            self._losses.add(link.loss)
            link.loss.add_done_callback(self._losses.discard)
        await asyncio.shield(link.loss)

    async def _forget(self, state: _Pool, link: AgentLink, why: str) -> None:
        if not state.agents.detach(link):
            return  # this replica is stopping: the agent is not lost
        logger.warning("pool %s: agent of rank %d lost (%s)", link.identity.pool, link.rank, why)
        await link.channel.close()  # its copies in flight fail now
        await self._invalidate(state, AgentLost(f"pool {link.identity.pool}: agent of rank "
                                                f"{link.rank} lost ({why})", [link.rank]))

    async def _invalidate(self, state: _Pool, failure: CacheTierError) -> None:
        state.agents.fail_steps(failure)
        try:
            epoch = await _acknowledged(state.index.invalidate)
        except StorageRollback as exc:  # the recovery starts it over in a fresh epoch instead
            state.recovery.start(exc)
            return
        self.observer.invalidated(state.agents.pool, epoch)

    def _new_pool(self, pool: str) -> _Pool:
        config = self.config_for(pool)
        index = PrefixIndex(self.redis, pool, config, acks=self.settings.replica_acks(),
                            tag=self.placement.cached(pool),
                            lease_s=self.settings.request_lease_s)
        agents = PoolAgents(pool, config.model.tp_degree)
        state = _Pool(index, agents, config, PoolRecovery(index, agents, self.observer))
        if self.settings.batch_tick_s > 0:
            tick, most = self.settings.batch_tick_s, config.cache.max_batch
            state.plans = PlanCoalescer(functools.partial(self._plan_now, state), index.release,
                                        tick, most)
            state.commits = CommitCoalescer(functools.partial(_commit_now, index),
                                            index.commit_groups, tick, most)
            state.confirms = ConfirmCoalescer(functools.partial(_confirm_now, index),
                                              index.confirm_many, tick, most)
            state.releases = ReleaseCoalescer(functools.partial(_release_now, index), tick, most)
        return state

    async def _known_pool(self, pool: str) -> _Pool:
        """The pool's state here, its storage verified (`recovery`); a pool that does not exist
        in Redis is not remembered, so requests naming random pools cost no memory."""
        if pool not in self._pools:
            if await self.placement.resolve(pool, create=False) is None:
                raise UnknownPool(f"unknown pool {pool!r}: no agent has registered it")
            state = self._new_pool(pool)
            state.index.epoch = await state.index.current_epoch()
            if state.index.epoch == 0:
                raise UnknownPool(f"unknown pool {pool!r}: no agent has registered it")
            self._pools.setdefault(pool, state)
        state = self._pools[pool]
        await state.recovery.ready()
        return state

    # client operations

    async def _plan(self, msg: Plan) -> PlanReply:
        state = await self._known_pool(msg.pool)
        if state.plans is None:
            outcome = await self._plan_now(state, msg.requests)
        else:
            outcome = await state.plans.submit(msg.requests)
        if isinstance(outcome, StepRefusal):
            return PlanReply(refusal=outcome)
        self.observer.step_planned(msg.pool, outcome)
        return PlanReply(plan=outcome)

    async def _plan_now(self, state: _Pool,
                        requests: Sequence[StepRequest]) -> StepPlan | StepRefusal:
        """One step: the plan script, the copies on every rank, the confirm."""
        links = state.agents.ready_links()
        with state.agents.step() as guard:
            steps = RequestLifecycle(state.index,
                                     functools.partial(self._carry_out, state, links, guard))
            plan_step = functools.partial(steps.plan, requests)
            try:
                if all(r.is_new for r in requests):
                    return await _retry_if_stale(plan_step)
                return await plan_step()  # a continuing request belongs to its plan's epoch
            except MAYBE_RAN as exc:  # the plan may have run: the lifecycle released the step
                raise step_failed(exc) from exc

    async def _carry_out(self, state: _Pool, links: list[AgentLink], guard: StepGuard,
                         plan: StepPlan) -> None:
        """Settle a plan: the copies on every rank, then the confirm. On any failure the loss of
        an agent is handled first (a slow one may still be copying: dropping it starts a new
        epoch, so nothing is planned on pages it may yet write), then the lifecycle releases the
        step's requests, so the failed step is answered in the new epoch, retryable."""
        try:
            guard.check()
            # no page of this plan is written (copies, the caller's pass) before every rank has
            # fenced off older epochs, whose late writers could land in the same page ids
            await fence_links(links, plan.epoch, self.settings.copy_timeout_s)
            batch = step_order(plan, state.config.cache.page_tokens, state.index.writes)
            if batch is not None:
                await run_copies(links, batch, self.settings.copy_timeout_s)
            await state.index.confirm(plan.ticket)
            guard.check()
        except BaseException as exc:
            # Not shielded: only `close()` cancels a step, once, and it waits for this.
            await self._lose_failed(state, links, exc)
            if isinstance(exc, WriterStalled):  # a new epoch moves the pool away from it
                await self._invalidate(state, exc)
            if isinstance(exc, Exception):
                raise step_failed(exc) from exc
            raise

    async def _commit(self, msg: Commit) -> CommitResult:
        state = await self._known_pool(msg.pool)
        if state.commits is None:
            result = await _commit_now(state.index, msg.items)
        else:
            result = await state.commits.submit(msg.items)
        self.observer.committed(msg.pool, result)
        return result

    async def _confirm(self, msg: Confirm) -> int:
        state = await self._known_pool(msg.pool)
        if state.confirms is None:
            return await _confirm_now(state.index, [msg.ticket])
        return await state.confirms.submit([msg.ticket])

    async def _release(self, msg: Release) -> ReleaseResult:
        state = await self._known_pool(msg.pool)
        if state.releases is None:
            result = await _release_now(state.index, msg.rids)
        else:
            result = await state.releases.submit(msg.rids)
        self.observer.released(msg.pool, result)
        return result

    async def _stats(self, msg: Stats) -> PoolStats:
        state = await self._known_pool(msg.pool)
        stats = await state.index.stats()
        return PoolStats(pool=msg.pool, ranks=sorted(state.agents.links), **asdict(stats))

    async def _route(self, msg: Route) -> RouteReply:
        """Every pool's probe, one round trip per shard (`index.routing`); the longest usable
        prefix first."""
        states = [await self._known_pool(pool) for pool in dict.fromkeys(msg.pools)]
        probes = await probe_pools([s.index for s in states], msg.prompt_tokens, msg.hashes,
                                   self.settings.route_from_replicas)
        return RouteReply(sorted(probes, key=lambda p: (-p.hit_tokens, -p.mla_tokens)))

    async def _pin(self, msg: Pin) -> PinnedPrefix:
        """The reader's pins are released like a request's (`Release`), so a reader that plans
        again after a lost reply releases first, as the client's docstring says for plans."""
        state = await self._known_pool(msg.pool)
        return await _retry_if_stale(functools.partial(state.index.pin_prefix, msg.reader,
                                                       msg.prompt_tokens, msg.hashes))

    async def _handoff(self, msg: Handoff) -> HandoffReply:
        """`cachetier.service.handoff`, as a step of both pools: a lost agent of either fails it, and
        any failure after the source pin answers a retryable error (both pools released)."""
        if msg.src_pool == msg.dst_pool:
            raise BadMessage("a hand-off needs two different pools")
        src, dst = await self._known_pool(msg.src_pool), await self._known_pool(msg.dst_pool)
        src_links, dst_links = src.agents.ready_links(), dst.agents.ready_links()
        with src.agents.step() as src_guard, dst.agents.step() as dst_guard:
            sides = (PoolSide(src.index, src.config, src_links, src_guard),
                     PoolSide(dst.index, dst.config, dst_links, dst_guard))
            try:
                return await hand_off(*sides, msg.prompt_tokens, msg.hashes,
                                      self.settings.copy_timeout_s)
            except (CacheIndexError, BadMessage):  # refused before any pin: retrying won't help
                raise
            except Exception as exc:
                await self._lose_failed(dst, dst_links, exc)
                raise step_failed(exc) from exc

    async def _invalidate_pool(self, msg: Invalidate) -> int:
        state = await self._known_pool(msg.pool)
        await self._invalidate(state, AgentLost(f"pool {msg.pool}: invalidated by an admin", []))
        return state.index.epoch

    async def _health(self, msg: Health) -> HealthReport:
        try:
            redis_ok = bool(await asyncio.wait_for(self.redis.ping(), 2.0))
        except (RedisError, TimeoutError):
            redis_ok = False
        pools = {name: sorted(s.agents.links) for name, s in self._pools.items() if s.agents.links}
        recovering = sorted(name for name, s in self._pools.items() if s.recovery.recovering)
        return HealthReport(self.settings.server_id, PROTOCOL_VERSION, redis_ok, pools,
                            recovering)


def _client_bound(settings: ServiceSettings) -> FrameBound:
    """A client's frames after its hello (`limits.frame_bound`), within `max_frame`."""
    bound = frame_bound(settings.limits, [settings.config, *settings.pool_configs.values()])
    return FrameBound(min(bound.max_bytes, settings.max_frame), bound.max_objects)


async def _retry_if_stale(call: Callable[[], Awaitable[T]]) -> T:
    """Run an index call; once more if this replica's epoch was stale.

    Another replica (or a liveness report) may have moved the pool to a new epoch; the refused
    call wrote nothing and the index has read the current epoch. Running it again is safe for
    calls that name requests or tickets (those of a dead epoch are simply unknown in the new one)
    and for plans of new requests only; a continuing request keeps the stale-epoch error.
    """
    try:
        return await call()
    except StaleEpoch:
        return await call()


async def _acknowledged(call: Callable[[], Awaitable[T]], tries: int = 5) -> T:
    """Run a call that may safely run twice (a new epoch) until a replica acknowledges it: an
    epoch bump lost in a failover would bring back pages the bump was meant to void."""
    for _ in range(tries - 1):
        try:
            return await call()
        except WriteNotAcknowledged:
            logger.warning("an epoch bump was not acknowledged by a replica: sent again")
    return await call()


async def _commit_now(index: PrefixIndex, items: Sequence[CommitItem]) -> CommitResult:
    return await _retry_if_stale(functools.partial(index.commit, items))


async def _confirm_now(index: PrefixIndex, tickets: Sequence[int]) -> int:
    """One caller's confirm (its one ticket), as `ConfirmCoalescer` runs it alone."""
    (ticket,) = tickets
    return await _retry_if_stale(functools.partial(index.confirm, ticket))


async def _release_now(index: PrefixIndex, rids: Sequence[str]) -> ReleaseResult:
    return await _retry_if_stale(functools.partial(index.release, rids))
