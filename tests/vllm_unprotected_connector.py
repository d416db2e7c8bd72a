"""The connector without its completion of vLLM's mid-block copies (`cachetier.vllm.cow`), for the
test that shows what the completion protects from. vLLM loads it like the real one
(`kv_connector_module_path="tests.vllm_unprotected_connector"`).
"""

from __future__ import annotations

from cachetier.config import Config
from cachetier.vllm.connector import CacheTierConnector
from cachetier.vllm.cow import CowCorrection


class UnprotectedConnector(CacheTierConnector):
    def _protect_copy_on_write(self, config: Config) -> CowCorrection | None:
        return None
