"""docker-compose.yml and the Dockerfile, checked without a Docker engine.

Debian's docker-compose (v1) validates the file against its schema and prints it normalised, with
the variables substituted, without talking to an engine; bin/setup installs it, so a missing binary
is a failure here, not a skip. The checks pin what the cluster needs: AOF on, the GPU reservations,
one set of addresses and one tensor-parallel degree shared by the service and its agents, commands
the real CLI accepts, on its default port, and credentials with no default, each container
mounting its own secret files only (the red-team finding: the file shipped a default token).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from cachetier.cli import build_parser, main
from cachetier.config import PRESETS
from cachetier.events.mqtt import BrokerAddress
from cachetier.run.redis_memory import index_maxmemory

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
CREDENTIALS = "/srv/cachetier-secrets"  # where `cachetier credentials` wrote them
AGENTS = {"agent-gpu0": 0, "agent-gpu1": 1}
CLUSTER_NODES = [f"redis-node-{i}" for i in range(9)]  # profile "cluster": 3 masters x 2 replicas
CLI_DEFAULT_LISTEN = build_parser().parse_args(["serve", "--redis", "redis://r"]).listen
SERVICE_PORT = int(CLI_DEFAULT_LISTEN.rsplit(":", 1)[1])


def docker_compose(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.fail("docker-compose is not installed: run bin/setup (it installs Debian's "
                    "docker-compose package, which validates the file without a Docker engine)")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CACHETIER_")}
    return subprocess.run([binary, "--file", str(COMPOSE_FILE), "--project-directory", str(ROOT),
                           *args], capture_output=True, text=True, env={**clean, **env},
                          timeout=60, check=False)


def load_config(**env: str) -> dict[str, Any]:
    result = docker_compose("config", **env)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    return load_config(CACHETIER_CREDENTIALS=CREDENTIALS)["services"]


def argv(service: dict[str, Any]) -> list[str]:
    command = service["command"]
    return shlex.split(command) if isinstance(command, str) else list(command)


def flags(service: dict[str, Any]) -> dict[str, str]:
    """The `--flag value` pairs of a service's command."""
    words = argv(service)
    return {w: v for w, v in zip(words, words[1:]) if w.startswith("--")}


def test_the_file_is_valid_and_has_no_default_credentials() -> None:
    result = docker_compose("config", "--quiet")
    assert result.returncode != 0 and "set CACHETIER_CREDENTIALS" in result.stderr
    result = docker_compose("config", "--quiet", CACHETIER_CREDENTIALS=CREDENTIALS)
    assert (result.returncode, result.stderr) == (0, "")
    defaults = set(re.findall(r"\$\{(\w+):-", COMPOSE_FILE.read_text()))
    assert defaults == {"CACHETIER_PRESET", "CACHETIER_REDIS"}  # no secret has a default


def test_a_missing_docker_compose_fails_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(pytest.fail.Exception, match="run bin/setup"):
        docker_compose("config")


def test_the_services(services: dict[str, Any]) -> None:
    assert set(services) == {"redis", "mosquitto", "service", *AGENTS, *CLUSTER_NODES,
                             "redis-cluster-init"}
    profiled = {name for name, service in services.items() if service.get("profiles")}
    assert profiled == {*CLUSTER_NODES, "redis-cluster-init"}


def test_the_cluster_profile_runs_the_settings_the_index_needs(services: dict[str, Any]) -> None:
    for name in CLUSTER_NODES:
        node = services[name]
        assert node["image"] == "redis:7" and node["profiles"] == ["cluster"]
        assert flags(node) | {"--cluster-node-timeout": "?"} == {
            "--aclfile": "/run/secrets/redis-users.acl",
            "--include": "/run/secrets/redis-replica.conf", "--cluster-enabled": "yes",
            "--cluster-config-file": "nodes.conf",
            "--cluster-node-timeout": "?", "--min-replicas-to-write": "1",
            "--repl-diskless-sync-delay": "0", "--appendonly": "yes", "--appendfsync": "everysec",
            "--maxmemory": "256mb", "--maxmemory-policy": "noeviction",
            "--latency-tracking": "no"}
        assert int(flags(node)["--cluster-node-timeout"]) <= 5000
        assert any(volume.split(":")[1] == "/data" for volume in node["volumes"])
    init = services["redis-cluster-init"]
    script = " ".join(argv(init))
    assert "--cluster-replicas 2 --cluster-yes" in script
    assert "for n in 0 1 2 3 4 5 6 7 8; do" in script  # every node's address, resolved
    assert set(init["depends_on"]) == set(CLUSTER_NODES)


def test_the_service_takes_the_cluster_from_the_environment() -> None:
    nodes = ",".join(f"{name}:6379" for name in CLUSTER_NODES[:3])
    services = load_config(CACHETIER_REDIS=f"--redis-cluster {nodes}",
                           CACHETIER_CREDENTIALS=CREDENTIALS)["services"]
    words = argv(services["service"])
    assert "--redis" not in words and flags(services["service"])["--redis-cluster"] == nodes
    build_parser().parse_args(words[1:])


def test_redis_persists_with_aof(services: dict[str, Any]) -> None:
    redis = services["redis"]
    assert redis["image"] == "redis:7"
    assert flags(redis)["--appendonly"] == "yes"
    assert flags(redis)["--latency-tracking"] == "no"  # as every redis-server cachetier starts
    assert any(volume.split(":")[1] == "/data" for volume in redis["volumes"])
    assert "ports" not in redis  # only the service talks to it


