"""vLLM engines as child processes serving steps on request: the tests' and `bench vllm`'s engines.

An engine is its own process, as in production: one started after another sees only what the tier
holds. `EngineProcess` forks it from a warm process (multiprocessing's fork server, which imports
vLLM once: `ENGINE_PRELOAD`; a fresh interpreter spends ~15 s of CPU importing it, most of a tiny
engine's life), sends it steps over a pipe (a step is one `generate` call of its requests
together: a batch) and reads each step's results from another; vLLM's logs go to the engine's
stdout and stderr, a log file. The fork server has only imported modules (no engine, no thread
pool has run), so each engine starts from the same clean state, with the environment its
`EngineProcess` was created in. With a `cachetier up --vllm-model` info file the engine uses the
connector with the info's engine arguments; without, it is a cold engine (no connector, prefix
caching off): the oracle.

A step's results hold, per request, the greedy token ids, the chosen tokens' logprobs and the top
`TOP_K` per position (the oracle needs the runner-up where outputs part), `num_cached_tokens`
and the connector's report (`kv_transfer_params`), and the step's seconds.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

TOP_K = 5
ENGINE_START_TIMEOUT_S = 300
ENGINE_STOP_TIMEOUT_S = 60
ENGINE_PRELOAD = ["vllm", "vllm.entrypoints.llm", "vllm.v1.engine.core", "cachetier.vllm.connector"]


class EngineFailed(RuntimeError):
    """The engine process exited or answered an error; `log` is the tail of its output."""

    def __init__(self, message: str, log: str) -> None:
        super().__init__(f"{message}\n{log[-4000:]}")
        self.log = log


def _fork_server() -> Any:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(ENGINE_PRELOAD)
    return context


class EngineProcess:
    """`single_process` runs vLLM's engine core inside this engine's process
    (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), and with tensor-parallel degree 1 its worker too, instead
    of spawning them (each spawn imports vLLM again): a degree 1 engine then starts in seconds.
    The connector's scheduler and worker sides then share a process, as they do in a CUDA engine
    of degree 1 (vLLM's CPU platform otherwise always spawns its workers); a degree above 1 keeps
    its worker processes."""

    def __init__(self, model: Path, log_file: Path, *, info: Path | None = None,
                 engine_args: dict[str, Any] | None = None, single_process: bool = False) -> None:
        self.log_file = log_file
        env = {**os.environ}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if single_process:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        context = _fork_server()
        orders, self._orders = context.Pipe(duplex=False)
        self._results, results = context.Pipe(duplex=False)
        self._proc = context.Process(
            target=_engine_main, name=f"engine {log_file.stem}",
            args=(str(model), None if info is None else info.read_text(), engine_args or {},
                  env, str(log_file), orders, results))
        self._proc.start()
        orders.close()  # the engine holds the other ends: its exit is our EOF
        results.close()
        self.ready_s = self._receive(ENGINE_START_TIMEOUT_S)["ready_s"]

    def send(self, requests: list[dict[str, Any]], max_tokens: int = 8) -> None:
        """Start one step: `requests` (`{"id", "prompt"}`) generated together."""
        self._orders.send({"requests": requests, "max_tokens": max_tokens})

    def receive(self) -> dict[str, Any]:
        """The results of the step sent last: `{"seconds", "requests": {id: result}}`."""
        return self._receive(None)

    def step(self, requests: list[dict[str, Any]], max_tokens: int = 8) -> dict[str, Any]:
        self.send(requests, max_tokens)
        return self.receive()

    def close(self) -> None:
        """End the engine (EOF on its orders) and wait: the connector's shutdown runs then."""
        self._orders.close()
        self._wait_or_kill()
        self._results.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _receive(self, timeout_s: float | None) -> dict[str, Any]:
        try:
            if not self._results.poll(timeout_s):
                self._proc.kill()
                self._proc.join()
                raise EngineFailed(f"engine did not answer within {timeout_s} s", self.log())
            message = json.loads(self._results.recv_bytes())
        except EOFError:
            self._wait_or_kill()
            raise EngineFailed(f"engine exited with {self._proc.exitcode}", self.log()) from None
        if "error" in message:
            # the engine raises the error again after answering it: its traceback, and whatever
            # vLLM logs while stopping, reach the log file before the process ends
            self._wait_or_kill()
            raise EngineFailed(message["error"], self.log())
        return message

    def _wait_or_kill(self) -> None:
        self._proc.join(ENGINE_STOP_TIMEOUT_S)
        if self._proc.exitcode is None:
            self._proc.kill()
            self._proc.join()

    def log(self) -> str:
        return self.log_file.read_text(errors="replace")


def _engine_main(model: str, info: str | None, extra_args: dict[str, Any], env: dict[str, str],
                 log_file: str, orders: Connection, results: Connection) -> None:
    """The engine, in the fork server's child: its creator's environment, its output in its log."""
    os.environ.clear()
    os.environ.update(env)
    log = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    try:
        _serve(model, None if info is None else json.loads(info), extra_args, orders, results)
    except Exception as exc:
        _answer(results, {"error": f"{type(exc).__name__}: {exc}"})
        raise


def _serve(model: str, info: dict[str, Any] | None, extra_args: dict[str, Any],
           orders: Connection, results: Connection) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    engine_args: dict[str, Any] = {"enforce_eager": True, "skip_tokenizer_init": True,
                                   "dtype": "bfloat16"}
    if info is not None:
        engine_args.update(info["engine_args"])
        engine_args["kv_transfer_config"] = KVTransferConfig(**info["kv_transfer_config"])
    else:
        engine_args["enable_prefix_caching"] = False
    engine_args.update(extra_args)
    _bind_cpu_ranks(engine_args.get("tensor_parallel_size", 1))
    _reserve_cpus_as_with_a_connector(engine_args.get("tensor_parallel_size", 1))
    started = time.perf_counter()
    llm = LLM(model=model, **engine_args)
    _answer(results, {"ready_s": time.perf_counter() - started})
    while (order := _next_order(orders)) is not None:
        params = SamplingParams(max_tokens=order["max_tokens"], temperature=0.0, logprobs=TOP_K)
        begin = time.perf_counter()
        outputs = llm.generate([_prompt(r) for r in order["requests"]], params, use_tqdm=False)
        seconds = time.perf_counter() - begin
        _answer(results, {"seconds": seconds,
                          "requests": {r["id"]: _result(r, o)
                                       for r, o in zip(order["requests"], outputs)}})
    # a forked child ends without the interpreter's exit hooks, where vLLM stops its engine core
    # (and with it the connector): stop it here
    llm.llm_engine.engine_core.shutdown()


def _answer(results: Connection, message: dict[str, Any]) -> None:
    """As JSON, so that a result reads the same however it travelled (a tuple comes back a list,
    as from vLLM's OpenAI server)."""
    results.send_bytes(json.dumps(message).encode())


def _next_order(orders: Connection) -> dict[str, Any] | None:
    try:
        return orders.recv()
    except EOFError:
        return None


def _bind_cpu_ranks(tp: int) -> None:
    """vLLM's CPU workers bind their threads one NUMA node per rank unless told which cores each
    rank gets; a one-node machine (this one) then refuses TP > 1. Give each rank its share of
    this process's cores, unless the user chose (`VLLM_CPU_OMP_THREADS_BIND`)."""
    from vllm.platforms import current_platform

    if tp == 1 or not current_platform.is_cpu() or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // tp)
    ranks = [cores[(r * share) % len(cores):][:share] for r in range(tp)]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, c)) for c in ranks)


