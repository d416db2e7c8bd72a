"""`cachetier agent`: one tensor-parallel rank's share of a pool, on one device.

The agent holds bytes and decides nothing: it builds its `PagedPool` with the geometry the service
sends at registration, runs each copy batch it is sent as one `page_copy` launch, and acknowledges
once the bytes are on the device. It also serves its pages to peer agents (`gpu_pool.transfer`,
on `data_listen`, announced in its registration) and, told to by a `Fetch`, pulls pages of
another pool (possibly of another TP degree) from that pool's agents into its own. A co-located worker attaches to the same memory through the
pool's `PoolHandle` (written to `--handle-file`).

It registers with every service replica it is given and keeps each connection up, reconnecting
with backoff. Copy batches run one at a time. A connection is given up only once the batches it
accepted have finished (`serve_requests` waits for them), so a service that dropped this agent
over a slow batch is served again only when that batch can no longer land on pages the service
has handed out since. Its first registration carries no epoch: its bytes are new, so the service
starts a new epoch for the pool. Later ones carry the highest epoch and pool write count it was
told, kept outside Redis, so a service finding the pool behind them starts it over
(`index.identity`).

Every order carries the epoch it was planned in, and the agent fences the data path
(`gpu_pool.fence`): told to by a `Fence` (or by an order of a newer epoch), it refuses orders
of older epochs from then on, waits for those running and for the in-place writers of the pool
(workers attached through the handle), and only then acknowledges. The service hands out a new
epoch's pages only after every rank's acknowledgement, so no writer of a voided epoch touches
them. An in-place writer is waited for `fence_wait_s` at most (well under the service's copy
timeout): one still in its section then (hung, or any process holding the fence file's lock)
is logged, and the new epoch starts in new pool memory, published as the next handle, while the
holder's mapping is retired (`gpu_pool.fence`).
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import random
import ssl
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cachetier.config import CacheSpec, ModelSpec
from cachetier.errors import (BrokenStream, CacheTierError, ConnectionLost, RemoteError,
                              RequestTimeout, error_info)
from cachetier.private_files import write_private
from cachetier.wire.channel import exchange, serve_requests
from cachetier.wire.framing import DEFAULT_MAX_FRAME, Endpoint, FramedStream
from cachetier.wire.protocol import (AGENT_OPS, PROTOCOL_VERSION, AgentIdentity, CopyBatch, Fence,
                                     Fetch, Hello, Register, Registered)
from gpu_pool import PageLayout, PagedPool, PoolHandle
from gpu_pool.fence import OrderFence, to_the_end
from gpu_pool.observer import AgentObserver
from gpu_pool.streams import PageMove
from gpu_pool.transfer import PageServer, pull
from kernels import page_copy

logger = logging.getLogger("gpu_pool.agent")


@dataclass(frozen=True)
class AgentSettings:
    services: tuple[str, ...]
    pool: str
    token: str  # this agent's credential: bound to `pool` and `rank` (`cachetier.credentials`)
    rank: int = 0
    tp_degree: int = 1
    device: str = "cpu"
    handle_file: Path | None = None
    max_frame: int = DEFAULT_MAX_FRAME
    handshake_timeout_s: float = 10.0
    reconnect_min_s: float = 0.05
    reconnect_max_s: float = 2.0
    debug: bool = False
    data_listen: str = "tcp://127.0.0.1:0"  # where peers pull this rank's pages
    torch_threads: int = 1  # torch's intra-op threads in this process, see Agent.run
    # how long an epoch bump waits for the in-place writers before it leaves them in the old
    # memory (`Agent._fence_writers`): well under the service's copy timeout
    fence_wait_s: float = 1.0
    agent_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # names this process life


class ConfigMismatch(CacheTierError):
    """Two services gave this agent different geometries: it cannot serve both."""


class Agent:
    def __init__(self, settings: AgentSettings, observer: AgentObserver | None = None) -> None:
        if not settings.services:
            raise ValueError("an agent needs at least one service URL")
        self.settings = settings
        self.observer = observer or AgentObserver()
        self.identity = AgentIdentity(settings.pool, settings.rank, settings.agent_id)
        self.pool: PagedPool | None = None
        self.epoch: int | None = None
        self.writes = 0  # the highest pool write count a registration or copy batch carried
        self.registered = asyncio.Event()
        self._copying = asyncio.Lock()
        self.fence = OrderFence(self._fence_writers)
        self.peer_token = ""  # from the registration: what peers pull pages with
        self._pages = PageServer(lambda: self.pool, lambda: self.peer_token, settings.max_frame)

    def handle(self) -> PoolHandle:
        if self.pool is None:
            raise RuntimeError("the pool exists once the agent has registered")
        return self.pool.handle()

    async def run(self) -> None:
        """Serve every service until cancelled. A refusal that retrying cannot fix (token,
        version, geometry, a TLS certificate its CA did not sign) ends the run with that error.

        Torch's thread count is bounded first (`torch_threads`): a CPU agent's copies move a few
        pages each, and with torch's default (one thread per core) they mostly wait on each other
        and on the service sharing the cores (measured: 2.5 ms of CPU per step, 0.45 with one)."""
        if self.settings.torch_threads < 1:
            raise ValueError(f"torch_threads must be at least 1, got {self.settings.torch_threads}")
        torch.set_num_threads(self.settings.torch_threads)
        await self._pages.start(self.settings.data_listen)
        try:
            async with asyncio.TaskGroup() as group:
                for url in self.settings.services:
                    group.create_task(self._keep_connected(url))
        except BaseExceptionGroup as group:
            raise _first(group) from None
        finally:
            await self._pages.close()
            self._shut_down()

    async def _keep_connected(self, url: str) -> None:
        delay = self.settings.reconnect_min_s
        while True:
            try:
                await self._session(url)
                delay = self.settings.reconnect_min_s  # it had registered: start the backoff over
            except ssl.SSLCertVerificationError:  # a service its CA did not sign: never ours
                raise
            except (OSError, ConnectionLost, BrokenStream, RequestTimeout) as exc:
                logger.info("service %s: %s", url, exc)
            except RemoteError as exc:
                if not exc.retryable:
                    raise
                logger.info("service %s refused for now: %s", url, exc)
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(2 * delay, self.settings.reconnect_max_s)

    async def _session(self, url: str) -> None:
        """One connection: hello, register, then answer copy batches until it ends."""
        stream = await Endpoint.parse(url).connect(self.settings.max_frame)
        try:
            async with asyncio.timeout(self.settings.handshake_timeout_s):
                await self._register(stream, url)
            await serve_requests(stream, AGENT_OPS, self._serve_op, error_info)
        except TimeoutError:
            raise RequestTimeout(f"{url}: no answer to the handshake") from None
        finally:
            await stream.close()

    async def _register(self, stream: FramedStream, url: str) -> None:
        s = self.settings
        await exchange(stream, 0, Hello(PROTOCOL_VERSION, s.token, "agent"))
        register = Register(s.pool, s.rank, s.tp_degree, self.identity.agent_id, self.epoch,
                            self._pages.url, self.writes)
        registered: Registered = await exchange(stream, 1, register)
        self._adopt(registered.model, registered.cache)
        self.epoch = registered.epoch
        self.writes = max(self.writes, registered.writes)
        self.peer_token = registered.peer_token
        self.registered.set()
        self.observer.registered(self.identity, url, registered.epoch)
        logger.info("pool %s rank %d registered with %s, epoch %d", s.pool, s.rank, url,
                    registered.epoch)

    def _adopt(self, model: ModelSpec, cache: CacheSpec) -> None:
        """Build the pool from the first registration's geometry; later ones must agree."""
        if self.pool is None:
            self.pool = self._new_pool(model, cache)
            self._publish_handle(self.pool.handle())
        elif (self.pool.layout.model, self.pool.layout.cache) != (model, cache):
            raise ConfigMismatch(f"a service sent another geometry for pool {self.settings.pool}")

    def _new_pool(self, model: ModelSpec, cache: CacheSpec) -> PagedPool:
        return PagedPool.create(model, cache, self.settings.device, debug=self.settings.debug)

    def _fence_writers(self, epoch: int) -> None:
        """Blocking, off the event loop (`OrderFence`): no in-place writer of an epoch before
        `epoch` can touch the pages `epoch` hands out. Those in a section are waited for up to
        `fence_wait_s`; past it the pool moves to new memory (`_move_pool`). No pool yet: no
        writer either."""
        pool = self.pool
        if pool is not None and not pool.fence.advance(epoch, self.settings.fence_wait_s):
            self._move_pool(pool, epoch)

    def _move_pool(self, old: PagedPool, epoch: int) -> None:
        """Start `epoch` in new memory, its fence at `epoch`, and leave the old one to the
        writers still in it, never to be served again (`gpu_pool.fence`); the bytes of the
        epochs before are void anyway. The old fence is retired before the new handle is
        published, and the raise fails (nothing acknowledged) unless both were done, so a
        worker told of `epoch` either finds the new handle or is refused on the old one."""
        holders = old.fence.holders()
        fresh = self._new_pool(old.layout.model, old.layout.cache)
        fresh.fence.advance(epoch, self.settings.fence_wait_s)  # nobody maps it yet
        old.fence.retire()
        self._publish_handle(fresh.handle())
        self.pool = fresh
        old.close()
        logger.warning("pool %s rank %d: the in-place writers' fence was held past %g s (lock "
                       "holders: pids %s); epoch %d starts in new pool memory, the holders' "
                       "mapping is retired and their writes are refused", self.settings.pool,
                       self.settings.rank, self.settings.fence_wait_s, holders or "unknown",
                       epoch)

    def _publish_handle(self, handle: PoolHandle) -> None:
        path = self.settings.handle_file
        if path is None:
            return
        # 0600: whoever reads the handle maps the pool and can overwrite its pages; written
        # whole, then renamed, so a worker never reads half of it
        write_private(path, pickle.dumps(handle))

    async def _serve_op(self, message: CopyBatch | Fence | Fetch) -> int | None:
        if isinstance(message, Fence):
            return await self.fence.advance(message.epoch)
        if isinstance(message, Fetch):
            return await self._fetch(message)
        return await self._copy(message)

    async def _fetch(self, order: Fetch) -> int:
        """Pull every move's streams from the source ranks; acked once the last byte is in place
        (a source lost before that fails the fetch, and the service drops the pages)."""
        if self.pool is None:
            raise RuntimeError("fetch before registration")
        src = PageLayout.from_specs(order.src_model, order.src_cache)
        moves = [PageMove.parse(*row) for row in order.moves]
        async with self.fence.order(order.epoch):
            received = await pull(self.pool, self.settings.rank, src, order.sources, moves,
                                  self.peer_token, max_frame=self.settings.max_frame)
        self.epoch = order.epoch
        return received

    async def _copy(self, batch: CopyBatch) -> None:
        async with self.fence.order(batch.epoch), self._copying:  # one batch at a time
            await to_the_end(asyncio.to_thread(self._run_copies, batch))
        self.epoch = batch.epoch
        self.writes = max(self.writes, batch.writes)

    def _run_copies(self, batch: CopyBatch) -> None:
        """One launch for the whole batch, finished on the device before the ack."""
        if self.pool is None:
            raise RuntimeError("copy batch before registration")
        self.pool.claims.claim(batch.stamp, batch.claims, self.settings.fence_wait_s)
        buffer = self.pool.buffer
        page_copy(buffer, buffer, batch.copies)
        if buffer.is_cuda:
            torch.cuda.current_stream(buffer.device).synchronize()

    def _shut_down(self) -> None:
        if self.settings.handle_file is not None:
            self.settings.handle_file.unlink(missing_ok=True)
        if self.pool is not None:
            self.pool.close()


def _first(group: BaseExceptionGroup) -> BaseException:
    """The first real error of a task group (cancellations of its siblings are noise)."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first(exc)
        if not isinstance(exc, asyncio.CancelledError):
            return exc
    return group.exceptions[0]
