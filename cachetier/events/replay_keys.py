"""The CURVE keys of the vLLM replay socket (`cachetier events vllm --replay-endpoint`).

A replay request is 8 bytes and its answer up to the whole buffer (megabytes), so the socket
answers only peers that hold the bridge's credential (its broker login: an observer's in
`cachetier up`). ZeroMQ's CURVE does the proving: both key pairs derive from the credential, the
bridge admits only the client key (a ZAP check), and a consumer with the credential sets three
socket options (`ReplayKeys.connect`) on the DEALER it speaks vLLM's replay protocol with; the
frames are vLLM's, unchanged. A consumer outside Python derives the same keys: each secret key is
the Z85 text of HMAC-SHA256(key=credential, message=label), the labels `vllm-replay-server` and
`vllm-replay-client`, and each public key `zmq_curve_public` of it.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

import zmq
from zmq.utils import z85

from cachetier.credentials import derive

_SERVER, _CLIENT = "vllm-replay-server", "vllm-replay-client"


@dataclass(frozen=True)
class CurvePair:
    public: bytes  # Z85, 40 bytes
    secret: bytes

    @classmethod
    def derived(cls, credential: str, label: str) -> CurvePair:
        """Any 32 bytes are a Curve25519 secret key: the MAC is one."""
        secret = z85.encode(bytes.fromhex(derive(credential, label)))
        return cls(zmq.curve_public(secret), secret)


@dataclass(frozen=True)
class ReplayKeys:
    server: CurvePair
    client: CurvePair

    @classmethod
    def of(cls, credential: str) -> ReplayKeys:
        """ValueError for an empty credential."""
        return cls(CurvePair.derived(credential, _SERVER), CurvePair.derived(credential, _CLIENT))

    def serve(self, socket: zmq.Socket) -> None:
        """Make `socket` (before it binds) a CURVE server of these keys."""
        socket.curve_secretkey = self.server.secret
        socket.curve_publickey = self.server.public
        socket.curve_server = True

    def connect(self, socket: zmq.Socket) -> None:
        """Make `socket` (before it connects) the CURVE client the replay socket admits."""
        socket.curve_secretkey = self.client.secret
        socket.curve_publickey = self.client.public
        socket.curve_serverkey = self.server.public

    def admits(self, client_public: bytes) -> bool:
        """Whether a peer that completed the handshake with `client_public` (Z85) holds the
        credential."""
        return hmac.compare_digest(client_public, self.client.public)
