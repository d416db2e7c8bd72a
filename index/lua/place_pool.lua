-- place_pool: record the hash tag of a pool's keys, once (the first placement wins).
-- KEYS[1] - the placement directory (hash: pool id -> tag)
-- ARGV[1] - pool id
-- ARGV[2] - the tag proposed for it
-- returns the pool's tag: the one proposed, or the one another service recorded first
local directory = KEYS[1]
local pool, tag = ARGV[1], ARGV[2]
redis.call("HSETNX", directory, pool, tag)
return redis.call("HGET", directory, pool)
