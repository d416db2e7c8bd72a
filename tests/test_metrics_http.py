"""`GET /metrics` (`service.metrics_http`) over real loopback HTTP: where it binds by default, and
the bearer token `serve` reads from a file or the environment, never from a flag."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from cachetier.cli import _metrics_listen, build_parser
from cachetier.config import ConfigError
from cachetier.service.metrics import ServiceMetrics
from cachetier.service.metrics_http import MetricsEndpoint

TOKEN = "scrape-token-0123456789"


def scrape(url: str, authorization: str | None = None) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of one GET (an error status is returned, not raised)."""
    request = urllib.request.Request(url)
    if authorization is not None:
        request.add_header("Authorization", authorization)
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as refused:
        return refused.code, dict(refused.headers), refused.read()


async def test_with_a_token_a_scrape_without_its_bearer_gets_401_and_no_series() -> None:
    async with MetricsEndpoint(ServiceMetrics(), token=TOKEN) as endpoint:
        for given in (None, "Bearer wrong", f"Basic {TOKEN}", TOKEN):
            status, headers, body = await asyncio.to_thread(scrape, endpoint.url, given)
            assert (status, headers["WWW-Authenticate"]) == (401, "Bearer"), given
            assert b"cachetier_" not in body
        for given in (f"Bearer {TOKEN}", f"bearer {TOKEN}"):
            status, _, body = await asyncio.to_thread(scrape, endpoint.url, given)
            assert status == 200 and b"cachetier_lookups_total" in body, given


async def test_without_a_token_any_scrape_is_answered() -> None:
    async with MetricsEndpoint(ServiceMetrics()) as endpoint:
        status, _, body = await asyncio.to_thread(scrape, endpoint.url)
    assert status == 200 and b"cachetier_lookups_total" in body


async def test_the_default_metrics_bind_is_loopback_only() -> None:
    async with MetricsEndpoint(ServiceMetrics()) as endpoint:
        port = int(endpoint.url.rpartition(":")[2].partition("/")[0])
        listening = {c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
    assert endpoint.url.startswith("http://127.0.0.1:") and listening == {"127.0.0.1"}
    listen = _metrics_listen(serve_args())
    assert listen is not None and listen.host == "127.0.0.1"


def serve_args(*flags: str):
    return build_parser().parse_args(["serve", "--redis", "redis://127.0.0.1:1",
                                      "--metrics-port", "0", *flags])


def test_serve_reads_the_token_from_a_file_or_the_environment_never_a_flag(
        tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("CACHETIER_METRICS_TOKEN", raising=False)
    listen = _metrics_listen(serve_args())
    assert listen is not None and listen.token is None
    monkeypatch.setenv("CACHETIER_METRICS_TOKEN", TOKEN)
    assert (listen := _metrics_listen(serve_args())) is not None and listen.token == TOKEN
    monkeypatch.delenv("CACHETIER_METRICS_TOKEN")
    (tmp_path / "token").write_text(TOKEN + "\n")
    listen = _metrics_listen(serve_args("--metrics-token-file", str(tmp_path / "token")))
    assert listen is not None and listen.token == TOKEN
    (tmp_path / "empty").write_text("")
    with pytest.raises(ConfigError, match="--metrics-token-file"):
        _metrics_listen(serve_args("--metrics-token-file", str(tmp_path / "empty")))
    with pytest.raises(ConfigError, match="--metrics-token-file"):  # a value is a file's name
        _metrics_listen(serve_args("--metrics-token", TOKEN))  # (argparse's abbreviation)
