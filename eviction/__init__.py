"""Eviction policies, expressed as a priority score that the Lua scripts order their sorted set by.

A policy is a set of weights (`EvictionWeights`) stored with the pool; the scripts compute each
evictable page's score from them, so a new policy changes the weights, never the scripts. Owns no
Redis access of its own.
"""
