"""`cachetier up --vllm-model DIR --info FILE --agents 2`: the cluster for vLLM engines of
tensor-parallel size 2, run as a user runs it.

The info file appears once the cluster answers, holds what an engine needs (a connector config
vLLM accepts as is, the engine arguments of the alignment rules), is readable by its owner only
like the agents' handle files, and goes away with the cluster on SIGTERM, every child stopped. That an engine given this file is served is
`tests/test_vllm_connector.py`'s subject.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import vllm
from vllm.config import KVTransferConfig

from cachetier.vllm.geometry import FINE_HASH_UNIT, model_fingerprint


def test_vllm_is_the_pinned_release() -> None:
    """The connector is written against vLLM 0.32; CI fails here, not skips, without it."""
    assert vllm.__version__ == "0.32.0"


def test_up_writes_the_info_file_when_ready_and_removes_it_on_sigterm(model_dir: Path,
                                                                      tmp_path: Path,
                                                                      usual_umask: None) -> None:
    info, run_dir = tmp_path / "tier.json", tmp_path / "run"
    events = f"ipc://{tmp_path / 'events.ipc'}"
    up = subprocess.Popen([sys.executable, "-m", "cachetier.cli", "up", "--vllm-model",
                           str(model_dir), "--info", str(info), "--port", "0", "--run-dir",
                           str(run_dir), "--kv-events-endpoint", events, "--agents", "2"],
                          stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not info.exists():
            assert up.poll() is None, up.stderr.read() if up.stderr else ""
            assert time.monotonic() < deadline, "no info file within 60 s"
            time.sleep(0.1)
        details = json.loads(info.read_text())
        assert {"service", "token", "pool", "kv_transfer_config", "engine_args"} <= details.keys()
        transfer = KVTransferConfig(**details["kv_transfer_config"])
        assert transfer.kv_connector == "CacheTierConnector"
        assert transfer.kv_load_failure_policy == "recompute"
        extra = transfer.kv_connector_extra_config
        assert extra["model_id"] == model_fingerprint(model_dir)
        # the token by its file, so `vllm serve`'s flags hold none; the files only up's user reads
        assert Path(extra["token_file"]).read_text().strip() == details["token"]
        assert stat.S_IMODE(info.stat().st_mode) == 0o600
        for rank in (0, 1):  # each rank's agent has published its pool, where its worker looks
            handle = Path(extra["handle_file"].replace("{rank}", str(rank)))
            assert stat.S_IMODE(handle.stat().st_mode) == 0o600
        assert details["engine_args"]["tensor_parallel_size"] == 2
        assert details["engine_args"]["block_size"] == 1152
        assert details["engine_args"]["prefix_match_unit"] == FINE_HASH_UNIT
        assert details["kv_events_endpoint"] == events
        pids = json.loads((run_dir / "pids.json").read_text())
        assert "vllm-events" in pids  # the bridge runs as a child of the cluster
        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert not info.exists(), "the info file outlived the cluster"
    for name, pid in pids.items():
        assert not _alive(pid), f"{name} (pid {pid}) outlived `up`"


def test_up_refuses_an_info_file_without_a_model(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "cachetier.cli", "up", "--info",
                           str(tmp_path / "tier.json"), "--port", "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "--vllm-model" in done.stderr


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
