"""`cachetier up` as a user runs it: a real process tree (redis, mosquitto, service, agents).

Each test checks what a newcomer would notice first: that the demo hits the cache from the second
turn on with every output verified, and that stopping leaves nothing running, whichever way.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from tests.up_harness import UP, children, ready_up, running, wait_for_line

pytestmark = pytest.mark.slow  # `up` and `demo` as processes

DEMO = [sys.executable, "-m", "cachetier.cli", "demo"]
SESSIONS = 2
TURNS = 3


# KDA + MLA; Gated DeltaNet + GQA, on a cluster whose every link is TLS (`--tls`)
@pytest.mark.parametrize("preset, tls", [("tiny", False), ("tiny-gqa", True)])
def test_demo_hits_from_the_second_turn_verifies_every_output_and_leaves_nothing_running(tmp_path,
                                                                                         preset,
                                                                                         tls):
    done = subprocess.run([*DEMO, "--preset", preset, "--sessions", str(SESSIONS), "--turns",
                           str(TURNS), "--json", "--run-dir", str(tmp_path),
                           *(["--tls"] if tls else [])],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    if tls:  # the service, Redis and the broker speak TLS only, under the run's CA
        ca = tmp_path / "tls" / "ca.pem"
        for link in (rf"service tls://127.0.0.1:\d+\?ca={ca} ",
                     rf"redis rediss://127.0.0.1:\d+\?ssl_ca_certs={ca},",
                     rf"mqtt mqtts://127.0.0.1:\d+\?ca={ca},"):
            assert re.search(link, done.stderr), link
        assert stat.S_IMODE((tmp_path / "tls" / "server.key").stat().st_mode) == 0o600
    report = json.loads(done.stdout)
    assert {"requests", "hit_requests", "tokens", "hit_tokens", "verified", "mismatches",
            "checkpoints", "checkpoint_bytes"} <= set(report)
    assert report["requests"] == report["verified"] == SESSIONS * TURNS
    assert report["mismatches"] == 0
    assert report["hit_requests"] >= SESSIONS * (TURNS - 1)
    assert 0 < report["hit_tokens"] < report["tokens"]
    assert report["checkpoints"] > 0 and report["checkpoint_bytes"] > 0
    assert (tmp_path / "demo-hit-ratio.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pids = children(tmp_path)
    assert set(pids) == {"redis", "mosquitto", "service", "agent-0", "agent-1"}
    assert not [name for name, pid in pids.items() if running(pid)]
    assert (tmp_path / "redis-data" / "appendonlydir").is_dir()  # AOF: metadata survives `up`


def test_ctrl_c_stops_every_process(tmp_path, usual_umask):
    run_dir, console = tmp_path / "run", tmp_path / "console.txt"
    secret = tmp_path / "secret"
    secret.write_text("cluster-secret-" * 4 + "\n")
    with open(console, "wb") as out:
        proc = subprocess.Popen([*UP, "--secret-file", str(secret), "--run-dir", str(run_dir)],
                                stdout=out, stderr=out)
    try:
        wait_for_line(console, r"ready; Ctrl-C to stop$", proc, 90)
        pids = children(run_dir)
        assert all(running(pid) for pid in pids.values())
        redis_url = re.search(r"redis (unix://\S+),", console.read_text())[1]
        check_credentials(run_dir, pids, redis_url)
        check_secret_stays_private(run_dir, pids, proc.pid, secret.read_text().strip())
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()
    assert not [name for name, pid in pids.items() if running(pid)]
    for log in ("service.log", "agent-0.log", "agent-1.log", "redis.log", "mosquitto.log"):
        assert "Traceback" not in (run_dir / log).read_text(), log


def check_credentials(run_dir: Path, pids: dict[str, int], redis_url: str) -> None:
    """Every credential in a file only its owner reads; each child holds its own only: the
    service the secret and its Redis password, each agent its rank's token, none on a command
    line; Redis refuses its default user."""
    directory = run_dir / "credentials"
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    files = {path.name: path for path in directory.iterdir()}
    assert {"admin", "client", "observer", "service", "agent-0", "agent-1"} <= set(files)
    assert all(stat.S_IMODE(path.stat().st_mode) == 0o600 for path in files.values())
    tokens = {path.read_text().strip() for path in files.values()}
    for name in ("service", "agent-0", "agent-1"):
        held = {k: v for k, v in environ(pids[name]).items() if k.startswith("CACHETIER_")}
        if name == "service":
            assert held["CACHETIER_REDIS_PASSWORD"] == files["redis-cachetier"].read_text().strip()
            assert set(held) == {"CACHETIER_SECRET", "CACHETIER_REDIS_PASSWORD"}
            assert held["CACHETIER_SECRET"] not in tokens
        else:
            assert held == {"CACHETIER_TOKEN": files[name].read_text().strip()}, name
        command_line = Path(f"/proc/{pids[name]}/cmdline").read_text()
        assert not [t for t in tokens | set(held.values()) if t in command_line], name
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(redis_url).ping()


def environ(pid: int) -> dict[str, str]:
    return dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text()
                .split("\0") if "=" in item)


def check_secret_stays_private(run_dir: Path, pids: dict[str, int], up_pid: int,
                               secret: str) -> None:
    """The cluster secret goes from `up --secret-file` to the service by its environment, on no
    command line (`up`'s own included); every file of the run directory holding the secret, a
    token or a pool handle (the agents' `*.handle`: whoever reads one maps the pool) is 0600."""
    assert environ(pids["service"])["CACHETIER_SECRET"] == secret
    command_lines = [Path(f"/proc/{pid}/cmdline").read_text() for pid in [up_pid, *pids.values()]]
    assert not [line for line in command_lines if secret in line]
    tokens = {secret} | {path.read_text().strip() for path in (run_dir / "credentials").iterdir()}
    files = [path for path in run_dir.rglob("*") if path.is_file()]  # logs: links, followed
    holding = [path for path in files if path.suffix == ".handle"
               or any(token.encode() in path.read_bytes() for token in tokens)]
    assert {"agent-0.handle", "agent-1.handle", "client", "service"} <= {p.name for p in holding}
    assert [p for p in holding if stat.S_IMODE(p.stat().st_mode) != 0o600] == []


def test_a_dead_agent_stops_the_cluster_without_orphans(tmp_path):
    run_dir, console = tmp_path / "run", tmp_path / "console.txt"
    with ready_up(run_dir, console, "--agents", "1") as proc:
        pids = children(run_dir)
        os.kill(pids["agent-0"], signal.SIGKILL)
        assert proc.wait(timeout=30) == 1
    assert "agent-0 exited with code -9" in console.read_text()
    assert not [name for name, pid in pids.items() if running(pid)]


def test_up_with_a_redis_cluster_serves_and_stops_every_node(tmp_path):
    """`up --redis-cluster 3x1`: the service runs on a local Redis Cluster (pool0 registered
    there, a prompt served twice hits), and Ctrl-C stops every node with the rest."""
    run_dir, console = tmp_path / "run", tmp_path / "console.txt"
    with open(console, "wb") as out:
        proc = subprocess.Popen([*UP, "--agents", "1", "--redis-cluster", "3x1",
                                 "--run-dir", str(run_dir)], stdout=out, stderr=out)
    try:
        wait_for_line(console, r"ready; Ctrl-C to stop$", proc, 90)
        pids = children(run_dir)
        assert {f"redis-{i}" for i in range(6)} <= set(pids) and "redis" not in pids
        assert all(running(pid) for pid in pids.values())
        url = re.search(r"service (\S+) ", console.read_text())[1]
        token = (run_dir / "credentials" / "client").read_text().strip()
        hits = subprocess.run([sys.executable, "-c", SERVE_TWICE, url],
                              env={**os.environ, "TOKEN": token}, capture_output=True,
                              text=True, timeout=60, check=False)
        assert hits.returncode == 0 and hits.stdout.split() == ["0", "96"], hits.stderr
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()
    assert "redis cluster 3x1" in console.read_text()
    assert not [name for name, pid in pids.items() if running(pid)]
    for log in ("service.log", "agent-0.log", "redis-0.log"):
        assert "Traceback" not in (run_dir / log).read_text(), log


SERVE_TWICE = """
import asyncio, os, sys
from cachetier.client import CacheTierClient
from index.lifecycle import RequestLifecycle
from tests.index_harness import commit_item, new_request, only
async def main():
    async with CacheTierClient(sys.argv[1], token=os.environ["TOKEN"], timeout=10) as tier:
        for rid in ("a", "b"):
            tokens = list(range(100)) + ([1] if rid == "b" else [])
            async with RequestLifecycle(tier.pool("pool0")) as steps:
                step = only(await steps.plan([new_request(rid, tokens, len(tokens), 16)]))
                await steps.finish([commit_item(step, len(tokens), True, True, 16)])
            print(step.hit_tokens)
asyncio.run(main())
"""
