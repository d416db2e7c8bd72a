"""Running things: project-started servers (`servers`: redis-server, mosquitto), how `serve` and
`agent` run with MQTT (`nodes`), the local cluster (`cluster`), the demo (`demo`) and progress
bars (`progress`).

The top of the stack below the CLI: it may import every room; nothing but the CLI, the benchmarks
and the replay imports it.
"""
