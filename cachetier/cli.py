"""The `cachetier` command: config, servers, the local cluster, demo, chaos, replay, traces,
benchmarks, vLLM-format events.

Bench modules (`cachetier.bench.<name>`) are imported only when their command runs, so `config show`
stays fast and the CLI keeps working while a benchmark is missing or broken. A bench module provides
`add_arguments(parser)` (its own flags; it may call `add_config_arguments`) and `run(args) -> dict`,
sync or async; the CLI owns `--json` and the printing of the result's `cases`. `serve`, `agent`
and `events vllm` (and their torch, Redis and vLLM imports) are likewise imported only when they
run; all three stop cleanly on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import importlib
import inspect
import json
import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from cachetier.config import (PRESETS, ConfigError, add_config_arguments, config_from_args,
                              load_config)
from cachetier.event_loops import DEFAULT_LOOP, LOOPS, run_on
from cachetier.wire.framing import DEFAULT_MAX_FRAME

if TYPE_CHECKING:
    from cachetier.events.vllm_bridge import BridgeSettings, VllmEventBridge
    from cachetier.run.cluster import ClusterSettings
    from cachetier.run.nodes import MetricsListen
    from cachetier.service.limits import ServiceLimits

BENCHES = ("cluster", "lookup", "restore", "service", "transfer", "vllm")


def _config_show(args: argparse.Namespace, rest: Sequence[str]) -> int:
    described = config_from_args(args).describe()
    print(json.dumps(described, indent=2) if args.json else format_config(described))
    return 0


def format_config(described: dict[str, Any]) -> str:
    """`Config.describe()` as TOML: loadable again with --config; derived sizes as comments."""
    lines: list[str] = []
    for section in ("model", "cache"):
        lines.append(f"[{section}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in described[section].items()]
        lines.append("")
    lines.append("# derived")
    lines += [f"# {key} = {_toml_value(value)}" for key, value in described.items()
              if not isinstance(value, dict)]
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return json.dumps(value) if isinstance(value, str) else str(value)


def _bench(args: argparse.Namespace, rest: Sequence[str]) -> int:
    name = args.bench
    try:
        module = _import_bench(name)
    except LookupError as exc:
        print(f"cachetier: {exc}", file=sys.stderr)
        return 1
    parser = argparse.ArgumentParser(prog=f"cachetier bench {name}", description=module.__doc__)
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    module.add_arguments(parser)
    bench_args = parser.parse_args(rest)
    if inspect.iscoroutinefunction(module.run):
        result = asyncio.run(module.run(bench_args))
    else:
        result = module.run(bench_args)
    print(json.dumps(result) if bench_args.json else format_cases(result))
    return 0


def _import_bench(name: str) -> ModuleType:
    """The bench module, or a LookupError saying it is missing (its own broken imports propagate)."""
    module_name = f"cachetier.bench.{name}"
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name not in (module_name, "cachetier.bench"):
            raise
        raise LookupError(f"bench {name} is not available: module {module_name} is missing") from exc


def format_cases(result: dict[str, Any]) -> str:
    """A bench result as a table of its `cases`, preceded by any other top-level fields."""
    header = [f"{key}: {value}" for key, value in result.items() if key != "cases"]
    cases = result.get("cases", [])
    columns = list(dict.fromkeys(key for case in cases for key in case))
    rows = [columns] + [[_cell(case.get(key, "")) for key in columns] for case in cases]
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    table = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    return "\n".join(header + table) if cases else "\n".join(header)


def _cell(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _limits(items: Sequence[str]) -> ServiceLimits:
    from cachetier.service.limits import parse_limits
    try:
        return parse_limits(items)
    except ValueError as exc:
        raise ConfigError("--limit", str(exc)) from None


def _serve(args: argparse.Namespace, rest: Sequence[str]) -> int:
    from cachetier.run.nodes import run_service
    from cachetier.service.server import ServiceSettings
    settings = ServiceSettings(
        redis_url=args.redis or "", secret=_secret(args, "secret", "CACHETIER_SECRET"),
        config=config_from_args(args),
        listen=args.listen, copy_timeout_s=args.copy_timeout, max_frame=args.max_frame,
        redis_connections=args.redis_connections, redis_cluster=args.redis_cluster or "",
        redis_acks=args.redis_acks, redis_ack_timeout_ms=args.redis_ack_timeout,
        route_from_replicas=args.route_replicas, limits=_limits(args.limit),
        redis_user=args.redis_user, redis_tls_ca=args.redis_tls_ca,
        redis_password=args.redis_user and _secret(args, "redis_password",
                                                   "CACHETIER_REDIS_PASSWORD"))
    if args.redis_acks is not None and args.redis_acks < 0 or args.redis_ack_timeout < 1:
        raise ConfigError("--redis-acks", "replicas must be >= 0 and the timeout >= 1 ms")
    if args.redis_cluster:
        try:
            settings.redis_target()
        except ValueError as exc:
            raise ConfigError("--redis-cluster", str(exc)) from None
    if args.batch_tick is not None:
        if args.batch_tick < 0:
            raise ConfigError("--batch-tick", "must be >= 0")
        settings = dataclasses.replace(settings, batch_tick_s=args.batch_tick)
    if args.request_lease is not None:
        if args.request_lease < 0:
            raise ConfigError("--request-lease", "must be >= 0")
        settings = dataclasses.replace(settings, request_lease_s=args.request_lease or None)
    return _run_until_signal(run_service(settings, _announce_listening, args.mqtt,
                                         _metrics_listen(args)), args.log_level, args.loop)


def _metrics_listen(args: argparse.Namespace) -> MetricsListen | None:
    """The token comes from a file or the environment only: a flag's value is readable by every
    local user."""
    if args.metrics_port is None:
        return None
    if not 0 <= args.metrics_port < 65536:
        raise ConfigError("--metrics-port", "must be a TCP port (0: any free port)")
    from cachetier.run.nodes import MetricsListen
    token = _secret(args, "metrics_token", "CACHETIER_METRICS_TOKEN", required=False)
    if args.metrics_token_file and not token:
        raise ConfigError("--metrics-token-file", "is empty: it would guard nothing")
    return MetricsListen(args.metrics_host, args.metrics_port, _announce_metrics, token or None)


def _announce_listening(url: str) -> None:
    """The line `cachetier up` and the tests wait for: the service answers from now on."""
    print(f"cachetier serve: listening on {url}", flush=True)


def _announce_metrics(url: str) -> None:
    """Printed before the listening line, so `up` finds both once the service answers."""
    print(f"cachetier serve: metrics on {url}", flush=True)


def _agent(args: argparse.Namespace, rest: Sequence[str]) -> int:
    from gpu_pool.agent import AgentSettings
    from cachetier.run.nodes import run_agent
    if args.torch_threads < 1:
        raise ConfigError("--torch-threads", "must be >= 1")
    if args.fence_wait < 0:
        raise ConfigError("--fence-wait", "must be >= 0")
    settings = AgentSettings(
        services=tuple(args.service), pool=args.pool,
        token=_secret(args, "token", "CACHETIER_TOKEN"), rank=args.rank,
        tp_degree=args.tp_degree, device=args.device, handle_file=args.handle_file,
        max_frame=args.max_frame, debug=args.debug, data_listen=args.data_listen,
        torch_threads=args.torch_threads, fence_wait_s=args.fence_wait)
    return _run_until_signal(run_agent(settings, args.mqtt), args.log_level, args.loop)


def _secret(args: argparse.Namespace, name: str, variable: str, required: bool = True) -> str:
    """A secret from `--NAME-file` (compose's secrets) or the environment, never from the
    command line, which every local user can read (`_SecretOnCommandLine`)."""
    flag = f"--{name.replace('_', '-')}-file"
    path = getattr(args, f"{name}_file")
    try:
        value = path.read_text().strip() if path else ""
    except OSError as exc:
        raise ConfigError(flag, str(exc)) from None
    value = value or os.environ.get(variable, "")
    if required and not value:
        raise ConfigError(flag, f"required (or set {variable})")
    return value


class _SecretOnCommandLine(argparse.Action):
    """`--NAME VALUE`, refused: a command line is readable by every local user (`ps`,
    `/proc/PID/cmdline`). The flag stays declared, hidden, so that argparse never takes
    `--secret S` for an abbreviation of `--secret-file S`."""

    def __init__(self, option_strings: Sequence[str], dest: str, variable: str,
                 **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kwargs)
        self.variable = variable

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        raise argparse.ArgumentError(self, f"a secret on the command line is readable by every "
                                           f"local user: use {option_string}-file PATH or set "
                                           f"{self.variable}")


def _add_secret_arguments(parser: argparse.ArgumentParser, name: str, what: str,
                          variable: str, otherwise: str = "") -> None:
    """`--NAME-file PATH`, and `--NAME`, which refuses its value; `otherwise`: the default
    when neither the file nor `variable` is given."""
    flag = f"--{name.replace('_', '-')}"
    parser.add_argument(flag, action=functools.partial(_SecretOnCommandLine, variable=variable))
    parser.add_argument(f"{flag}-file", type=Path, metavar="PATH",
                        help=f"a file holding {what} (default: ${variable}{otherwise})")


def registry_names(text: str, flag: str, kind: str, registry: Sequence[str], *,
                   many: bool = True) -> list[str]:
    """The names `text` gives `flag`: a comma list (spaces and empty items ignored), or exactly
    one name unless `many`, each of them in `registry` and none twice. Every flag that picks
    entries of a registry parses here, so all refuse a name alike: a `ConfigError` (exit 2) that
    names the flag and says what kind of entry was meant (`kind`: "checkpoint placement", "replay
    runner"), with the names it accepts in registry order."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    expected = f"expected one of {', '.join(registry)}"
    if not names:
        raise ConfigError(flag, f"no {kind} named; {expected}")
    for name in names:
        if name not in registry:
            raise ConfigError(flag, f"unknown {kind} {name!r}; {expected}")
    if not many and len(names) > 1:
        raise ConfigError(flag, f"one {kind} only, got {', '.join(names)}")
    twice = [name for i, name in enumerate(names) if name in names[:i]]
    if twice:
        raise ConfigError(flag, f"{kind} {twice[0]!r} named twice")
    return names


def _run_until_signal(main: Coroutine[Any, Any, None], log_level: str,
                      loop: str = DEFAULT_LOOP) -> int:
    """Run `main` on the event loop `loop` until it returns or SIGTERM/SIGINT cancels it, which
    is a clean stop (0); an error it ends with is printed (1)."""
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")

    async def until_signal() -> None:
        task = asyncio.current_task()
        assert task is not None
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, task.cancel)
        try:
            await main
        except asyncio.CancelledError:
            pass  # a signal: the clean way out

    try:
        run_on(loop, until_signal())
    except Exception as exc:
        print(f"cachetier: {exc}", file=sys.stderr)
        return 1
    return 0


def _add_node_arguments(parser: argparse.ArgumentParser) -> None:
    """What `serve` and `agent` share: the broker, the frame limit, logging and the event loop."""
    parser.add_argument("--mqtt", metavar="URL",
                        help="mqtt://HOST:PORT of the broker for cache events and liveness")
    parser.add_argument("--max-frame", type=int, default=DEFAULT_MAX_FRAME, metavar="BYTES",
                        help="largest frame sent or accepted (default 64 MiB; the service "
                             "accepts less from clients and agents: its --limit's frame bounds)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    parser.add_argument("--loop", default=DEFAULT_LOOP, choices=LOOPS,
                        help=f"the asyncio event loop (default {DEFAULT_LOOP}; compare them with "
                             "`bench service --loops asyncio,uvloop`)")


def _add_serve_parser(commands: Any) -> None:
    serve = commands.add_parser("serve", help="run the control-plane service")
    storage = serve.add_mutually_exclusive_group(required=True)
    storage.add_argument("--redis", metavar="URL", help="redis://HOST:PORT or unix:///PATH")
    storage.add_argument("--redis-cluster", metavar="HOST:PORT,...",
                         help="some nodes of a Redis Cluster (the others are discovered)")
    serve.add_argument("--redis-acks", type=int, metavar="N",
                       help="replicas that must hold a plan, commit, pin or epoch before it is "
                            "answered (WAIT; default 1 with --redis-cluster, 0 with --redis)")
    serve.add_argument("--redis-tls-ca", metavar="PATH",
                       help="with --redis-cluster: the nodes speak TLS, verified against this CA "
                            "(one server: rediss://HOST:PORT?ssl_ca_certs=PATH)")
    serve.add_argument("--redis-user", metavar="NAME",
                       help="the Redis ACL user to log in as (default: Redis' default user)")
    _add_secret_arguments(serve, "redis_password", "the Redis user's password",
                          "CACHETIER_REDIS_PASSWORD")
    serve.add_argument("--redis-ack-timeout", type=int, default=100, metavar="MS",
                       help="how long a write waits for its replicas (default 100 ms)")
    serve.add_argument("--route-replicas", action="store_true",
                       help="route reads its probes on the shards' replicas (a cluster)")
    serve.add_argument("--listen", default="tcp://127.0.0.1:7400", metavar="URL",
                       help="tcp://HOST:PORT (port 0: any free port), unix:///PATH, or with TLS "
                            "tls://HOST:PORT?cert=PATH&key=PATH[&ca=PATH]")
    serve.add_argument("--copy-timeout", type=float, default=10.0, metavar="SECONDS",
                       help="how long a step waits for the agents' copy acks")
    serve.add_argument("--redis-connections", type=int, default=64)
    serve.add_argument("--metrics-port", type=int, metavar="PORT",
                       help="serve Prometheus metrics on http://HOST:PORT/metrics (0: any free "
                            "port; default: no metrics)")
    serve.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                       help="the address the metrics listen on (default 127.0.0.1)")
    serve.add_argument("--metrics-token-file", type=Path, metavar="PATH",
                       help="a file holding the bearer token every scrape must carry (default: "
                            "$CACHETIER_METRICS_TOKEN; neither: scrapes need none)")
    serve.add_argument("--batch-tick", type=float, metavar="SECONDS",
                       help="how long a pool's plans gather into one step while one of its "
                       "steps is in flight (0: every plan on its own; default 0.001)")
    serve.add_argument("--request-lease", type=float, metavar="SECONDS",
                       help="a request or pinned reader not stepped for this long is released: "
                       "its scheduler is taken for gone (0: never; default 300)")
    serve.add_argument("--limit", action="append", default=[], metavar="NAME=VALUE",
                       help="change one of the service's limits (cachetier/service/limits.py: "
                       "idle_timeout_s, max_release_ids, max_held_requests, ...); repeatable")
    _add_secret_arguments(serve, "secret", "the cluster secret every credential derives from",
                          "CACHETIER_SECRET")
    add_config_arguments(serve)
    _add_node_arguments(serve)
    serve.set_defaults(handler=_serve)


