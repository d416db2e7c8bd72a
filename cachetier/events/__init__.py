"""MQTT: the broker link (`mqtt`), cache events in numbered batches (`cache_events`), agent
liveness with a Last Will (`liveness`), and the observers that turn what the service and the agent
report into that traffic (`observers`).

It knows the index's records (what events describe) and the two observer bases
(`cachetier.service.observer`, `gpu_pool.observer`), never the service or the agent themselves:
`cachetier.run.nodes` wires them together.
"""
