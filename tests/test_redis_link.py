"""The index's Redis clients pack commands with hiredis: the very bytes redis-py's own packer
makes, the same refusals, on every connection `connect` opens, to one server or a cluster."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.exceptions import DataError

from index.redis_link import BoundedCluster, RedisTarget, close, connect, hiredis_packing
from tests.cluster_harness import OPERATOR_LOGIN

ARGUMENT = st.one_of(st.text(), st.binary(max_size=9000),
                     st.integers(min_value=-2**70, max_value=2**70),
                     st.floats(allow_nan=False), st.binary(max_size=64).map(memoryview))
NAME = st.sampled_from(["FCALL", "FUNCTION LOAD", b"SCRIPT LOAD", "GET"])


@given(NAME, st.lists(ARGUMENT, max_size=24))
def test_hiredis_packs_the_bytes_redis_py_packs(name: str | bytes, args: list) -> None:
    python = Connection()
    hiredis = hiredis_packing(Connection)()
    assert b"".join(map(bytes, hiredis.pack_command(name, *args))) == b"".join(
        map(bytes, python.pack_command(name, *args)))
    pipeline = [(name, *args), ("PING",)]
    assert b"".join(map(bytes, hiredis.pack_commands(pipeline))) == b"".join(
        map(bytes, python.pack_commands(pipeline)))


@pytest.mark.parametrize("value", [True, None, [1], {"a": 1}])
def test_a_value_redis_cannot_take_is_refused_as_by_redis_py(value: object) -> None:
    for connection in (Connection(), hiredis_packing(Connection)()):
        with pytest.raises(DataError):
            connection.pack_command("SET", "k", value)


@pytest.mark.parametrize("base", [Connection, SSLConnection, UnixDomainSocketConnection])
def test_every_connection_kind_keeps_its_own_behaviour(base: type) -> None:
    packing = hiredis_packing(base)
    assert issubclass(packing, base) and packing is not base
    assert hiredis_packing(packing) is packing


async def test_a_server_client_sends_through_hiredis_packing_connections(
        operator_url: str) -> None:
    client = connect(RedisTarget(operator_url))
    try:
        assert await client.execute_command("ECHO", b"\x00\xff") == b"\x00\xff"
        pool = client.connection_pool
        assert pool.connection_class is hiredis_packing(pool.connection_class)
        connection = await pool.get_connection()
        try:
            assert type(connection) is pool.connection_class
        finally:
            await pool.release(connection)
    finally:
        await close(client)


async def test_a_cluster_client_sends_through_hiredis_packing_connections(redis_cluster) -> None:
    client = connect(RedisTarget.cluster(redis_cluster.startup_nodes, **OPERATOR_LOGIN))
    assert isinstance(client, BoundedCluster)
    try:
        for n in range(12):  # keys on every shard
            await client.set(f"link-{n}", n)
            assert await client.get(f"link-{n}") == str(n).encode()
        nodes = client.get_nodes()
        assert len(nodes) >= 3
        for node in nodes:
            assert node.connection_class is hiredis_packing(node.connection_class)
            connection = node.acquire_connection()
            try:
                assert type(connection) is node.connection_class
            finally:
                node.release(connection)
        await client.delete(*(f"link-{n}" for n in range(12)))
    finally:
        await close(client)