def _add_agent_parser(commands: Any) -> None:
    agent = commands.add_parser("agent", help="hold one rank's share of a pool and run its copies")
    agent.add_argument("--service", action="append", required=True, metavar="URL",
                       help="a service replica to register with (repeat for each replica)")
    agent.add_argument("--pool", required=True, help="pool id")
    agent.add_argument("--rank", type=int, default=0, help="tensor-parallel rank")
    agent.add_argument("--tp-degree", type=int, default=1, help="tensor-parallel degree")
    agent.add_argument("--device", default="cpu", help="cpu or cuda:N")
    agent.add_argument("--handle-file", type=Path, metavar="PATH",
                       help="where to write the pickled PoolHandle a worker attaches with "
                            "(0600: who reads it maps the pool)")
    agent.add_argument("--debug", action="store_true", help="check page type tags on every view")
    agent.add_argument("--data-listen", default="tcp://127.0.0.1:0", metavar="URL",
                       help="where peer agents pull this rank's pages (default: any loopback port)")
    agent.add_argument("--torch-threads", type=int, default=1, metavar="N",
                       help="torch CPU threads in this agent (default: 1, so agents sharing cores "
                            "do not oversubscribe them)")
    agent.add_argument("--fence-wait", type=float, default=1.0, metavar="SECONDS",
                       help="how long an epoch bump waits for workers writing in place; one "
                            "still writing then is left in the old pool memory, refused "
                            "(default: 1, keep it well under the service's copy timeout)")
    _add_secret_arguments(agent, "token", "this agent's credential, bound to its pool and rank",
                          "CACHETIER_TOKEN")
    _add_node_arguments(agent)
    agent.set_defaults(handler=_agent)


