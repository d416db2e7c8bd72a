"""Where the agent reports what happens to it, for liveness (MQTT) and tests.

The base class is the null implementation (STYLE 7);
`cachetier.events.observers.PresenceObserver` calls `AgentPresence.set_epoch`. Calls are made on the agent's event loop and must not block.
"""

from __future__ import annotations

from cachetier.wire.protocol import AgentIdentity


class AgentObserver:
    def registered(self, identity: AgentIdentity, service: str, epoch: int) -> None:
        """The agent registered with `service` (it may serve several replicas) in `epoch`."""
