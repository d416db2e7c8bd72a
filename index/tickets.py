"""Tickets a caller cannot guess or replay: a ticket is its pool's counter and a nonce.

A ticket settles a step's copies or a forward pass's writes (`confirm`): confirming one that is
not yours makes pages matchable before their bytes exist. A bare counter invites exactly that:
the next value is easy to guess, and a counter issued again (storage that went back in time
unnoticed, a pool dropped and created anew) makes an old caller's retried confirm settle
somebody else's ticket. So each ticket also carries `NONCE_BITS` random bits, drawn by the
caller that asks for it (Lua has no secret randomness: its PRNG is seeded alike at every call)
and stored by the script beside the ticket's requests; `confirm` must name both, and anything
else is an unknown ticket, refused before any write. A replay from another epoch or another
life of the pool then needs the same counter *and* the same nonce: one chance in 2^24 even when
the counter came back. The counter stays in the high bits, so tickets still order as their
counters do (confirmation is cumulative per request) and fit msgpack's signed 64 bits.
"""

from __future__ import annotations

import secrets

from index.errors import BadRequest

NONCE_BITS = 24
NUMBER_BITS = 39  # 5.5e11 tickets per pool: 1.7 years at 10,000 a second


def random_nonce() -> int:
    return secrets.randbits(NONCE_BITS)


def compose(number: int, nonce: int) -> int:
    """The ticket a caller holds, from the counter and nonce a script returned."""
    if not 0 <= number < 1 << NUMBER_BITS or not 0 <= nonce < 1 << NONCE_BITS:
        raise BadRequest(f"ticket {number} / nonce {nonce} out of range")
    return number << NONCE_BITS | nonce


def write_stamp(ticket: int) -> int:
    """What a step's in-place writes are stamped with (`gpu_pool.claims`): its ticket's counter,
    never issued twice in a pool's life, plus one, so no stamp is an unclaimed page's 0. The
    counter is the ticket's high bits, the same in every caller's view of the ticket."""
    return (ticket >> NONCE_BITS) + 1


def split(ticket: int) -> tuple[int, int]:
    """(counter, nonce) of a ticket a caller sends back; refused if it cannot be one."""
    if isinstance(ticket, bool) or not isinstance(ticket, int) \
            or not 0 <= ticket < 1 << (NUMBER_BITS + NONCE_BITS):
        raise BadRequest(f"ticket must be an integer in [0, 2^{NUMBER_BITS + NONCE_BITS})")
    return ticket >> NONCE_BITS, ticket & ((1 << NONCE_BITS) - 1)
