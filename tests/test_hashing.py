"""Chained hashing: the properties the prefix index relies on, checked against a plain reference."""

from __future__ import annotations

import hashlib
import struct
import time

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from index.hashing import (BlockHash, chain_hashes, hash_len, namespace_root, split_hashes,
                           token_array)

token_ids = st.integers(min_value=0, max_value=2**32 - 1)
token_lists = st.lists(token_ids, max_size=64)
block_sizes = st.integers(min_value=1, max_value=8)
algos = st.sampled_from(["xxh3_128", "sha256"])
names = st.text(max_size=8)
ROOT = namespace_root("model")


def reference_chain(tokens: list[int], root: bytes, block_tokens: int, algo: str) -> list[bytes]:
    """The definition, token by token: h(n) = H(h(n-1) || block n as little-endian uint32)."""
    digest = {"xxh3_128": xxhash.xxh3_128_digest,
              "sha256": lambda data: hashlib.sha256(data).digest()}[algo]
    hashes, parent = [], root
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        block = b"".join(struct.pack("<I", t) for t in tokens[start:start + block_tokens])
        parent = digest(parent + block)
        hashes.append(parent)
    return hashes


def blocks(tokens: list[int], block_tokens: int, algo: str = "xxh3_128") -> list[BlockHash]:
    root = namespace_root("model", algo=algo)
    return split_hashes(chain_hashes(tokens, root, block_tokens, algo), algo)


@given(tokens=token_lists, block_tokens=block_sizes, algo=algos)
def test_matches_reference_definition(tokens: list[int], block_tokens: int, algo: str) -> None:
    root = namespace_root("model", algo=algo)
    blob = chain_hashes(tokens, root, block_tokens, algo)
    assert split_hashes(blob, algo) == reference_chain(tokens, root, block_tokens, algo)