def _cluster_settings(args: argparse.Namespace, agents: int) -> ClusterSettings:
    from cachetier.run.cluster import ClusterSettings
    from cachetier.run.redis_cluster import ClusterShape
    args.overrides.append(("model.tp_degree", str(agents)))  # one agent per rank
    config = config_from_args(args)  # a bad configuration is refused here, not in a child
    serve_config = ["--preset", args.preset, *(["--config", args.config] if args.config else []),
                    *(["--hf-config", args.hf_config] if args.hf_config else []),
                    *(f"--set={key}={value}" for key, value in args.overrides)]
    run_dir = args.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    shape = getattr(args, "redis_cluster", None)
    try:
        redis_cluster = None if shape is None else ClusterShape.parse(shape)
    except ValueError as exc:
        raise ConfigError("--redis-cluster", str(exc)) from None
    if not args.no_metrics and not 0 <= args.metrics_port < 65536:
        raise ConfigError("--metrics-port", "must be a TCP port (0: any free port)")
    return ClusterSettings(run_dir=run_dir.resolve(), secret=_cluster_secret(args),
                           config=config, serve_config_args=tuple(serve_config), agents=agents,
                           port=args.port, redis_cluster=redis_cluster, tls=args.tls,
                           metrics_port=None if args.no_metrics else args.metrics_port)


