"""The data plane's memory: the unified paged pool, its page layouts and typed views.

Holds bytes only. It never decides what a page means: page ownership, hashes and refcounts live in
Redis (`index/`).
"""
