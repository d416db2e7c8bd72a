"""The wire: length-prefixed msgpack frames (a large body decoded a chunk at a time), the
protocol's typed messages, multiplexed request channels and raw-socket helpers, shared by the
service, its clients and the agents.

It imports only the shared base (`cachetier.config`, `cachetier.errors`) and the index's records;
it never imports the service, the runners or the CLI, so the data plane (`gpu_pool`) may use it.
"""