def _cluster_secret(args: argparse.Namespace) -> str:
    """`up`'s, `demo`'s and `chaos`'s cluster secret: given, or a new random one."""
    return _secret(args, "secret", "CACHETIER_SECRET", required=False) or secrets.token_hex(16)


def _up(args: argparse.Namespace, rest: Sequence[str]) -> int:
    from cachetier.run.cluster import up
    if args.vllm_model is None:
        if args.info is not None:
            raise ConfigError("--info", "is written for vLLM engines: give --vllm-model too")
        if args.kv_events_endpoint is not None:
            raise ConfigError("--kv-events-endpoint", "publishes for vLLM engines: give "
                                                      "--vllm-model too")
        settings = _cluster_settings(args, 2 if args.agents is None else args.agents)
        return up(dataclasses.replace(settings, tenants=_tenants(args.tenants)))
    from cachetier.run.vllm_cluster import serve_vllm
    settings = dataclasses.replace(_vllm_cluster_settings(args), tenants=_tenants(args.tenants))
    return serve_vllm(settings, args.vllm_model, args.info)


def _tenants(listed: str | None) -> tuple[str, ...]:
    """`--tenants a,b`: the tenants a client credential is written for."""
    from cachetier.credentials import TENANT_NAME
    names = tuple(name for name in (listed or "").split(",") if name)
    bad = [name for name in names if not TENANT_NAME.match(name)]
    if bad or len(set(names)) != len(names):
        raise ConfigError("--tenants", f"distinct names like {TENANT_NAME.pattern}, "
                                       f"got {bad or names}")
    return names


