"""Throughput of the hot paths at realistic sizes; prints timings and, more usefully, their ratios.

Machines are noisy: each figure is the median of several repeats after a warm-up.

Usage:
    python bench.py                 # all benchmarks
    python bench.py --only log-probs
    python bench.py --only epochs --data data/sim
    python bench.py --only grpo --shapes 64,16,4 32,8,1 256,64,8   # offline GRPO epoch vs Lever-Plus's step
    python bench.py --only decode                                  # greedy decoding vs Lever-Plus's decoder
    python bench.py --only pools --pool-whole-rows 50000          # pool building: time and peak memory by size
    python bench.py --only sim                                     # simulator scoring per call, in each world
    python bench.py --only library                                 # picking for new questions from 443,757 items
    python bench.py --only run-sh                                  # bash run.sh on a fresh copy: each stage's time
    python bench.py --only lvlm --lvlm Qwen/Qwen2.5-VL-3B-Instruct --vqa-root /data/okvqa --device cuda
    python bench.py --only lvlm --lvlm random-3b --group-size 16 --lvlm-batch-size 16 --pool-size 64   # GPU, no weights
    python bench.py --only lvlm --lvlm tiny-3b-pixels --lvlm-steps 4      # the CPU side at a real checkpoint's cost
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import torch
from torch import Tensor

from icl_select import tiny
from icl_select.cli import default_is, run_cli
from model import DECODE_CHUNK, PointerSelector, SelectorConfig, slices


@dataclass
class Args:
    only: Literal["all", "log-probs", "epochs", "grpo", "decode", "pools", "lvlm", "sim", "library", "run-sh"] = "all"
    """Which benchmark (all = the CPU ones but pools and library; lvlm needs --lvlm and --vqa-root; every GPU figure
    of docs/real-models.md in one run: gpu_report.py)."""
    shapes: list[str] = field(default_factory=lambda: ["64,16,4"])
    """GRPO benchmark: K,G,S (pool size, group size, shots) of each simulated dataset."""
    reference_queries: int = 64
    """GRPO benchmark: training queries Lever-Plus's step is timed on (time is linear in them)."""
    grpo_epochs: int = 10
    """GRPO benchmark: epochs per run (10 = grpo.py's offline default; 1 shows a run's fixed costs)."""
    repeats: int = 5
    """Timed repeats per measurement (min / median / max, or the median alone)."""
    threads: int = 1
    """torch threads for every benchmark (0 = torch's default; epochs uses --thread-counts, pools one)."""
    thread_counts: list[int] = field(default_factory=lambda: [1])
    """Epoch benchmark: the thread counts to compare, interleaved (e.g. 1 2)."""
    pool_rows: list[int] = field(default_factory=lambda: [50_000, 200_000, 443_757])
    """Pool benchmark: train rows of each synthetic dataset (443,757 = VQAv2's train set)."""
    pool_queries: int = 15_000
    """Pool benchmark: anchor queries (train rows) that each get a pool of 64."""
    pool_samplers: list[str] = field(default_factory=lambda: ["random", "image", "mix"])
    """Pool benchmark: samplers to time (text costs what image does)."""
    pool_whole_rows: int = 0
    """Pool benchmark: up to this many rows, also check the chunked pools against a whole-mask build."""
    library_rows: int = 443_757
    """Library benchmark: demonstrations in the library (443,757 = VQAv2's train questions)."""
    library_pictures: int = 500
    """Library benchmark: 640 x 480 pictures (two questions each) the tiny CLIP embeds once."""
    data: Annotated[Path | None, default_is("a fresh simulated dataset")] = None
    """Dataset folder for the epoch benchmarks."""
    lvlm: str | None = None
    """LVLM benchmark: a hub id or folder, or tiny / random-3b / tiny-3b-pixels (docs/flags.md)."""
    vqa_root: Path | None = None
    """LVLM benchmark: folder of the official OK-VQA / VQAv2 files and COCO images."""
    dataset: Literal["okvqa", "vqav2"] = "okvqa"
    """LVLM benchmark: which dataset's files are under --vqa-root."""
    device: str = "auto"
    """LVLM benchmark: cpu, cuda, or auto (CUDA in bf16 if present, else CPU float32)."""
    queries: int = 4
    """LVLM benchmark: validation questions, each with --group-size sequences."""
    group_size: int = 8
    """LVLM benchmark: sequences (G) per question."""
    pool_size: int = 0
    """LVLM benchmark: pool each question's sequences are drawn from (0 = all train questions)."""
    shots: int = 4
    """LVLM benchmark: ICDs (S) per sequence."""
    lvlm_steps: int = 1
    """LVLM benchmark: online GRPO steps per timed pass, each --queries questions with fresh pools, the picture caches
    kept from step to step (pictures recur as in a run)."""
    lvlm_passes: list[str] = field(default_factory=list)
    """LVLM benchmark: which scoring paths to time (ids of bench.LVLM_PASSES; none = every one that applies)."""
    lvlm_batch_size: int = 0
    """LVLM benchmark: prompts per forward pass at most (0 = the stages' default: 64 on a GPU, 8 on the CPU)."""
    lvlm_batch_tokens: int = 0
    """LVLM benchmark: padded prompt tokens per forward pass at most (0 = the stages' default: on a GPU, what half its
    memory left after loading holds; none on the CPU)."""
    lvlm_workers: int = 0
    """LVLM benchmark: picture threads (0 = one per CPU core, shared among a machine's torchrun ranks)."""
    lvlm_compile: bool = True
    """LVLM benchmark: torch.compile the norms, MLPs and vision blocks (CUDA, half precision)."""
    lvlm_static_decode: Literal["off", "inductor", "cudagraphs"] = "off"
    """LVLM benchmark: the default path's decoding over a static cache, compiled on CUDA (lvlm.StaticDecode)."""
    encoder_cache_mib: int | None = None
    """LVLM benchmark: GPU memory for the vision encoder's outputs (Qwen family; 0 = off; none: the stages' default, a
    quarter of a GPU's free memory or 4096 MiB)."""
    image_cache_mib: int = 4096
    """LVLM benchmark: memory for decoded and preprocessed pictures (half each), as the stages' flag."""
    lvlm_reference: bool = True
    """LVLM benchmark: also time the unshared reference, whose answers check the default path's (slow)."""


