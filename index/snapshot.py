"""Read a whole pool out of Redis, and check every invariant of DESIGN.md on it.

`read_pool` decodes the keys into the same `PoolState` the reference model keeps, so a property
test can compare the two field by field. `sanity_check` is the pool's self-test (SGLang's
`sanity_check()` habit): tests call it after every operation. `recount` recomputes from the
records the counters `stats.lua` reads, so a script that forgets one is caught. All of them read
everything, so they are for tests and operators, never for the hot path.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import msgpack
from redis.asyncio import Redis

from eviction.policy import CLASSES
from index.execution import call_function
from index.meta import CORE_FIELD, COUNTER_FIELDS, decode_core
from index.records import IndexStats
from index.reference import PoolState, pack_ids
from index.scripts import library
from index.tickets import compose, split

_TEXT_FIELDS = ("k", "st", "owner", "cls")


async def read_pool(redis: Redis, keys: list[str], classes: Sequence[str] = CLASSES) -> PoolState:
    """The pool's keys (`pool_keys`) in one read-only call (`snapshot.lua`): atomic, and within
    the service user's ACL."""
    replies = await call_function(redis, library(), "snapshot", keys, [])
    (meta, pages, ep, ck, req, reqh, tix, rf, path, refs, ckr) = map(_pairs, replies[:11])
    free = replies[11]
    lru, lease = (_pairs(flat).items() for flat in replies[12:])
    core = decode_core(meta[CORE_FIELD.encode()])
    counted = {field: int(core[field]) for field in COUNTER_FIELDS}
    return PoolState(
        epoch=counted["epoch"], fresh=counted["fresh"], tick=counted["tick"],
        ticket=counted["ticket"], clock=core["clock"],
        pages=_records(pages, rf, path, refs, ckr, classes),
        free=deque(int(x) for x in free),
        ep={h: tuple(msgpack.unpackb(v)) for h, v in ep.items()},
        ck={h: int(v) for h, v in ck.items()},
        lru={int(m): float(s) for m, s in lru},
        req={k.decode(): _request(msgpack.unpackb(v, raw=True)) for k, v in req.items()},
        reqh={k.decode(): v for k, v in reqh.items()},
        tix=dict(_ticket(int(k), msgpack.unpackb(v, raw=True)) for k, v in tix.items()),
        lease={rid.decode(): int(float(d)) for rid, d in lease},
        lru_page_count=counted["lru_pages"],
        durable_cks=counted["durable_cks"],
    )


def _pairs(flat: list[bytes]) -> dict[bytes, bytes]:
    """HGETALL's (or ZRANGE WITHSCORES's) flat list as the map it lists."""
    return dict(zip(flat[::2], flat[1::2]))


def _ticket(number: int, entry: dict[bytes, Any]) -> tuple[int, list[str]]:
    """A `tix` entry as the reference keeps it: the ticket (counter and nonce) -> its rids."""
    return compose(number, entry[b"n"]), [r.decode() for r in entry[b"rids"]]


def recount(state: PoolState, num_pages: int) -> IndexStats:
    """The pool's counters counted from its records, not read from the counters the scripts
    keep: what `PrefixIndex.stats()` must answer."""
    return IndexStats(epoch=state.epoch, num_pages=num_pages,
                      free_pages=len(state.free) + num_pages - state.fresh,
                      evictable_pages=state.lru_pages(), requests=len(state.req),
                      pending_tickets=len(state.tix), checkpoints=len(state.ck),
                      durable_checkpoints=state.durable_checkpoints())


def _records(pages: dict[bytes, bytes], rf: dict[bytes, bytes], path: dict[bytes, bytes],
             refs: dict[bytes, bytes], ckr: dict[bytes, bytes],
             classes: Sequence[str]) -> dict[int, dict[str, Any]]:
    """Lead records with the pins, ready fill and path the scripts keep in hashes of their own
    merged back in, as the reference model holds them. Pins must be kept for exactly the
    registered sets, and the `ckr` entries (what matching reads of a ready checkpoint) must say
    what the records say, a class as its place in `classes` (the scripts' ScriptConstants):
    AssertionError otherwise."""
    out = {}
    for key, raw in pages.items():
        rec = _record(msgpack.unpackb(raw, raw=True))
        private = rec["st"] == "private"
        assert (key in refs) != private, f"page {int(key)}: pins kept for a private set, or missing"
        rec["ref"] = 1 if private else int(refs[key])  # a private set's owner pin is implied
        if key in rf:
            rec["rf"], rec["path"] = int(rf[key]), path.get(key, b"")
        out[int(key)] = rec
    assert refs.keys() <= pages.keys(), "pins kept for a page set that is gone"
    expected = {rec["h"]: bytes([classes.index(rec["cls"]) + 1]) + pack_ids(rec["pages"])
                for rec in out.values() if rec["k"] == "K" and rec["st"] == "ready" and "h" in rec}
    assert ckr == expected, "the ready checkpoints matching reads disagree with their records"
    return out