def _vllm_cluster_settings(args: argparse.Namespace) -> ClusterSettings:
    from cachetier.run.vllm_cluster import vllm_cluster_settings
    if args.info is None:
        raise ConfigError("--info", "where to write the engines' settings: required with "
                                    "--vllm-model")
    return vllm_cluster_settings(args.vllm_model, run_dir=args.run_dir,
                                 secret=_cluster_secret(args), port=args.port,
                                 agents=1 if args.agents is None else args.agents,
                                 pool_pages=args.pool_pages, hash_unit=args.vllm_hash_unit,
                                 kv_events_endpoint=args.kv_events_endpoint,
                                 overrides=args.overrides, tls=args.tls)


def _demo(args: argparse.Namespace, rest: Sequence[str]) -> int:
    from cachetier.engine.checkpoint_placement import PLACEMENTS
    from cachetier.engine.sessions import SessionSpec
    from cachetier.run.cluster import up
    from cachetier.run.demo import DemoOptions, run_demo
    [policy] = registry_names(args.policy, "--policy", "checkpoint placement", tuple(PLACEMENTS),
                              many=False)
    try:
        spec = SessionSpec(sessions=args.sessions, turns=args.turns, seed=args.seed)
    except ValueError as exc:
        raise ConfigError("demo", str(exc)) from None
    if args.chunk < 1:
        raise ConfigError("demo.chunk", "must be >= 1")
    options = DemoOptions(spec, policy, args.chunk, args.json, args.plot)
    return up(_cluster_settings(args, args.agents), lambda cluster: run_demo(cluster, options))


def _chaos(args: argparse.Namespace, rest: Sequence[str]) -> int:
    from cachetier.run.chaos import ChaosOptions, run_chaos
    from cachetier.run.cluster import up
    if args.kills < 0 or args.clients < 1 or args.model_every < 1 or args.copy_timeout <= 0:
        raise ConfigError("chaos", "--kills must be >= 0, --clients and --model-every >= 1, "
                                   "--copy-timeout > 0")
    options = ChaosOptions(kills=args.kills, clients=args.clients, model_every=args.model_every,
                           storm_messages=args.storm_messages, copy_timeout_s=args.copy_timeout,
                           seed=args.seed, json=args.json)
    settings = dataclasses.replace(_cluster_settings(args, args.agents), agent_zygote=True,
                                   serve_args=("--copy-timeout", str(args.copy_timeout),
                                               "--request-lease", str(options.lease_s)))
    return up(settings, lambda cluster: run_chaos(cluster, options))


def _add_chaos_parser(commands: Any) -> None:
    chaos = commands.add_parser("chaos", help="kill agents, restart Redis and the broker, forge "
                                              "liveness, all under a verifying load; report")
    chaos.add_argument("--kills", type=int, default=20, metavar="N",
                       help="faults to inject, the kinds in turn (default 20)")
    chaos.add_argument("--agents", type=int, default=2, metavar="N",
                       help="CPU agents: the pool's tensor-parallel ranks (default 2)")
    chaos.add_argument("--clients", type=int, default=4, help="load clients (default 4)")
    chaos.add_argument("--model-every", type=int, default=10, metavar="K",
                       help="run the tiny model against its recompute every K faults (default 10)")
    chaos.add_argument("--storm-messages", type=int, default=100, metavar="N",
                       help="forged statuses per liveness storm (default 100)")
    chaos.add_argument("--copy-timeout", type=float, default=1.0, metavar="SECONDS",
                       help="the service's copy timeout, past which a frozen agent is lost "
                            "(default 1)")
    chaos.add_argument("--seed", type=int, default=0)
    chaos.add_argument("--json", action="store_true", help="print the report as one JSON object")
    _add_cluster_arguments(chaos, 0)
    chaos.set_defaults(handler=_chaos)


def _zygote(args: argparse.Namespace, rest: Sequence[str]) -> int:
    from cachetier.run.zygote import serve_forks
    serve_forks(main)
    return 0


def _add_cluster_arguments(parser: argparse.ArgumentParser, port: int) -> None:
    parser.add_argument("--port", type=int, default=port,
                        help=f"service TCP port (0: any free port; default {port})")
    _add_secret_arguments(parser, "secret", "the cluster secret the credentials are derived from",
                          "CACHETIER_SECRET", ", else a new random one")
    parser.add_argument("--tls", action="store_true",
                        help="TLS on every link (the service, Redis, the broker), under a CA made "
                             "for the run (tls/ca.pem in the run directory)")
    parser.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                        help="the service's Prometheus metrics port (default 0: any free port; "
                             "its address is printed and written to cluster.json)")
    parser.add_argument("--no-metrics", action="store_true", help="serve no metrics")
    parser.add_argument("--run-dir", type=Path, metavar="DIR",
                        help="logs, pids.json and redis data (default: runs/<timestamp>)")
    add_config_arguments(parser)