def _reserve_cpus_as_with_a_connector(tp: int) -> None:
    """vLLM's CPU engine keeps cores for its scheduler (one per rank) and, with a KV connector,
    one more per rank, so a cold engine would run its OpenMP threads on more cores than a
    connector's (on two cores: 1 thread against 2). With AMX, the bfloat16 GEMMs of a decode step
    reduce differently by thread count: the oracle then saw logprobs 3e-4 apart that no restore
    caused. Every engine here reserves a connector engine's cores, unless the user chose
    (`VLLM_CPU_NUM_OF_RESERVED_CPU`)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", str(2 * tp))


def _prompt(request: dict[str, Any]) -> dict[str, Any]:
    """vLLM's token prompt; a request's `salt` becomes its `cache_salt`, which keeps it apart from
    every cached prefix computed without it (a from-scratch run inside a warm engine)."""
    prompt: dict[str, Any] = {"prompt_token_ids": request["prompt"]}
    if "salt" in request:
        prompt["cache_salt"] = request["salt"]
    return prompt


def _result(request: dict[str, Any], output: Any) -> dict[str, Any]:
    completion = output.outputs[0]
    return {"token_ids": list(completion.token_ids),
            "logprobs": [entry[token].logprob
                         for token, entry in zip(completion.token_ids, completion.logprobs)],
            "top": [sorted(((t, lp.logprob) for t, lp in entry.items()), key=lambda p: -p[1])
                    for entry in completion.logprobs],
            "prompt_tokens": len(request["prompt"]),
            "num_cached_tokens": output.num_cached_tokens or 0,
            "connector": output.kv_transfer_params or {}}
