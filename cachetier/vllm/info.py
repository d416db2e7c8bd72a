"""The info file of `cachetier up --vllm-model`: everything an engine needs to use the cluster.

`kv_transfer_config` goes unchanged to `LLM(kv_transfer_config=...)` (or, as JSON, to `vllm serve
--kv-transfer-config`) and `engine_args` are every other engine argument the connector relies on, so
`LLM(model=MODEL_DIR, **engine_args, kv_transfer_config=KVTransferConfig(**kv_transfer_config))` is
the whole set-up; `vllm_serve_args` are the same two as `vllm serve` flags (`vllm serve MODEL_DIR
$(jq -r '.vllm_serve_args[]' FILE)`); `kv_events_endpoint`, where given, is the ZeroMQ endpoint the
pool's cache events are published on as vLLM KV events, for a router (None otherwise). The file
appears once the cluster is ready (written whole, then renamed) and is removed when it stops, so an
engine never reads the address of a cluster that is gone; it holds the client token, so only its
owner reads it (0600). """

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cachetier.config import Config
from cachetier.private_files import write_private
from cachetier.vllm.geometry import engine_args_for, model_fingerprint

# A load the connector reports failed (a failed receive) is recomputed, never
# failed: a void hit is a miss.
CONNECTOR = {"kv_connector": "CacheTierConnector", "kv_connector_module_path": "cachetier.vllm",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


def connector_info(*, service: str, token: str, token_file: Path, pool: str,
                   handle_file: Path | str, model_dir: Path, config: Config,
                   kv_events_endpoint: str | None = None) -> dict[str, Any]:
    """`handle_file`: the agents' handle files, `{rank}` standing for a worker's rank;
    `token_file`: the file holding `token`, which the connector is given instead of the token,
    so `vllm_serve_args` put no secret on vLLM's command line."""
    model_id = model_fingerprint(model_dir)
    extra = {"service": service, "token_file": str(token_file), "pool": pool,
             "handle_file": str(handle_file), "model_id": model_id}
    transfer = {**CONNECTOR, "kv_connector_extra_config": extra}
    engine_args = engine_args_for(config)
    return {"service": service, "token": token, "pool": pool, "model": str(model_dir),
            "model_id": model_id, "handle_file": str(handle_file),
            "kv_transfer_config": transfer, "engine_args": engine_args,
            "vllm_serve_args": serve_flags(engine_args, transfer),
            "kv_events_endpoint": kv_events_endpoint}


def serve_flags(engine_args: dict[str, Any], transfer: dict[str, Any]) -> list[str]:
    """`engine_args` and the connector as `vllm serve` command-line flags (vLLM spells each
    engine argument `--name-with-dashes`, a boolean `--name` or `--no-name`)."""
    flags = ["--kv-transfer-config", json.dumps(transfer, separators=(",", ":"))]
    for name, value in engine_args.items():
        flag = name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            flags += [f"--{flag}", str(value)]
    return flags


def write_info(path: Path, info: dict[str, Any]) -> None:
    """0600, since it holds the client token; written whole, then renamed."""
    write_private(path, json.dumps(info, indent=2) + "\n")