def _add_up_parser(commands: Any) -> None:
    up = commands.add_parser("up", help="run redis, mosquitto, the service and CPU agents here "
                                        "until Ctrl-C, SIGTERM, SIGHUP or its parent's death")
    up.add_argument("--agents", type=int, default=None, metavar="N",
                    help="CPU agents: the tensor-parallel ranks of pool pool0 (default 2; 1 with "
                         "--vllm-model, where N is the engines' tensor_parallel_size)")
    up.add_argument("--vllm-model", type=Path, metavar="MODEL_DIR",
                    help="size the pool for this model's vLLM layout and write --info for "
                         "vLLM engines (Gated DeltaNet + GQA models)")
    up.add_argument("--info", type=Path, metavar="FILE",
                    help="with --vllm-model: JSON written once ready (service, token, pool, "
                         "kv_transfer_config, engine_args), removed on stop")
    up.add_argument("--vllm-hash-unit", type=int, metavar="TOKENS",
                    help="with --vllm-model: the hash unit (vLLM's prefix_match_unit; default "
                         "128, which serves prompt tails; any divisor of vLLM's attention block, "
                         "e.g. the block itself)")
    up.add_argument("--tenants", metavar="A,B",
                    help="also write a client credential for each tenant "
                         "(credentials/client-<tenant>): each tenant's schedulers reach only "
                         "its own cache entries")
    up.add_argument("--redis-cluster", nargs="?", const="3x2", metavar="MASTERSxREPLICAS",
                    help="a local Redis Cluster instead of one redis-server (default 3x2: three "
                         "shards of a master and two replicas; a new cluster per run)")
    up.add_argument("--pool-pages", type=int, default=1024, metavar="N",
                    help="with --vllm-model: pages in the pool (default 1024)")
    up.add_argument("--kv-events-endpoint", metavar="URL",
                    help="with --vllm-model: also publish the pool's cache events as vLLM KV "
                         "events on this ZeroMQ endpoint, as `events vllm` does (tcp://*:5557 "
                         "binds on 127.0.0.1; a concrete address connects to a router that "
                         "binds)")
    _add_cluster_arguments(up, 7400)
    up.set_defaults(handler=_up)


def _add_demo_parser(commands: Any) -> None:
    from cachetier.engine.checkpoint_placement import PLACEMENTS
    demo = commands.add_parser("demo", help="the local cluster serving multi-turn sessions through "
                                            "the tiny hybrid model, every hit verified")
    demo.add_argument("--agents", type=int, default=2, metavar="N",
                      help="CPU agents: the tensor-parallel ranks the model runs on (default 2)")
    demo.add_argument("--sessions", type=int, default=24, help="sessions (default 24)")
    demo.add_argument("--turns", type=int, default=5, help="turns per session (default 5)")
    demo.add_argument("--chunk", type=int, default=48, metavar="TOKENS",
                      help="chunked-prefill size, any number of tokens (default 48)")
    demo.add_argument("--policy", default="branch", metavar="NAME",
                      help=f"checkpoint placement, one of {', '.join(PLACEMENTS)} (default branch)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the sessions (default 0)")
    demo.add_argument("--plot", type=Path, metavar="PNG",
                      help="hit ratio plot (default: demo-hit-ratio.png in the run directory)")
    demo.add_argument("--json", action="store_true", help="print the report as one JSON object")
    _add_cluster_arguments(demo, 0)
    demo.set_defaults(handler=_demo)


def _replay(args: argparse.Namespace, rest: Sequence[str]) -> int:
    from cachetier.replay import report
    from cachetier.replay.replayer import ReplayError, budget_pages, parse_budget
    from cachetier.replay.runners import RUNNER_NAMES, replay_trace
    from cachetier.replay.traces import TraceError, read_trace
    config = load_config(args.preset)
    try:
        budgets = [parse_budget(b) for b in (args.sweep or args.budget).split(",")]
        for budget in budgets:
            budget_pages(budget, config)
    except (ValueError, ReplayError) as exc:
        raise ConfigError("--sweep" if args.sweep else "--budget", str(exc)) from None
    budgets.sort(key=lambda b: (b is None, b or 0))
    policies = (list(RUNNER_NAMES) if args.policies is None else
                registry_names(args.policies, "--policies", "replay runner", RUNNER_NAMES))
    if args.chunk < 1:
        raise ConfigError("--chunk", "must be >= 1")
    try:
        requests = read_trace(args.trace)
    except (OSError, TraceError) as exc:
        raise ConfigError(str(args.trace), str(exc)) from None
    try:
        results = asyncio.run(replay_trace(requests, config, budgets, policies, args.chunk))
    except ReplayError as exc:
        print(f"cachetier: {exc}", file=sys.stderr)
        return 1
    trace = str(args.trace)
    if not args.sweep:
        out = report.replay_json(trace, len(requests), results[0], args.preset, args.chunk)
        table = report.format_table(trace, len(requests), results[0])
        print(json.dumps(out) if args.json else table)
        return 0
    plot = args.plot or Path("runs") / f"{args.trace.stem}-sweep.png"
    report.write_sweep_plot(results, plot, f"cachetier replay: {args.trace.name}, {args.preset}")
    out = report.sweep_json(trace, len(requests), results, args.preset, args.chunk, plot)
    print(json.dumps(out) if args.json
          else f"{report.format_sweep(trace, len(requests), results)}\nplot: {plot}")
    return 0


