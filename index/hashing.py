"""Chained prefix hashes: the identity of every cached token prefix.

h(0) is a root derived from the namespace (model, tenant salt, adapter), and
h(n) = H(h(n-1) || block n's token ids as little-endian uint32). Because each hash covers its parent,
matching one endpoint certifies the whole prefix before it, and because the root covers the namespace,
two namespaces never share an entry. Hashes travel as one concatenated blob (fixed width per algo) so
a whole prompt is one Redis argument, not one argument per block.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import Literal, NewType, get_args

import numpy as np
import xxhash

BlockHash = NewType("BlockHash", bytes)
HashAlgo = Literal["xxh3_128", "sha256"]
DEFAULT_ALGO: HashAlgo = "xxh3_128"

_HASH_LEN: dict[str, int] = {"xxh3_128": 16, "sha256": 32}
_DIGEST: dict[str, Callable[[bytes], bytes]] = {
    "xxh3_128": xxhash.xxh3_128_digest,
    "sha256": lambda data: hashlib.sha256(data).digest(),
}
# Bumped whenever the root encoding or the chaining rule changes, so old and new entries never match.
_ROOT_VERSION = b"cachetier/chained-hash/v1"
_TOKEN_LIMIT = 2**32
_TOKEN_DTYPE = np.dtype("<u4")

TokenIds = Sequence[int] | np.ndarray


def hash_len(algo: HashAlgo) -> int:
    """Bytes per block hash: 16 for xxh3_128, 32 for sha256."""
    try:
        return _HASH_LEN[algo]
    except KeyError:
        raise ValueError(f"unknown hash algo {algo!r}; expected one of {get_args(HashAlgo)}") from None


def _digest_fn(algo: HashAlgo) -> Callable[[bytes], bytes]:
    """The digest for `algo`; `hash_len` first, so an unknown algo gets its clear ValueError."""
    hash_len(algo)
    return _DIGEST[algo]


def namespace_root(model_id: str, tenant_salt: str = "", adapter_id: str = "",
                   algo: HashAlgo = DEFAULT_ALGO) -> bytes:
    """The chain's seed h(0) for one namespace.

    Fields are length-prefixed so that no two distinct triples encode alike ("ab"+"c" != "a"+"bc").
    """
    fields = {"model_id": model_id, "tenant_salt": tenant_salt, "adapter_id": adapter_id}
    parts = [_ROOT_VERSION]
    for name, value in fields.items():
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a str, got {type(value).__name__}")
        encoded = value.encode("utf-8")
        parts.append(struct.pack("<I", len(encoded)) + encoded)
    if not model_id:
        raise ValueError("model_id must not be empty")
    return _digest_fn(algo)(b"".join(parts))


def token_array(tokens: TokenIds) -> np.ndarray:
    """Token ids as a 1-D little-endian uint32 array, the byte form the hashes are defined over.

    Values are range-checked in their original dtype, before the cast, so -1 or 2**32 are reported
    instead of silently wrapping into a valid-looking id.
    """
    arr = tokens if isinstance(tokens, np.ndarray) else _as_array(tokens)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be a 1-D sequence, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=_TOKEN_DTYPE)
    if arr.dtype.kind == "O":
        _check_objects(arr)
    elif arr.dtype.kind in "iu":
        _check_int_range(arr)
    else:
        raise ValueError(f"token ids must be integers, got an array of {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=_TOKEN_DTYPE)


def _as_array(tokens: Sequence[int]) -> np.ndarray:
    try:
        arr = np.asarray(tokens)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"token ids must be a flat sequence of integers: {exc}") from None
    # Mixed huge/negative ints or floats make numpy pick float64; re-check them one by one.
    return arr if arr.dtype.kind in "iu" else np.asarray(tokens, dtype=object)


def _check_objects(arr: np.ndarray) -> None:
    for index, value in enumerate(arr):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"token ids must be integers; got {value!r} "
                             f"({type(value).__name__}) at index {index}")
        if not 0 <= value < _TOKEN_LIMIT:
            raise ValueError(f"token ids must be in [0, 2**32); got {value} at index {index}")


def _check_int_range(arr: np.ndarray) -> None:
    bad = None
    if arr.dtype.kind == "i" and arr.min() < 0:
        bad = arr < 0
    elif np.iinfo(arr.dtype).max >= _TOKEN_LIMIT and arr.max() >= _TOKEN_LIMIT:
        bad = arr >= _TOKEN_LIMIT
    if bad is not None:
        index = int(np.flatnonzero(bad)[0])
        raise ValueError(f"token ids must be in [0, 2**32); got {arr[index]} at index {index}")


def chain_hashes(tokens: TokenIds, root: bytes, block_tokens: int,
                 algo: HashAlgo = DEFAULT_ALGO) -> bytes:
    """The concatenated chained hashes of every complete block of `tokens`.

    `root` is h(0): a `namespace_root`, or any earlier block hash to continue a chain from a block
    boundary. A trailing partial block is not hashed: its identity is not final until it fills.
    """
    width = hash_len(algo)
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens <= 0:
        raise ValueError(f"block_tokens must be a positive integer, got {block_tokens!r}")
    if not isinstance(root, bytes) or len(root) != width:
        raise ValueError(f"root must be {width} bytes for {algo}, got {root!r}")
    arr = token_array(tokens)
    n_blocks = arr.size // block_tokens
    data = memoryview(arr[: n_blocks * block_tokens]).cast("B")  # zero-copy: arr is contiguous
    step = block_tokens * _TOKEN_DTYPE.itemsize
    digest = _digest_fn(algo)
    hashes = []
    parent = root
    for start in range(0, len(data), step):
        parent = digest(parent + data[start:start + step])
        hashes.append(parent)
    return b"".join(hashes)


def split_hashes(blob: bytes, algo: HashAlgo = DEFAULT_ALGO) -> list[BlockHash]:
    """The blob of `chain_hashes` as one `BlockHash` per block (for tests and debugging)."""
    width = hash_len(algo)
    if len(blob) % width:
        raise ValueError(f"hash blob of {len(blob)} bytes is not a multiple of {width} ({algo})")
    return [BlockHash(bytes(blob[i:i + width])) for i in range(0, len(blob), width)]


def key_chain(blob: bytes, key: bytes, width: int) -> bytes:
    """`blob`'s hashes, `width` bytes each, each replaced by a keyed BLAKE2b of it: the chain
    a tenant's entries are stored under. Each chained hash already stands for its whole prefix,
    so keying them one by one keeps every property of the chain (equal prefixes, equal keyed
    hashes) while a prefix under another key, or under none, is another entry; and a keyed hash
    seen (a commit's reply, a cache event) reveals nothing of another key's."""
    if len(blob) % width:
        raise ValueError(f"hash blob of {len(blob)} bytes is not a multiple of {width}")
    return b"".join(hashlib.blake2b(blob[i:i + width], key=key, digest_size=width).digest()
                    for i in range(0, len(blob), width))
