"""`cachetier up --vllm-model`: the local cluster sized for one model's vLLM layout, for engines.

The cluster is `cachetier up`'s (redis, mosquitto, the service, one CPU agent for the pool); once
every part answers, the info file (`cachetier.vllm.info`) tells engines how to use it. It runs
until SIGINT or SIGTERM, then removes the info file and stops everything in order.
"""

from __future__ import annotations

from pathlib import Path

from cachetier.run.cluster import POOL, Cluster, ClusterSettings, _watch, say, up
from cachetier.vllm.info import connector_info, write_info


def serve_vllm(settings: ClusterSettings, model_dir: Path, info_path: Path) -> int:
    model_dir, info_path = model_dir.resolve(), info_path.resolve()

    def job(cluster: Cluster) -> None:
        info = connector_info(service=cluster.service_url, token=settings.token, pool=POOL,
                              handle_file=cluster.handle_file(0), model_dir=model_dir,
                              config=settings.config)
        try:
            write_info(info_path, info)
            say(f"engines: {info_path} (LLM(model={model_dir}, **engine_args, "
                "kv_transfer_config=KVTransferConfig(**kv_transfer_config))); Ctrl-C to stop")
            _watch(cluster)
        finally:
            info_path.unlink(missing_ok=True)

    return up(settings, job)
