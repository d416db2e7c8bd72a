"""The prefix index and checkpoint registry: chained hashing, Lua scripts, and the Redis store.

Owns every byte of metadata (pages, endpoints, checkpoints, pins, free list, eviction order, epochs)
and changes it only through the scripts under `index/lua/`. It must not touch pool bytes.
"""
