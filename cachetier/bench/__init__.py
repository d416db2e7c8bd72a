"""The benchmarks behind `cachetier bench NAME`: one module per command (`lookup`, `restore`,
`service`, `transfer`), each with `add_arguments(parser)` and `run(args)` returning a JSON-able
result whose figures sit beside a baseline measured in the same run.

They reach the index through `PrefixIndex` and the request lifecycle, and pool bytes through
`gpu_pool` and `kernels`, like any other client; nothing imports them but the CLI.
"""
