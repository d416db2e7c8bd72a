"""`cachetier up`: the whole cluster on this machine, for a newcomer's first run and for tests.

It starts, in order, a redis-server (AOF on, its data under the run directory, so restarting `up`
on the same directory keeps the metadata) or, with `--redis-cluster MASTERSxREPLICAS`, a local
Redis Cluster (`run.redis_cluster`: a new one per run, its nodes' logs in the run directory),
mosquitto, `cachetier serve` and one `cachetier agent`
per tensor-parallel rank of pool `pool0` on the CPU, each only once the previous one answers, and
stops them in the reverse order (agents first, so the broker never sends Wills of live agents)
on SIGINT, SIGTERM or SIGHUP, and on its parent's death (`_follow_parent`). Every child runs in
its own session, so a signal for the terminal's or the caller's process group reaches `up` alone
and the order holds, and gets SIGTERM if `up` itself dies (SIGKILL included), so nothing outlives
it. All logs and `pids.json` live in the run directory, and stay. Every credential is generated
from the cluster secret into `credentials/` in the run
directory (`run.credential_files`); each child gets its own only (the service the secret, each
agent its rank's token), through the environment, not its command line. The broker admits those
principals only, each to its own topics (`run.mqtt_auth`). With `--tls` every link (the service's,
Redis', the broker's) is TLS only, under certificates of a CA made for the run (`run.tls`, in
`tls/` of the run directory).
With `metrics_port` the service serves Prometheus metrics; its address is in the `up:` line and,
with every other address, in `cluster.json` of the run directory. With `agent_zygote` agents are
forked from a warm process (`run.zygote`) and `restart_agent` replaces one in milliseconds (the
chaos campaign restarts one after every kill).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from cachetier.client import CacheTierClient
from cachetier.config import Config
from cachetier.credentials import Role
from cachetier.errors import CacheTierError
from cachetier.run.credential_files import ClusterCredentials
from cachetier.run.mqtt_auth import BrokerAuth
from cachetier.run.redis_auth import RedisAcl
from cachetier.run import tls
from cachetier.run.redis_cluster import ClusterNode, ClusterShape, LocalRedisCluster
from cachetier.run.redis_memory import index_maxmemory
from cachetier.run.servers import (MosquittoServer, RedisServer, ChildServer, parent_death_hook,
                                   terminate)
from cachetier.run.zygote import AgentZygote, ForkedProcess

POOL = "pool0"
_LISTENING = re.compile(rb"listening on (\S+)")
_BRIDGING = re.compile(rb"published on (\S+)")
_METRICS = re.compile(rb"metrics on (\S+)")
_POLL_S = 0.05


class ClusterError(RuntimeError):
    """A part of the cluster did not start or died; the message names its log."""


@dataclass(frozen=True)
class ClusterSettings:
    run_dir: Path
    secret: str  # the cluster secret every credential derives from (`cachetier.credentials`)
    config: Config
    serve_config_args: tuple[str, ...]  # the flags that give `serve` the same `config`
    agents: int = 2
    port: int = 7400
    startup_timeout_s: float = 60.0  # agents import torch: seconds each on a small machine
    # where `events vllm` republishes the pool's cache events as vLLM KV events (ZeroMQ), if set
    kv_events_endpoint: str | None = None
    redis_cluster: ClusterShape | None = None  # None: one redis-server
    tls: bool = False  # every link TLS (`run.tls`): the service, Redis, the broker
    metrics_port: int | None = None  # the service's Prometheus metrics (0: any port; None: off)
    serve_args: tuple[str, ...] = ()  # more `serve` flags (e.g. a shorter --copy-timeout)
    agent_zygote: bool = False  # agents forked from a warm process (restarts in milliseconds)
    tenants: tuple[str, ...] = ()  # a client credential each, `credentials/client-<tenant>`


@dataclass(kw_only=True)
class _LoggedServer(ChildServer):
    """A server whose log is readable in the run directory while it runs (a link into its
    private directory) and stays there afterwards (a copy made as it stops)."""

    log_file: Path

    def start(self) -> Self:
        super().start()
        self.log_file.unlink(missing_ok=True)
        self.log_file.symlink_to(self.workdir / "server.log")
        return self

    def stop(self) -> None:
        if self._proc is not None:
            terminate(self._proc)  # first, so the copy has its last words
        with contextlib.suppress(RuntimeError):  # RuntimeError: never started
            log = self.workdir / "server.log"
            self.log_file.unlink(missing_ok=True)
            shutil.copyfile(log, self.log_file)
        super().stop()


@dataclass(kw_only=True)
class _DurableRedis(_LoggedServer, RedisServer):
    """Redis with an append-only file in `data_dir` (later flags override the throwaway ones)."""

    data_dir: Path

    def _command(self, workdir: Path) -> list[str]:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        return [*super()._command(workdir), "--appendonly", "yes", "--dir", str(self.data_dir)]


@dataclass(kw_only=True)
class _LoggedClusterNode(_LoggedServer, ClusterNode):
    """A node of `up --redis-cluster`, its log `redis-<i>.log` in the run directory."""


@dataclass(kw_only=True)
class _LoggedMosquitto(_LoggedServer, MosquittoServer):
    """Mosquitto drops root privileges before opening a log file, hence the link, not `log_dest`."""


@dataclass
class Node:
    """A `cachetier serve` or `cachetier agent` child, its output in `log`."""

    name: str
    args: list[str]
    log: Path
    env: dict[str, str]
    zygote: AgentZygote | None = None  # fork it from this warm process
    proc: subprocess.Popen[bytes] | ForkedProcess | None = field(default=None, repr=False)

    def start(self) -> Self:
        if self.zygote is not None:
            self.log.write_bytes(b"")
            self.proc = self.zygote.fork(self.args, self.log)
            return self
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cachetier.cli", *self.args], stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
                preexec_fn=parent_death_hook())  # noqa: PLW1509 (no threads run here yet)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc)  # type: ignore[arg-type]  (a ForkedProcess stops alike)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def check_alive(self) -> None:
        code = None if self.proc is None else self.proc.poll()
        if code is not None:
            raise ClusterError(f"{self.name} exited with code {code}; see {self.log}")

    def wait_for(self, pattern: re.Pattern[bytes], timeout_s: float) -> re.Match[bytes]:
        """The first match of `pattern` in the log, polled until `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while (found := pattern.search(self.log.read_bytes())) is None:
            self.check_alive()
            if time.monotonic() > deadline:
                raise ClusterError(f"{self.name} not ready within {timeout_s:g} s; see {self.log}")
            time.sleep(_POLL_S)
        return found


class Cluster:
    """`with Cluster(settings) as cluster:` everything runs inside the block, stopped after it
    (also when starting fails half-way)."""

    def __init__(self, settings: ClusterSettings) -> None:
        self.settings = settings
        self.run_dir = settings.run_dir
        maxmemory = index_maxmemory([settings.config])
        self.credentials = ClusterCredentials(settings.secret, POOL, settings.agents,
                                              settings.tenants)
        password = self.credentials.redis_password
        acl = RedisAcl(password("cachetier"), password("replica"), password("operator"))
        self.tls = tls.generate(self.run_dir / "tls") if settings.tls else None
        self.redis = _DurableRedis(log_file=self.run_dir / "redis.log",
                                   data_dir=self.run_dir / "redis-data", maxmemory=maxmemory,
                                   acl=acl, tls=self.tls)
        self.redis_cluster = None if settings.redis_cluster is None else LocalRedisCluster(
            settings.redis_cluster, maxmemory=maxmemory, acl=acl, tls=self.tls,
            make_node=lambda i: _LoggedClusterNode(log_file=self.run_dir / f"redis-{i}.log"))
        self.mqtt = _LoggedMosquitto(log_file=self.run_dir / "mosquitto.log",
                                     auth=BrokerAuth.of(self.credentials.mqtt_tokens()),
                                     tls=self.tls)
        self.service_url = ""
        self.metrics_url = ""
        self.nodes: list[Node] = []
        self.agents: dict[int, Node] = {}
        self._agent_starts: dict[int, int] = {}
        self._zygote: AgentZygote | None = None
        self._pids: dict[str, int] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Self:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Everything started, in reverse order. A second Ctrl-C cannot cut it short and leave
        orphans: each child's stop is bounded anyway (SIGTERM, then SIGKILL)."""
        with _signal_handlers(_IGNORED):
            self._stack.close()

    def _start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.credentials.write(self.run_dir)
        if self.settings.agent_zygote:  # its imports run while the servers start
            zygote = AgentZygote(self.run_dir / "zygote.log", self._env({}),
                                 self.settings.startup_timeout_s)
            self._zygote = self._stack.enter_context(zygote)
            self._record("zygote", self._zygote.pid)
        self._record("mosquitto", self._stack.enter_context(self.mqtt).pid)
        metrics = ([] if self.settings.metrics_port is None else
                   ["--metrics-port", str(self.settings.metrics_port)])
        service = self._spawn("service", {
            "CACHETIER_SECRET": self.settings.secret,
            "CACHETIER_REDIS_PASSWORD": self.credentials.redis_password("cachetier")}, [
            "serve", *self._start_redis(), "--redis-user", "cachetier",
            "--listen", self._listen_url(), *metrics, *self._node_args(),
            *self.settings.serve_config_args, *self.settings.serve_args])
        url = service.wait_for(_LISTENING, self.settings.startup_timeout_s)[1]
        self.service_url = url.decode()
        if metrics:
            self.metrics_url = service.wait_for(_METRICS, 0)[1].decode()
        for rank in range(self.settings.agents):
            self.start_agent(rank)
        asyncio.run(self._until_registered())
        self._write_addresses()
        if self.settings.kv_events_endpoint is not None:
            observer = {"CACHETIER_TOKEN": self.credentials.role(Role.OBSERVER)}
            bridge = self._spawn("vllm-events", observer, [
                "events", "vllm", *self._node_args(), "--pool", POOL, "--endpoint",
                self.settings.kv_events_endpoint, *self.settings.serve_config_args])
            bridge.wait_for(_BRIDGING, self.settings.startup_timeout_s)

    def _start_redis(self) -> list[str]:
        """Start the server or the cluster; the flags that give `serve` its address."""
        if self.redis_cluster is None:
            self._record("redis", self._stack.enter_context(self.redis).pid)
            return ["--redis", self.redis.url]
        self._stack.enter_context(self.redis_cluster)
        for i, node in enumerate(self.redis_cluster.nodes):
            self._record(f"redis-{i}", node.pid)
        tls = [] if self.tls is None else ["--redis-tls-ca", str(self.tls.ca)]
        return ["--redis-cluster", self.redis_cluster.startup_nodes, *tls]

    def _listen_url(self) -> str:
        if self.tls is None:
            return f"tcp://127.0.0.1:{self.settings.port}"
        return (f"tls://127.0.0.1:{self.settings.port}?cert={self.tls.cert}&key={self.tls.key}"
                f"&ca={self.tls.ca}")

    def _node_args(self) -> list[str]:
        return ["--mqtt", self.mqtt.url]

    def _env(self, secrets: dict[str, str]) -> dict[str, str]:
        """Our environment without our credentials (`CACHETIER_*`), with `secrets`."""
        return {k: v for k, v in os.environ.items() if not k.startswith("CACHETIER_")} | secrets

    def _spawn(self, name: str, secrets: dict[str, str], args: list[str],
               zygote: AgentZygote | None = None) -> Node:
        """A child with `secrets` in its environment, and none of ours."""
        node = Node(name, args, self.run_dir / f"{name}.log", self._env(secrets), zygote)
        self._stack.callback(node.stop)  # before starting: a failed start still gets reaped
        self.nodes.append(node.start())
        self._record(name, node.pid)
        return node

    def start_agent(self, rank: int) -> Node:
        """Start the agent of `rank` (forked from the zygote if there is one); it registers on
        its own. Its log is `agent-<rank>.log`, restarts append `agent-<rank>.<n>.log`."""
        starts = self._agent_starts[rank] = self._agent_starts.get(rank, 0) + 1
        name = f"agent-{rank}" if starts == 1 else f"agent-{rank}.{starts - 1}"
        args = ["agent", "--service", self.service_url, "--pool", POOL, "--rank", str(rank),
                "--tp-degree", str(self.settings.agents), "--device", "cpu",
                "--handle-file", str(self.handle_file(rank)), *self._node_args()]
        secrets = {"CACHETIER_TOKEN": self.credentials.agent(rank)}
        if self._zygote is not None:  # a fork has the zygote's environment: its token by file
            args += ["--token-file", str(self.credential_file(f"agent-{rank}"))]
            secrets = {}
        self.agents[rank] = self._spawn(name, secrets, args, self._zygote)
        return self.agents[rank]

    def restart_agent(self, rank: int) -> Node:
        """The agent of `rank` stopped if it still runs (SIGKILL: its death, not a goodbye),
        its pool's shared memory unlinked, and a new one started."""
        node = self.agents[rank]
        if node.proc is not None:
            node.proc.kill()
            node.proc.wait(timeout=10)
        self.nodes.remove(node)
        _unlink_pool_files(self.handle_file(rank))
        return self.start_agent(rank)

    def _write_addresses(self) -> None:
        """cluster.json: every address of the run, for operators and monitors."""
        redis = (self.redis.url if self.redis_cluster is None
                 else self.redis_cluster.startup_nodes)
        (self.run_dir / "cluster.json").write_text(json.dumps(
            {"service": self.service_url, "metrics": self.metrics_url or None, "redis": redis,
             "mqtt": self.mqtt.url, "pool": POOL, "agents": self.settings.agents}, indent=2))

    def _record(self, name: str, pid: int) -> None:
        """pids.json: what a test or an operator checks is gone after the run."""
        self._pids[name] = pid
        (self.run_dir / "pids.json").write_text(json.dumps(self._pids))

    async def _until_registered(self) -> None:
        """Every rank of the pool registered with the service, as its `health` reports."""
        ranks = list(range(self.settings.agents))
        deadline = time.monotonic() + self.settings.startup_timeout_s
        async with self.client() as tier:
            while (await tier.health()).pools.get(POOL) != ranks:
                self.check_alive()
                if time.monotonic() > deadline:
                    raise ClusterError(f"agents not registered within "
                                       f"{self.settings.startup_timeout_s:g} s; see "
                                       f"{self.run_dir}/agent-*.log")
                await asyncio.sleep(_POLL_S)

    def handle_file(self, rank: int) -> Path:
        """Where agent `rank` writes the handle a co-located worker attaches to its pool with."""
        return Path(self.handle_file_pattern.format(rank=rank))

    @property
    def handle_file_pattern(self) -> str:
        """Every agent's handle file, `{rank}` standing for the rank: what a vLLM connector is
        given, so each tensor-parallel worker finds its own rank's agent."""
        return str(self.run_dir / "agent-{rank}.handle")

    @property
    def client_token(self) -> str:
        """A scheduler's credential (role client), as in `credentials/client`."""
        return self.credentials.role(Role.CLIENT)

    def credential_file(self, name: str) -> Path:
        """The file of credential `name` (`client`, `agent-0`, ...), readable by its owner only."""
        return self.run_dir / "credentials" / name

    def client(self) -> CacheTierClient:
        return CacheTierClient(self.service_url, token=self.client_token)

    def check_alive(self) -> None:
        """A ClusterError naming the first child that exited (the servers are checked by use)."""
        for node in self.nodes:
            node.check_alive()

    def describe(self) -> str:
        if self.redis_cluster is None:
            redis = f"redis {self.redis.url}"
        else:
            shape = self.redis_cluster.shape
            redis = (f"redis cluster {shape.masters}x{shape.replicas} "
                     f"{self.redis_cluster.startup_nodes}")
        metrics = f"metrics {self.metrics_url}, " if self.metrics_url else ""
        return (f"service {self.service_url} (pool {POOL}, {self.settings.agents} CPU agents), "
                f"{metrics}{redis}, mqtt {self.mqtt.url}, "
                f"credentials {self.run_dir / 'credentials'}")


def _unlink_pool_files(handle_file: Path) -> None:
    """The shared memory of a killed agent's pool (the agent unlinks it only when it exits
    cleanly), named by its handle file."""
    import pickle
    try:
        handle = pickle.loads(handle_file.read_bytes())
    except (OSError, pickle.UnpicklingError, EOFError):
        return
    handle_file.unlink(missing_ok=True)
    for part in (handle.data, handle.tags, handle.fence):
        path = getattr(part, "path", None)  # a CUDA pool's data has no file
        if path is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)


def _interrupt(signum: int, frame: Any) -> None:
    """The first stop signal unwinds `up` as a KeyboardInterrupt and ignores the next ones: a
    second (`timeout` sends SIGTERM to `up` and again to its group; a held Ctrl-C) could
    otherwise cut the unwinding short before the info file is removed and the stop begins."""
    for sig in _STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt


@contextlib.contextmanager
def _signal_handlers(handlers: dict[signal.Signals, Any]) -> Iterator[None]:
    previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_IGNORED = {sig: signal.SIG_IGN for sig in _STOP_SIGNALS}


def _hangup_ignored() -> bool:
    """Whether `up` was started under nohup (SIGHUP ignored), which asks it to outlive its
    terminal and the shell that started it."""
    return signal.getsignal(signal.SIGHUP) is signal.SIG_IGN


def _stop_handlers() -> dict[signal.Signals, Any]:
    """Each stop signal unwinds `up` through the same orderly stop: Ctrl-C even where the shell
    started `up` with SIGINT ignored (`up &`), SIGHUP (its terminal closed) unless under nohup."""
    return {sig: _interrupt for sig in _STOP_SIGNALS
            if sig is not signal.SIGHUP or not _hangup_ignored()}


def _follow_parent() -> None:
    """SIGTERM for `up` when the process that started it dies (Linux): a harness or a shell
    killed outright then takes the cluster down in order, the info file removed, instead of
    leaving it running unattended. Not under nohup. The kernel sends it when the *thread* that
    started `up` ends: start `up` from a thread that lives as long as it should."""
    set_parent_death_signal = parent_death_hook()
    if set_parent_death_signal is None or _hangup_ignored():
        return
    set_parent_death_signal()
    if os.getppid() != _STARTED_BY:  # it died before the signal was set (imports, settings)
        raise KeyboardInterrupt


# `up`'s parent as early as this process knows it, for `_follow_parent` to see if it is gone
_STARTED_BY = os.getppid()


def up(settings: ClusterSettings, job: Callable[[Cluster], None] | None = None) -> int:
    """Run the cluster until interrupted, or with `job` until the job is done: 0, or 1 if
    anything failed. Status lines go to stderr; stdout is the job's."""
    say(f"run directory {settings.run_dir} (logs: *.log, pids.json)")
    try:
        with _signal_handlers(_stop_handlers()):
            _follow_parent()
            _run(settings, job)
    except KeyboardInterrupt:
        say("interrupted")
    except (ClusterError, CacheTierError, RuntimeError, OSError) as exc:  # all stopped by now
        say(f"failed: {exc}; stopped")
        return 1
    say("stopped")
    return 0


def _run(settings: ClusterSettings, job: Callable[[Cluster], None] | None) -> None:
    """The cluster until `job` is done or, without one, until interrupted; stopped either way."""
    with Cluster(settings) as cluster:
        say(f"up: {cluster.describe()}")
        if job is not None:
            job(cluster)
        else:
            say("ready; Ctrl-C to stop")
            _watch(cluster)


def _watch(cluster: Cluster) -> None:
    """Until interrupted, or a ClusterError if a child dies."""
    while True:
        cluster.check_alive()
        time.sleep(0.5)


def say(line: str) -> None:
    print(f"cachetier up: {line}", file=sys.stderr, flush=True)
