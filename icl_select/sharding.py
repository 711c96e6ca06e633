"""Scale-out with torchrun: ranks split the items, each appends to its own file, rank 0 merges.

A plain `python script.py` is world size 1 with no process group. Under torchrun each rank runs its own model on its own
GPU, takes the items i with i % world == rank and flushes each to its shard, so a crash loses only the items in flight
and the same command resumes (gen_rl_data.py, evaluate.py). Online GRPO works in lock-step instead: each rank scores a
`chunk` of every batch, `gather` hands every rank all the scores, and rank 0 alone writes the run folder.
"""

from __future__ import annotations

import functools
import json
import os
from datetime import timedelta
from pathlib import Path
from typing import TextIO

import torch
import torch.distributed as dist
from torch import Tensor

from icl_select.files import DataError, append_jsonl, atomic_write_text, read_jsonl


def init() -> tuple[int, int]:
    """(rank, world size); joins the process group when started by torchrun with more than one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    if not dist.is_initialized():
        # Ranks wait for each other only at the start and before the merge; scoring can take hours.
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=timedelta(hours=48))
    return dist.get_rank(), world


def rank_world() -> tuple[int, int]:
    """(rank, world size) of the process group this process has joined, (0, 1) outside torchrun."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def share(n: int, rank: int, world: int) -> range:
    """The item indices this rank owns: fixed by index, never by what is left, so ranks that read the progress
    files at different moments still split the work into disjoint parts that cover it all."""
    return range(rank, n, world)


def chunk(n: int, rank: int, world: int) -> range:
    """This rank's contiguous part of n items (parts differ in size by at most one): a query's group of sequences,
    adjacent in a batch, stays on one rank, where the LVLM can share the prompts' common prefix."""
    return range(rank * n // world, (rank + 1) * n // world)


def gather(mine: Tensor, n: int, world: int) -> Tensor:
    """Every rank's `mine`, the rows of its `chunk` of n, joined in item order and returned on every rank."""
    if world == 1:
        return mine
    width = -(-n // world)
    padded = mine.new_zeros(width, *mine.shape[1:])
    padded[: len(mine)] = mine
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=_cpu_group())
    return torch.cat([part[: len(chunk(n, r, world))] for r, part in enumerate(parts)])


def from_rank0(value, world: int):
    """Rank 0's `value` on every rank (what only rank 0 decides, such as the checkpoint a run resumes from)."""
    if world == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=_cpu_group())
    return box[0]


@functools.cache
def _cpu_group():
    """A gloo group for small CPU tensors and objects, whatever the default backend (nccl on GPUs)."""
    return dist.new_group(backend="gloo", timeout=timedelta(hours=48))


def barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def finish(world: int) -> None:
    if world > 1 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------------------
# Progress files: each rank appends one JSON line per finished item to its own file and flushes it


def done(paths: list[Path], key: str, header: dict | None = None) -> dict:
    """Records already written, by record[key], from the progress files `paths` (every rank's, of this run or of an
    interrupted one). With a `header`, a file whose first line is not that header was left by other settings and
    counts for nothing. A truncated last line (a killed write) is skipped: that item is simply done again."""
    out = {}
    for path in paths:
        if not path.exists() or (header is not None and not _starts_with(path, header)):
            continue
        for line, r in read_jsonl(path, truncated="skip")[header is not None :]:
            if not isinstance(r, dict) or not isinstance(r.get(key), int) or isinstance(r[key], bool):
                raise DataError(f"{path} line {line}: expected an object with an integer '{key}'")
            out[r[key]] = r
    return out


def own_file(path: Path, header: dict | None = None) -> TextIO:
    """This rank's progress file opened for appending (a killed write's last line mended: `files.append_jsonl`); a
    file that does not start with `header` (new, or left by other settings) is started afresh with it."""
    if header is not None and not _starts_with(path, header):
        atomic_write_text(path, json.dumps(header) + "\n")
    return append_jsonl(path)


def _starts_with(path: Path, header: dict) -> bool:
    if not path.exists():
        return False
    with path.open() as f:
        return f.readline() == json.dumps(header) + "\n"
