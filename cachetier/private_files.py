"""Files only their owner reads: credentials, and the handles that map a pool's memory.

A token, a password, a key or a pool handle (whoever reads it maps the pool's pages, and can
overwrite them) is written 0600 from its first byte: a file created world-readable and narrowed
afterwards has been readable for a moment, and a reader that opened it then keeps its descriptor.
It sits in the shared base because the agent (a low package) writes its handle file with it.
"""

from __future__ import annotations

import os
from pathlib import Path


def write_private(path: Path, data: str | bytes) -> Path:
    """`data` in `path`, readable by its owner only, replacing `path` whole: written to a
    temporary file beside it, created 0600 (never widened for a moment), then renamed, so a
    reader sees the old file or the new one, never half of one."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.unlink(missing_ok=True)  # a crashed writer's leftover: O_EXCL refuses it
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data.encode() if isinstance(data, str) else data)
    temporary.replace(path)
    return path
