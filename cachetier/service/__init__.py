"""The control-plane service: the asyncio server (`server`), the per-pool gathering of concurrent
callers' plans and releases into one script call (`batching`), its view of the agents serving
each pool's ranks (`fleet`), pool-to-pool hand-off (`handoff`) and the observer it reports to.

It changes metadata only through `index` (one script per operation) and reaches pool bytes only
by sending copy batches to agents; it never imports MQTT, the runners or the CLI.
"""
