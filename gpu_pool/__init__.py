"""The data plane's memory: the unified paged pool, its page layouts and typed views.

Holds bytes only. It never decides what a page means: page ownership, hashes and refcounts live in
Redis (`index/`).
"""

from gpu_pool.layout import ByteRange, PageKind, PageLayout
from gpu_pool.pool import PageKindError, PagedPool, PoolHandle

__all__ = ["ByteRange", "PageKind", "PageKindError", "PageLayout", "PagedPool", "PoolHandle"]
