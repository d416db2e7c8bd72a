"""Who owns a request: the scheduler session that planned it, nobody else.

Every scheduler holds the same `client` credential and request ids are the scheduler's own
(vLLM passes user-supplied ids through), so ids alone cannot say whose a request is: a second
scheduler's `release(["victim"])` once freed another's in-flight request, whose forward pass then
wrote into pages handed to a third request. So the service scopes every id a client names by its
owner before it reaches the index: `plan`, `commit`, `release` and `pin` name
`<scope>:<id>`, and replies give the bare id back. The scope is a digest of the principal and of
the session the client drew for itself (`Hello.session`: random, sent only in the hello, kept
across the client's reconnections so a reconnected scheduler still owns its requests); a hello
without one gets a scope of its own connection. Two schedulers may then use the same id without
touching each other, and another owner's request cannot even be named: the same id in another
scope is another request, unknown here. The tickets a client sees are bound to its owner as well
(their nonce bits masked by the scope), so a ticket read off another scheduler confirms nothing.
A refusal is the index's own `unknown` answer, never a `forbidden` that would tell a caller which
ids or tickets somebody else holds.

A tenant's principal (`client/<tenant>`) also has its own cache: every chained hash its calls
carry is keyed by the tenant (`index.hashing.key_chain`, a key derived from the cluster secret)
before it reaches Redis, so no call of one tenant sees, pins, routes to or commits into another
tenant's entries, even for the same prompts. The default tenant (`client`) is unkeyed, as before.

The reaper releases by the scoped ids, so it and the owner's own release stay the only ways to
free a request.
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
from dataclasses import dataclass
from typing import Any

from cachetier.credentials import Principal, derive
from cachetier.wire.protocol import Commit, Confirm, Handoff, Pin, Plan, PlanReply, Release, Route
from index.hashing import key_chain
from index.prefix import PinnedPrefix
from index.records import CommitResult, ReleaseResult, StepPlan, StepRequest
from index.tickets import NONCE_BITS

SCOPE_HEX = 16  # 64 bits of digest: the scope of one principal's session


@dataclass(frozen=True)
class Owner:
    """One scheduler session: `scope` prefixes its ids in the index, `mask` its tickets' nonces,
    `tenant_key` (None: the default tenant) keys its hashes."""

    scope: str
    mask: int
    tenant_key: bytes | None = None

    @classmethod
    def of(cls, principal: Principal, session: str, secret: str) -> Owner:
        """The owner of a connection whose hello named `session` ("": this connection alone),
        in the cluster of `secret`."""
        drawn = session or secrets.token_hex(16)
        digest = hashlib.blake2b(f"{principal.name}\n{drawn}".encode(), digest_size=16).digest()
        scope = digest[:SCOPE_HEX // 2].hex() + ":"
        tenant_key = (bytes.fromhex(derive(secret, f"tenant-hashes:{principal.tenant}"))
                      if principal.tenant else None)
        return cls(scope, int.from_bytes(digest[8:], "big") & ((1 << NONCE_BITS) - 1),
                   tenant_key)

    def rid(self, rid: str) -> str:
        return self.scope + rid

    def bare(self, rid: str) -> str:
        return rid.removeprefix(self.scope)

    def ticket(self, ticket: int) -> int:
        """A ticket between the index and this owner, either way (XOR is its own inverse)."""
        return ticket ^ self.mask

    def hashes(self, blob: bytes, width: int) -> bytes:
        """A prompt's chained hashes as this owner's tenant stores them."""
        return blob if self.tenant_key is None else key_chain(blob, self.tenant_key, width)

    def inbound(self, message: Any, hash_width: int) -> Any:
        """The message as the index must see it: this owner's ids and tenant's hashes
        (`hash_width` bytes each), its tickets unmasked."""
        if isinstance(message, Plan):
            return Plan(message.pool, [self._request(r, hash_width) for r in message.requests])
        if isinstance(message, (Route, Handoff)):
            return dataclasses.replace(message, hashes=self.hashes(message.hashes, hash_width))
        if isinstance(message, Commit):
            return Commit(message.pool, [dataclasses.replace(i, rid=self.rid(i.rid))
                                         for i in message.items])
        if isinstance(message, Release):
            return Release(message.pool, [self.rid(rid) for rid in message.rids])
        if isinstance(message, Pin):
            return dataclasses.replace(message, reader=self.rid(message.reader),
                                       hashes=self.hashes(message.hashes, hash_width))
        if isinstance(message, Confirm):
            return Confirm(message.pool, self.ticket(message.ticket))
        return message

    def _request(self, request: StepRequest, hash_width: int) -> StepRequest:
        hashes = request.hashes
        if hashes is not None and self.tenant_key is not None:
            hashes = key_chain(hashes, self.tenant_key, hash_width)
        return dataclasses.replace(request, rid=self.rid(request.rid), hashes=hashes)

    def outbound(self, reply: Any) -> Any:
        """The reply as its caller named things: bare ids, masked tickets."""
        if isinstance(reply, PlanReply) and reply.plan is not None:
            return PlanReply(plan=self._plan(reply.plan))
        if isinstance(reply, CommitResult):
            return dataclasses.replace(
                reply, ticket=self.ticket(reply.ticket),
                requests=[dataclasses.replace(r, rid=self.bare(r.rid)) for r in reply.requests])
        if isinstance(reply, ReleaseResult):
            return dataclasses.replace(reply, unknown=[self.bare(rid) for rid in reply.unknown])
        if isinstance(reply, PinnedPrefix):
            return dataclasses.replace(reply, reader=self.bare(reply.reader))
        return reply

    def _plan(self, plan: StepPlan) -> StepPlan:
        return dataclasses.replace(
            plan, ticket=self.ticket(plan.ticket),
            requests=[dataclasses.replace(r, rid=self.bare(r.rid)) for r in plan.requests])
