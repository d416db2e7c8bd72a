"""The prefix index and checkpoint registry: chained hashing, the Lua scripts and their loader,
the Redis store (`PrefixIndex`), its one declared face (`face.Index`) and the request lifecycle
over it (`lifecycle`), the in-memory reference model and the snapshots the tests check.

Owns every byte of metadata (pages, endpoints, checkpoints, pins, free list, eviction order, epochs)
and changes it only through the scripts under `index/lua/`; nothing outside this package reads a
pool's keys. It must not touch pool bytes, and imports no `cachetier` room but the shared base.
"""
