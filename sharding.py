"""Scale-out with torchrun: ranks split the queries, each appends to its own shard file, rank 0 merges.

    torchrun --nproc-per-node 8 gen_rl_data.py --lvlm Qwen/Qwen2.5-VL-3B-Instruct ...

A plain `python script.py` is world size 1 and needs no process group. Under torchrun every rank loads its own
model on its own GPU (LOCAL_RANK), takes the queries i with i % world == rank, and flushes each finished query to
its shard; a crash loses only the queries in flight, and re-running the same command resumes from the shards.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


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


def share(n: int, rank: int, world: int) -> range:
    """The item indices this rank owns: fixed by index, never by what is left, so ranks that read the progress
    files at different moments still split the work into disjoint parts that cover it all."""
    return range(rank, n, world)


def barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def finish(world: int) -> None:
    if world > 1 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
