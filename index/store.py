"""The async face of the index: one script call (one round trip) per operation, whatever the batch.

`PrefixIndex` turns records into script arguments and replies back into records. It holds no
metadata of its own beyond its view of the pool (`index.identity.PoolView`: the epoch, write
count and ticket it last saw), which it passes to every call so that a caller holding pins from
before an invalidation is told so (`StaleEpoch`) instead of touching new pages, and a pool whose
storage went back in time is told apart from one that moved on (`StorageRollback`).

A step whose new requests' hashes reach `stage_bytes` (`STAGE_BYTES` by default) sends them
staged in a key of the pool rather than as script arguments (`index.execution.Staged`): the
script then reads the few hashes its lookup probes instead of Lua interning all of them.

With `lease_s`, every request it plans (and every reader it pins) holds a lease of that many
seconds, renewed by each of its steps; `reap` releases those whose lease ran out (a scheduler
that died between plan and release, a release that was lost), a bounded number per call.
Deadlines are read on `clock` (wall-clock seconds), so the replicas sharing a pool must agree on
the time to well within a lease.
"""

from __future__ import annotations

import re
import secrets
import struct
import time
from typing import Any, Callable, Sequence

import msgpack
from redis.asyncio import Redis

from cachetier.config import Config
from eviction.policy import EvictionWeights, lru
from index.errors import (BadRequest, StaleEpoch, StorageLost, StorageRollback, UnknownEntity,
                          UnknownPool)
from index.execution import ReplicaAcks, Staged
from index.hashing import hash_len
from index.identity import PoolView
from index.meta import CORE_FIELD, decode_core
from index.prefix import PinnedPrefix, PrefixProbe
from index.records import (CommitItem, CommitResult, CommittedRequest, EvictResult, IndexStats,
                           PageCopy, ReleaseResult, Removal, RequestPlan, StepPlan, StepRefusal,
                           StepRequest)
from index.scripts import Scripts
from index.tickets import compose, random_nonce, split

KEY_NAMES = ("meta", "pages", "free", "ep", "ck", "lru", "req", "reqh", "tix", "rf", "path",
             "lease", "refs", "ckr")
_POOL_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
# A step's hash bytes from which staging them costs less than Lua interning them as arguments:
# at 4 KB (a 128K-token prompt) both cost about the same (the pipeline's two more commands
# against 5 us of interning), at 32 KB staging saves ~30 us of server time.
STAGE_BYTES = 16384


def pool_keys(pool_id: str, tag: str | None = None) -> list[str]:
    """All keys of one pool share the `{pool_id}` hash tag (or the `tag` its placement chose on a
    cluster, `index.placement`): one Redis Cluster slot per pool."""
    if not _POOL_ID.match(pool_id):
        raise ValueError(f"pool id {pool_id!r} must be 1-128 characters of [A-Za-z0-9_.:-]")
    return [f"ct:{{{tag or pool_id}}}:{name}" for name in KEY_NAMES]


def stage_key(keys: Sequence[str], token: str) -> str:
    """A key of the pool's slot (its keys' prefix) for one call's staged bytes."""
    return f"{keys[0].removesuffix(KEY_NAMES[0])}stage:{token}"


def pool_fields(config: Config, weights: EvictionWeights) -> dict[str, int | float]:
    model, cache = config.model, config.cache
    return {
        "num_pages": cache.num_pages, "blocks_per_page": cache.blocks_per_page,
        "block_tokens": cache.hash_block_tokens, "hash_len": hash_len(cache.hash_algo),
        "kda_groups": model.kda_groups, "mla_groups": model.mla_groups,
        "mla_token_bytes": model.mla_token_bytes, "kda_state_bytes": model.kda_rank_layer_bytes,
        "max_batch": cache.max_batch, **weights.as_pool_fields(),
    }


