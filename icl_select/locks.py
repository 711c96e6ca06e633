"""One writer per dataset folder, run folder and evaluation file: two would corrupt it quietly (two rce.py into one
--out interleave their metrics). flock on a hidden sibling `.<name>.lock` that names the holder; the kernel releases it
however the holder exits, so no lock goes stale. Under torchrun only rank 0 takes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path


def lock_file(path: Path) -> Path:
    return path.parent / f".{path.name}.lock"


@contextlib.contextmanager
def exclusive(path: Path, rank: int = 0) -> Iterator[None]:
    """Hold `path`'s lock for the block; if another process holds it, stop at once with one line naming it."""
    if rank != 0:
        yield
        return
    lock = lock_file(Path(path))
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise ValueError(f"{path} is being written by {holder}; wait for it to finish or choose another") from None
        f.seek(0)
        f.truncate()
        command = " ".join(Path(sys.argv[0]).name if i == 0 else a for i, a in enumerate(sys.argv))[:200]
        f.write(f"pid {os.getpid()} on {socket.gethostname()} ({command}) since {time.strftime('%Y-%m-%d %H:%M:%S')}")
        f.flush()
        yield  # closing the file releases the lock
