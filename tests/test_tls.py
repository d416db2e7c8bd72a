"""TLS on the service link (`wire.framing.Endpoint`, `run.tls`): a client holding the run's CA
is served; a plain client, or one that does not trust the CA, is not. `tests/test_cluster.py`
runs the demo on a whole TLS cluster (Redis and the broker too)."""

from __future__ import annotations

import ssl

import pytest

from cachetier.client import CacheTierClient
from cachetier.errors import ConnectionLost
from cachetier.run.tls import generate
from cachetier.wire.framing import Endpoint
from tests.cluster_harness import TOKEN, running_agent, running_service


def test_tls_endpoints_parse_and_keep_only_the_ca_in_their_url():
    listen = Endpoint.parse("tls://127.0.0.1:0?cert=/c.pem&key=/k.pem&ca=/ca.pem")
    assert (listen.cert, listen.key, listen.ca) == ("/c.pem", "/k.pem", "/ca.pem")
    assert listen.url == "tls://127.0.0.1:0?ca=/ca.pem"
    for bad in ("tls://h:1?cert=/c.pem", "tls://h:1?pw=x", "tls://h"):
        with pytest.raises(ValueError, match="bad endpoint"):
            Endpoint.parse(bad)


async def test_only_a_client_trusting_the_ca_is_served(redis, redis_url, tmp_path):
    files = generate(tmp_path / "tls")
    listen = f"tls://127.0.0.1:0?cert={files.cert}&key={files.key}&ca={files.ca}"
    async with running_service(redis_url, listen=listen) as service:
        assert service.url.startswith("tls://127.0.0.1:") and "key" not in service.url
        async with CacheTierClient(service.url, token=TOKEN) as tier:
            assert (await tier.health()).redis
        port = service.url.split(":")[2].split("?")[0]
        with pytest.raises(ConnectionLost):  # plain TCP: the TLS server never answers a hello
            async with CacheTierClient(f"tcp://127.0.0.1:{port}", token=TOKEN,
                                       connect_timeout=1.0, timeout=1.0):
                pass
        other = generate(tmp_path / "other")  # a CA that did not sign the service's certificate
        with pytest.raises(ssl.SSLCertVerificationError):
            async with CacheTierClient(f"tls://127.0.0.1:{port}?ca={other.ca}", token=TOKEN):
                pass
        with pytest.raises(ssl.SSLCertVerificationError):  # an agent too: at once, not retried
            async with running_agent(f"tls://127.0.0.1:{port}?ca={other.ca}"):
                pass
