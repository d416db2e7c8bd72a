"""Which role may do what on the service link: checked once per connection and once per request.

A hello's token proves a principal (`cachetier.credentials.verify`); the connection it opens must
suit the role (an agent credential opens agent connections, the others client connections), each
client request must be one of its role's ops, and a registration must name the agent
credential's own pool and rank: a scheduler cannot register as an agent (and acknowledge copies
it never ran), nor can an agent take over another rank or pool. Pools come into being by their
agents' first registration, so creating one also takes an agent credential bound to it (issued by
whoever holds the cluster secret). Every refusal is a non-retryable `Forbidden` naming the
credential and what it may not do.
"""

from __future__ import annotations

from cachetier.credentials import Principal, Role
from cachetier.errors import Forbidden
from cachetier.wire.protocol import Register

_CLIENT = frozenset({"plan", "commit", "confirm", "release", "stats", "health", "route", "pin",
                     "handoff"})
CLIENT_ROLE_OPS: dict[Role, frozenset[str]] = {
    Role.CLIENT: _CLIENT,
    Role.ADMIN: _CLIENT | {"invalidate"},
    Role.OBSERVER: frozenset({"health"}),
}


def check_connection(principal: Principal, role: str) -> None:
    """`role` is the hello's: "agent" or "client"."""
    if (role == "agent") != (principal.role is Role.AGENT) or principal.role is Role.SERVICE:
        raise Forbidden(f"{principal.describe()} cannot open a{'n' if role == 'agent' else ''} "
                        f"{role} connection")


def check_op(principal: Principal, op: str) -> None:
    if op not in CLIENT_ROLE_OPS.get(principal.role, frozenset()):
        raise Forbidden(f"{principal.describe()} may not {op}")


def check_registration(principal: Principal, register: Register) -> None:
    if (principal.pool, principal.rank) != (register.pool, register.rank):
        raise Forbidden(f"{principal.describe()} cannot register for pool {register.pool}, "
                        f"rank {register.rank}")
