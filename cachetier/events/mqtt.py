"""MQTT transport shared by cache events and agent liveness: broker URLs, topic names, and a link
that keeps one connection alive in the background.

A broker restart must never take the service or an agent down with it, and neither may a broker that
is not up yet: every MQTT user here goes through `MqttLink`, which reconnects with jittered
exponential backoff and runs the user's `setup` (subscribe, announce) again on every new connection,
since the brokers here keep no sessions across restarts. This module knows nothing of what is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Self
from urllib.parse import parse_qs, quote, unquote, urlsplit

import aiomqtt

log = logging.getLogger(__name__)

DEFAULT_PORT = 1883
DEFAULT_TLS_PORT = 8883
TOPIC_ROOT = "cachetier"
_FORBIDDEN_IN_POOL = frozenset("/+#\0")

Session = Callable[[aiomqtt.Client], Awaitable[None]]


@dataclass(frozen=True)
class BrokerAddress:
    host: str
    port: int = DEFAULT_PORT
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False
    ca: str | None = None  # with tls: the CA the broker's certificate is verified against

    @classmethod
    def parse(cls, url: str) -> BrokerAddress:
        """`mqtt://[USER:PASSWORD@]HOST[:PORT]` (user and password percent-encoded, as
        `with_login` writes them), or `mqtts://...[?ca=PATH]` for TLS; anything else is a
        ValueError naming the URL."""
        parts = urlsplit(url)
        shown = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()  # no password
        try:
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"bad MQTT URL {shown!r}: {exc}") from None
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        tls = parts.scheme == "mqtts"
        if parts.scheme not in ("mqtt", "mqtts") or not parts.hostname \
                or parts.path not in ("", "/") or set(query) - ({"ca"} if tls else set()):
            raise ValueError(f"bad MQTT URL {shown!r}: expected mqtt://HOST[:PORT] or "
                             "mqtts://HOST[:PORT][?ca=PATH]")
        username = None if parts.username is None else unquote(parts.username)
        password = None if parts.password is None else unquote(parts.password)
        return cls(parts.hostname, port or (DEFAULT_TLS_PORT if tls else DEFAULT_PORT), username,
                   password, tls, query.get("ca"))


def with_login(url: str, username: str, password: str) -> str:
    """`url` with a login, for the links of one process (never put on a command line: every
    local user can read those)."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{quote(username, safe='')}:{quote(password, safe='')}@{rest}"


def check_pool_name(pool: str) -> str:
    """`pool` if it can stand as one topic level (no separator, no wildcard); else a ValueError."""
    if not pool or _FORBIDDEN_IN_POOL & set(pool):
        raise ValueError(f"pool name {pool!r} must be non-empty without '/', '+', '#' or NUL")
    return pool


@dataclass
class Backoff:
    """Reconnect delays: exponential from `initial_s` up to `max_s`, each scaled by a random factor
    in [0.5, 1] so that many agents cut off by one broker restart do not reconnect in lockstep."""

    initial_s: float = 0.05
    max_s: float = 2.0
    factor: float = 2.0
    _next_s: float = field(default=0.0, init=False, repr=False)

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._next_s = self.initial_s

    def next_delay(self) -> float:
        delay, self._next_s = self._next_s, min(self._next_s * self.factor, self.max_s)
        return delay * random.uniform(0.5, 1.0)


class MqttLink:
    """One MQTT connection kept alive by a background task, for as long as the link is entered.

    On each connection `setup(client)` runs (subscribe, publish a state), then `connected` is set
    and `serve(client)` runs until the connection drops (aiomqtt raises `MqttError`); then the link
    waits a backoff delay and connects again. `client` is the live client while connected, so its
    owner can publish from outside `serve`. Errors other than `MqttError` are bugs: they end the
    task and are raised again by `close()`.
    """

    def __init__(self, url: str, *, setup: Session, serve: Session,
                 will: aiomqtt.Will | None = None, keepalive_s: int = 5,
                 backoff: Backoff | None = None) -> None:
        self.address = BrokerAddress.parse(url)
        self.connected = asyncio.Event()
        self.client: aiomqtt.Client | None = None
        self.connections = 0  # connections set up so far: tells a reconnection from a steady link
        self._setup, self._serve, self._will = setup, serve, will
        self._keepalive_s = keepalive_s
        self._backoff = backoff or Backoff()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("MQTT link already started")
        where = f"{self.address.host}:{self.address.port}"
        self._task = asyncio.create_task(self._run(), name=f"mqtt-link {where}")

    async def close(self) -> None:
        """Stop the task (idempotent); a graceful DISCONNECT, so the broker sends no Will."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def wait_connected(self, timeout_s: float) -> None:
        """Return once connected and set up; TimeoutError after `timeout_s`."""
        await asyncio.wait_for(self.connected.wait(), timeout_s)

    async def __aenter__(self) -> Self:
        self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _run(self) -> None:
        while True:
            try:
                await self._connection()
            except aiomqtt.MqttError as exc:
                log.warning("MQTT %s:%d: %s; reconnecting", self.address.host, self.address.port,
                            exc)
            await asyncio.sleep(self._backoff.next_delay())

    async def _connection(self) -> None:
        address = self.address
        tls = aiomqtt.TLSParameters(ca_certs=address.ca) if address.tls else None
        client = aiomqtt.Client(address.host, address.port, will=self._will,
                                keepalive=self._keepalive_s, username=address.username,
                                password=address.password, tls_params=tls)
        try:
            async with client:
                await self._setup(client)
                self._backoff.reset()
                self.client = client
                self.connections += 1
                self.connected.set()
                try:
                    await self._serve(client)
                finally:
                    self.connected.clear()
                    self.client = None
        finally:
            _retrieve_disconnection(client)


def _retrieve_disconnection(client: aiomqtt.Client) -> None:
    """aiomqtt keeps the reason of an unexpected disconnection in a future that nobody awaits when
    the link was cancelled or already failed elsewhere; reading it here stops asyncio from logging
    "Future exception was never retrieved" (after the test summary, or in a service's log)."""
    disconnected = getattr(client, "_disconnected", None)
    if isinstance(disconnected, asyncio.Future) and disconnected.done() and not disconnected.cancelled():
        disconnected.exception()


class LinkOwner:
    """For classes built on one `MqttLink`: `async with` runs the link."""

    link: MqttLink

    async def __aenter__(self) -> Self:
        self.link.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.link.close()


def payload_bytes(message: aiomqtt.Message) -> bytes:
    """A received message's payload (paho hands over bytes; the type allows more)."""
    if not isinstance(message.payload, (bytes, bytearray)):
        raise ValueError(f"payload on {message.topic} is not bytes")
    return bytes(message.payload)


async def until_disconnected(client: aiomqtt.Client) -> None:
    """A `serve` for links that only publish: never returns, raises MqttError when the connection
    drops (aiomqtt reports a drop only to readers of `messages`; nothing is subscribed here)."""
    async for message in client.messages:
        log.debug("ignoring unexpected message on %s", message.topic)
