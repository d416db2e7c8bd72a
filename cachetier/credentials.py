"""Credentials: who a peer is, and a token that proves it, derived from the cluster's secret.

A credential names a principal (`Principal`): a role, and for an agent the one pool and rank it
serves. Its token is `<principal>.<mac>`, the mac an HMAC-SHA256 of the principal's name under the
cluster secret, so the principal travels in the clear and cannot be changed without the secret:
the service (the only holder of the secret, with `cachetier up`) verifies a token by recomputing
its mac (`hmac.compare_digest`), and keeps no table of issued credentials. A scheduler, an agent
or an observer holds its own token only; none can derive another principal's from it.

Principal names: `admin`, `client`, `client/<tenant>`, `observer`, `service`,
`agent/<rank>/<pool>` (no pool id holds a `/`). A tenant's schedulers reach only that tenant's
cache entries (`cachetier.service.ownership`); `client` is the default tenant. The same token is the peer's MQTT password (its username is the principal's name,
`MqttLogin`), so each process is handed one credential for every link.

Agents also share a data-plane token (`peer_token`) that the service hands to each agent it
registers, for pulling pages from each other (`gpu_pool.transfer`): an agent of one pool pulls
from the agents of another, whose own tokens it does not hold.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import re
from dataclasses import dataclass

from cachetier.errors import Unauthorized

_SEPARATOR = "."
TENANT_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")  # a tenant's name: `client/<tenant>`


class Role(enum.StrEnum):
    ADMIN = "admin"  # everything a client does, and invalidating any pool
    CLIENT = "client"  # a scheduler: steps, commits, releases, lookups, stats of a pool
    AGENT = "agent"  # registers for one pool and rank, and runs that rank's copies
    OBSERVER = "observer"  # health, and the cache events on MQTT; nothing that changes state
    SERVICE = "service"  # the service's own MQTT login: agents' liveness in, cache events out


@dataclass(frozen=True)
class Principal:
    role: Role
    pool: str = ""  # agents only
    rank: int = -1  # agents only
    tenant: str = ""  # clients only; "" is the default tenant

    def __post_init__(self) -> None:
        is_agent = self.role is Role.AGENT
        if is_agent != bool(self.pool) or is_agent != (self.rank >= 0):
            raise ValueError("an agent principal names a pool and a rank; no other does")
        if self.tenant and (self.role is not Role.CLIENT or not TENANT_NAME.match(self.tenant)):
            raise ValueError(f"a tenant is a client's, named like {TENANT_NAME.pattern}, "
                             f"got {self.tenant!r}")

    @property
    def name(self) -> str:
        if self.role is Role.AGENT:
            return f"agent/{self.rank}/{self.pool}"
        if self.tenant:
            return f"{self.role}/{self.tenant}"
        return str(self.role)

    @classmethod
    def parse(cls, name: str) -> Principal:
        """ValueError for anything `name` never produces."""
        role, slash, rest = name.partition("/")
        if role not in Role.__members__.values():
            raise ValueError(f"unknown role in {name!r}")
        if role == Role.CLIENT and slash:
            if not TENANT_NAME.match(rest):
                raise ValueError(f"a tenant is named like {TENANT_NAME.pattern}: {name!r}")
            return cls(Role.CLIENT, tenant=rest)
        if role != Role.AGENT:
            if rest:
                raise ValueError(f"{role} takes no pool: {name!r}")
            return cls(Role(role))
        rank, _, pool = rest.partition("/")
        if not (rank.isascii() and rank.isdigit()) or not pool or "/" in pool:
            raise ValueError(f"an agent principal is agent/<rank>/<pool>, got {name!r}")
        return cls(Role.AGENT, pool, int(rank))

    def describe(self) -> str:
        """For error messages: `an agent credential (pool p, rank 0)`, `an observer credential`."""
        where = f" (pool {self.pool}, rank {self.rank})" if self.role is Role.AGENT else \
            f" (tenant {self.tenant})" if self.tenant else ""
        article = "an" if self.role in (Role.ADMIN, Role.AGENT, Role.OBSERVER) else "a"
        return f"{article} {self.role} credential{where}"


def agent(pool: str, rank: int) -> Principal:
    return Principal(Role.AGENT, pool, rank)


def derive(secret: str, label: str) -> str:
    """A secret for `label` (a Redis password, the peer token) that reveals nothing of `secret`.
    Principal names never start with a label's `<word>-`, so no label yields a token's mac."""
    return _mac(secret, label)


def _mac(secret: str, message: str) -> str:
    if not secret:
        raise ValueError("the cluster secret is empty")
    return hmac.new(secret.encode(), message.encode(), hashlib.sha256).hexdigest()


def issue(secret: str, principal: Principal) -> str:
    """The token of `principal` in the cluster of `secret`."""
    return f"{principal.name}{_SEPARATOR}{_mac(secret, principal.name)}"


def principal_of(token: str) -> Principal:
    """Who `token` claims to be, unverified (for logins that are checked elsewhere: MQTT)."""
    name, separator, _ = token.rpartition(_SEPARATOR)
    if not separator:
        raise ValueError("a credential is <principal>.<mac>")
    return Principal.parse(name)


def verify(secret: str, token: str) -> Principal:
    """The principal `token` proves, or `Unauthorized` (one message for every failure, so a
    refusal tells a prober nothing about which part was wrong)."""
    name, _, mac = token.rpartition(_SEPARATOR)
    try:
        principal = Principal.parse(name)
    except ValueError:
        raise Unauthorized("bad credential") from None
    if not hmac.compare_digest(mac.encode(), _mac(secret, name).encode()):
        raise Unauthorized("bad credential")
    return principal


def peer_token(secret: str) -> str:
    """The agents' shared data-plane token (see the module docstring)."""
    return derive(secret, "peer-transfer")


@dataclass(frozen=True)
class MqttLogin:
    """The username and password a process logs in to the broker with: its principal's name (a
    pool's `:` escaped, since mosquitto's password file ends a username at the first `:`) and its
    token (`cachetier.run.mqtt_auth` writes the broker's matching password file and ACL)."""

    username: str
    password: str

    @classmethod
    def of(cls, token: str) -> MqttLogin:
        return cls(mqtt_username(principal_of(token)), token)


def mqtt_username(principal: Principal) -> str:
    return principal.name.replace(":", "%3A")  # no pool id holds a `%`
