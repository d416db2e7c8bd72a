"""vLLM 0.32's copy-on-write of a mid-block hit, made whole for hybrids (vllm-project/vllm#55112).

A prefix hit inside a block (`prefix_match_unit` below the block) gives the request a private copy
of the hit's last block, made on the worker by `copy_kv_cache_blocks_inplace`
(vllm/v1/worker/utils.py) once per distinct KV view. vLLM 0.32.0 tells views apart by their first
byte (`data_ptr`) and copies only the first view that starts at a given byte. A hybrid's cache
groups overlay one tensor per layer slot, and the GDN state view (268,288 bytes of the tiny
Qwen3-Next's 294,912-byte block) comes before the attention view that starts at the same byte: the
attention block is copied only as far as the state reaches and the rest of the copy keeps the zeros
of the fresh block: a local hit deep enough into a block reads them (in vLLM's CPU layout, one KV
head's V rows from token 736 of the tiny model's block on). A tensor holding a single layer slot
(one layer per group) escapes: vLLM copies its storage's whole blocks instead.
`docs/vllm-cow-bug.md` is the report for upstream.

`protect` decides at the connector's start, in each worker, from the behaviour of the installed
function on a synthetic overlay (`probe`), not from a version string alone:
- it copies every view (a fixed vLLM): nothing to do;
- the engine's hash unit is its block: no hit is mid-block, no such copy runs: nothing to do;
- it skips the views as vLLM 0.32.0 does, on a release in `CORRECTED_RELEASES`: every module that
  bound the function gets `CowCorrection`, which runs vLLM's copy and then copies the views it
  skipped (the correction replicates that release's rule for which views it skipped);
- otherwise (skipping on a release the correction was not checked against, or a behaviour of its
  own) the engine is refused, naming the release and the hash unit that would avoid it.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch

log = logging.getLogger("cachetier.vllm")

CORRECTED_RELEASES = {(0, 32, 0)}  # vLLM releases whose copy `CowCorrection` completes
COPY_FUNCTION = "copy_kv_cache_blocks_inplace"
Behaviour = Literal["copies every view", "skips views at a seen address", "copies otherwise"]

_PROBE_BLOCKS, _PROBE_PAGE, _PROBE_SMALL = 4, 64, 48  # blocks, bytes per block, the small view


class CopyOnWriteRefused(RuntimeError):
    """The installed vLLM's copy-on-write would serve wrong mid-block hits and the connector has
    no correction checked against it."""


class CowCorrection:
    """vLLM's copy, then the views it skipped: a view that starts at the byte an earlier view of
    another layout starts at, in a tensor whose blocks vLLM does not copy whole (it does when the
    storage is one layer slot: its block stride times the blocks is the storage). Counts the
    block copies it completed and their seconds (on CUDA, the time to queue them), for the
    connector's report."""

    def __init__(self, original: Callable[..., None]) -> None:
        self.original = original
        self.copies = 0
        self.seconds = 0.0

    def __call__(self, kv_caches: Iterable[torch.Tensor], num_blocks: int,
                 kv_cache_block_copies: Sequence[Any]) -> None:
        views = list(kv_caches)
        self.original(views, num_blocks, kv_cache_block_copies)
        if not kv_cache_block_copies:
            return
        begin = time.perf_counter()
        pairs = torch.tensor([tuple(c) for c in kv_cache_block_copies], dtype=torch.int64)
        for view in skipped_views(views, num_blocks):
            src, dst = pairs.to(view.device).unbind(dim=1)
            blocks = view.unflatten(0, (num_blocks, view.shape[0] // num_blocks))
            blocks[dst] = blocks[src]
            self.copies += len(kv_cache_block_copies)
        self.seconds += time.perf_counter() - begin

    def take(self) -> tuple[int, float]:
        """The block copies completed and their seconds since the last call."""
        taken = self.copies, self.seconds
        self.copies, self.seconds = 0, 0.0
        return taken


def skipped_views(kv_caches: Sequence[torch.Tensor], num_blocks: int) -> list[torch.Tensor]:
    """The views vLLM 0.32.0's copy passes over, each layout once: for every address, the views
    of other layouts than the first one there, unless vLLM copied that first view's storage
    whole."""
    firsts: dict[tuple[torch.device, int], torch.Tensor] = {}
    skipped: dict[tuple[Any, ...], torch.Tensor] = {}
    for view in kv_caches:
        address = (view.device, view.data_ptr())
        first = firsts.setdefault(address, view)
        if _layout(view) != _layout(first) and not _copied_whole(first, num_blocks):
            skipped.setdefault((*address, *_layout(view)), view)
    return list(skipped.values())


def _layout(view: torch.Tensor) -> tuple[Any, ...]:
    return view.dtype, tuple(view.shape), view.stride()


def _copied_whole(view: torch.Tensor, num_blocks: int) -> bool:
    """vLLM copies whole blocks of the storage when the view's block stride spans it."""
    block_bytes = view.stride(0) * view.element_size() * (view.shape[0] // num_blocks)
    return view.untyped_storage().nbytes() == num_blocks * block_bytes


def probe(copy: Callable[..., None]) -> Behaviour:
    """What `copy` does to a hybrid's overlay: two layer slots of one buffer, each seen first
    through a state-like view shorter than the block, then through a block-wide one at the same
    byte, as vLLM allocates a GDN + attention hybrid with two layers per group."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy

    buffer = torch.randint(-128, 128, (2 * _PROBE_BLOCKS * _PROBE_PAGE,), dtype=torch.int8,
                           generator=torch.Generator().manual_seed(0))
    before = buffer.clone().view(2, _PROBE_BLOCKS, _PROBE_PAGE)
    views = []
    for slot in range(2):
        offset = slot * _PROBE_BLOCKS * _PROBE_PAGE
        views.append(buffer.as_strided((_PROBE_BLOCKS, _PROBE_SMALL), (_PROBE_PAGE, 1), offset))
        views.append(buffer.as_strided((_PROBE_BLOCKS, _PROBE_PAGE), (_PROBE_PAGE, 1), offset))
    copy(views, _PROBE_BLOCKS, [KVCacheBlockCopy(src_block_id=0, dst_block_id=2)])
    after = buffer.view(2, _PROBE_BLOCKS, _PROBE_PAGE)
    whole, partial = before.clone(), before.clone()
    whole[:, 2] = before[:, 0]
    partial[:, 2, :_PROBE_SMALL] = before[:, 0, :_PROBE_SMALL]
    if torch.equal(after, whole):
        return "copies every view"
    return "skips views at a seen address" if torch.equal(after, partial) else "copies otherwise"


def decide(behaviour: Behaviour, release: tuple[int, ...], hash_unit: int,
           block_tokens: int) -> Literal["none", "correct"]:
    """What the connector does about the installed copy (`CopyOnWriteRefused` when it cannot
    vouch for mid-block hits)."""
    if behaviour == "copies every view" or hash_unit == block_tokens:
        return "none"
    if behaviour == "skips views at a seen address" and release in CORRECTED_RELEASES:
        return "correct"
    checked = ", ".join(".".join(map(str, r)) for r in sorted(CORRECTED_RELEASES))
    raise CopyOnWriteRefused(
        f"vLLM {'.'.join(map(str, release))}: its copy-on-write of a mid-block prefix hit "
        f"{behaviour} (vllm-project/vllm#55112 on a hybrid: wrong attention rows after a local "
        f"hit inside a block) and cachetier's correction was checked against vLLM {checked} "
        f"only; refused at prefix_match_unit {hash_unit} (a hash unit equal to the "
        f"{block_tokens}-token block, `cachetier up --vllm-hash-unit {block_tokens}`, makes no "
        "mid-block hit)")


def protect(hash_unit: int, block_tokens: int) -> CowCorrection | None:
    """Make the installed vLLM's mid-block copies whole in this process (see the module's
    docstring), logging what was decided; the correction, or None where none is needed."""
    import vllm
    from packaging.version import Version
    from vllm.v1.worker import utils

    current = getattr(utils, COPY_FUNCTION)
    if isinstance(current, CowCorrection):  # another connector of this process installed it
        return current
    release = Version(vllm.__version__).release
    behaviour = probe(current)
    if decide(behaviour, release, hash_unit, block_tokens) == "none":
        log.info("cachetier: vLLM %s's copy-on-write %s at prefix_match_unit %d, block %d: no "
                 "correction", vllm.__version__, behaviour, hash_unit, block_tokens)
        return None
    correction = CowCorrection(current)
    # a module's own names, not a lookup: lazy modules (transformers') import on one
    patched = [name for name, module in list(sys.modules.items())
               if getattr(module, "__dict__", {}).get(COPY_FUNCTION) is current]
    for name in patched:
        setattr(sys.modules[name], COPY_FUNCTION, correction)
    log.warning("cachetier: vLLM %s's copy-on-write of a mid-block hit skips views sharing a "
                "tensor (vllm-project/vllm#55112); the connector completes it (%s in %s)",
                vllm.__version__, COPY_FUNCTION, ", ".join(patched))
    return correction
