"""The data plane: the unified paged pool, its page layouts and typed views, and the agent
process that holds one rank's pool and runs the copy batches the service sends (`gpu_pool.agent`,
imported on its own: it brings the protocol and the kernels).

Holds bytes only. It never decides what a page means: page ownership, hashes and refcounts live in
Redis (`index/`).
"""

from gpu_pool.layout import ByteRange, PageKind, PageLayout
from gpu_pool.pool import PageKindError, PagedPool, PoolHandle

__all__ = ["ByteRange", "PageKind", "PageKindError", "PageLayout", "PagedPool", "PoolHandle"]
