"""vLLM engines as child processes serving steps on request: the tests' and `bench vllm`'s engines.

An engine is its own process, as in production: one started after another sees only what the tier
holds. `EngineProcess` starts `python -m cachetier.vllm.engine_run`, then sends it steps, one JSON
line each on its stdin (a step is one `generate` call of its requests together: a batch), and reads
each step's results from a pipe of its own (vLLM's logs go to its stdout and stderr, into a log
file). With a `cachetier up --vllm-model` info file the engine uses the connector with the info's
engine arguments; without, it is a cold engine (no connector, prefix caching off): the oracle.

A step's results hold, per request, the greedy token ids, the chosen tokens' logprobs and the top
`TOP_K` per position (the oracle needs the runner-up where outputs part), `num_cached_tokens`
and the connector's report (`kv_transfer_params`), and the step's seconds. vLLM spawns processes
of its own, hence the `__main__` guard.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

TOP_K = 5
ENGINE_START_TIMEOUT_S = 300


class EngineFailed(RuntimeError):
    """The engine process exited or answered an error; `log` is the tail of its output."""

    def __init__(self, message: str, log: str) -> None:
        super().__init__(f"{message}\n{log[-4000:]}")
        self.log = log


class EngineProcess:
    def __init__(self, model: Path, log_file: Path, *, info: Path | None = None,
                 engine_args: dict[str, Any] | None = None) -> None:
        self.log_file = log_file
        read_end, write_end = os.pipe()
        command = [sys.executable, "-m", "cachetier.vllm.engine_run", "--model", str(model),
                   "--results-fd", str(write_end),
                   "--engine-args", json.dumps(engine_args or {})]
        if info is not None:
            command += ["--info", str(info)]
        env = {**os.environ}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        with open(log_file, "wb") as log:
            self._proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=log,
                                          stderr=subprocess.STDOUT, pass_fds=(write_end,),
                                          env=env)
        os.close(write_end)
        self._results: IO[str] = os.fdopen(read_end, "r")
        self.ready_s = self._receive()["ready_s"]

    def send(self, requests: list[dict[str, Any]], max_tokens: int = 8) -> None:
        """Start one step: `requests` (`{"id", "prompt"}`) generated together."""
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps({"requests": requests, "max_tokens": max_tokens})
                               .encode() + b"\n")
        self._proc.stdin.flush()

    def receive(self) -> dict[str, Any]:
        """The results of the step sent last: `{"seconds", "requests": {id: result}}`."""
        return self._receive()

    def step(self, requests: list[dict[str, Any]], max_tokens: int = 8) -> dict[str, Any]:
        self.send(requests, max_tokens)
        return self.receive()

    def close(self) -> None:
        """End the engine (EOF on its stdin) and wait: the connector's shutdown runs then."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            self._proc.stdin.close()
        try:
            self._proc.wait(60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._results.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _receive(self) -> dict[str, Any]:
        line = self._results.readline()
        if not line:
            self._proc.wait(60)
            raise EngineFailed(f"engine exited with {self._proc.returncode}", self.log())
        message = json.loads(line)
        if "error" in message:
            raise EngineFailed(message["error"], self.log())
        return message

    def log(self) -> str:
        return self.log_file.read_text(errors="replace")


def _serve(model: str, info: dict[str, Any] | None, extra_args: dict[str, Any],
           results: IO[str]) -> None:
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
    for line in sys.stdin:
        order = json.loads(line)
        params = SamplingParams(max_tokens=order["max_tokens"], temperature=0.0, logprobs=TOP_K)
        begin = time.perf_counter()
        outputs = llm.generate([_prompt(r) for r in order["requests"]], params, use_tqdm=False)
        seconds = time.perf_counter() - begin
        _answer(results, {"seconds": seconds,
                          "requests": {r["id"]: _result(r, o)
                                       for r, o in zip(order["requests"], outputs)}})


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


def _answer(results: IO[str], message: dict[str, Any]) -> None:
    results.write(json.dumps(message) + "\n")
    results.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--results-fd", type=int, required=True)
    parser.add_argument("--engine-args", default="{}")
    parser.add_argument("--info", type=Path)
    args = parser.parse_args()
    results = os.fdopen(args.results_fd, "w")
    info = json.loads(args.info.read_text()) if args.info else None
    try:
        _serve(args.model, info, json.loads(args.engine_args), results)
    except Exception as exc:
        _answer(results, {"error": f"{type(exc).__name__}: {exc}"})
        raise


if __name__ == "__main__":
    main()
