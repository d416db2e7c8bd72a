"""MQTT: the broker link (`mqtt`), cache events in numbered batches (`cache_events`) and agent
liveness with a Last Will (`liveness`).

It knows the index's records (what events describe) but never imports the service or the agent:
`cachetier.run.nodes` wires them together.
"""
