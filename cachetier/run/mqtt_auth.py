"""Who may publish and read what on the broker: mosquitto's password file and topic ACL.

Each principal (`cachetier.credentials`) logs in as its own user with its token for password
(`MqttLogin`); anonymous clients are refused. The ACL is what each role needs and no more:

- an agent writes its own status topic only (`cachetier/<pool>/agents/<rank>`, its Will too), so
  no one else can announce it online or forge its "offline";
- the service reads every agent status and writes the cache events, the only writer there;
- an observer reads the cache events only (agent statuses carry ids and pids);
- an admin reads everything.

Passwords are stored as mosquitto 2's PBKDF2-SHA512 hashes (`$7$`), written here rather than by
`mosquitto_passwd`, which not every installation has.
"""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cachetier.credentials import Principal, Role, mqtt_username, principal_of
from cachetier.events.cache_events import events_topic
from cachetier.events.liveness import agent_topic, agents_filter
from cachetier.events.mqtt import TOPIC_ROOT
from cachetier.private_files import write_private

_ITERATIONS = 101  # mosquitto_passwd's own default
_SALT_BYTES = 12


def password_hash(password: str, salt: bytes | None = None) -> str:
    salt = os.urandom(_SALT_BYTES) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, _ITERATIONS)
    return f"$7${_ITERATIONS}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def topic_rules(principal: Principal) -> list[str]:
    """The ACL lines of `principal`'s user."""
    if principal.role is Role.AGENT:
        return [f"topic write {agent_topic(principal.pool, principal.rank)}"]
    if principal.role is Role.SERVICE:
        return [f"topic read {agents_filter()}", f"topic write {events_topic('+')}"]
    if principal.role is Role.OBSERVER:
        return [f"topic read {events_topic('+')}"]
    if principal.role is Role.ADMIN:
        return [f"topic read {TOPIC_ROOT}/#"]
    return []  # a scheduler has no business on the broker


@dataclass(frozen=True)
class BrokerAuth:
    """The broker's users: each principal with the token it logs in with."""

    users: tuple[tuple[Principal, str], ...]

    @classmethod
    def of(cls, tokens: Iterable[str]) -> BrokerAuth:
        return cls(tuple((principal_of(token), token) for token in tokens))

    def write(self, directory: Path) -> tuple[Path, Path]:
        """The password file and the ACL file, readable by their owner only."""
        passwords = "".join(f"{mqtt_username(p)}:{password_hash(token)}\n"
                            for p, token in self.users)
        acl = "".join(f"user {mqtt_username(p)}\n" + "".join(f"{rule}\n"
                                                             for rule in topic_rules(p)) + "\n"
                      for p, _ in self.users)
        return write_private(directory / "mosquitto.passwd", passwords), \
            write_private(directory / "mosquitto.acl", acl)
