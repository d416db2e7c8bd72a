"""cachetier as vLLM's KV connector (`kv_connector_module_path="cachetier.vllm"`).

vLLM imports this package and looks up `CacheTierConnector`; importing vLLM is deferred to that
lookup, so `cachetier.vllm.geometry` and `cachetier.vllm.tiny` stay usable (by `cachetier up`) at
the cost of importing only what they need.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "CacheTierConnector":
        from cachetier.vllm.connector import CacheTierConnector
        return CacheTierConnector
    raise AttributeError(name)
