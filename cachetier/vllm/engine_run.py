"""One vLLM engine process serving a scripted workload: the tests' and `bench vllm`'s engine.

    python -m cachetier.vllm.engine_run --model DIR --work WORK.json --out OUT.json [--info F]

WORK.json is `{"max_tokens": N, "engine_args": {...}, "steps": [[{"id": .., "prompt": [..]}, ..],
..]}`: each step is one `generate` call of its requests together (a batch), steps in order. With
`--info` (a `cachetier up --vllm-model` info file) the engine uses the connector with the info's
engine arguments; without, it is a cold engine (no connector, prefix caching off): the oracle.
OUT.json holds, per request, the greedy token ids, the chosen tokens' logprobs and the top 5 per
position,
`num_cached_tokens` and the connector's report (`kv_transfer_params`), and each step's seconds.
vLLM spawns processes, hence the `__main__` guard.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

TOP_K = 5  # logprobs kept per position: where outputs part, the oracle needs the runner-up


def run(model: str, work: dict[str, Any], info: dict[str, Any] | None) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    engine_args: dict[str, Any] = {"enforce_eager": True, "skip_tokenizer_init": True,
                                   "dtype": "bfloat16"}
    if info is not None:
        engine_args.update(info["engine_args"])
        engine_args["kv_transfer_config"] = KVTransferConfig(**info["kv_transfer_config"])
    else:
        engine_args["enable_prefix_caching"] = False
    engine_args.update(work.get("engine_args", {}))
    started = time.perf_counter()
    llm = LLM(model=model, **engine_args)
    ready_s = time.perf_counter() - started
    params = SamplingParams(max_tokens=work["max_tokens"], temperature=0.0, logprobs=TOP_K)
    results: dict[str, Any] = {}
    step_seconds = []
    for step in work["steps"]:
        begin = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": r["prompt"]} for r in step], params,
                               use_tqdm=False)
        step_seconds.append(time.perf_counter() - begin)
        for request, output in zip(step, outputs):
            completion = output.outputs[0]
            results[request["id"]] = {
                "token_ids": list(completion.token_ids),
                "logprobs": [entry[token].logprob for token, entry in
                             zip(completion.token_ids, completion.logprobs)],
                "top": [sorted(((t, lp.logprob) for t, lp in entry.items()),
                               key=lambda pair: -pair[1]) for entry in completion.logprobs],
                "prompt_tokens": len(request["prompt"]),
                "num_cached_tokens": output.num_cached_tokens or 0,
                "connector": output.kv_transfer_params or {}}
    return {"ready_s": ready_s, "step_seconds": step_seconds, "requests": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--info", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    info = json.loads(args.info.read_text()) if args.info else None
    result = run(args.model, json.loads(args.work.read_text()), info)
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