def median_seconds(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up: allocator, thread pool
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def mmm(values: list[float], fmt: str = "{:.2f}") -> str:
    """min / median / max."""
    return " / ".join(fmt.format(v) for v in (min(values), statistics.median(values), max(values)))


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


def bench_epochs(data: Path | None, repeats: int, thread_counts: list[int]) -> None:
    """One RCE, one offline and one online GRPO epoch (steps + validation + start-up) over the default simulated
    data (800 x 16 x 4, K=64), the same for a selector that may stop (RCE's cross-fit included), and evaluating 800
    questions x 4 shots, at each thread count. Stages and thread counts are interleaved in every repeat, so machine
    load hits them alike."""
    import contextlib
    import io

    import evaluate
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
            "grpo --online --replay-steps 0": lambda r: grpo.main(  # what replay, online's default, costs
                grpo.Args(data=data, init=r / "rce", out=r / "o0", epochs=1, online=True, replay_steps=0)
            ),
            "rce --can-stop": lambda r: rce.main(rce.Args(data=data, out=r / "rce-stop", epochs=1, can_stop=True)),
            "grpo --online, may stop": lambda r: grpo.main(  # its ladders beside one query in four, its stop set
                grpo.Args(data=data, init=r / "rce-stop", out=r / "os", epochs=1, online=True)
            ),
            "evaluate 800": lambda r: evaluate.main(evaluate.Args(data=data, runs=[r / "rce"], num_samples=[800])),
        }
        times = {(name, t): [] for name in stages for t in thread_counts}
        for rep in range(repeats):
            for t in thread_counts:
                torch.set_num_threads(t)
                for name, fn in stages.items():
                    t0 = time.perf_counter()
                    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
                        fn(tmp / f"rep{rep}-t{t}")
                    times[name, t].append(time.perf_counter() - t0)
    where = data if data.name != "data" else "the default sim data"
    print(f"one epoch over {where} (800 queries x 16 x 4, K=64), validation and start-up included, {repeats} repeats")
    for name in stages:
        base = statistics.median(times[name, thread_counts[0]])
        for t in thread_counts:
            x = times[name, t]
            print(
                f"  {name:30s} {t} thread(s): min {min(x):6.2f} s  median {statistics.median(x):6.2f} s  "
                f"max {max(x):6.2f} s   (median {statistics.median(x) / base:.2f}x {thread_counts[0]} thread(s))"
            )


def reference_grpo_steps(model: PointerSelector, ds, queries: Tensor, epochs: int, beta: float = 0.1) -> None:
    """GRPO steps as Lever-Plus's v3 trainer takes them, on our network and weights for a like-for-like timing: one
    query per optimizer step, its query and pool copied and encoded once per sequence, a Python loop over steps with
    -100 masking, PPO clip 0.2 against old log-probs computed once, beta * mean(rho - 1 - log rho), global-norm clipping
    at 1, AdamW (lr 1e-5) and eight .item() calls per step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)
    g, emb = ds.groups, ds.emb["train"]
    reward = g.fields["acc"] + g.fields["correct"]  # (Q, G)

    def seq_logp(q: int) -> Tensor:
        keep = g.seq_mask[q]  # (G,)
        seqs = model.cfg.from_prompt(g.seqs[q][keep][None])[0]  # (G', S)
        n, (K, d) = len(seqs), emb[g.pools[q]].shape
        query = emb[g.queries[q]].expand(n, d).clone()  # (G', d): one copy per sequence
        pool = emb[g.pools[q]].expand(n, K, d).clone()  # (G', K, d)
        avail = g.pool_mask[q].expand(n, K).clone()  # (G', K)
        s, keys, _ = model.encode(query, pool, avail)
        total = torch.zeros(n)
        for t in range(seqs.shape[1]):
            scores = torch.einsum("nh,nkh->nk", s, keys) / model.cfg.temperature
            log_dist = scores.masked_fill(~avail, -100.0).log_softmax(-1)  # (G', K)
            total = total + log_dist.gather(1, seqs[:, t : t + 1])[:, 0]
            avail = avail.scatter(1, seqs[:, t : t + 1], False)
            s = model.advance(s[:, None], keys, seqs[:, t : t + 1])[:, 0]
        return total

    with torch.no_grad():
        model.eval()
        old = {q: seq_logp(q) for q in queries.tolist()}
    model.train()
    for q in queries.tolist() * epochs:
        r = reward[q][g.seq_mask[q]].float()
        adv = ((r - r.mean()) / r.std(correction=0).clamp_min(0.1)).clamp(-5, 5)
        ratio = (seq_logp(q) - old[q]).exp()
        surrogate = torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
        kl = (ratio - 1 - ratio.log()).mean()
        loss = -surrogate.mean() + beta * kl
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        for x in (loss, surrogate.mean(), kl, ratio.mean(), ratio.min(), ratio.max(), adv.mean(), adv.std()):
            x.item()


def bench_grpo_epoch(repeats: int, shapes: list[tuple[int, int, int]], reference_queries: int, epochs: int) -> None:
    """An offline GRPO run (`grpo.main`, validation and checkpoints included) against as many epochs of
    `reference_grpo_steps` on the same data and init, interleaved, in seconds per epoch per 800 training queries; then
    the same run as a fresh `python grpo.py` process, start-up included."""
    import contextlib
    import io
    import subprocess
    import sys

    import grpo
    import rce
    from gen_rl_data import Args as GenArgs
    from gen_rl_data import generate
    from icl_select.batches import split_queries
    from icl_select.data import load_dataset
    from icl_select.runs import load_selector

    quiet = (contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()))
    print(
        f"offline GRPO, {epochs}-epoch runs: seconds per epoch per 800 training queries ({repeats} repeats, "
        "interleaved; min / median / max)"
    )
    for K, G, S in shapes:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            with quiet[0], quiet[1]:
                generate(GenArgs(out=tmp / "data", pool_size=K, group_size=G, seq_len=S))
                rce.main(rce.Args(data=tmp / "data", out=tmp / "rce", epochs=1))
            ds = load_dataset(tmp / "data")
            train = split_queries(ds, grpo.resolve(grpo.Args(data=tmp / "data"))).train
            sub = train[:reference_queries]
            reference_grpo_steps(load_selector(tmp / "rce"), ds, sub[:1], 1)  # warm-up: torch's one-off imports
            ours, ref, fresh = [], [], []
            for rep in range(repeats):
                t0 = time.perf_counter()
                with quiet[0], quiet[1]:
                    grpo.main(grpo.Args(data=tmp / "data", init=tmp / "rce", out=tmp / f"g{rep}", epochs=epochs))
                ours.append((time.perf_counter() - t0) * 800 / len(train) / epochs)
                model = load_selector(tmp / "rce")
                t0 = time.perf_counter()
                reference_grpo_steps(model, ds, sub, epochs)
                ref.append((time.perf_counter() - t0) * 800 / len(sub) / epochs)
                t0 = time.perf_counter()
                cmd = [sys.executable, "grpo.py", "--data", str(tmp / "data"), "--init", str(tmp / "rce")]
                cmd += ["--out", str(tmp / f"p{rep}"), "--epochs", str(epochs)]
                subprocess.run(cmd, check=True, capture_output=True, cwd=Path(__file__).parent)
                fresh.append((time.perf_counter() - t0) * 800 / len(train) / epochs)

        ratios = sorted(r / o for r, o in zip(ref, ours))
        f = "{:6.2f}"
        print(
            f"  K={K:3d} G={G:2d} S={S}: Lever-Plus step {mmm(ref, f)}   ours {mmm(ours, f)}   ratio {mmm(ratios, f)}x"
        )
        print(f"  {'':17s} ours as a fresh process, start-up included: {mmm(fresh, f)}")


def proc_status_bytes(field: str) -> int:
    """A memory figure of this process from /proc/self/status (Linux), e.g. VmRSS (resident) or VmHWM (its peak)."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # kB