def _add_replay_parser(commands: Any) -> None:
    replay = commands.add_parser("replay", help="replay a request trace through the real index, "
                                                "one pool per replay runner")
    replay.add_argument("trace", type=Path, metavar="TRACE.jsonl",
                        help="Mooncake-format JSONL (timestamp, input_length, output_length, "
                             "hash_ids; session_id and turn optional)")
    replay.add_argument("--budget", default="unlimited", metavar="SIZE",
                        help="cache capacity in bytes of the preset, e.g. 400GB or 1.6TB "
                             "(GB = 1e9), or unlimited (default)")
    replay.add_argument("--sweep", metavar="SIZE,SIZE,...",
                        help="replay at each budget, e.g. 100GB,400GB,1.6TB,unlimited, and plot "
                             "hit ratio against capacity")
    replay.add_argument("--policies", metavar="NAME,NAME,...",
                        help="replay runners to compare, among oracle, seed, branch, ladder, "
                             "coupled, full-6144, adaptive (default: all)")
    replay.add_argument("--chunk", type=int, default=8192, metavar="TOKENS",
                        help="chunked-prefill size (default 8192)")
    replay.add_argument("--preset", default="kimi-k3", choices=sorted(PRESETS),
                        help="model whose page bytes the budget counts (default kimi-k3)")
    replay.add_argument("--plot", type=Path, metavar="PNG",
                        help="sweep plot (default: runs/<trace name>-sweep.png)")
    replay.add_argument("--json", action="store_true", help="print the result as one JSON object")
    replay.set_defaults(handler=_replay)


def _trace_synth(args: argparse.Namespace, rest: Sequence[str]) -> int:
    from cachetier.replay.traces import AgenticSpec, synth_agentic, write_trace
    spec = AgenticSpec(sessions=args.sessions, seed=args.seed, max_context=args.max_context,
                       turns_mean=args.turns_mean, fork_prob=args.fork_prob)
    if min(spec.sessions, spec.max_context, spec.turns_mean) < 1 or not 0 <= spec.fork_prob <= 1:
        raise ConfigError("trace synth", "--sessions, --max-context and --turns-mean must be >= 1, "
                          "--fork-prob in [0, 1]")
    requests = synth_agentic(spec)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_trace(args.out, requests)
    sessions = len({r.session_id for r in requests})
    print(f"wrote {len(requests)} requests of {sessions} sessions to {args.out}")
    return 0


def _add_trace_parser(commands: Any) -> None:
    trace = commands.add_parser("trace", help="request traces for `cachetier replay`")
    actions = trace.add_subparsers(dest="action", required=True, metavar="ACTION")
    synth = actions.add_parser("synth", help="write synthetic agentic multi-turn sessions in the "
                                             "Mooncake format, plus session_id and turn")
    synth.add_argument("out", type=Path, metavar="OUT.jsonl")
    synth.add_argument("--sessions", type=int, default=200, help="sessions (default 200)")
    synth.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    synth.add_argument("--max-context", type=int, default=160_000, metavar="TOKENS",
                       help="a session's longest prompt (default 160000)")
    synth.add_argument("--turns-mean", type=float, default=8.0,
                       help="mean turns of a short session (default 8)")
    synth.add_argument("--fork-prob", type=float, default=0.04,
                       help="chance a turn forks a sub-session (default 0.04)")
    synth.set_defaults(handler=_trace_synth)


def _events_vllm(args: argparse.Namespace, rest: Sequence[str]) -> int:
    from cachetier.events.vllm_bridge import run_bridge
    return _run_until_signal(run_bridge(_bridge_settings(args), ready=_announce_bridge),
                             args.log_level)


def _bridge_settings(args: argparse.Namespace) -> BridgeSettings:
    """The replay socket's CURVE keys derive from the bridge's credential, so a replay endpoint
    needs one: without it the socket would answer anyone."""
    from cachetier.events.replay_keys import ReplayKeys
    from cachetier.events.vllm_bridge import BridgeSettings
    from cachetier.events.vllm_events import VllmEventMapping
    from cachetier.run.nodes import logged_in
    mapping = VllmEventMapping.for_model(config_from_args(args).model)
    token = _secret(args, "token", "CACHETIER_TOKEN", required=False)
    if args.replay_endpoint and not token:
        raise ConfigError("--replay-endpoint", "answers only peers holding the bridge's "
                          "credential: give --token-file or set CACHETIER_TOKEN")
    if args.replay_rate < 1:
        raise ConfigError("--replay-rate", "must be >= 1")
    return BridgeSettings(logged_in(args.mqtt, token) if token else args.mqtt, args.endpoint,
                          args.replay_endpoint, args.pool, mapping, bind_host=args.bind_host,
                          replay_keys=ReplayKeys.of(token) if args.replay_endpoint else None,
                          replay_rate=args.replay_rate)


