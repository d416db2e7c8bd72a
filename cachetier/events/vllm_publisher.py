"""vLLM's `ZmqEventPublisher` with the guards a cache tier's stream needs (issue 34).

vLLM's publisher binds `tcp://*:PORT` on every address and answers any replay request with every
buffered batch from the asked seq on: 8 bytes in, up to the whole buffer out (about 5 MB at
10,000 batches), to anyone who can reach the port. This subclass keeps vLLM's numbering,
buffering and frames, so a consumer written for vLLM engines reads it unchanged, and changes
three things:

- `tcp://*:PORT` binds `bind_host` (default loopback; `*`: every address, as vLLM). Concrete
  addresses keep vLLM's meaning: the PUB socket connects to them, the replay socket binds them.
- The replay socket is a CURVE server that admits only the client key derived from the bridge's
  credential (`replay_keys`): an unauthenticated peer completes no handshake, so its request is
  never read. The PUB socket stays plain, as vLLM's SUB consumers expect; it binds loopback
  unless told otherwise.
- Replay answers send at most `replay_rate` batches in any one second, all requests together:
  past that a request gets vLLM's end marker alone, and the consumer asks again from where it
  stands (what vLLM's consumers do on any gap).

Each publisher has a ZeroMQ context of its own, since a context holds one ZAP handler (vLLM's
share the process-wide one).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

import zmq
from vllm.distributed.kv_events import ZmqEventPublisher
from zmq.auth.thread import ThreadAuthenticator

from cachetier.events.replay_keys import ReplayKeys

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
DEFAULT_REPLAY_RATE = 1000  # batches per second


class BatchRate:
    """At most `per_second` batches in any one-second window: the send times of the last
    `per_second` are kept, and one more goes only once the oldest of them is a second old."""

    def __init__(self, per_second: int, clock: Callable[[], float] = time.monotonic) -> None:
        if per_second < 1:
            raise ValueError(f"a replay rate is at least 1 batch per second, got {per_second}")
        self._sent: deque[float] = deque(maxlen=per_second)
        self._clock = clock

    def take(self) -> bool:
        now = self._clock()
        if len(self._sent) == self._sent.maxlen and now - self._sent[0] < 1.0:
            return False
        self._sent.append(now)  # a full deque drops the oldest
        return True


def bind_address(endpoint: str, host: str) -> str:
    """`tcp://*:PORT` on `host` (`*`: every address); any other endpoint as given."""
    if host == "*" or not endpoint.startswith("tcp://*:"):
        return endpoint
    bracketed = f"[{host}]" if ":" in host else host
    return f"tcp://{bracketed}:{endpoint.removeprefix('tcp://*:')}"


class _ClientKeyCheck:
    """pyzmq's ZAP credentials provider: admits the one client key of `keys`."""

    def __init__(self, keys: ReplayKeys) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return self.keys.admits(key)


class GuardedZmqPublisher(ZmqEventPublisher):
    """The module docstring says what differs from vLLM's; ValueError for a replay endpoint
    without keys (it would answer anyone)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *,
                 buffer_steps: int = 10_000, topic: str = "", bind_host: str = LOOPBACK,
                 replay_keys: ReplayKeys | None = None,
                 replay_rate: int = DEFAULT_REPLAY_RATE) -> None:
        if replay_endpoint is not None and replay_keys is None:
            raise ValueError("a replay endpoint answers only peers holding the bridge's "
                             "credential: give its keys")
        self._bind_host = bind_host
        self._keys = replay_keys
        self._rate = BatchRate(replay_rate)
        self._auth: ThreadAuthenticator | None = None
        super().__init__(0, endpoint, replay_endpoint, buffer_steps=buffer_steps, topic=topic)

    def _socket_setup(self) -> None:
        """vLLM calls this once from its constructor, which then fails: nothing left open."""
        self._ctx = zmq.Context()
        try:
            self._open_sockets()
        except BaseException:
            self._close()
            raise

    def _open_sockets(self) -> None:
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(self._hwm)
        if self._is_bind_endpoint(self._endpoint):
            self._endpoint = self._bind_here(self._pub, self._endpoint)
        else:
            self._pub.connect(self._endpoint)
        if self._replay_endpoint is not None:
            assert self._keys is not None
            self._auth = ThreadAuthenticator(self._ctx)  # before the socket admits anyone
            self._auth.start()
            self._auth.configure_curve_callback("*", _ClientKeyCheck(self._keys))
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._keys.serve(self._replay)
            self._replay_endpoint = self._bind_here(self._replay, self._replay_endpoint)

    def _bind_here(self, socket: zmq.Socket, endpoint: str) -> str:
        """Bind; the bound endpoint (a port 0 made real, a `*` its host)."""
        address = bind_address(endpoint, self._bind_host)
        if address.startswith("tcp://["):
            socket.ipv6 = True
        socket.bind(address)
        return socket.last_endpoint.decode()

    def _service_replay(self) -> None:
        """vLLM's answer (each buffered batch from the asked seq on, then the end marker),
        within the rate."""
        assert self._replay is not None
        frame = self._replay.recv_multipart()
        if len(frame) != 3:
            log.warning("replay request of %d frames ignored", len(frame))
            return
        client, _, start = frame
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq < start_seq:
                continue
            if not self._rate.take():
                break
            self._replay.send_multipart((client, b"", self._topic_bytes, seq.to_bytes(8, "big"),
                                         payload))
        self._replay.send_multipart((client, b"", b"", self.END_SEQ, b""))

    def shutdown(self) -> None:
        super().shutdown()
        self._close()

    def _close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self._ctx.destroy(linger=0)