def pool_build_run(rows: int, queries: int, sampler: str, whole: bool, repeats: int) -> dict:
    """In a fresh process: random unit-norm embeddings (rows, 512) of the three views, then pools of 64 for `queries`
    anchors, `repeats` times, chunked (`pools.query_pools`) or with `whole` from the whole matrices
    (`pools.build_pools`). Peak memory: the peak RSS while building (VmHWM, reset once the embeddings exist) minus the
    RSS just before."""
    import hashlib

    from icl_select import pools

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    emb = {}
    for name in ("train", "train_image", "train_text"):
        x = torch.randn(rows, 512, generator=g)  # (N, d), normalised in place: no second copy
        emb[name] = x.div_(x.norm(dim=1, keepdim=True))
    image_ids = {"train": torch.randint(rows * 10 // 54, (rows,), generator=g)}  # VQAv2: ~5.4 questions per image
    anchors = torch.randperm(rows, generator=g)[:queries]  # (Q,)
    views = {"random": (), "image": ("image",), "text": ("text",), "mix": ("image", "text")}[sampler]

    def build() -> Tensor:
        if not whole:
            return pools.query_pools(sampler, 64, emb, image_ids, "train", anchors, anchors, torch.Generator())
        exclude = pools.exclusion_mask(image_ids["train"][anchors], image_ids["train"], anchors)  # (Q, N)
        sims = {f"{v}_sim": emb[f"train_{v}"][anchors] @ emb[f"train_{v}"].T for v in views}  # (Q, N) each
        return pools.build_pools(sampler, 64, exclude, torch.Generator(), **sims)

    before = proc_status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        pool = build()
        seconds.append(time.perf_counter() - t0)
    return {
        "seconds": seconds,
        "emb_bytes": sum(x.nbytes for x in emb.values()),
        "rss_before": before,
        "extra_peak": proc_status_bytes("VmHWM") - before,
        "digest": hashlib.sha1(pool.numpy().tobytes()).hexdigest(),
    }


def bench_pools(rows_list: list[int], queries: int, samplers: list[str], repeats: int, whole_rows: int) -> None:
    """Pool building at each train-row count, each size, sampler and method in a fresh process (one thread) so
    its peak memory is its own: chunked (`pools.query_pools`), and at sizes up to `whole_rows` also from the whole
    matrices at once, with a check that both give the same pools."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    def run(*args) -> dict:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
            return ex.submit(pool_build_run, *args).result()

    gib = 2**30
    print(
        f"pool building: {queries} train anchors, pools of 64, d=512, 1 thread ({repeats} repeats; min / median / max)"
    )
    print("peak = the building process's peak RSS (VmHWM) above its RSS once the embeddings exist")
    for rows in rows_list:
        for sampler in samplers:
            digests = {}
            for mode in ("chunked", "whole matrix") if rows <= whole_rows else ("chunked",):
                r = run(rows, queries, sampler, mode == "whole matrix", repeats)
                x, digests[mode] = r["seconds"], r["digest"]
                print(
                    f"  {rows:7d} rows {sampler:6s} {mode:12s} {min(x):7.1f} / {statistics.median(x):7.1f} / "
                    f"{max(x):7.1f} s  peak +{r['extra_peak'] / gib:5.2f} GiB  (embeddings {r['emb_bytes'] / gib:.2f} "
                    f"GiB, RSS before {r['rss_before'] / gib:.2f} GiB)",
                    flush=True,
                )
            if len(digests) > 1:
                print(f"  {'':7s} same pools chunked and whole: {len(set(digests.values())) == 1}", flush=True)


def bench_library(repeats: int, rows: int, pictures: int) -> None:
    """Demonstrations for new questions (icl_select/library.py) from a library of `rows` items: random unit-norm 512-d
    embeddings of the three views, about 5.4 questions per picture (VQAv2's), a random-weight selector, pools of 64,
    4 picks. Per sampler: one question alone (seconds) and batches of 64 (questions per second), and the peak memory
    above the embeddings (VmHWM). Then the one-time cost of a library of OK-VQA files on the tiny offline CLIP:
    COCO-sized pictures decoded, hashed, embedded and cached, per item (a real CLIP's forward adds its own time)."""
    import torch.nn.functional as F

    from icl_select.library import Demonstrations, Library

    g = torch.Generator().manual_seed(0)
    emb = {}
    for name in ("fused", "image", "text"):
        x = torch.randn(rows, 512, generator=g)  # (N, d), normalised in place: no second copy
        emb[name] = x.div_(x.norm(dim=1, keepdim=True))
    image_ids = torch.randint(rows * 10 // 54, (rows,), generator=g).tolist()
    items = [{"question_id": i, "image_id": m, "question": "q", "answers": ["a"]} for i, m in enumerate(image_ids)]
    library = Library(items, emb, "random embeddings")
    selector = PointerSelector(SelectorConfig(dim=512, picks=4)).eval()
    n = 64 * (repeats + 1)
    queries = {name: F.normalize(torch.randn(n, 512, generator=g), dim=-1) for name in emb}  # (n, d) each
    gib = 2**30
    print(
        f"demonstrations for new questions: a library of {rows} items (embeddings {3 * rows * 512 * 4 / gib:.2f} "
        f"GiB), pools of 64, 4 picks, d=512, 1 thread ({repeats} repeats after a warm-up; min / median / max)"
    )
    before = proc_status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    for sampler in ("image", "mix", "text", "random"):
        demos = Demonstrations(selector, library, sampler, 64, source="a random selector")
        one, batch = [], []
        for r in range(repeats + 1):  # the first round warms up
            t0 = time.perf_counter()
            demos.pick_embedded({k: v[r : r + 1] for k, v in queries.items()})
            one.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            demos.pick_embedded({k: v[64 * r : 64 * (r + 1)] for k, v in queries.items()})
            batch.append(64 / (time.perf_counter() - t0))
        print(
            f"  {sampler:6s} one question {mmm([t * 1e3 for t in one[1:]], '{:.0f}')} ms   batches of 64 "
            f"{mmm(batch[1:], '{:.0f}')} questions/s",
            flush=True,
        )
    extra = proc_status_bytes("VmHWM") - before
    print(f"  peak memory above the library: +{extra / gib:.2f} GiB (RSS before {before / gib:.2f} GiB)")

    times = []
    with tempfile.TemporaryDirectory(prefix="icl-select-bench-") as tmp:
        vqa = tiny.build_okvqa_fixture(Path(tmp, "okvqa"), image_size=(640, 480), train_images=pictures)
        clip = str(tiny.build_tiny_clip(Path(tmp, "clip")))
        for _ in range(2):  # embedded, then read back from its cache
            t0 = time.perf_counter()
            size = len(Library.from_vqa("okvqa", vqa, clip, device="cpu").items)
            times.append(time.perf_counter() - t0)
    print(
        f"one-time embedding on the TINY random CLIP (32-px input, not a real CLIP's cost), {size} items on "
        f"{pictures} 640x480 pictures: {times[0] / size * 1e3:.2f} ms per item; read back from the cache "
        f"{times[1] / size * 1e3:.3f} ms per item"
    )


@torch.no_grad()
def reference_greedy(model: PointerSelector, query: Tensor, pool: Tensor, pool_mask: Tensor, steps: int) -> Tensor:
    """Greedy decoding as Lever-Plus's decoder does it, in batches of 32 queries: no input checks, taken candidates
    masked with -100, argmax, gated state update."""
    picks = []
    for a in range(0, len(query), 32):
        s, keys, _ = model.encode(query[a : a + 32], pool[a : a + 32], pool_mask[a : a + 32])
        avail, out = pool_mask[a : a + 32].clone(), []
        for _ in range(steps):
            scores = torch.einsum("bh,bkh->bk", s, keys) / model.cfg.temperature
            pick = scores.masked_fill(~avail, -100.0).argmax(-1)  # (B,)
            out.append(pick)
            avail = avail.scatter(1, pick[:, None], False)
            s = model.advance(s[:, None], keys, pick[:, None])[:, 0]
        picks.append(torch.stack(out, -1))
    return torch.cat(picks)


def bench_decode(repeats: int, B=800, S=4, K=64, d=512) -> None:
    """Greedy picks for 800 queries: ours (one call; slices inside, inputs checked once) against Lever-Plus's
    decoder in batches of 32, interleaved; and the encoder alone over the same slices, which both decoders run."""
    model = PointerSelector(SelectorConfig(dim=d)).eval()
    query, pool, pool_mask, _, _ = random_batch(B, 1, S, K, d, torch.Generator().manual_seed(0))

    @torch.no_grad()
    def encoder_only() -> None:
        for part in slices(B, DECODE_CHUNK):
            model.encode(query[part], pool[part], pool_mask[part])

    times, picks = {"ours": [], "lever": [], "encoder": []}, {}
    for _ in range(repeats + 1):  # the first round warms up
        for name, fn in (
            ("ours", lambda: model.greedy(query, pool, pool_mask, S)[0]),
            ("lever", lambda: reference_greedy(model, query, pool, pool_mask, S)),
            ("encoder", encoder_only),
        ):
            t0 = time.perf_counter()
            picks[name] = fn()
            times[name].append(time.perf_counter() - t0)
        assert torch.equal(picks["lever"], picks["ours"])  # the same decoder
    ours, lever, encoder = times["ours"][1:], times["lever"][1:], times["encoder"][1:]
    ratios = sorted(b / a for a, b in zip(ours, lever))
    print(f"greedy decoding of {B} queries, S={S} K={K} d={d} ({repeats} repeats; min / median / max)")
    print(
        f"  ours, one call:             {min(ours) * 1e3:7.1f} / {statistics.median(ours) * 1e3:7.1f} / "
        f"{max(ours) * 1e3:7.1f} ms"
    )
    print(
        f"  Lever-Plus, batches of 32:  {min(lever) * 1e3:7.1f} / {statistics.median(lever) * 1e3:7.1f} / "
        f"{max(lever) * 1e3:7.1f} ms"
    )
    print(f"  speed-up:                   {ratios[0]:.2f} / {statistics.median(ratios):.2f} / {ratios[-1]:.2f}x")
    share = statistics.median(encoder) / statistics.median(ours)
    print(f"  the encoder alone:          {statistics.median(encoder) * 1e3:7.1f} ms median, {share:.0%} of ours")


def bench_sim(repeats: int, G=16, Q=64, S=4, calls=20) -> dict[str, list[float]]:
    """Per-call scoring time of the simulated LVLM in each world at a GRPO-like batch (G sequences of S shots for
    each of Q queries), the worlds interleaved in every repeat; each repeat times `calls` calls."""
    from icl_select import sim

    sims = {world: sim.Simulator(sim.world_config(world)) for world in sim.WORLDS}
    g, n = torch.Generator().manual_seed(0), sims["additive"].cfg.num_train
    queries = torch.randint(n, (Q,), generator=g).repeat_interleave(G)  # (Q*G,)
    icds = torch.rand(Q * G, n, generator=g).argsort(dim=1)[:, :S]  # (Q*G, S) distinct train rows
    for s in sims.values():
        s.score("train", queries, icds)  # warm-up: allocator, a world's answer tables
    times = {world: [] for world in sims}
    for _ in range(repeats):
        for world, s in sims.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                s.score("train", queries, icds)
            times[world].append((time.perf_counter() - t0) / calls)
    base = statistics.median(times["additive"])
    print(f"simulator scoring per call, {Q} queries x {G} sequences x {S} shots ({repeats} repeats of {calls} calls)")
    print("| world | min ms | median ms | max ms | median / additive |")
    print("|---|---|---|---|---|")
    for world, t in times.items():
        row = f"{min(t) * 1e3:.2f} | {statistics.median(t) * 1e3:.2f} | {max(t) * 1e3:.2f}"
        print(f"| {world} | {row} | {statistics.median(t) / base:.2f}x |")
    return times


@torch.inference_mode()
def unshared_scores(backend, examples: list) -> tuple[list[str], Tensor]:
    """The reference the LVLM benchmark compares against: each prompt runs once for transformers' generate() and
    once more per credited reply, teacher-forced behind it (how scoring worked before prompts were shared).
    Returns (raw answers, gt_prob (N,)) and counts prompt tokens in backend.counts like LVLMBackend.run."""
    from icl_select.lvlm import credited_replies

    texts, rows, replies, credits = [], [], [], []
    for start in range(0, len(examples), backend.batch_size):
        inputs = backend.encode(examples[start : start + backend.batch_size])
        backend.counts["prompt_tokens"] += int(inputs["attention_mask"].sum())
        out = backend.model.generate(**inputs)  # (B, T + new)
        texts += backend.tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    for i, (query, _) in enumerate(examples):
        for reply, credit in credited_replies(query["answers"]):
            rows, replies, credits = rows + [i], replies + [reply], credits + [credit]
    probs = []
    for start in range(0, len(rows), backend.batch_size):
        batch = [examples[i] for i in rows[start : start + backend.batch_size]]
        inputs = backend.encode(batch)
        backend.counts["prompt_tokens"] += int(inputs["attention_mask"].sum())
        ids = [
            torch.tensor(backend.reply_ids(backend.messages(*examples[i]), [a])[0])
            for i, a in zip(rows[start : start + backend.batch_size], replies[start : start + backend.batch_size])
        ]
        reply = torch.nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=backend.pad_id)  # (B, L)
        reply = reply.to(backend.model.device)
        reply_mask = (torch.arange(reply.shape[1]) < torch.tensor([len(x) for x in ids])[:, None]).to(reply.device)
        prompt = inputs["input_ids"]  # (B, T)
        full = dict(inputs, input_ids=torch.cat([prompt, reply], dim=1))  # (B, T + L)
        for key, value in inputs.items():  # attention mask and per-token type ids grow by the reply's columns
            if key != "input_ids" and value.shape == prompt.shape and not value.is_floating_point():
                fill = reply_mask if key == "attention_mask" else torch.zeros_like(reply_mask)
                full[key] = torch.cat([value, fill.to(value.dtype)], dim=1)
        logits = backend.model(**full, use_cache=False, logits_to_keep=reply.shape[1] + 1).logits[:, :-1]  # (B, L, V)
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, reply[..., None]).squeeze(-1)  # (B, L)
        probs.append((logp * reply_mask).sum(1).exp().cpu())
    p = torch.cat(probs) * torch.tensor(credits)  # (R,)
    return texts, torch.zeros(len(examples)).index_add_(0, torch.tensor(rows), p).clamp_(max=1.0)


# Dense bf16 matrix-multiply peaks from the datasheets (FLOP/s, without sparsity), by a substring of the device name.
BF16_PEAKS = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12), ("L40S", 362e12))
VISION_MODULES = ("visual", "vision_tower", "vision_model", "multi_modal_projector", "connector")


def parameter_counts(model) -> tuple[int, int]:
    """(language model, vision encoder + projector) parameters; the input embeddings are a lookup, not counted."""
    vision = lm = 0
    for name, p in model.named_parameters():
        if any(part in VISION_MODULES for part in name.split(".")):
            vision += p.numel()
        elif p is not model.get_input_embeddings().weight:
            lm += p.numel()
    return lm, vision


def matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a large dense matrix product in `dtype` on `device`, measured here (the achievable peak)."""
    n = 8192 if device.type == "cuda" else 1024
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    for _ in range(2):
        a @ b
    reps = 10
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync()
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def padding(lengths: list[int], batches: list[list[int]]) -> float:
    """Padded prompt tokens over real ones for examples of these lengths put in these batches."""
    return sum(len(b) * max(lengths[i] for i in b) for b in batches) / sum(lengths)


def lvlm_steps(items: dict[str, list[dict]], args: Args) -> list[list]:
    """The bench's prompts as --lvlm-steps online GRPO steps: each step --queries validation questions, each with
    --group-size sequences of --shots ICDs drawn from its own pool of --pool-size train questions (a GRPO group).
    Pictures recur within a group (its question's in every sequence, its pool's in several) and, over steps, as the
    same train questions fall in other pools."""
    import random

    rng, steps = random.Random(0), []
    for step in range(args.lvlm_steps):
        examples = []
        for q in range(args.queries):
            pool = rng.sample(items["train"], args.pool_size) if args.pool_size else items["train"]
            query = items["val"][(step * args.queries + q) % len(items["val"])]
            examples += [(query, rng.sample(pool, args.shots)) for _ in range(args.group_size)]
        steps.append(examples)
    return steps


# The scoring paths bench_lvlm times: an id (--lvlm-passes), what it prints, and the levers it turns off or on.
LVLM_PASSES = {
    "default": ("default", {}),
    "no-encoder-cache": ("no encoder cache", {"cache": False}),
    "preprocess-held": ("pictures the encoder holds preprocessed again", {"held": False}),
    "picture-processes": ("pictures preprocessed in worker processes", {"processes": True}),
    "inline": ("no background thread or workers", {"threads": False}),
    "no-compile": ("no torch.compile", {"compiled": False}),
    "per-window": ("per-window vision attention, no torch.compile", {"varlen": False, "compiled": False}),
    "static-inductor": ("decoding over a static cache, inductor + CUDA graphs", {"static": "inductor"}),
    "static-cudagraphs": ("decoding over a static cache, CUDA graphs of eager kernels", {"static": "cudagraphs"}),
    "unshared": ("unshared: generate(), then a forward per reply", {"unshared": True}),
}


def bench_lvlm(args: Args) -> dict:
    """--lvlm-steps steps of prompts (`lvlm_steps`) scored by the default path (`LVLMBackend`), by that path with each
    of its levers turned off (or on), and by the unshared reference, interleaved, --repeats each, every timed pass
    starting with empty picture caches (kept from step to step within it). Then the default path against the device's
    peak, and where its wall time goes."""
    import resource

    from icl_select import hf, pictures, preprocessing
    from icl_select.lvlm import LVLMBackend, credited_replies
    from icl_select.vqa import postprocess
    from icl_select.vqa_data import load_vqa_split

    if args.lvlm == "tiny":
        return bench_tiny_families(args)
    if args.lvlm in ("random-3b", "tiny-3b-pixels"):
        return bench_coco_sized(args)
    if args.lvlm is None or args.vqa_root is None:
        raise ValueError("--only lvlm needs --lvlm MODEL and --vqa-root FOLDER (the official VQA files and images)")
    items = {s: load_vqa_split(args.dataset, args.vqa_root, s) for s in ("train", "val")}
    backend = LVLMBackend(
        args.lvlm,
        items,
        batch_size=args.lvlm_batch_size,
        device=args.device,
        encoder_cache_mib=args.encoder_cache_mib,
        image_cache_mib=args.image_cache_mib,
        batch_tokens=args.lvlm_batch_tokens,
        workers=args.lvlm_workers,
        compile=args.lvlm_compile,
        static_decode=args.lvlm_static_decode,
    )
    steps = lvlm_steps(items, args)
    examples = [ex for step in steps for ex in step]
    device, cuda = backend.model.device, backend.model.device.type == "cuda"
    encoder_cache, pool, images = backend.encoder_cache, backend.pool, backend.processor.image_processor
    n_workers = preprocessing.worker_count(args.lvlm_workers)
    workers = preprocessing.picture_processes(n_workers) if n_workers > 1 and hasattr(images, "pool") else None
    has_varlen = hf.varlen_runs(backend.model)

    def levers(cache=True, held=True, threads=True, processes=False, varlen=True, static=args.lvlm_static_decode, **_):
        if has_varlen:
            hf.vision_attention(backend.model, varlen)
        backend.encoder_cache, backend.reuse_held = (encoder_cache if cache else None), held
        backend.pool = pool if threads else None
        backend.picture_pool = (workers if processes and workers is not None else pool) if threads else None
        backend.prefetch = 2 if threads else 0
        backend.static_decode = static
        if hasattr(images, "pool"):
            images.pool = backend.picture_pool

    def cold() -> None:
        for c in (pictures.DECODED_IMAGES, getattr(images, "cache", None), encoder_cache and encoder_cache.cache):
            if c is not None:
                c.clear()
        backend.counts.clear()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    available = {
        "no-encoder-cache": encoder_cache is not None,
        "preprocess-held": encoder_cache is not None,
        "picture-processes": workers is not None,
        "no-compile": bool(backend.compiled),
        "per-window": has_varlen,  # eager: compiled vision blocks would be recompiled for every count of windows
        "static-inductor": cuda and args.lvlm_static_decode != "inductor",
        "static-cudagraphs": cuda and args.lvlm_static_decode != "cudagraphs",
        "unshared": args.lvlm_reference,
    }
    wanted = args.lvlm_passes or list(LVLM_PASSES)
    passes = {k: LVLM_PASSES[k][1] for k in wanted if available.get(k, True)}
    passes = {"default": {}, **passes}

    def score(name: str, prompts: list) -> tuple[list[str], Tensor]:
        p = passes[name]
        with torch.compiler.set_stance("default" if p.get("compiled", True) else "force_eager"):
            if p.get("unshared"):
                return unshared_scores(backend, prompts)
            out = backend.score_examples(prompts)
            return out["prediction"], out["gt_prob"]

    # The CPU side alone: every batch prepared (pictures, processor, positions, replies) and nothing run, with the
    # pictures preprocessed in threads, in worker processes, or in line, and without the encoder cache (every
    # picture's patch rows copied into its batch, not only those of the pictures the encoder has not seen).
    sides = {"in threads": {}, "in line": {"threads": False}}
    if workers is not None:
        sides["in processes"] = {"processes": True}
    if encoder_cache is not None:
        sides["in threads, no encoder cache"] = {"cache": False}
    replies = [[[r for r, _ in credited_replies(query["answers"])] for query, _ in step] for step in steps]
    prepared = {k: [] for k in sides}

    def prepare_all() -> None:
        for step, wanted in zip(steps, replies):
            for _ in backend.batches(step, wanted):
                pass

    results = {name: {"rate": [], "seconds": []} for name in passes}
    for name in passes:  # warm-up: kernels, allocator, and each path's compiled graphs
        levers(**passes[name])
        score(name, steps[0][: backend.batch_size])
    for _ in range(args.repeats):
        for side, setting in sides.items():
            levers(**setting)
            cold()
            t0 = time.perf_counter()
            prepare_all()
            prepared[side].append(len(examples) / (time.perf_counter() - t0))
        for name in passes:
            levers(**passes[name])
            cold()
            t0 = time.perf_counter()
            answers, gt_prob = [], []
            for step in steps:  # the caches persist from step to step, as in a run
                a, g = score(name, step)
                answers, gt_prob = answers + a, gt_prob + [g]
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            r = results[name]
            r["rate"].append(len(examples) / seconds)
            r["seconds"].append(seconds)
            r["tokens"], r["counts"] = backend.counts["prompt_tokens"] / len(examples), dict(backend.counts)
            r["peak"] = (
                torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            )
            r["answers"], r["gt_prob"] = answers, torch.cat(gt_prob)
    levers()
    default, ref = results["default"], results.get("unshared")
    same = diff = ratio = None  # checked against the unshared reference only
    if ref is not None:
        same = default["answers"] == [postprocess(t) for t in ref["answers"]]
        diff = float((default["gt_prob"] - ref["gt_prob"]).abs().max())

    where = f"{device} ({backend.model.dtype})"
    slots = [it["image"] for query, icds in examples for it in (*icds, query)]
    print(
        f"LVLM {args.lvlm} on {where}, {args.lvlm_steps} step(s) of {args.queries} questions x G={args.group_size} x "
        f"S={args.shots} shots from pools of {args.pool_size or len(items['train'])}: {len(set(slots))} distinct "
        f"pictures in {len(slots)} picture slots"
    )
    print(
        f"(each sequence scored for its greedy answer and gt_prob; batches of <= {backend.batch_size} prompts; "
        f"min / median / max of {args.repeats} interleaved passes, the picture caches empty at each pass's start)"
    )
    memory = "peak GPU memory" if cuda else "peak process RSS"
    for name, r in results.items():
        tokens_per_s = [x * r["tokens"] for x in r["rate"]]
        print(
            f"  {LVLM_PASSES[name][0]:55s} {mmm(r['rate'])} sequences/s  {mmm(tokens_per_s, '{:.0f}')} prompt "
            f"tokens/s  {r['tokens']:.0f} prompt tokens/sequence  {memory} {r['peak'] / 2**30:.2f} GiB"
        )
    print(
        f"  the CPU side alone (batches prepared, nothing run), {n_workers} picture worker(s): "
        + "; ".join(f"pictures preprocessed {side} {mmm(rates)} sequences/s" for side, rates in prepared.items())
    )
    agreement = {}
    for name, r in results.items():
        if name not in ("default", "unshared"):
            agree = sum(a == b for a, b in zip(default["answers"], r["answers"]))
            agreement[name] = (agree, float((default["gt_prob"] - r["gt_prob"]).abs().max()))
    print(
        "  against the default: "
        + "; ".join(f"{n}: {a} of {len(examples)} same answers, gt_prob {g:.1e}" for n, (a, g) in agreement.items())
    )
    if ref is not None:
        ratio = ref["tokens"] / default["tokens"]
        shared = f"{ratio:.2f}x fewer prompt tokens shared"
        print(f"  {shared}; same answers as unshared: {same}; max |gt_prob diff| {diff:.2e}")

    # What the default path achieves: 2 x parameters x tokens (attention's T^2 term left out), against the peak.
    lm, vision = parameter_counts(backend.model)
    c, seconds = default["counts"], statistics.median(default["seconds"])
    lm_tokens = c.get("prompt_tokens", 0) + c.get("new_tokens", 0) + c.get("reply_tokens", 0)
    lm_rate, vision_rate = 2 * lm * lm_tokens / seconds, 2 * vision * c.get("vision_patches", 0) / seconds
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    sheet = next((peak for key, peak in BF16_PEAKS if key in name), None) if cuda else None
    measured = matmul_rate(device, backend.model.dtype)
    print(f"Model FLOP/s of the default path (2 x parameters x tokens), median pass, on {name}:")
    print(
        f"  language model {lm / 1e9:.3g} B parameters x {lm_tokens / len(examples):.0f} tokens/sequence "
        f"(prompt, decoded, replies): {lm_rate / 1e12:.3g} TFLOP/s"
    )
    print(
        f"  vision encoder {vision / 1e9:.3g} B parameters x {c.get('vision_patches', 0) / len(examples):.0f} "
        f"patches/sequence encoded: {vision_rate / 1e12:.3g} TFLOP/s"
    )
    total = lm_rate + vision_rate
    shares = f"{total / measured:.1%} of a dense {str(backend.model.dtype).removeprefix('torch.')} matmul here "
    shares += f"({measured / 1e12:.3g} TFLOP/s)"
    if sheet:
        shares += f", {total / sheet:.1%} of the datasheet's bf16 peak ({sheet / 1e12:.0f} TFLOP/s)"
    print(f"  together {total / 1e12:.3g} TFLOP/s: {shares}")

    # Padding: the default's batches (longest first) against the same prompts batched in the order given.
    first = steps[0]
    lengths = [int(backend.process([ex])["attention_mask"].sum()) for ex in first]
    given = [list(range(i, min(i + backend.batch_size, len(first)))) for i in range(0, len(first), backend.batch_size)]
    formed = [prep.rows for prep in backend.batches(first, None)]
    print(
        f"Padded prompt tokens per real one: {padding(lengths, formed):.3f} in batches by length, "
        f"{padding(lengths, given):.3f} in the order given"
    )

    # Where the wall time goes: one more cold pass, the device synchronised at each phase boundary.
    cold()
    backend.phases = {}
    t0 = time.perf_counter()
    for step in steps:
        backend.score_examples(step)
    wall = time.perf_counter() - t0
    phases, backend.phases = backend.phases, None
    phases["other"] = max(wall - sum(phases.values()), 0.0)
    print(f"Where the wall time goes ({wall:.2f} s, one pass synchronised at each phase boundary):")
    print("  " + ", ".join(f"{k} {v / wall:.0%}" for k, v in phases.items()))
    return {
        "token_ratio": ratio,
        "tokens": default["tokens"],
        "same_answers": same,
        "max_diff": diff,
        "agreement": agreement,
        "rates": {name: r["rate"] for name, r in results.items()},
        "prepared": prepared,
        "peaks": {name: r["peak"] for name, r in results.items()},
        "pictures": {"slots": len(slots), "distinct": len(set(slots))},
        "batch": {"prompts": backend.batch_size, "tokens": backend.batch_tokens},
        "encoded_per_sequence": c.get("vision_patches", 0) / len(examples),
        "phases": phases,
        "flops": {"lm": lm_rate, "vision": vision_rate, "matmul": measured, "datasheet": sheet, "device": name},
    }


def bench_run_sh() -> dict[str, float]:
    """`bash run.sh` on a fresh copy of this checkout (its tracked files, nothing cached): its wall time and each
    stage's seconds and share of its chain, from the runs/logs/seconds.tsv it writes."""
    import shutil
    import subprocess

    root = Path(__file__).resolve().parent
    files = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    with tempfile.TemporaryDirectory(prefix="icl-select-run-sh-") as tmp:
        for name in files:
            (Path(tmp) / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, Path(tmp) / name)
        start = time.perf_counter()
        subprocess.run(["bash", "run.sh"], cwd=tmp, check=True, capture_output=True)
        wall = time.perf_counter() - start
        rows = [line.split("\t") for line in (Path(tmp) / "runs/logs/seconds.tsv").read_text().splitlines()]
    seconds = {name: float(s) for name, s in rows}
    online = {"rce-stop", "online", "evaluate-online"}  # run.sh's online chain; the rest run beside it or before
    print(f"\nbash run.sh: {wall / 60:.1f} min wall on {os.cpu_count()} cores\n")
    print("| stage | seconds | share of its chain |\n|---|---|---|")
    for chain in (online, seconds.keys() - online):
        total = sum(seconds[n] for n in chain)
        for name in (n for n in seconds if n in chain):
            print(f"| {name} | {seconds[name]:.0f} | {100 * seconds[name] / total:.0f}% |")
    return seconds | {"wall": wall}


TINY_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "idefics3", "llava", "llava_next", "llava_onevision", "gemma3")


