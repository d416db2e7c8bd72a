"""Cache events for routers and observers: what each pool stored, removed or cleared.

The shape follows vLLM's KV events: tagged structs (`BlockStored`, `BlockRemoved`,
`AllBlocksCleared`) sent in an `EventBatch`, msgpack-encoded as arrays with the tag first, one MQTT
message per batch on `cachetier/<pool>/events` at QoS 1. Every publisher (one per service replica,
named by a random `source`) numbers its batches per pool from 0, so a consumer that sees seq 7
after seq 5 knows one batch is lost and its view of the pool must be rebuilt; QoS 1 redeliveries
come back with an old seq and are dropped. Publishing never blocks a scheduling step: batches wait
in a bounded buffer while the broker is away, and the oldest are dropped when it is full, which
consumers then see as a gap.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Self

import aiomqtt
import msgpack

from cachetier.events.mqtt import (TOPIC_ROOT, Backoff, LinkOwner, MqttLink, check_pool_name,
                                   payload_bytes)
from index.records import Removal

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
CacheKind = Literal["mla", "kda"]
_KIND_OF_REMOVAL: dict[str, CacheKind] = {"ep": "mla", "ck": "kda"}


def events_topic(pool: str) -> str:
    """The topic of one pool's batches; `pool="+"` gives the filter for every pool."""
    return f"{TOPIC_ROOT}/{pool if pool == '+' else check_pool_name(pool)}/events"


@dataclass(frozen=True)
class BlockStored:
    """Blocks a commit stored (matchable once its ticket is confirmed, moments later). Each hash
    covers `block_size` tokens past its parent:
    `parent_block_hash` for the first (None at the namespace root), the previous hash after that.
    MLA events list registered endpoints; a KDA event lists one checkpoint boundary.
    `group_idx` None means every group of the kind: page sets are stored and evicted whole."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    block_size: int
    kind: CacheKind
    group_idx: int | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks that are no longer matchable (evicted, rolled back or recycled)."""

    block_hashes: list[bytes]
    kind: CacheKind
    group_idx: int | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    """The pool was invalidated (agent lost, operator request): nothing of it is matchable any more;
    `epoch` is the pool's new epoch, so a consumer can ignore stragglers from older ones."""

    epoch: int


CacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
_EVENT_TYPES: dict[str, type[CacheEvent]] = {
    cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}


@dataclass(frozen=True)
class EventBatch:
    """One MQTT message: `seq` counts the batches of (`pool`, `source`) from 0; `ts` is Unix time."""

    ts: float
    seq: int
    pool: str
    source: str
    events: list[CacheEvent]


def removed_events(removals: Iterable[Removal]) -> list[BlockRemoved]:
    """The index's removal records (`StepPlan.removed`, `CommitResult.removed`, ...) as events:
    one per cache kind present, hashes in the index's order."""
    by_kind: dict[CacheKind, list[bytes]] = {}
    for removal in removals:
        by_kind.setdefault(_KIND_OF_REMOVAL[removal.kind], []).append(removal.block_hash)
    return [BlockRemoved(hashes, kind) for kind, hashes in by_kind.items()]


def encode_batch(batch: EventBatch) -> bytes:
    events = [[type(e).__name__, *(getattr(e, f.name) for f in dataclasses.fields(e))]
              for e in batch.events]
    return msgpack.packb([FORMAT_VERSION, batch.ts, batch.seq, batch.pool, batch.source, events],
                         use_bin_type=True)


