"""Errors raised by the index, mapped from the scripts' `CT_<CODE>` replies.

`ValueError` for bad input, `LookupError` for things that do not exist (any more), `RuntimeError`
for corrupted state (STYLE.md). `retryable` tells a scheduler whether the same step may succeed if
planned again.
"""

from __future__ import annotations


class CacheIndexError(Exception):
    retryable = False


class BadRequest(CacheIndexError, ValueError):
    pass


class PoolConflict(CacheIndexError, ValueError):
    pass


class UnknownPool(CacheIndexError, LookupError):
    pass


class UnknownEntity(CacheIndexError, LookupError):
    """An unknown request or ticket: released, already confirmed, or wiped by an invalidation."""

    retryable = True


class StaleEpoch(CacheIndexError, LookupError):
    """The pool was invalidated since the caller last looked: its pins are void; plan again."""

    retryable = True


class CorruptState(CacheIndexError, RuntimeError):
    pass


class StorageRollback(CacheIndexError, RuntimeError):
    """The pool is behind what this caller has seen of it (`index.identity`): its storage went
    back in time. Retryable: its pool starts over in a fresh epoch (`PrefixIndex.reconcile`)."""

    retryable = True
    pool = ""  # the pool's id, set by the `PrefixIndex` that found it


class StorageLost(StorageRollback):
    """A pool this caller has seen is gone from its storage (restarted empty, data lost)."""


_BY_CODE: dict[str, type[CacheIndexError]] = {
    "CT_BADINPUT": BadRequest, "CT_CONFLICT": PoolConflict, "CT_NOPOOL": UnknownPool,
    "CT_UNKNOWN": UnknownEntity, "CT_STALE": StaleEpoch, "CT_CORRUPT": CorruptState,
    "CT_ROLLBACK": StorageRollback,
}


def from_reply(message: str) -> CacheIndexError | None:
    """The typed error for a script's error reply, or None when it is not one of ours."""
    code, _, text = message.partition(" ")
    text = text.split(" script: ", 1)[0]  # Redis appends the script's SHA and line
    cls = _BY_CODE.get(code)
    return cls(text) if cls else None