def bench_coco_sized(args: Args) -> dict:
    """bench_lvlm on 1,000 train pictures of 640 x 480 built in a temporary folder, with random weights in
    Qwen2.5-VL-3B-Instruct's shape in bfloat16 (random-3b: the GPU time of scoring without the checkpoint; a random
    model rarely stops before its 10 new tokens, so the rate is a floor) or the tiny Qwen with that checkpoint's image
    processing (tiny-3b-pixels: the CPU side of scoring at its real cost, beside a small model)."""
    from dataclasses import replace

    with tempfile.TemporaryDirectory(prefix="icl-select-bench-") as tmp:
        root = Path(tmp)
        vqa = tiny.build_okvqa_fixture(root / "okvqa", image_size=(640, 480), train_images=1000)
        if args.lvlm == "random-3b":
            folder = tiny.build_qwen2_5_vl_3b_shape(root / "qwen2.5-vl-3b-shape")
        else:
            folder = tiny.build_tiny_qwen_3b_pixels(root / "tiny-qwen-3b-pixels")
        return bench_lvlm(replace(args, lvlm=str(folder), vqa_root=vqa))


def bench_tiny_families(args: Args) -> dict:
    """bench_lvlm for the tiny checkpoint of every family tested here, built offline in a temporary folder."""
    from dataclasses import replace

    rows = {}
    with tempfile.TemporaryDirectory(prefix="icl-select-bench-") as tmp:
        vqa = tiny.build_okvqa_fixture(Path(tmp, "okvqa"), mixed=True)
        for family in TINY_FAMILIES:
            builder = "build_tiny_qwen" if family == "qwen2_5_vl" else f"build_tiny_{family}"
            folder = getattr(tiny, builder)(Path(tmp, family))
            rows[family] = bench_lvlm(replace(args, lvlm=str(folder), vqa_root=vqa, device="cpu"))
    print("\n| family | prompt tokens per sequence (shared) | fewer than unshared | same answers | max gt_prob diff |")
    print("|---|---|---|---|---|")
    for family, r in rows.items():
        print(f"| {family} | {r['tokens']:.1f} | {r['token_ratio']:.2f}x | {r['same_answers']} | {r['max_diff']:.1e} |")
    return rows


def main(args: Args) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.only in ("all", "log-probs"):
        bench_log_probs(args.repeats)
    if args.only in ("all", "epochs"):
        bench_epochs(args.data, args.repeats, args.thread_counts)
    if args.only in ("all", "decode"):
        bench_decode(args.repeats)
    if args.only in ("all", "grpo"):
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes]
        bench_grpo_epoch(args.repeats, shapes, args.reference_queries, args.grpo_epochs)
    if args.only in ("all", "sim"):
        bench_sim(args.repeats)
    if args.only == "library":
        bench_library(args.repeats, args.library_rows, args.library_pictures)
    if args.only == "pools":
        bench_pools(args.pool_rows, args.pool_queries, args.pool_samplers, args.repeats, args.pool_whole_rows)
    if args.only == "lvlm":
        bench_lvlm(args)
    if args.only == "run-sh":
        bench_run_sh()


if __name__ == "__main__":
    run_cli(main, Args)
