"""The throwaway servers: they answer, stop without an orphan, and fail loudly."""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path

import pytest
import redis as sync_redis
from redis.asyncio import Redis

from cachetier.config import PRESETS
from cachetier.run.cluster import Cluster, ClusterSettings
from cachetier.run.redis_cluster import ClusterNode, ClusterShape
from cachetier.run.redis_memory import index_maxmemory
from cachetier.run.servers import MosquittoServer, RedisServer


def assert_gone(pid: int, workdir: Path) -> None:
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not workdir.exists()


@pytest.mark.parametrize("tcp", [False, True], ids=["unix", "tcp"])
def test_redis_starts_answers_and_stops(tcp: bool) -> None:
    with RedisServer(tcp=tcp) as server:
        pid, workdir = server.pid, server.workdir
        assert server.url.startswith("redis://127.0.0.1:" if tcp else "unix:///")
        client = sync_redis.Redis.from_url(server.url)
        assert client.ping()
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("appendonly") == {"appendonly": "no"}
        # bounded, and refusing writes at the bound rather than evicting index keys
        assert client.config_get("maxmemory") == {"maxmemory": str(1 << 30)}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        # no latency histogram per command, so not per command a script issues
        assert client.config_get("latency-tracking") == {"latency-tracking": "no"}
        client.close()
    assert_gone(pid, workdir)


def test_redis_maxmemory_is_sized_from_the_pools(tmp_path: Path) -> None:
    """`cachetier up` and its cluster nodes: the budget of `run.redis_memory`, noeviction."""
    tiny, big = PRESETS["tiny"], dataclasses.replace(
        PRESETS["tiny"], cache=dataclasses.replace(PRESETS["tiny"].cache, num_pages=1 << 20))
    small, large = index_maxmemory([tiny]), index_maxmemory([tiny, big])
    # a million pages of 4 hash blocks: their ~700 measured bytes each, with room to spare
    assert large - small >= (1 << 20) * 700 * 1.5
    cluster = Cluster(ClusterSettings(tmp_path, "t", big, (), redis_cluster=ClusterShape()))
    assert cluster.redis.maxmemory == cluster.redis_cluster.maxmemory == index_maxmemory([big])
    command = ClusterNode(maxmemory=12345)._command(tmp_path)
    flags = dict(zip(command[1::2], command[2::2]))
    assert (flags["--maxmemory"], flags["--maxmemory-policy"]) == ("12345", "noeviction")




async def test_redis_usable_from_async_code() -> None:
    async with RedisServer() as server:
        client = Redis.from_url(server.url)
        assert await client.ping()
        await client.aclose()
        pid, workdir = server.pid, server.workdir
    assert_gone(pid, workdir)


def test_keyboard_interrupt_leaves_no_orphan() -> None:
    server = RedisServer()
    with pytest.raises(KeyboardInterrupt), server:
        pid, workdir = server.pid, server.workdir
        raise KeyboardInterrupt
    assert_gone(pid, workdir)
    server.stop()  # idempotent


def test_missing_binary_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match=r"cannot run `/nonexistent/redis-server .*apt-get"):
        RedisServer(binary="/nonexistent/redis-server").start()


def test_failed_start_reports_the_command_and_log_tail(tmp_path: Path) -> None:
    fake = tmp_path / "fake-redis"
    fake.write_text("#!/bin/sh\necho 'FATAL: cannot bind' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(RuntimeError, match=r"(?s)fake-redis --port 0 .*exited with code 3.*"
                                           r"FATAL: cannot bind"):
        RedisServer(binary=str(fake)).start()


def test_start_twice_is_refused() -> None:
    with RedisServer() as server, pytest.raises(RuntimeError, match="already running"):
        server.start()


async def test_redis_fixture_starts_empty(redis_operator: Redis) -> None:
    assert await redis_operator.dbsize() == 0
    await redis_operator.set(b"left-behind", b"1")


async def test_redis_fixture_flushes_between_tests(redis_operator: Redis) -> None:
    assert await redis_operator.dbsize() == 0
    await redis_operator.set(b"left-behind", b"1")


def test_mosquitto_accepts_an_mqtt_connection() -> None:
    with MosquittoServer() as broker:
        pid, workdir = broker.pid, broker.workdir
        assert broker.url == f"mqtt://127.0.0.1:{broker.port}"
        with socket.create_connection(("127.0.0.1", broker.port), timeout=5) as sock:
            # CONNECT, MQTT 3.1.1, clean session, keep-alive 10 s, client id "t".
            sock.sendall(bytes([0x10, 13, 0, 4]) + b"MQTT" + bytes([4, 2, 0, 10, 0, 1]) + b"t")
            assert sock.recv(4) == bytes([0x20, 2, 0, 0])  # CONNACK, accepted
    assert_gone(pid, workdir)
