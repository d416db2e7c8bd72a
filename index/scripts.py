"""Loads the Lua scripts once and calls them by SHA.

Each script is `lib.lua` (and `match.lua` for the scripts in `USES_MATCH`) followed by the
script's own file, so the shared helpers are written once and every script stays self-contained
on the server. redis-py's `AsyncScript` sends EVALSHA and
reloads the source on NOSCRIPT (after a server restart or SCRIPT FLUSH).
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import ResponseError

from index.errors import from_reply

SCRIPT_NAMES = ("create_pool", "plan_step", "commit", "confirm", "release", "evict",
                "invalidate_pool", "probe", "pin_prefix", "reweigh")
USES_MATCH = frozenset({"plan_step", "probe", "pin_prefix"})  # look a prompt up


@cache
def script_source(name: str) -> str:
    lua = resources.files("index") / "lua"
    parts = ["lib", *(["match"] if name in USES_MATCH else []), name]
    return "\n".join((lua / f"{part}.lua").read_text() for part in parts)


class Scripts:
    """The pool's scripts bound to one Redis client."""

    def __init__(self, redis: Redis) -> None:
        self._scripts: dict[str, AsyncScript] = {
            name: redis.register_script(script_source(name)) for name in SCRIPT_NAMES
        }

    async def call(self, name: str, keys: list[str], args: list[bytes | str | int | float]):
        try:
            return await self._scripts[name](keys=keys, args=args)
        except ResponseError as exc:
            typed = from_reply(str(exc))
            if typed is None:
                raise
            raise typed from None