def _announce_bridge(bridge: VllmEventBridge) -> None:
    """The line the tests wait for: the sockets are up and the broker has the subscription."""
    config = bridge.config
    replay = f", replay on {config.replay_endpoint}" if config.replay_endpoint else ""
    broker = bridge.subscriber.link.address  # not the URL: it holds the password
    print(f"cachetier events vllm: pool {bridge.settings.pool} of mqtt://{broker.host}:"
          f"{broker.port} published on {config.endpoint}{replay}", flush=True)


def _add_events_parser(commands: Any) -> None:
    events = commands.add_parser("events", help="cache events in other formats")
    actions = events.add_subparsers(dest="action", required=True, metavar="ACTION")
    vllm = actions.add_parser("vllm", help="republish cache events as vLLM KV events over ZeroMQ, "
                                           "until Ctrl-C")
    vllm.add_argument("--mqtt", required=True, metavar="URL", help="mqtt://HOST:PORT of the broker")
    vllm.add_argument("--pool", default="+", help="the pool to follow (default: every pool, in "
                                                  "one stream)")
    vllm.add_argument("--endpoint", required=True, metavar="URL",
                      help="vLLM's PUB endpoint: tcp://*:PORT binds (on --bind-host), "
                           "tcp://HOST:PORT connects to a subscriber that binds")
    vllm.add_argument("--replay-endpoint", metavar="URL",
                      help="where vLLM's ROUTER socket binds for replay requests (tcp://*:PORT "
                           "on --bind-host); it answers CURVE peers holding the bridge's "
                           "credential only (cachetier.events.replay_keys), so it needs --token")
    vllm.add_argument("--bind-host", default="127.0.0.1", metavar="HOST",
                      help="the address a tcp://*:PORT endpoint binds (default 127.0.0.1; '*': "
                           "every address)")
    vllm.add_argument("--replay-rate", type=int, default=1000, metavar="N",
                      help="at most N replayed batches a second, all requests together (default "
                           "1000)")
    _add_secret_arguments(vllm, "token", "an observer's credential, the broker's login and what "
                          "replay peers prove they hold (none: anonymous, no replay)",
                          "CACHETIER_TOKEN")
    vllm.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    add_config_arguments(vllm)  # the model: which vLLM spec kind the full-attention group is
    vllm.set_defaults(handler=_events_vllm)


def _credentials(args: argparse.Namespace, rest: Sequence[str]) -> int:
    from cachetier.run.cluster import POOL
    from cachetier.run.compose_credentials import write_compose_credentials
    from cachetier.run.credential_files import ClusterCredentials
    if args.agents < 1:
        raise ConfigError("--agents", "must be >= 1")
    secret = os.environ.get("CACHETIER_SECRET", "")
    if len(secret) < 32:
        raise ConfigError("CACHETIER_SECRET", "set it to a random secret of 32 characters or "
                          "more, e.g. $(python -c 'import secrets; print(secrets.token_hex(32))')")
    written = write_compose_credentials(ClusterCredentials(secret, POOL, args.agents), args.dir)
    print(f"wrote {len(written)} files to {args.dir}: {' '.join(p.name for p in written)}")
    return 0


def _add_credentials_parser(commands: Any) -> None:
    parser = commands.add_parser("credentials", help="write the secret files docker-compose.yml "
                                                     "mounts, from $CACHETIER_SECRET")
    parser.add_argument("dir", type=Path, metavar="DIR")
    parser.add_argument("--agents", type=int, default=2, metavar="N",
                        help="agents of pool pool0: its tensor-parallel ranks (default 2)")
    parser.set_defaults(handler=_credentials)


def build_parser() -> argparse.ArgumentParser:
    """The command tree; bench flags are parsed later, by the bench module's own parser."""
    parser = argparse.ArgumentParser(prog="cachetier", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    config = commands.add_parser("config", help="inspect the configuration")
    config_commands = config.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = config_commands.add_parser("show", help="print the configuration and derived page sizes")
    add_config_arguments(show)
    show.add_argument("--json", action="store_true", help="print one JSON object")
    show.set_defaults(handler=_config_show)
    bench = commands.add_parser("bench", help="run a benchmark")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name in BENCHES:
        benches.add_parser(name, add_help=False, help=f"`cachetier bench {name} --help` for flags")
    bench.set_defaults(handler=_bench)
    _add_serve_parser(commands)
    _add_agent_parser(commands)
    _add_up_parser(commands)
    _add_demo_parser(commands)
    _add_chaos_parser(commands)
    commands.add_parser("zygote").set_defaults(handler=_zygote)  # unlisted: `run.zygote`'s
    _add_replay_parser(commands)
    _add_trace_parser(commands)
    _add_events_parser(commands)
    _add_credentials_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status (2 for a bad configuration)."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.handler is not _bench:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return int(args.handler(args, rest))
    except ConfigError as exc:
        print(f"cachetier: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