@pytest.mark.parametrize("name", ["redis", "redis-node-0"])
def test_redis_refuses_writes_past_a_bound_rather_than_evict(services: dict[str, Any],
                                                             name: str) -> None:
    """A Redis without `maxmemory` grows with whatever prompts clients leave held."""
    server = flags(services[name])
    assert server["--maxmemory-policy"] == "noeviction"
    assert int(server["--maxmemory"].removesuffix("mb")) * 2**20 >= max(
        index_maxmemory([config]) for config in PRESETS.values())


def test_mosquitto_runs_the_written_configuration(services: dict[str, Any]) -> None:
    mosquitto = services["mosquitto"]
    assert mosquitto["image"] == "eclipse-mosquitto:2"
    assert argv(mosquitto) == ["mosquitto", "-c", "/run/secrets/mosquitto.conf"]
    assert mosquitto["ports"] == ["127.0.0.1:1883:1883/tcp"]


def test_the_service(services: dict[str, Any]) -> None:
    service = services["service"]
    assert service["build"]["context"] == str(ROOT)
    assert argv(service)[:2] == ["cachetier", "serve"]
    assert flags(service) == {
        "--redis": "redis://redis:6379", "--listen": f"tcp://0.0.0.0:{SERVICE_PORT}",
        "--mqtt": "mqtt://mosquitto:1883", "--secret-file": "/run/secrets/secret",
        "--redis-user": "cachetier", "--redis-password-file": "/run/secrets/redis-cachetier",
        "--preset": "tiny", "--set": f"model.tp_degree={len(AGENTS)}"}
    assert service["ports"] == [f"127.0.0.1:{SERVICE_PORT}:{SERVICE_PORT}/tcp"]
    assert service["depends_on"]["redis"] == {"condition": "service_healthy"}
    assert BrokerAddress.parse(flags(service)["--mqtt"]) == BrokerAddress("mosquitto", 1883)


@pytest.mark.parametrize("name", sorted(AGENTS))
def test_one_agent_per_gpu(services: dict[str, Any], name: str) -> None:
    agent, gpu = services[name], AGENTS[name]
    assert argv(agent)[:2] == ["cachetier", "agent"]
    assert flags(agent) == {
        "--service": f"tcp://service:{SERVICE_PORT}", "--pool": "pool0", "--rank": str(gpu),
        "--tp-degree": str(len(AGENTS)), "--device": "cuda:0",
        "--mqtt": flags(services["service"])["--mqtt"],
        "--token-file": f"/run/secrets/agent-{gpu}"}
    assert agent["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "device_ids": [str(gpu)], "capabilities": ["gpu"]}]
    assert agent["image"] == services["service"]["image"]
    assert set(agent["depends_on"]) == {"service", "mosquitto"}


@pytest.mark.parametrize("name", ["service", *sorted(AGENTS)])
def test_the_cli_accepts_each_command(services: dict[str, Any], name: str) -> None:
    words = argv(services[name])
    assert words[0] == "cachetier"
    build_parser().parse_args(words[1:])  # exits (SystemExit) on an unknown or missing flag


def test_the_preset_comes_from_the_environment() -> None:
    services = load_config(CACHETIER_PRESET="kimi-k3",
                           CACHETIER_CREDENTIALS=CREDENTIALS)["services"]
    assert flags(services["service"])["--preset"] == "kimi-k3"


MOUNTS = {"service": {"secret", "redis-cachetier"}, "agent-gpu0": {"agent-0"},
          "agent-gpu1": {"agent-1"}, "redis": {"redis-users.acl"},
          "mosquitto": {"mosquitto.conf", "mosquitto.passwd", "mosquitto.acl"},
          "redis-cluster-init": {"redis-operator"},
          **{node: {"redis-users.acl", "redis-replica.conf"} for node in CLUSTER_NODES}}


def test_each_container_mounts_its_own_secrets_only(services: dict[str, Any]) -> None:
    for name, service in services.items():
        mounted = {secret["source"] for secret in service.get("secrets", [])}
        assert mounted == MOUNTS[name], name
        assert not [k for k in service.get("environment", {}) if k.startswith("CACHETIER_")]


def test_cachetier_credentials_writes_every_file_compose_mounts(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CACHETIER_SECRET", "s" * 31)
    assert main(["credentials", str(tmp_path / "short")]) == 2  # a guessable secret is refused
    monkeypatch.setenv("CACHETIER_SECRET", "s" * 64)
    assert main(["credentials", str(tmp_path / "secrets"), "--agents", str(len(AGENTS))]) == 0
    written = {path.name: path for path in (tmp_path / "secrets").iterdir()}
    files = load_config(CACHETIER_CREDENTIALS=str(tmp_path / "secrets"))["secrets"]
    assert {Path(f["file"]).name for f in files.values()} <= set(written)
    assert all(path.stat().st_mode & 0o077 == 0 for path in written.values())
    conf = written["mosquitto.conf"].read_text()
    assert "allow_anonymous false" in conf and "/run/secrets/mosquitto.passwd" in conf
    assert written["redis-users.acl"].read_text().startswith("user default off")


def test_dockerfile_installs_the_lock_on_python_3_11_slim() -> None:
    lines = [line.strip() for line in (ROOT / "Dockerfile").read_text().splitlines()]
    assert [line for line in lines if line.startswith("FROM ")] == ["FROM python:3.11-slim"]
    assert "ARG TORCH_INDEX_URL=\"\"" in lines
    assert "COPY requirements.lock ./" in lines
    assert "&& pip install -r requirements.lock" in lines
    assert "RUN pip install --no-deps ." in lines


def test_build_context_is_only_what_the_image_needs() -> None:
    patterns = [line for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line and not line.startswith("#")]
    assert patterns[0] == "*"  # everything out (.venv, .git), then the sources back in
    copied = {source for line in (ROOT / "Dockerfile").read_text().splitlines()
              if line.startswith("COPY ") for source in line.split()[1:-1]}
    assert {f"!{source}" for source in copied} <= set(patterns)
