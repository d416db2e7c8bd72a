"""How a pool's bytes reach a co-located worker process without a copy.

Each handle is a small picklable record that any process (spawned, forked or started on its own)
can `open()` into a flat uint8 tensor over the same memory:

- `HostShm`: a named file in /dev/shm mapped with `MAP_SHARED` (`torch.from_file(shared=True)`).
  A name, unlike torch's fd-passing pickler, survives plain `pickle` and needs no live socket to the
  owner; the owner unlinks it when the pool closes.
- `CudaIpc`: torch's CUDA IPC export of the buffer's storage (`torch.multiprocessing.reductions`),
  which also carries torch's producer/consumer reference counting.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.multiprocessing.reductions import reduce_tensor

SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class HostShm:
    """A host memory segment named by a file under /dev/shm."""

    path: str
    nbytes: int

    @classmethod
    def create(cls, nbytes: int, prefix: str = "cachetier") -> HostShm:
        path = os.path.join(SHM_DIR, f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        return cls(path, nbytes)

    def open(self) -> torch.Tensor:
        """Map the segment; writes through the tensor are visible to every process that mapped it."""
        return torch.from_file(self.path, shared=True, size=self.nbytes, dtype=torch.uint8)

    def unlink(self) -> None:
        """Remove the name; mappings stay valid until their tensors are freed."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


@dataclass(frozen=True)
class CudaIpc:
    """A CUDA buffer exported through torch's IPC reductions."""

    rebuild: Callable[..., torch.Tensor]
    args: tuple[Any, ...]
    owner_pid: int

    @classmethod
    def export(cls, tensor: torch.Tensor) -> CudaIpc:
        rebuild, args = reduce_tensor(tensor)
        return cls(rebuild, args, os.getpid())

    def open(self) -> torch.Tensor:
        if os.getpid() == self.owner_pid:
            raise ValueError("CUDA IPC cannot reopen a buffer in the process that exported it; "
                             "use the owner's PagedPool object there")
        return self.rebuild(*self.args)
