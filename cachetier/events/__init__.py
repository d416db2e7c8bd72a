"""MQTT: the broker link (`mqtt`), cache events in numbered batches (`cache_events`), agent
liveness with a Last Will (`liveness`), and the observers that turn what the service and the agent
report into that traffic (`observers`); and those cache events in vLLM's KV-events format
(`vllm_events`), republished over ZeroMQ by vLLM's own publisher (`vllm_bridge`), guarded
(`vllm_publisher`: loopback binds, CURVE replay peers, a replay rate; `replay_keys`: their keys,
without vLLM, for consumers). Only those three vLLM modules import vLLM, and nothing else here
imports them.

It knows the index's records (what events describe) and the two observer bases
(`cachetier.service.observer`, `gpu_pool.observer`), never the service or the agent themselves:
`cachetier.run.nodes` wires them together.
"""
