"""How much memory the index's Redis may use: `maxmemory`, sized from the pools it holds.

Every redis-server the project starts runs with `maxmemory-policy noeviction`: evicting keys on
its own would drop index records mid-chain (a page without its endpoints, a request without its
pins), so Redis refuses writes at the limit instead, and the service answers them `capacity`,
retryable (`index.redis_link.is_full`); the pools' own eviction (leaf-first, in Lua) is what
frees room. The limit keeps a client holding long prompts from taking the machine's memory (30
unreleased 10^7-token prompts once grew Redis by 556 MB); the service's quotas
(`cachetier.service.limits`) keep one client from taking all of it.

The budget, measured on a full tiny pool (`used_memory` after filling every page with durable
checkpoints): about 400 bytes per page plus 70 per hash-block endpoint it registers (550-700
bytes per page at 4 blocks per page, 1,475 at 16), and 1.3 bytes per prompt token of a request
held (its hashes). The formula doubles the per-page figure for fragmentation and the AOF
rewrite's buffers and adds a base for Redis itself, the scripts and client buffers, and room
for `HELD_TOKENS` prompt tokens of requests in flight across all clients.
"""

from __future__ import annotations

from collections.abc import Iterable

from cachetier.config import Config

BASE_BYTES = 64 << 20
PAGE_BYTES = 800  # per page, doubled from the ~400 measured
ENDPOINT_BYTES = 140  # per hash block of a page, doubled from the ~70 measured
HELD_TOKENS = 1 << 26  # prompt tokens held by requests in flight, all clients together
HELD_TOKEN_BYTES = 2  # measured 1.3


def index_maxmemory(configs: Iterable[Config]) -> int:
    """`maxmemory` in bytes for a Redis holding one pool of each of `configs`."""
    pools = sum(c.cache.num_pages * (PAGE_BYTES + ENDPOINT_BYTES * c.cache.blocks_per_page)
                for c in configs)
    return BASE_BYTES + pools + HELD_TOKENS * HELD_TOKEN_BYTES