@given(tokens=token_lists, block_tokens=block_sizes, algo=algos)
def test_blob_holds_one_hash_per_complete_block(tokens: list[int], block_tokens: int,
                                                algo: str) -> None:
    root = namespace_root("model", algo=algo)
    blob = chain_hashes(tokens, root, block_tokens, algo)
    assert len(blob) == (len(tokens) // block_tokens) * hash_len(algo)


@given(prefix=token_lists, tail_a=token_lists, tail_b=token_lists, block_tokens=block_sizes)
def test_equal_prefixes_share_hashes_until_divergence(prefix: list[int], tail_a: list[int],
                                                      tail_b: list[int], block_tokens: int) -> None:
    a = prefix + [0] + tail_a
    b = prefix + [1] + tail_b
    diverge = len(prefix) // block_tokens
    hashes_a, hashes_b = blocks(a, block_tokens), blocks(b, block_tokens)
    assert hashes_a[:diverge] == hashes_b[:diverge]
    assert all(x != y for x, y in zip(hashes_a[diverge:], hashes_b[diverge:]))


@given(tokens=st.lists(token_ids, min_size=1, max_size=64), block_tokens=block_sizes,
       data=st.data())
def test_changed_token_changes_its_block_and_all_later(tokens: list[int], block_tokens: int,
                                                       data: st.DataObject) -> None:
    index = data.draw(st.integers(0, len(tokens) - 1), label="index")
    value = data.draw(token_ids.filter(lambda v: v != tokens[index]), label="value")
    changed = tokens[:index] + [value] + tokens[index + 1:]
    before, after = blocks(tokens, block_tokens), blocks(changed, block_tokens)
    first = index // block_tokens
    assert before[:first] == after[:first]
    assert all(x != y for x, y in zip(before[first:], after[first:]))


@given(tokens=st.lists(token_ids, min_size=1, max_size=32), block_tokens=block_sizes,
       ns_a=st.tuples(names.filter(bool), names, names),
       ns_b=st.tuples(names.filter(bool), names, names))
def test_namespaces_never_share_a_hash(tokens: list[int], block_tokens: int,
                                       ns_a: tuple[str, str, str], ns_b: tuple[str, str, str]) -> None:
    if ns_a == ns_b:
        return
    chain_a = chain_hashes(tokens, namespace_root(*ns_a), block_tokens)
    chain_b = chain_hashes(tokens, namespace_root(*ns_b), block_tokens)
    assert namespace_root(*ns_a) != namespace_root(*ns_b)
    assert not set(split_hashes(chain_a)) & set(split_hashes(chain_b))


def test_namespace_fields_do_not_run_together() -> None:
    roots = {namespace_root("ab", "c"), namespace_root("a", "bc"), namespace_root("a", "b", "c"),
             namespace_root("a", "", "bc"), namespace_root("abc")}
    assert len(roots) == 5


@given(tokens=token_lists, extra=token_lists, block_tokens=block_sizes)
def test_partial_last_block_is_not_hashed(tokens: list[int], extra: list[int],
                                          block_tokens: int) -> None:
    room = block_tokens - 1 - len(tokens) % block_tokens
    longer = tokens + extra[:room]
    assert chain_hashes(longer, ROOT, block_tokens) == chain_hashes(tokens, ROOT, block_tokens)


@given(tokens=token_lists, block_tokens=block_sizes, cut=st.integers(0, 8))
def test_chain_continues_from_any_block_hash(tokens: list[int], block_tokens: int, cut: int) -> None:
    whole = split_hashes(chain_hashes(tokens, ROOT, block_tokens))
    cut = min(cut, len(whole))
    parent = whole[cut - 1] if cut else ROOT
    rest = chain_hashes(tokens[cut * block_tokens:], parent, block_tokens)
    assert split_hashes(rest) == whole[cut:]


def test_sha256_option() -> None:
    root = namespace_root("model", algo="sha256")
    assert hash_len("sha256") == 32 and len(root) == 32
    blob = chain_hashes(list(range(10)), root, 4, "sha256")
    assert len(blob) == 2 * 32
    assert blob[:32] == hashlib.sha256(root + np.arange(4, dtype="<u4").tobytes()).digest()
    assert blob != chain_hashes(list(range(10)), ROOT, 4)


@pytest.mark.parametrize("dtype", ["<i8", ">i8", "<u8", ">u4", "<u4", "<i4", "u2"])
def test_numpy_inputs_hash_like_lists(dtype: str) -> None:
    tokens = [0, 1, 65535, 7, 42, 3, 9, 12]
    assert chain_hashes(np.array(tokens, dtype=dtype), ROOT, 4) == chain_hashes(tokens, ROOT, 4)


def test_token_array_is_little_endian_uint32() -> None:
    arr = token_array([1, 2**32 - 1])
    assert arr.dtype == np.dtype("<u4") and arr.tobytes() == b"\x01\0\0\0\xff\xff\xff\xff"
    assert token_array([]).dtype == np.dtype("<u4")


@pytest.mark.parametrize(("tokens", "message"), [
    ([1, -1], r"\[0, 2\*\*32\); got -1 at index 1"),
    ([2**32], r"got 4294967296 at index 0"),
    ([5, 2**70], r"got 1180591620717411303424 at index 1"),
    ([-1, 2**63], r"got -1 at index 0"),
    ([1, 1.5], r"integers; got 1.5 \(float\) at index 1"),
    (["7"], r"integers; got '7' \(str\) at index 0"),
    ([True, False], r"integers; got True \(bool\) at index 0"),
    (np.array([True]), r"integers, got an array of bool"),
    (np.array([-3], dtype=np.int64), r"got -3 at index 0"),
    (np.array([2**40], dtype=np.uint64), r"got 1099511627776 at index 0"),
    (np.array([1.0, 2.0]), r"integers, got an array of float64"),
    ([[1, 2], [3, 4]], r"1-D sequence, got shape \(2, 2\)"),
    ([[1, 2], [3]], r"flat sequence of integers"),
])
def test_bad_tokens_raise_naming_the_problem(tokens: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        chain_hashes(tokens, ROOT, 2)  # type: ignore[arg-type]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"block_tokens": 0}, "block_tokens must be a positive integer"),
    ({"root": b"short"}, "root must be 16 bytes"),
    ({"algo": "md5"}, "unknown hash algo 'md5'"),
])
def test_bad_arguments_raise(kwargs: dict[str, object], message: str) -> None:
    call = {"tokens": [1, 2, 3], "root": ROOT, "block_tokens": 2} | kwargs
    with pytest.raises(ValueError, match=message):
        chain_hashes(**call)  # type: ignore[arg-type]


def test_bad_namespace_and_blob_raise() -> None:
    with pytest.raises(ValueError, match="model_id must not be empty"):
        namespace_root("")
    with pytest.raises(ValueError, match="tenant_salt must be a str"):
        namespace_root("m", 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a multiple of 16"):
        split_hashes(b"x" * 17)


def test_a_million_tokens_hash_in_milliseconds() -> None:
    """A loose bound that still catches a per-token Python loop (hundreds of ms)."""
    tokens = np.random.default_rng(0).integers(0, 2**31, size=1 << 20, dtype=np.int64)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        blob = chain_hashes(tokens, ROOT, 512)
        best = min(best, time.perf_counter() - start)
    assert len(blob) == 2048 * 16
    assert best < 0.1, f"1M tokens took {best * 1e3:.1f} ms"
