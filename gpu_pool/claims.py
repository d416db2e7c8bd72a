"""The fence per request: only the step a page was last handed to may write it in place.

The epoch fence (`gpu_pool.fence`) stops the writers of a voided epoch. Within one epoch a page
also changes hands: a request released by its scheduler, or reaped once its lease ran out, gives
its pages back, and the next step hands them to another request. A forward pass of the first
request that writes late (its scheduler stalled past the lease, or released too early) would land
in the second's bytes, in the same epoch, past the epoch fence.

So every page carries a claim: the ticket counter of the step that last handed it to a request
(`stamp`; counters are never issued twice in a pool's life). The service tells every rank's agent
the pages a step's requests write (their own MLA pages from the step's start, state and
checkpoint pages) with the step's stamp before it answers the plan (`CopyBatch.claims`), and a
worker writes a step's pages under that step's stamp (`PagedPool.writing`): a page claimed since
by a later step refuses the write (`StaleOrder`). The claims are 8 bytes per page in a shared
file beside the pool's bytes; a worker holds a shared byte-range lock of its pages' claims while
it checks and writes them, and the agent takes an exclusive one of the pages it claims, which
the kernel grants once the writers in them have left. Open-file-description locks (`F_OFD_*`):
each opener of the file is an owner of its own, and a writer killed mid-section drops its locks
with its descriptor.

Only a late writer can hold a page that is being claimed (it was handed out because its request
is over), so a claim waits for nobody else. One that does not leave within `wait_s` (hung) makes
the claim fail (`WriterStalled`); the service then starts a new epoch, whose bounded fence moves
the pool to new memory away from the holder (`gpu_pool.fence`).

A released page that nobody claims again may still take a late write: it is either free (its
next owner's claim comes first, and what that owner reads as valid it writes or copies itself
after the claim) or cached past its confirmed fill, which nothing matches.
"""

from __future__ import annotations

import collections.abc
import contextlib
import fcntl
import os
import struct
import time
import weakref
from collections.abc import Iterable, Sequence

from cachetier.errors import StaleOrder, WriterStalled

_STAMP = struct.Struct("<q")
CLAIM_BYTES = _STAMP.size  # per page
# struct flock on Linux: l_type, l_whence, l_start, l_len, l_pid (and padding)
_FLOCK = struct.Struct("@hhqqi4x")
_FIRST_PAUSE_S, _LONGEST_PAUSE_S = 0.001, 0.02


def runs(pages: Iterable[int]) -> list[tuple[int, int]]:
    """`pages` as sorted runs of consecutive ids, `(first, count)`: one lock call per run."""
    out: list[tuple[int, int]] = []
    for page in sorted(set(pages)):
        if out and out[-1][0] + out[-1][1] == page:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((page, 1))
    return out


class PageClaims:
    """One process's descriptor of a pool's claims file (the handle's `claims` segment, zero
    to begin with: no page is claimed); each one opened is a lock owner of its own."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR)
        self._fd = fd
        self._closer = weakref.finalize(self, os.close, fd)

    def stamp(self, page: int) -> int:
        return _STAMP.unpack(os.pread(self._fd, CLAIM_BYTES, page * CLAIM_BYTES))[0]

    @contextlib.contextmanager
    def writing(self, stamp: int, pages: Sequence[int]) -> collections.abc.Iterator[None]:
        """Write `pages` for the step of `stamp`: `StaleOrder` if a later step claimed one."""
        spans = runs(pages)
        for first, count in spans:
            self._lock(fcntl.F_RDLCK, first, count, fcntl.F_OFD_SETLKW)
        try:
            for first, count in spans:
                stamps = struct.unpack(f"<{count}q", os.pread(self._fd, count * CLAIM_BYTES,
                                                              first * CLAIM_BYTES))
                if any(s != stamp for s in stamps):
                    taken = [first + i for i, s in enumerate(stamps) if s != stamp]
                    raise StaleOrder(f"a write of step {stamp}: pages {taken} were handed to "
                                     "another request since (its request was released or "
                                     "reaped)")
            yield
        finally:
            for first, count in spans:
                self._lock(fcntl.F_UNLCK, first, count, fcntl.F_OFD_SETLK)

    def claim(self, stamp: int, pages: Sequence[int], wait_s: float) -> None:
        """Blocking: hand `pages` to the step of `stamp` once no writer is in them;
        `WriterStalled` (nothing claimed) if one still is after `wait_s`."""
        spans = runs(pages)
        if not spans:
            return
        deadline = time.monotonic() + wait_s
        pause = _FIRST_PAUSE_S
        while not self._try_exclusive(spans):
            left = deadline - time.monotonic()
            if left <= 0:
                raise WriterStalled(f"pages of step {stamp} are held by a late writer past "
                                   f"{wait_s:g} s")
            time.sleep(min(pause, left))
            pause = min(2 * pause, _LONGEST_PAUSE_S)
        try:
            for first, count in spans:
                os.pwrite(self._fd, struct.pack(f"<{count}q", *[stamp] * count),
                          first * CLAIM_BYTES)
        finally:
            for first, count in spans:
                self._lock(fcntl.F_UNLCK, first, count, fcntl.F_OFD_SETLK)

    def close(self) -> None:
        self._closer()

    def _try_exclusive(self, spans: list[tuple[int, int]]) -> bool:
        """Every span's exclusive lock, or none of them."""
        taken: list[tuple[int, int]] = []
        try:
            for first, count in spans:
                self._lock(fcntl.F_WRLCK, first, count, fcntl.F_OFD_SETLK)
                taken.append((first, count))
            return True
        except BlockingIOError:
            for first, count in taken:
                self._lock(fcntl.F_UNLCK, first, count, fcntl.F_OFD_SETLK)
            return False

    def _lock(self, kind: int, first: int, count: int, command: int) -> None:
        try:
            fcntl.fcntl(self._fd, command, _FLOCK.pack(kind, os.SEEK_SET, first * CLAIM_BYTES,
                                                       count * CLAIM_BYTES, 0))
        except PermissionError as exc:  # EACCES: some kernels' answer for a held lock
            raise BlockingIOError(*exc.args) from exc
