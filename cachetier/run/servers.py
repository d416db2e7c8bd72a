"""Private, throwaway `redis-server` and `mosquitto` processes for tests, benchmarks and `cachetier up`.

Each server is a child process with its own temporary directory and nothing persisted, so runs never
see each other's state. It is always stopped: on leaving its `with` block (KeyboardInterrupt
included), and, on Linux, by a parent-death signal if this process is killed outright, so no run
leaves an orphan holding a port. Start it from the thread that owns it: the parent-death signal fires
when the *starting thread* exits.
"""

from __future__ import annotations

import ctypes
import getpass
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Self

import redis

if TYPE_CHECKING:
    from cachetier.run.mqtt_auth import BrokerAuth
    from cachetier.run.redis_auth import RedisAcl
    from cachetier.run.tls import TlsFiles

LOOPBACK = "127.0.0.1"
_STOP_TIMEOUT_S = 5.0
_LOG_TAIL_BYTES = 4000
_SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin")  # mosquitto lives here; a non-root PATH may lack them
# Redis 7 records every command's latency in a histogram (INFO latencystats), the commands a
# script issues too: a plan_step issues ~20, and `bench lookup` measured 5-9% less of the
# server's time per step without it (command stats, which the benchmarks read, stay on).
SCRIPT_TUNING = ("--latency-tracking", "no")


def find_binary(name: str) -> str:
    """`name` resolved on PATH plus the sbin directories; `name` itself when nowhere to be found."""
    search = os.pathsep.join([os.environ.get("PATH", ""), *_SBIN_DIRS])
    return shutil.which(name, path=search) or name


