"""A connector that kills its pool's agent in the middle of a load, for the fault test.

vLLM loads it like the real one (`kv_connector_module_path="tests.vllm_fault_connector"`); the
first step carrying loads SIGKILLs the process named by `KILL_PID_ENV` and waits until the service
has voided the pool (the agent's MQTT Will bumps its epoch), then runs the real load. The pins
were taken and the pages chosen before the kill, so the load's bytes are ones nobody vouches for
any more, exactly the case the worker's after-copy epoch check exists for.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from cachetier.vllm.connector import CacheTierConnector

KILL_PID_ENV = "CACHETIER_TEST_KILL_AGENT_PID"
VOID_TIMEOUT_S = 20.0


class AgentKillingConnector(CacheTierConnector):
    _killed = False

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        loads = self._metadata().loads
        if loads and not self._killed and self._worker is not None:
            self._killed = True
            os.kill(int(os.environ[KILL_PID_ENV]), signal.SIGKILL)
            pinned_in = max(job.epoch for job in loads)
            deadline = time.monotonic() + VOID_TIMEOUT_S
            while self._worker._pool_epoch() <= pinned_in:
                if time.monotonic() > deadline:
                    raise RuntimeError("the service did not void the pool of the killed agent")
                time.sleep(0.05)
        super().start_load_kv(forward_context, **kwargs)
