"""A tiny real hybrid KDA + MLA model: the correctness oracle of the cache.

It keeps no cache of its own: `TinyHybrid.forward` reads and writes KDA states and MLA latent rows
in a `PagedPool`, while `TinyHybrid.recompute` computes the same outputs cold, without the pool. A
prefill resumed from a cache hit is right exactly when `outputs_match(forward(...),
recompute(tokens)[start:stop])`; a wrong, stale, corrupt or type-confused page makes it fail.
"""

from tinymodel.chunk import ChunkError, ChunkRequest
from tinymodel.model import ATOL, RTOL, TinyHybrid, outputs_match
from tinymodel.pool_io import PoolMismatch
from tinymodel.state import KdaState
from tinymodel.weights import Dims, UnsupportedModel

__all__ = ["ATOL", "RTOL", "ChunkError", "ChunkRequest", "Dims", "KdaState", "PoolMismatch",
           "TinyHybrid", "UnsupportedModel", "outputs_match"]