def _record(raw: dict[bytes, Any]) -> dict[str, Any]:
    rec = {k.decode(): v for k, v in raw.items()}
    for name in _TEXT_FIELDS:
        if name in rec:
            rec[name] = rec[name].decode()
    return rec


def _request(raw: dict[bytes, Any]) -> dict[str, Any]:
    r = {k.decode(): v for k, v in raw.items()}
    r["pend"] = [_pending(item) for item in r["pend"]]
    return r


def _pending(raw: dict[bytes, Any]) -> dict[str, Any]:
    item = {k.decode(): v for k, v in raw.items()}
    item["fills"] = {int(k): v for k, v in dict(item["fills"] or {}).items()}
    return item


def sanity_check(state: PoolState, num_pages: int, blocks_per_page: int) -> None:
    """Raise AssertionError naming the first broken invariant."""
    free = list(state.free)
    assert len(free) == len(set(free)), "a page is twice on the free list"
    assert all(0 <= p < state.fresh for p in free), "free list holds a never-allocated page"
    leads = state.pages
    held = [pid for rec in leads.values() for pid in rec["pages"]]
    assert all(rec["pages"][0] == lead for lead, rec in leads.items()), "a record off its lead"
    assert len(held) == len(set(held)), "a page belongs to two page sets"
    assert not set(free) & set(held), "a page is both free and referenced"
    assert len(free) + len(held) == state.fresh <= num_pages, "pages leaked or double-counted"
    for lead, rec in leads.items():
        _check_lead(state, lead, rec, blocks_per_page)
    for h, (lead, fill) in state.ep.items():
        rec = leads[lead]
        assert rec["k"] == "M" and [h, fill] in [list(e) for e in rec["eps"]], f"endpoint of {lead} unknown to it"
    for h, lead in state.ck.items():
        rec = leads[lead]
        assert rec["k"] == "K" and rec["h"] == h, "checkpoint record mismatch"
        assert h in state.ep and state.ep[h][0] == rec["anchor"], "checkpoint without its MLA endpoint"
        assert h in leads[rec["anchor"]]["cks"], "anchor does not list its checkpoint"
    assert state.lru_page_count == state.lru_pages(), "meta.lru_pages out of step with the LRU"
    assert state.durable_cks == state.durable_checkpoints(), (
        "meta.durable_cks out of step with the checkpoints' classes")
    assert set(state.lease) <= set(state.req), "a lease outlives its request"
    for ticket, rids in state.tix.items():
        number = split(ticket)[0]
        assert rids and all(number in state.req[rid]["tix"] for rid in rids), (
            f"ticket {ticket} dangles")
    pins = _expected_pins(state)
    for lead, rec in leads.items():
        assert rec["ref"] == pins.get(lead, 0), f"page {lead} refcount {rec['ref']} != holders {pins.get(lead, 0)}"


def _check_lead(state: PoolState, lead: int, rec: dict[str, Any], blocks_per_page: int) -> None:
    assert rec["ref"] >= 0, f"negative refcount on page {lead}"
    evictable = rec["st"] == "ready" and rec["ref"] == 0 and (rec["k"] == "K" or rec["kids"] == 0)
    assert (lead in state.lru) == evictable, f"page {lead} eviction membership wrong"
    if rec["k"] != "M" or rec["st"] == "private":
        return
    assert 0 <= rec["rf"] <= rec["fill"] <= blocks_per_page, f"page {lead} fills out of order"
    kids = sum(1 for r in state.pages.values() if r.get("par") == lead and r.get("st") != "private")
    assert rec["kids"] == kids, f"page {lead} counts {rec['kids']} children, has {kids}"
    if rec["par"] >= 0:
        parent = state.pages[rec["par"]]
        assert parent["path"] + pack_ids(parent["pages"]) == rec["path"], f"page {lead} path broken"
        if rec["rf"] > 0:
            assert parent["rf"] == blocks_per_page, f"ready page {lead} under a page not ready"


def _expected_pins(state: PoolState) -> dict[int, int]:
    """Every reference a live request holds: its hit pin, its restore pin, its private pages."""
    pins: dict[int, int] = {}

    def add(lead: int) -> None:
        if lead >= 0:
            pins[lead] = pins.get(lead, 0) + 1

    for r in state.req.values():
        add(r["pin"])
        for item in r["pend"]:
            add(item["unpin"])
        for lead in r["own"]:
            if state.pages[lead]["owner"] != "":
                add(lead)
        add(r["state"])
        add(r["ck"])
    return pins
