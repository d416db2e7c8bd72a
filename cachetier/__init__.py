"""cachetier: the control plane's processes and their faces: configuration, the wire protocol, the
service, the scheduler's client, MQTT events and liveness, the CLI and benchmarks.

It must not touch Redis keys except through `index.store`, nor pool bytes except through
`gpu_pool` and `kernels`.
"""
