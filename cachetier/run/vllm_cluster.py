"""`cachetier up --vllm-model`: the local cluster sized for one model's vLLM layout, for engines.

The cluster is `cachetier up`'s (redis, mosquitto, the service, one CPU agent for the pool); once
every part answers, the info file (`cachetier.vllm.info`) tells engines how to use it. It runs
until `up` is stopped (SIGINT, SIGTERM, SIGHUP, its parent's death), then removes the info file
and stops everything in order.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from pathlib import Path

from cachetier.config import ConfigError, load_config, override_arguments
from cachetier.run.cluster import POOL, Cluster, ClusterSettings, _watch, say, up
from cachetier.vllm.geometry import GeometryMismatch, config_for_model
from cachetier.vllm.info import connector_info, write_info


def vllm_cluster_settings(model_dir: Path, *, run_dir: Path | None = None,
                          secret: str | None = None, port: int = 7400, agents: int = 1,
                          pool_pages: int = 1024, hash_unit: int | None = None,
                          kv_events_endpoint: str | None = None,
                          overrides: Sequence[tuple[str, str]] = (),
                          tls: bool = False) -> ClusterSettings:
    """The cluster whose pool is sized for `model_dir`'s vLLM layout
    (`cachetier.vllm.geometry.config_for_model`) on engines of tensor-parallel size `agents` (one
    agent per rank, rank r's worker attaching to agent r), `overrides` (`--set` pairs) on top;
    with `kv_events_endpoint`, its cache events also go out there as vLLM KV events."""
    if agents < 1:
        raise ConfigError("--agents", f"one agent per tensor-parallel rank: at least 1, got "
                                      f"{agents}")
    try:
        config = config_for_model(model_dir, num_pages=pool_pages, hash_unit=hash_unit,
                                  tp_degree=agents)
    except (GeometryMismatch, ConfigError, OSError) as exc:
        raise ConfigError("--vllm-model", str(exc)) from None
    serve_config = override_arguments(config) + [f"--set={k}={v}" for k, v in overrides]
    config = load_config(overrides=dict(flag.removeprefix("--set=").split("=", 1)
                                        for flag in serve_config))
    run_dir = run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    return ClusterSettings(run_dir=run_dir.resolve(), secret=secret or secrets.token_hex(16),
                           config=config, serve_config_args=tuple(serve_config), agents=agents,
                           port=port, kv_events_endpoint=kv_events_endpoint, tls=tls)


def serve_vllm(settings: ClusterSettings, model_dir: Path, info_path: Path) -> int:
    model_dir, info_path = model_dir.resolve(), info_path.resolve()

    def job(cluster: Cluster) -> None:
        info = connector_info(service=cluster.service_url, token=cluster.client_token,
                              token_file=cluster.credential_file("client"), pool=POOL,
                              handle_file=cluster.handle_file_pattern, model_dir=model_dir,
                              config=settings.config,
                              kv_events_endpoint=settings.kv_events_endpoint)
        try:
            write_info(info_path, info)
            say(f"engines: {info_path} (LLM(model={model_dir}, **engine_args, "
                "kv_transfer_config=KVTransferConfig(**kv_transfer_config))); Ctrl-C to stop")
            _watch(cluster)
        finally:
            info_path.unlink(missing_ok=True)

    return up(settings, job)