class PrefixIndex:
    def __init__(self, redis: Redis, pool_id: str, config: Config,
                 weights: EvictionWeights | None = None, acks: ReplicaAcks | None = None,
                 tag: str | None = None, *, lease_s: float | None = None,
                 clock: Callable[[], float] = time.time,
                 nonce: Callable[[], int] = random_nonce, stage_bytes: int = STAGE_BYTES) -> None:
        self.redis = redis
        self.pool_id = pool_id
        self.config = config
        self.weights = weights or lru()
        self.keys = pool_keys(pool_id, tag)
        self.epoch = 0
        self.writes = 0  # the highest meta.wc a reply carried
        self.ticket = 0  # the highest ticket counter a reply carried
        self.nonce = nonce  # each new ticket's nonce (index.tickets)
        self.lease_s = lease_s
        self.clock = clock
        self._scripts = Scripts(redis, acks=acks)  # acks: writes wait for replicas (a cluster)
        self._hash_len = hash_len(config.cache.hash_algo)
        self.stage_bytes = stage_bytes

    async def create(self) -> int:
        """Create the pool (or join an existing one of the same geometry); returns its epoch.
        The view keeps what it saw before: a pool created again after its data was lost is
        behind it until `reconcile` starts it over."""
        args = _pairs(pool_fields(self.config, self.weights))
        epoch = int(await self._scripts.call("create_pool", self.keys, args))
        self.epoch = max(self.epoch, epoch)
        return epoch

    @property
    def view(self) -> PoolView:
        return PoolView(self.epoch, self.writes, self.ticket)

    async def reconcile(self, seen: PoolView, holder: str, fresh_epoch: int) -> str:
        """`reconcile_pool.lua`: a pool behind `seen` (what this caller and its agents saw), or
        held by another storage instance than the last one vouched for while `seen` has no write
        to vouch with, starts over in `fresh_epoch` (or its own epoch + 1); otherwise `holder`
        is stamped as the pool's. Returns why it started over ("" if it did not); either way
        this view is the pool's afterwards."""
        args = [seen.epoch, seen.writes, seen.ticket, fresh_epoch, holder]
        raw = await self._script("reconcile_pool", args)
        reply = _decoded(raw)
        self.epoch = max(self.epoch, reply["epoch"])  # replies of calls in flight may be later
        self.writes = max(self.writes, reply["wc"])
        self.ticket = max(self.ticket, reply["ticket"])
        return reply["why"].decode()

    async def reweigh(self, weights: EvictionWeights, batch: int = 4096) -> int:
        """Switch the pool to new eviction weights and rescore its eviction order, `batch` page
        ids per script call (each call is short, so other operations interleave); returns the
        number of calls."""
        args, first, calls = _pairs(weights.as_pool_fields()), 0, 0
        while first >= 0:
            first = int(await self._call("reweigh", [first, batch, *args], decode=False))
            calls += 1
        self.weights = weights
        return calls

    async def plan_step(self, requests: Sequence[StepRequest]) -> StepPlan | StepRefusal:
        args, staged = self._step_arguments(requests)
        raw = await self._call("plan_step", args, decode=False, staged=staged)
        writes, outcome = decode_step(raw, self.config.model.mla_groups)
        self.writes = max(self.writes, writes)
        if isinstance(outcome, StepPlan):
            self.ticket = max(self.ticket, split(outcome.ticket)[0])
        return outcome

    def step_arguments(self, requests: Sequence[StepRequest]
                       ) -> tuple[list[str], list[Any], Staged | None]:
        """The KEYS, ARGV and staged hashes (their key the last KEY, `call_function`)
        `plan_step(requests)` would send now, checked as it checks them: a benchmark sends them
        to a no-op script to measure what Redis costs before any Lua runs."""
        args, staged = self._step_arguments(requests)
        return self.keys, [self.view.argument, *args], staged

    def _step_arguments(self, requests: Sequence[StepRequest]) -> tuple[list[Any], Staged | None]:
        """The ARGV after the view, and the staged hashes (None: they are in the ARGV)."""
        self._check_batch(requests)
        batch = _pack(self._encode_batch(requests))
        blobs = [bytes(r.hashes) for r in requests if r.is_new]
        if not blobs or sum(map(len, blobs)) < self.stage_bytes:
            return [batch, *blobs, self.nonce()], None
        staged = Staged(stage_key(self.keys, secrets.token_hex(8)), b"".join(blobs))
        return [batch, self.nonce()], staged

    async def confirm(self, ticket: int) -> int:
        """Returns how many of the ticket's requests were still active; a ticket this pool did
        not issue in its current epoch (a guess, another epoch's or life's) is `UnknownEntity`."""
        (count,) = await self.confirm_many([ticket])
        if count is None:
            raise unknown_ticket(ticket)
        return count

    async def confirm_many(self, tickets: Sequence[int]) -> list[int | None]:
        """Several tickets in one call, confirmed in order as one `confirm` each would be: per
        ticket, how many of its requests were still active, or None for an unknown one (which
        confirms nothing and fails none of the others)."""
        self._check_size(tickets)
        reply = await self._call("confirm", [part for t in tickets for part in split(t)])
        return [None if count < 0 else count for count in _list(reply["requests"])]

    async def commit(self, items: Sequence[CommitItem]) -> CommitResult:
        (result,) = await self.commit_groups([items])
        return result

    async def commit_groups(self, groups: Sequence[Sequence[CommitItem]]) -> list[CommitResult]:
        """Several callers' commits in one call: each group gets its own ticket and its own
        requests, as if committed one after the other in order (the `removed` of all go to the
        first); any bad item refuses the whole call, as one commit of them all would be."""
        self._check_size([item for group in groups for item in group])
        batch = [{"rid": i.rid, "stop": i.stop, "ckpt_tokens": i.checkpoint_tokens,
                  "kind": i.checkpoint_class, **({"g": g} if g > 1 else {})}
                 for g, group in enumerate(groups, 1) for i in group]
        nonces = [self.nonce() for _ in groups]
        reply = await self._call("commit", [_pack(batch), *nonces])
        self.ticket = max(self.ticket, reply["ticket"] + len(groups) - 1)
        committed = [self._committed(r) for r in _list(reply["requests"])]
        results, at = [], 0
        for g, (group, nonce) in enumerate(zip(groups, nonces)):
            results.append(CommitResult(ticket=compose(reply["ticket"] + g, nonce),
                                        requests=committed[at:at + len(group)],
                                        removed=_removals(reply["removed"]) if g == 0 else []))
            at += len(group)
        return results

    def _committed(self, r: dict[bytes, Any]) -> CommittedRequest:
        stored = r[b"stored"]
        hashes = [stored[i:i + self._hash_len] for i in range(0, len(stored), self._hash_len)]
        return CommittedRequest(r[b"rid"].decode(), r[b"endpoints"], r[b"ckpt"].decode(), hashes,
                                r[b"parent"] or None, r[b"ckh"] or None)

    async def release(self, rids: Sequence[str]) -> ReleaseResult:
        reply = await self._call("release", [_pack(list(rids))])
        return ReleaseResult(reply["released"], [r.decode() for r in _list(reply["unknown"])],
                             _removals(reply["removed"]))

    async def reap(self, count: int) -> ReleaseResult:
        """Release up to `count` requests whose lease has run out, earliest deadline first:
        `released` says how many (each was released as `release` does)."""
        reply = await self._call("release", [_pack([]), _ms(self.clock()), count])
        return ReleaseResult(reply["released"], [], _removals(reply["removed"]))

    def _deadline(self) -> int | None:
        return None if self.lease_s is None else _ms(self.clock() + self.lease_s)

    async def evict(self, count: int) -> EvictResult:
        reply = await self._call("evict", [count])
        return EvictResult(reply["evicted"], _removals(reply["removed"]))

    async def invalidate(self, seen_epoch: int | None = None) -> int:
        """Start a new epoch; with `seen_epoch`, only if the pool is still in that epoch."""
        arg = "" if seen_epoch is None else str(seen_epoch)
        self.epoch = int(await self._script("invalidate_pool", [arg, self.view.argument]))
        return self.epoch

    async def current_epoch(self) -> int:
        core = await self.redis.hget(self.keys[0], CORE_FIELD)
        return 0 if core is None else int(decode_core(core)["epoch"])

    async def drop(self) -> None:
        """Delete the pool, every key of it (a fixed set: UNLINK is O(1) per key), for a scratch
        pool such as a benchmark's; its ids and epochs may then be issued again."""
        await self.redis.unlink(*self.keys)

    async def probe(self, prompt_tokens: int, hashes: bytes) -> PrefixProbe:
        """Read-only: what the pool could serve of the prompt now (no pin, no recency), for a
        router choosing among pools."""
        view = self.view
        return self.probe_answer(view, await self._script("probe", [prompt_tokens, bytes(hashes)]))

    def probe_answer(self, view: PoolView, raw: bytes, replica: bool = False) -> PrefixProbe:
        """`probe.lua`'s reply to a call sent with `view` (`index.routing` sends many at once).
        From the master a reply behind the view is a rollback; from a `replica` it is lag: one
        in an epoch before the view's speaks of void pages and reports no hit. Either way it only
        advises a router: a plan on the master decides what is served, so no replica's answer
        ever becomes a hit."""
        reply = _decoded(raw)
        if replica and reply["epoch"] < view.epoch:
            return PrefixProbe(self.pool_id, view.epoch, 0, 0)
        if not replica:
            reply = self._checked(view, reply)
        block = self.config.cache.hash_block_tokens
        return PrefixProbe(self.pool_id, reply["epoch"], reply["hit"] * block, reply["mla"] * block)

    async def stats(self) -> IndexStats:
        """The pool's counters now, from one O(1) script; read-only and in whatever epoch the
        pool is (it does not refresh `epoch`: a caller's pins are told stale by its next call)."""
        view = self.view
        raw = await self._script("stats", [])
        reply = self._checked(view, _decoded(raw))
        del reply["wc"]
        return IndexStats(**reply)

    async def pin_prefix(self, reader: str, prompt_tokens: int, hashes: bytes) -> PinnedPrefix:
        """Pin the prompt's longest usable prefix under `reader`, for another pool to copy;
        `release([reader])` unpins it. A hit of 0 pins nothing."""
        deadline = self._deadline()
        reply = await self._call("pin_prefix", [reader, prompt_tokens, bytes(hashes),
                                                "" if deadline is None else deadline])
        groups = self.config.model.mla_groups
        table = _page_table(reply["mla"], b"", groups) if reply["hit"] else []
        return PinnedPrefix(reader, reply["epoch"], reply["hit"] * self.config.cache.hash_block_tokens,
                            table, list(_list(reply["ckpt"])))

    async def _call(self, name: str, args: list[Any], decode: bool = True,
                    staged: Staged | None = None) -> Any:
        view = self.view
        try:
            raw = await self._script(name, [view.argument, *args], staged)
        except StaleEpoch:
            current = await self.current_epoch()
            if current < view.epoch:  # went back between the call and this read
                raise self._rolled_back(StorageRollback(f"pool epoch went back to {current}"))
            self.epoch = max(self.epoch, current)  # a concurrent reply may have seen later
            raise
        if not decode:
            return raw
        reply = _decoded(raw)
        self.writes = max(self.writes, reply["wc"])
        if isinstance(reply.get("ticket"), int):
            self.ticket = max(self.ticket, reply["ticket"])
        return reply

    async def _script(self, name: str, args: list[Any], staged: Staged | None = None) -> Any:
        """One script call; a pool this view has seen that is gone is `StorageLost`."""
        try:
            return await self._scripts.call(name, self.keys, args, staged)
        except (UnknownPool, StorageRollback) as exc:
            raise self.storage_error(exc) from None

    def storage_error(self, exc: UnknownPool | StorageRollback) -> Exception:
        """What a script's refusal means for this view: a pool it has seen that is gone is
        `StorageLost`; a rollback names the pool."""
        if isinstance(exc, UnknownPool):
            if self.view == PoolView():
                return exc
            exc = StorageLost(f"pool {self.pool_id} was lost: {exc}")
        return self._rolled_back(exc)

    def _checked(self, view: PoolView, reply: dict[str, Any]) -> dict[str, Any]:
        """A read-only reply (any epoch) from a pool behind the view the call was sent with is
        a rollback too (not the view now: replies of calls sent later may have raised it)."""
        if reply["epoch"] < view.epoch or reply["wc"] < view.writes:
            raise self._rolled_back(StorageRollback(
                f"pool is at epoch {reply['epoch']} write {reply['wc']}, this caller saw epoch "
                f"{view.epoch} write {view.writes}"))
        return reply

    def _rolled_back(self, exc: StorageRollback) -> StorageRollback:
        exc.pool = self.pool_id
        return exc

    def _encode_batch(self, requests: Sequence[StepRequest]) -> list[dict[str, Any]]:
        """New requests name their hash blob by position among the extra script arguments."""
        items, blobs, deadline = [], 0, self._deadline()
        for r in requests:
            item = self._encode(r)
            if deadline is not None:
                item["lease"] = deadline
            if r.is_new:
                blobs += 1
                item["hashes"] = blobs
            items.append(item)
        return items

    def _encode(self, r: StepRequest) -> dict[str, Any]:
        if not isinstance(r.rid, str) or not r.rid:
            raise BadRequest(f"request id must be a non-empty string, got {r.rid!r}")
        if isinstance(r.compute_tokens, bool) or not isinstance(r.compute_tokens, int) or r.compute_tokens < 1:
            raise BadRequest(f"{r.rid}: compute_tokens must be an integer >= 1")
        item: dict[str, Any] = {"rid": r.rid, "compute": r.compute_tokens, "ckpt": int(r.checkpoint),
                                "at_match": int(r.stop_at_match), "at_page": int(r.stop_at_page_end),
                                "at_last": int(r.stop_at_last_page_end),
                                "at_resend": int(r.stop_at_resend_point)}
        if r.turn_end_kind is not None:
            item["turn_end"] = r.turn_end_kind
        if r.is_new:
            blocks = (r.prompt_tokens or 0) // self.config.cache.hash_block_tokens
            if len(r.hashes) != blocks * self._hash_len:
                raise BadRequest(f"{r.rid}: {len(r.hashes)} hash bytes for {r.prompt_tokens} tokens; "
                                 f"expected {blocks} hashes of {self._hash_len} bytes")
            item["tokens"] = r.prompt_tokens
        return item

    def _check_batch(self, requests: Sequence[StepRequest]) -> None:
        """Checked before the script, so before the epoch (ReferenceIndex checks in this order)."""
        self._check_size(requests)
        rids = [r.rid for r in requests]
        if len(set(rids)) != len(rids):
            raise BadRequest("a request id appears twice in the step")

    def _check_size(self, items: Sequence[object]) -> None:
        if len(items) > self.config.cache.max_batch:
            raise BadRequest(f"batch of {len(items)} exceeds max_batch {self.config.cache.max_batch}")


