"""A scheduler over the tier: agentic sessions (`sessions`), where checkpoints are placed
(`checkpoint_placement`) and the chunked-prefill scheduler that drives the tiny model through the
client (`scheduler`).

It talks to the tier only through `cachetier.client` and to pool bytes only through the pages it
is handed; it never imports the service or the runners.
"""