def decode_batch(payload: bytes) -> EventBatch:
    """The batch in `payload`; ValueError for anything that is not a batch of this format."""
    try:
        version, ts, seq, pool, source, events = msgpack.unpackb(payload, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ValueError(f"not an event batch: {exc}") from None
    if version != FORMAT_VERSION:
        raise ValueError(f"event batch format {version!r}, expected {FORMAT_VERSION}")
    if not (isinstance(ts, (int, float)) and isinstance(seq, int) and seq >= 0
            and isinstance(pool, str) and isinstance(source, str) and isinstance(events, list)):
        raise ValueError("event batch header has wrong types")
    return EventBatch(float(ts), seq, pool, source, [_decode_event(e) for e in events])


def _decode_event(item: Any) -> CacheEvent:
    if not isinstance(item, list) or not item or item[0] not in _EVENT_TYPES:
        raise ValueError(f"not a tagged event: {item!r:.80}")
    try:
        return _EVENT_TYPES[item[0]](*item[1:])
    except TypeError as exc:
        raise ValueError(f"bad {item[0]} event: {exc}") from None


class EventPublisher:
    """Numbers batches per pool and hands them to `_send`; subclasses say where they go.

    `publish` is synchronous and never waits on the network, so the service can call it on the
    path of a scheduling step. Enter the publisher (`async with`) to run its delivery.
    """

    def __init__(self) -> None:
        self.source = secrets.token_hex(4)
        self._next_seq: dict[str, int] = {}

    def publish(self, pool: str, events: Sequence[CacheEvent]) -> None:
        """Send `events` as the pool's next batch; an empty list sends nothing."""
        check_pool_name(pool)
        if not events:
            return
        seq = self._next_seq.get(pool, 0)
        self._next_seq[pool] = seq + 1
        self._send(EventBatch(time.time(), seq, pool, self.source, list(events)))

    def _send(self, batch: EventBatch) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        return None


class NullEventPublisher(EventPublisher):
    """For a service run without a broker: events go nowhere."""

    def _send(self, batch: EventBatch) -> None:
        return None


class MqttEventPublisher(LinkOwner, EventPublisher):
    """Delivers batches at QoS 1, in order, from a buffer of at most `max_queued` batches.

    A batch leaves the buffer only once the broker acknowledged it, so a connection lost
    mid-publish resends it after reconnecting (consumers drop the duplicate by its seq).
    """

    def __init__(self, url: str, *, max_queued: int = 4096, publish_timeout_s: float = 2.0,
                 flush_timeout_s: float = 2.0, backoff: Backoff | None = None) -> None:
        super().__init__()
        self.dropped = 0
        self._pending: collections.deque[tuple[str, bytes]] = collections.deque(maxlen=max_queued)
        self._wakeup = asyncio.Event()
        self._drained = asyncio.Event()
        self._drained.set()
        self._publish_timeout_s = publish_timeout_s
        self._flush_timeout_s = flush_timeout_s
        self.link = MqttLink(url, setup=_nothing, serve=self._deliver, backoff=backoff)

    def _send(self, batch: EventBatch) -> None:
        """Encoded here, so that an unencodable event fails its caller, not the delivery task."""
        message = (events_topic(batch.pool), encode_batch(batch))
        if len(self._pending) == self._pending.maxlen:
            self.dropped += 1
            if self.dropped % 1000 == 1:
                log.warning("event buffer full: %d batches dropped so far", self.dropped)
        self._pending.append(message)
        self._drained.clear()
        self._wakeup.set()

    async def _deliver(self, client: aiomqtt.Client) -> None:
        while True:
            if not self._pending:
                self._drained.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            message = self._pending[0]
            await client.publish(*message, qos=1, timeout=self._publish_timeout_s)
            if self._pending and self._pending[0] is message:  # not pushed out meanwhile
                self._pending.popleft()

    async def __aexit__(self, *exc_info: object) -> None:
        """Deliver what is buffered, for at most `flush_timeout_s`, then disconnect."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._drained.wait(), self._flush_timeout_s)
        await self.link.close()


async def _nothing(client: aiomqtt.Client) -> None:
    return None


class SequenceTracker:
    """The last seq seen per (pool, source), to tell in-order batches from gaps and duplicates.

    A batch's seq is what it says it is, and anyone able to publish on the events topic could say
    anything: one forged batch numbered 2^62 under the real publisher's source, if adopted, made
    every later real batch a duplicate. So a jump of more than `max_gap` past the last seq is
    rejected, not adopted, unless `confirm` such batches arrive in a row, each one past the
    previous (a real publisher that lost that many batches goes on numbering; a single forged
    number does not). At most `max_sources` (pool, source) pairs are followed, the least recently
    heard of forgotten first (a forgotten source is a new one if it comes back).
    """

    def __init__(self, *, max_gap: int = 1 << 20, confirm: int = 3,
                 max_sources: int = 1024) -> None:
        self.max_gap, self.confirm, self.max_sources = max_gap, confirm, max_sources
        self._last: collections.OrderedDict[tuple[str, str], int] = collections.OrderedDict()
        self._jumps: dict[tuple[str, str], tuple[int, int]] = {}  # key: (last jump seq, run)
        self.rejected = 0

    def observe(self, batch: EventBatch) -> int | None:
        """How many batches were missed just before `batch` (0: in order); None for a duplicate
        or a rejected jump.

        A source seen for the first time counts its earlier batches as missed: a consumer that
        joined late has not seen them, so its view is incomplete all the same.
        """
        key = (batch.pool, batch.source)
        last = self._last.get(key, -1)
        if batch.seq <= last:
            return None
        if key in self._last and batch.seq - last > self.max_gap and not self._confirmed(key,
                                                                                         batch):
            self.rejected += 1
            return None
        self._jumps.pop(key, None)
        self._last[key] = batch.seq
        self._last.move_to_end(key)
        if len(self._last) > self.max_sources:
            forgotten, _ = self._last.popitem(last=False)
            self._jumps.pop(forgotten, None)
        return batch.seq - last - 1

    def _confirmed(self, key: tuple[str, str], batch: EventBatch) -> bool:
        """Whether this jump is the `confirm`-th of a run numbered one after the other."""
        seq, run = self._jumps.get(key, (-2, 0))
        run = run + 1 if batch.seq == seq + 1 else 1
        self._jumps[key] = (batch.seq, run)
        return run >= self.confirm


@dataclass(frozen=True)
class ReceivedBatch:
    batch: EventBatch
    missed: int  # batches of the same pool and source lost just before this one


class EventSubscriber(LinkOwner):
    """A consumer of one pool's batches (`pool="+"`: every pool), decoded and checked for gaps;
    duplicates and implausible jumps (`SequenceTracker`) are dropped, undecodable messages logged
    and skipped. Iterate it inside `async with`. At most `max_queued` batches wait for the
    consumer: one that arrives past that is dropped before its seq is taken, so the next one
    delivered reports it missed.
    """

    def __init__(self, url: str, pool: str = "+", *, max_queued: int = 4096,
                 backoff: Backoff | None = None) -> None:
        self.topic = events_topic(pool)
        self.tracker = SequenceTracker()
        self._received: asyncio.Queue[ReceivedBatch] = asyncio.Queue(max_queued)
        self.link = MqttLink(url, setup=self._subscribe, serve=self._receive, backoff=backoff)

    async def _subscribe(self, client: aiomqtt.Client) -> None:
        await client.subscribe(self.topic, qos=1)

    async def _receive(self, client: aiomqtt.Client) -> None:
        async for message in client.messages:
            try:
                batch = decode_batch(payload_bytes(message))
            except ValueError as exc:
                log.warning("skipping a message on %s: %s", message.topic, exc)
                continue
            if self._received.full():
                continue
            missed = self.tracker.observe(batch)
            if missed is not None:
                self._received.put_nowait(ReceivedBatch(batch, missed))

    async def get(self) -> ReceivedBatch:
        return await self._received.get()

    async def __aiter__(self) -> AsyncIterator[ReceivedBatch]:
        while True:
            yield await self._received.get()
