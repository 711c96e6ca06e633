"""Throughput of the hot paths at realistic sizes; prints timings and, more usefully, their ratios.

Machines are noisy: each figure is the median of several repeats after a warm-up.

Usage:
    python bench.py                 # all benchmarks
    python bench.py --only log-probs
    python bench.py --only epochs --data data/sim
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import tyro

from model import PointerSelector, SelectorConfig


@dataclass
class Args:
    only: Literal["all", "log-probs", "epochs"] = "all"
    """Which benchmark to run."""
    repeats: int = 5
    """Timed repeats per measurement (the median is reported)."""
    threads: int = 0
    """torch threads (0 = torch's default)."""
    data: Path | None = None
    """Dataset folder for the epoch benchmarks (default: generate the default simulated data in a temp folder)."""


def median_seconds(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up: allocator, thread pool
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def random_batch(B: int, G: int, S: int, K: int, d: int, g: torch.Generator):
    query, pool = torch.randn(B, d, generator=g), torch.randn(B, K, d, generator=g)
    pool_mask = torch.ones(B, K, dtype=torch.bool)
    seqs = torch.rand(B, G, K, generator=g).argsort(-1)[..., :S]  # (B, G, S) distinct picks
    return query, pool, pool_mask, seqs, torch.ones(B, G, dtype=torch.bool)


def bench_log_probs(repeats: int, B=32, G=40, S=4, K=64, d=512, queries=800) -> None:
    """Teacher-forced log-probs, forward + backward: shared pool encoding vs one copy of query+pool per sequence."""
    model = PointerSelector(SelectorConfig(dim=d)).train()
    query, pool, pool_mask, seqs, seq_mask = random_batch(B, G, S, K, d, torch.Generator().manual_seed(0))

    def vectorised():
        model.zero_grad(set_to_none=True)
        model.log_probs(query, pool, pool_mask, seqs, seq_mask).sum().backward()

    def naive():  # what a per-sequence implementation does: every sequence re-encodes its query and pool
        model.zero_grad(set_to_none=True)
        q = query.repeat_interleave(G, 0)  # (B*G, d)
        p = pool.repeat_interleave(G, 0)  # (B*G, K, d)
        m = pool_mask.repeat_interleave(G, 0)
        model.log_probs(q, p, m, seqs.flatten(0, 1)[:, None], torch.ones(B * G, 1, dtype=torch.bool)).sum().backward()

    fast, slow = median_seconds(vectorised, repeats), median_seconds(naive, repeats)
    print(f"log_probs fwd+bwd  B={B} G={G} S={S} K={K} d={d}")
    print(f"  vectorised (pool encoded once): {fast * 1e3:8.1f} ms/batch")
    print(f"  naive (one copy per sequence):  {slow * 1e3:8.1f} ms/batch")
    print(f"  ratio naive/vectorised:         {slow / fast:8.1f}x")
    print(f"  pass over {queries} queries:        {fast * queries / B:8.2f} s (vectorised)")


def bench_epochs(data: Path | None, repeats: int) -> None:
    """One RCE, one offline and one online GRPO epoch (steps + validation + start-up) over the default simulated
    data: 800 x 16 x 4, K=64. The three are interleaved in every repeat, so machine load hits them alike."""
    import contextlib
    import io

    import grpo
    import rce
    from gen_rl_data import Args as GenArgs
    from gen_rl_data import generate

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if data is None:
            data = tmp / "data"
            with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
                generate(GenArgs(out=data))
        stages = {
            "rce": lambda r: rce.main(rce.Args(data=data, out=r / "rce", epochs=1)),
            "grpo": lambda r: grpo.main(grpo.Args(data=data, init=r / "rce", out=r / "g", epochs=1)),
            "grpo --online": lambda r: grpo.main(
                grpo.Args(data=data, init=r / "rce", out=r / "o", epochs=1, online=True)
            ),
        }
        times = {name: [] for name in stages}
        for rep in range(repeats):
            for name, fn in stages.items():
                t0 = time.perf_counter()
                with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
                    fn(tmp / f"rep{rep}")
                times[name].append(time.perf_counter() - t0)
    where = data if data.name != "data" else "the default sim data"
    print(f"one epoch over {where} (800 queries x 16 x 4, K=64), validation and start-up included, {repeats} repeats")
    base = statistics.median(times["rce"])
    for name, t in times.items():
        print(
            f"  {name:14s} min {min(t):6.2f} s  median {statistics.median(t):6.2f} s  max {max(t):6.2f} s"
            f"   (median {statistics.median(t) / base:.2f}x rce)"
        )


def main(args: Args) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.only in ("all", "log-probs"):
        bench_log_probs(args.repeats)
    if args.only in ("all", "epochs"):
        bench_epochs(args.data, args.repeats)


if __name__ == "__main__":
    main(tyro.cli(Args))