def free_port() -> int:
    """A loopback port that was free a moment ago (the kernel's pick)."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def parent_death_hook() -> Any:
    """A function that makes the process calling it receive SIGTERM when its parent dies (Linux
    only): a child's preexec_fn, or `cachetier up` for itself (`run.cluster._follow_parent`).

    SIGTERM, not SIGKILL: an orphan stops as its parent would have stopped it (an agent unlinks its
    pool's shared memory, redis-server syncs its append-only file). `prctl` is looked up here,
    before the fork, so the child runs no dynamic loading.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1
    return lambda: prctl(pr_set_pdeathsig, signal.SIGTERM)


def terminate(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, a bounded wait, then SIGKILL; reaps the child even if interrupted meanwhile."""
    try:
        proc.terminate()
        proc.wait(timeout=_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@dataclass(kw_only=True)
class ChildServer:
    """Start/readiness/stop shared by the servers; subclasses say how to run and how to probe."""

    name: ClassVar[str]
    install_hint: ClassVar[str]
    startup_timeout_s: float = 10.0
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _workdir: Path | None = field(default=None, init=False, repr=False)
    _command_line: list[str] = field(default_factory=list, init=False, repr=False)

    def _command(self, workdir: Path) -> list[str]:
        raise NotImplementedError

    def _answers(self) -> bool:
        raise NotImplementedError

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError(f"{self.name} is not running")
        return self._proc.pid

    @property
    def running(self) -> bool:
        """Started and not exited (stopped, or killed from outside)."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def workdir(self) -> Path:
        if self._workdir is None:
            raise RuntimeError(f"{self.name} is not running")
        return self._workdir

    def start(self) -> Self:
        """Spawn the server and return once it answers; on any failure nothing is left running."""
        if self._proc is not None:
            raise RuntimeError(f"{self.name} is already running (pid {self._proc.pid})")
        self._workdir = Path(tempfile.mkdtemp(prefix=f"cachetier-{self.name}-"))
        try:
            self._spawn()
            self._wait_until_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the process (idempotent) and delete its directory."""
        proc, self._proc = self._proc, None
        try:
            if proc is not None:
                terminate(proc)
        finally:
            if self._workdir is not None:
                shutil.rmtree(self._workdir, ignore_errors=True)
                self._workdir = None

    def restart(self, sig: int = signal.SIGKILL) -> None:
        """Stop the process with `sig` (SIGKILL: a crash) and start it again in the same
        directory, on the same address, as a supervisor would; its log goes on in the same file."""
        proc = self._proc
        if proc is None:
            raise RuntimeError(f"{self.name} is not running")
        proc.send_signal(sig)
        try:
            proc.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self._spawn()
        self._wait_until_ready()

    def _spawn(self) -> None:
        workdir = self.workdir
        self._command_line = self._command(workdir)
        with open(workdir / "server.log", "ab") as log:
            try:
                self._proc = subprocess.Popen(
                    self._command_line, stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT, cwd=workdir, start_new_session=True,
                    preexec_fn=parent_death_hook())
            except OSError as exc:
                raise RuntimeError(f"cannot run `{shlex.join(self._command_line)}`: {exc} "
                                   f"({self.install_hint})") from exc

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while not self._answers():
            assert self._proc is not None
            code = self._proc.poll()
            if code is not None:
                raise self._failure(f"exited with code {code}")
            if time.monotonic() > deadline:
                raise self._failure(f"did not answer within {self.startup_timeout_s:g} s")
            time.sleep(0.01)

    def _failure(self, reason: str) -> RuntimeError:
        log = (self.workdir / "server.log").read_bytes()[-_LOG_TAIL_BYTES:]
        tail = log.decode(errors="replace").strip() or "(empty)"
        return RuntimeError(f"`{shlex.join(self._command_line)}` {reason}; log tail:\n{tail}")

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        """Starts synchronously (tens of ms), so the starting thread is the event loop's."""
        return self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        self.stop()


@dataclass(kw_only=True)
class RedisServer(ChildServer):
    """A redis-server with persistence off, on a unix socket (default) or a loopback TCP port,
    bounded by `maxmemory` with `noeviction`; with `acl`, its default user off and the users of
    `run.redis_auth` (`client()` logs in as the operator); with `tls`, TLS only, on a loopback TCP
    port (`tls-port`, the plain port off; clients verify the server, and log in with a password
    rather than a certificate)."""

    name: ClassVar[str] = "redis"
    install_hint: ClassVar[str] = "install it with `apt-get install redis-server` or run bin/setup"
    binary: str = field(default_factory=lambda: find_binary("redis-server"))
    tcp: bool = False
    port: int = 0  # with tcp: 0 picks a free port at start
    # Redis refuses writes past this rather than evict index keys (`run.redis_memory`); the
    # default is for throwaway servers (tests, benchmarks); `cachetier up` sizes it from the pools
    maxmemory: int = 1 << 30
    acl: RedisAcl | None = None
    tls: TlsFiles | None = None

    @property
    def socket_path(self) -> Path:
        return self.workdir / "redis.sock"

    @property
    def url(self) -> str:
        """The URL redis-py's `from_url` takes: redis://127.0.0.1:PORT, unix:///…/redis.sock, or
        rediss://127.0.0.1:PORT?ssl_ca_certs=CA with `tls`."""
        if self.tls is not None:
            return f"rediss://{LOOPBACK}:{self.port}?ssl_ca_certs={self.tls.ca}"
        return f"redis://{LOOPBACK}:{self.port}" if self.tcp else f"unix://{self.socket_path}"

    def _command(self, workdir: Path) -> list[str]:
        if self.tls is not None:
            self.port = self.port or free_port()
            listen = ["--port", "0", "--tls-port", str(self.port), "--bind", LOOPBACK,
                      "--tls-cert-file", str(self.tls.cert), "--tls-key-file", str(self.tls.key),
                      "--tls-ca-cert-file", str(self.tls.ca), "--tls-auth-clients", "no"]
        elif self.tcp:
            self.port = self.port or free_port()
            listen = ["--port", str(self.port), "--bind", LOOPBACK]
        else:
            listen = ["--port", "0", "--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        auth = [] if self.acl is None else [str(self.acl.write(workdir))]  # a config file first
        return [self.binary, *auth, *listen, "--save", "", "--appendonly", "no",
                "--dir", str(workdir), "--daemonize", "no", "--logfile", "",
                "--maxmemory", str(self.maxmemory), "--maxmemory-policy", "noeviction",
                *SCRIPT_TUNING]

    @property
    def operator_login(self) -> dict[str, str]:
        """redis-py's keyword arguments to log in as the operator (none without `acl`)."""
        return {} if self.acl is None else {"username": "operator", "password": self.acl.operator}

    def client(self) -> redis.Redis:
        """A blocking client, for setting up and inspecting the server."""
        return redis.Redis.from_url(self.url, socket_timeout=2.0, **self.operator_login)

    def _connect(self) -> socket.socket:
        if self.tcp:
            return socket.create_connection((LOOPBACK, self.port), timeout=1.0)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(1.0)
        try:
            sock.connect(str(self.socket_path))
        except OSError:
            sock.close()
            raise
        return sock

    def _answers(self) -> bool:
        if self.acl is not None or self.tls is not None:
            try:
                with self.client() as client:
                    return bool(client.ping())
            except redis.RedisError:
                return False
        try:
            with self._connect() as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False


@dataclass(kw_only=True)
class MosquittoServer(ChildServer):
    """A mosquitto MQTT broker on a loopback port, nothing persisted: anonymous, or with `auth`
    its users and topic ACL only (`run.mqtt_auth`)."""

    name: ClassVar[str] = "mosquitto"
    install_hint: ClassVar[str] = "install it with `apt-get install mosquitto` or run bin/setup"
    binary: str = field(default_factory=lambda: find_binary("mosquitto"))
    port: int = 0  # 0 picks a free port at start
    auth: BrokerAuth | None = None
    tls: TlsFiles | None = None  # TLS only

    @property
    def url(self) -> str:
        if self.tls is not None:
            return f"mqtts://{LOOPBACK}:{self.port}?ca={self.tls.ca}"
        return f"mqtt://{LOOPBACK}:{self.port}"

    def _command(self, workdir: Path) -> list[str]:
        self.port = self.port or free_port()
        config = workdir / "mosquitto.conf"
        access = "allow_anonymous true\n"
        if self.auth is not None:
            passwords, acl = self.auth.write(workdir)
            # `user`: run as the user who started it (a broker started by root otherwise drops
            # to user mosquitto, who cannot read these private files)
            access = (f"allow_anonymous false\npassword_file {passwords}\nacl_file {acl}\n"
                      f"user {getpass.getuser()}\n")
        tls = "" if self.tls is None else (f"cafile {self.tls.ca}\ncertfile {self.tls.cert}\n"
                                           f"keyfile {self.tls.key}\n")
        config.write_text(f"listener {self.port} {LOOPBACK}\n{tls}{access}"
                          "persistence false\nlog_dest stderr\n")
        return [self.binary, "-c", str(config)]

    def _answers(self) -> bool:
        try:
            socket.create_connection((LOOPBACK, self.port), timeout=1.0).close()
        except OSError:
            return False
        return True
