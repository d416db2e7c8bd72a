"""The pool's geometry and counters as one packed field of its meta hash (`meta.core`).

Every script call reads them and every write call saves them. As 17 fields of a hash they cost
an HMGET that scans the hash's listpack once per field, a string-to-number conversion per field,
and on save an HSET whose seven numbers Redis formats one by one: 20-24 us of every call
(`stats`, a load, 48.7 -> 28.5 us; `evict` of nothing, a load and a save, 54.6 -> 30.5 us), some
8% of a one-request step's server time. One field of little-endian doubles is one HGET and one
`struct.unpack` (Lua numbers are doubles, so nothing is lost). The scripts get this definition
through the library's preamble (index/scripts.py); the weights, the record layout and the holder
stay fields of their own, read only by the calls that need them.
"""

from __future__ import annotations

import struct

CORE_FIELD = "core"
# geometry (fixed for the pool's life, create_pool.lua), then counters (lib.lua's meta table)
GEOMETRY_FIELDS = ("num_pages", "blocks_per_page", "block_tokens", "hash_len", "kda_groups",
                   "mla_groups", "mla_token_bytes", "kda_state_bytes", "max_batch")
COUNTER_FIELDS = ("epoch", "fresh", "tick", "ticket", "lru_pages", "clock", "durable_cks", "wc")
CORE_FIELDS = GEOMETRY_FIELDS + COUNTER_FIELDS
CORE_FORMAT = struct.Struct("<" + "d" * len(CORE_FIELDS))


def decode_core(blob: bytes) -> dict[str, float]:
    """`meta.core` as field -> value; every field but `clock` holds an integer."""
    return dict(zip(CORE_FIELDS, CORE_FORMAT.unpack(blob), strict=True))


def lua_core_codec() -> str:
    """Lua for the preamble: `CORE_FORMAT`, `CORE_FIELD`, `CORE_FIELDS` and `GEOMETRY_FIELDS`
    (lists) and the two functions that turn the field into a table and back, spelled field by
    field so that the table is built by one constructor (presized, no rehash) and packed
    without a loop."""
    names = ", ".join(CORE_FIELDS)
    table = ", ".join(f"{n} = {n}" for n in CORE_FIELDS)
    values = ", ".join(f"m.{n}" for n in CORE_FIELDS)

    def quoted(fields: tuple[str, ...]) -> str:
        return "{" + ", ".join(f'"{n}"' for n in fields) + "}"

    return "\n".join([
        f'local CORE_FORMAT, CORE_FIELD = "{CORE_FORMAT.format}", "{CORE_FIELD}"',
        f"local CORE_FIELDS, GEOMETRY_FIELDS = {quoted(CORE_FIELDS)}, {quoted(GEOMETRY_FIELDS)}",
        "local function core_table(raw)",
        f"  local {names} = struct.unpack(CORE_FORMAT, raw)",
        f"  return {{{table}}}",
        "end",
        f"local function core_blob(m) return struct.pack(CORE_FORMAT, {values}) end",
    ])
