"""lib.lua's hand-assembled encodings against cmsgpack's own, on a real redis-server: a record the
step writes from its template must read back as the table it stands for."""

from __future__ import annotations

from importlib import resources

import msgpack
import pytest
from redis.asyncio import Redis

from index.scripts import ScriptConstants


def with_lib(snippet: str) -> str:
    lib = (resources.files("index") / "lua" / "lib.lua").read_text()
    return "\n".join([ScriptConstants().preamble(), lib, snippet])


@pytest.mark.parametrize(("kind", "ids", "owner"), [
    ("K", [3, 70000, 5], "c1.turn2"), ("M", [0], "r"), ("M", [2**32 - 1, 128, 65535], "x" * 40),
])
async def test_a_private_record_from_its_template_reads_back_as_its_table(
        redis: Redis, kind: str, ids: list[int], owner: str) -> None:
    lua_ids = "{" + ", ".join(map(str, ids)) + "}"
    snippet = f"""
    begin_call(KEYS)
    local ids = {lua_ids}
    return {{private_record("{kind}", ids, "{owner}"),
             cmsgpack.pack({{k = "{kind}", g = 0, pages = ids, st = "private", owner = "{owner}",
                            lu = 0, lc = 0, depth = 0, kids = 0}})}}"""
    template, packed = await redis.eval(with_lib(snippet), 0)
    assert msgpack.unpackb(template, raw=False) == msgpack.unpackb(packed, raw=False)
    assert msgpack.unpackb(template, raw=False)["pages"] == ids