def unknown_ticket(ticket: int) -> UnknownEntity:
    """What `confirm` raises for a ticket the pool does not hold (`confirm_many`'s None)."""
    return UnknownEntity(f"unknown ticket {ticket} (already confirmed, the pool was invalidated, "
                         "or never issued)")


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


def _pairs(fields: dict[str, int | float]) -> list[Any]:
    """Field, value pairs as script arguments; floats by repr, which round-trips exactly."""
    out: list[Any] = []
    for name, value in fields.items():
        out += [name, repr(value) if isinstance(value, float) else value]
    return out


def _pack(value: object) -> bytes:
    # Redis 7.0's cmsgpack predates the bin type: bytes travel as raw strings.
    return msgpack.packb(value, use_bin_type=False)


def _decoded(raw: bytes) -> dict[str, Any]:
    """A script's msgpack reply. Redis' cmsgpack packs every string alike, so keys and hashes
    arrive as bytes; the reply's own keys become str, while the per-request maps a commit's reply
    lists keep byte keys (`_committed`): decoding every key of 64 of them cost more than the
    unpacking."""
    return {k.decode(): v for k, v in msgpack.unpackb(raw, raw=True).items()}


def _list(value: Any) -> list[Any]:
    """Lua packs an empty table as an empty map or list alike."""
    return list(value) if value else []


