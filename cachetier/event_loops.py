"""Which asyncio event loop the long-running processes use, and a way to run on a named one.

The service and the agents spend most of their CPU in the event loop itself (a profile under 64
clients: 55% of the service's time), so its implementation is a choice worth measuring:
`cachetier bench service --loops asyncio,uvloop` runs the same benchmark on each in one run.
`DEFAULT_LOOP` is the one that measured faster here: asyncio's own. uvloop served 0.61-0.70x
its batched steps per second (64 clients, either order, plan p50 up to 2x longer; libuv's
timers tick in whole milliseconds, and the service's batching tick is 1 ms), and unbatched
0.94-1.21x. The other stays selectable (`serve --loop`, `agent --loop`) so a deployment can
compare on its own machine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

LOOPS = ("asyncio", "uvloop")
DEFAULT_LOOP = "asyncio"


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """A new-loop factory for `name`; a ValueError names the choices for any other name."""
    if name == "asyncio":
        return asyncio.new_event_loop
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    raise ValueError(f"unknown event loop {name!r}; expected one of {', '.join(LOOPS)}")


def run_on(name: str, main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on the loop `name`."""
    with asyncio.Runner(loop_factory=loop_factory(name)) as runner:
        return runner.run(main)
