"""The info file of `cachetier up --vllm-model`: everything an engine needs to use the cluster.

`kv_transfer_config` goes unchanged to `LLM(kv_transfer_config=...)` (or, as JSON, to `vllm serve
--kv-transfer-config`) and `engine_args` are every other engine argument the connector relies on,
so `LLM(model=MODEL_DIR, **engine_args, kv_transfer_config=KVTransferConfig(**kv_transfer_config))`
is the whole set-up. The file appears once the cluster is ready (written whole, then renamed) and is
removed when it stops, so an engine never reads the address of a cluster that is gone.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from cachetier.config import Config
from cachetier.vllm.geometry import engine_args_for, model_fingerprint

# A load the connector reports failed (`get_block_ids_with_load_errors`) is recomputed, never
# failed: a void hit is a miss.
CONNECTOR = {"kv_connector": "CacheTierConnector", "kv_connector_module_path": "cachetier.vllm",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


def connector_info(*, service: str, token: str, pool: str, handle_file: Path, model_dir: Path,
                   config: Config) -> dict[str, Any]:
    model_id = model_fingerprint(model_dir)
    extra = {"service": service, "token": token, "pool": pool, "handle_file": str(handle_file),
             "model_id": model_id}
    return {"service": service, "token": token, "pool": pool, "model": str(model_dir),
            "model_id": model_id, "handle_file": str(handle_file),
            "kv_transfer_config": {**CONNECTOR, "kv_connector_extra_config": extra},
            "engine_args": engine_args_for(config)}


def write_info(path: Path, info: dict[str, Any]) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(json.dumps(info, indent=2) + "\n")
    temporary.replace(path)