def _removals(raw: Any) -> list[Removal]:
    return [Removal(kind.decode(), h) for kind, h in _list(raw)]


# plan_step.lua's COPY_FORMAT: one restore or copy-on-write copy (src, dst, offset, nbytes),
# packed little-endian. struct, not numpy: for the few ids and copies of one request, numpy's
# per-call cost was most of the decoding.
COPY_FORMAT = struct.Struct("<IIQQ")


def _ids(packed: bytes) -> tuple[int, ...]:
    """Little-endian uint32 page ids."""
    return struct.unpack(f"<{len(packed) // 4}I", packed)


def _page_table(shared: bytes, own: bytes, groups: int) -> list[list[int]]:
    """[group][slot]: the cached slots, then the request's own page sets (uint32 per page,
    slot-major)."""
    ids = _ids(shared + own)
    return [list(ids[g::groups]) for g in range(groups)]


def decode_step(raw: list[Any], groups: int) -> tuple[int, StepPlan | StepRefusal]:
    """plan_step.lua's array reply (that script's header says what is where; not a msgpack
    map, which cost a pack in Lua and an unpack here on every step): the pool's write count,
    and the plan or the refusal."""
    status, writes, *reply = raw
    if not status:
        reason, need, available = reply
        return writes, StepRefusal(reason.decode(), need, available)
    epoch, ticket, nonce, evicted, removed, planned = reply
    return writes, StepPlan(ticket=compose(ticket, nonce), epoch=epoch,
                            requests=[_request_plan(r, groups) for r in planned],
                            evicted=evicted, removed=_removals(removed))


def _request_plan(r: list[Any], groups: int) -> RequestPlan:
    """One request of plan_step.lua's array reply, its fields in the order the script lists."""
    rid, hit, match, start, stop, shared, own, state, ckpt, ckpt_tokens, copies = r
    return RequestPlan(
        rid=rid.decode(), hit_tokens=hit, start=start, stop=stop,
        mla_pages=_page_table(shared, own, groups), state_pages=list(_ids(state)),
        checkpoint_pages=list(_ids(ckpt)), checkpoint_tokens=ckpt_tokens,
        copies=[PageCopy(*c) for c in COPY_FORMAT.iter_unpack(copies)], match_tokens=match)

