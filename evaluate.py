"""Stage 4: VQA accuracy (CIDEr-D for captions) at 1..4 shots of a selector run or a baseline, on the dataset's fixed
question order.

Each question's ICDs come from its own pool (eval_pools.json; with --split train the anchor's rl_data pool): a run's
selector decodes the largest shot greedily once and k-shot uses its first k picks, in the prompt order it was trained
with. Question counts are nested prefixes of one fixed order (800 contains 400), so compare.py pairs runs question by
question.

Writes RUN/eval/<split>.json (or <split>-epoch002.json with --epochs):
    {"data", "backend", "split", "selector", "selector_epoch", "selector_digest", "order", "shots", "num_samples",
     "results": [{"question_id", "row", "shot", "icds": [train rows], "prediction", "score"}, ...],  # question order
     "summary": {"800": {"1": 48.55, ...}, ...}}                                                    # percentages
With --seeds N > 1 (random baseline) a result holds the mean "score" and "per_seed": [{"seed", "icds",
"prediction", "score"}, ...] instead of one seed's icds and prediction. Progress is kept per question in
<file>.seedN.rankR.partial.jsonl, so an interrupted evaluation resumes; under torchrun each rank scores every
world-th question and rank 0 writes the file.

Usage:
    python evaluate.py runs/rce runs/grpo-kl0.1
    python evaluate.py runs/grpo-kl0.1 --epochs 1 2 3
    python evaluate.py --baseline random --seeds 3        # -> runs/baseline-random
    python evaluate.py --baseline image-sim               # most similar last, next to the query (RICES)
    python evaluate.py runs/rce --split train             # train/val gap
    torchrun --nproc-per-node 8 evaluate.py runs/grpo-kl0.1 --data data/okvqa-qwen3b   # questions split over GPUs
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Literal

import torch
import torch.nn.functional as F
import tyro
from torch import Tensor
from tqdm import tqdm

from icl_select import lineage, pools, sharding
from icl_select.backends import LVLMRun, check_lvlm_run, lvlm_identity, open_backend
from icl_select.cider import coco_cider
from icl_select.cli import CpuArgs, default_is, help_first, run_cli
from icl_select.data import DEFAULT_DATA, METRIC, TOP_SCORE, Dataset, data_digest, load_dataset
from icl_select.files import DataError, atomic_write_text, full_disk_names, read_json, selector_digest
from icl_select.locks import exclusive
from icl_select.runs import (
    check_selector,
    checkpoints,
    load_selector,
    lvlm_spent,
    lvlm_total,
    read_args,
    read_metrics,
    settings_file,
    unfinished,
)
from icl_select.tables import accuracy_table
from icl_select.validation import greedy_icds
from icl_select.vqa_data import check_images
from model import PointerSelector, reverse_picks

Baseline = Literal["zero-shot", "random", "image-sim", "text-sim", "mmices", "mmr", "coreset", "oracle", "observable"]
# Baselines that rank demonstrations by relevance to the query: the most relevant goes next to it (RICES' order).
RANKED = ("image-sim", "text-sim", "mmices", "mmr", "coreset")
VIEWS = {"image-sim": ("image",), "text-sim": ("text",), "mmices": ("image", "text"), "mmr": ("image",)}  # compared


@help_first("baseline", "data", "out", "lvlm")
@dataclass
class Args(LVLMRun, CpuArgs):
    runs: tyro.conf.Positional[list[Path]] = field(default_factory=list)
    """Run folders whose selector (model.safetensors) to evaluate."""
    baseline: Baseline | None = None
    """Evaluate a baseline instead (docs/rivals.md); oracle and observable need the simulator (docs/worlds.md)."""
    out: Annotated[Path | None, default_is("runs/baseline-<name>")] = None
    """Run folder for a baseline."""
    data: Path = DEFAULT_DATA
    """Dataset folder (its backend answers the questions)."""
    split: Literal["val", "train"] = "val"
    """val = the validation questions; train = the anchor queries (train/val gap)."""
    shots: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    """Shot counts to evaluate."""
    num_samples: list[int] = field(default_factory=lambda: [100, 200, 400, 800])
    """Question counts to summarise (nested prefixes of the fixed order)."""
    order: Literal["auto", "selected", "reversed"] = "auto"
    """ICD order in the prompt: selected (first pick first), reversed, or auto (docs/flags.md)."""
    epochs: list[int] = field(default_factory=list)
    """Also evaluate these epoch checkpoints of each run (eval/<split>-epochNNN.json)."""
    prefilter: int = 32
    """MMICES: the most image-similar candidates kept before the question reranks them."""
    mmr_lambda: float = 0.9
    """MMR: weight of relevance against redundancy (1 = RICES)."""
    seeds: int = 1
    """Random baseline: average over this many seeds."""
    seed: int = 0
    """Random baseline: first seed."""
    batch_size: int = 256
    """Questions per backend call (each one's line is flushed when its call returns)."""
    lvlm: Annotated[str | None, default_is("the dataset's own")] = None
    """Answer with this LVLM (HF id or path) instead of the dataset's (real datasets only)."""
    data_root: Path | None = None
    """Real data: where the dataset's files live now, if they moved since gen_rl_data.py."""


def check_args(args: Args) -> None:
    if bool(args.runs) == (args.baseline is not None):
        raise ValueError("give either run folders or --baseline NAME (not both, not neither)")
    if args.out is not None and args.runs:
        raise ValueError("--out is for baselines; a run's results go to RUN/eval/")
    if not args.shots or min(args.shots) < 1 or not args.num_samples or min(args.num_samples) < 1:
        raise ValueError("--shots and --num-samples must be positive")
    for flag, values in (("--shots", args.shots), ("--num-samples", args.num_samples)):
        if len(set(values)) < len(values):
            raise ValueError(f"{flag} {' '.join(map(str, values))} names {max(values, key=values.count)} twice")
    if args.seeds < 1 or args.batch_size < 1:
        raise ValueError("--seeds and --batch-size must be >= 1")
    if not 0 <= args.mmr_lambda <= 1:
        raise ValueError(f"--mmr-lambda must be in [0, 1], got {args.mmr_lambda}")
    if args.baseline == "mmices" and args.prefilter < max(args.shots):
        raise ValueError(f"--prefilter {args.prefilter} is smaller than the {max(args.shots)} demonstrations asked for")
    check_lvlm_run(args)
    for run in args.runs:
        if not (run / "model.safetensors").is_file():
            raise ValueError(f"{run}: no model.safetensors; is this a finished rce/grpo run?")
        have = list(checkpoints(run))
        for e in args.epochs:
            if e not in have:
                raise ValueError(
                    f"{run}: no checkpoint for epoch {e} (ckpt/epoch_{e:03d}.safetensors); it has epochs {have} "
                    "(training keeps every --keep-every-th epoch, the best and the last)"
                )


def questions(ds: Dataset, split: str, n: int) -> tuple[Tensor, Tensor, list[dict]]:
    """The first n questions of the fixed order: rows (n,), pools (n, K) train rows, items."""
    if split == "val":
        rows, pool = torch.arange(len(ds.items["val"])), ds.eval_pools
    else:
        rows, pool = ds.groups.queries, ds.groups.pools
    if n > len(rows):
        raise ValueError(f"--num-samples {n} exceeds the {len(rows)} {split} questions of {ds.folder}")
    return rows[:n], pool[:n], [ds.items[split][r] for r in rows[:n].tolist()]


def baseline_icds(
    args: Args, ds: Dataset, backend, split: str, rows: Tensor, pool: Tensor, k: int, seed: int, upto: bool = False
) -> list[Tensor]:
    """ICDs per shot (list over shots of (n, shot) train rows, selection order, -1 after the last of fewer) for a
    baseline; `upto`: a ceiling's best of 0..shot demonstrations."""
    shots = args.shots
    if args.baseline == "zero-shot":
        return [pool[:, :0] for _ in shots]
    if args.baseline in ("oracle", "observable"):
        # searched per shot count (the best 2 ICDs need not be a prefix of the best 4), already in prompt order; the
        # simulator rebuilt from meta.json searches its own world (a beam search where it is not additive)
        observable = args.baseline == "observable"
        lengths = range(k + 1) if upto else shots
        best = {j: backend.sim.oracle(split, rows, pool, j, observable=observable) for j in lengths}  # (n, j) each
        if not upto:
            return [best[s] for s in shots]
        # the best of 0..shot: by the search's own value of each length's best sequence (fewer on a tie)
        value = torch.stack([backend.sim.oracle_value(split, rows, best[j], observable) for j in lengths])  # (k+1, n)
        out = []
        for s in shots:
            j = value[: s + 1].argmax(0)  # (n,) the first maximum: the fewest demonstrations
            padded = torch.stack([F.pad(best[i], (0, s - i), value=-1) for i in range(s + 1)])  # (s+1, n, s)
            out.append(padded[j, torch.arange(len(rows))])  # (n, s)
        return out
    if args.baseline == "random":
        g = torch.Generator().manual_seed(seed)
        order = pools.random_sequences(pool >= 0, 1, k, g)[:, 0]  # (n, k)
        return [pool.gather(1, order[:, :s]) for s in shots]
    emb = {v: (ds.emb[f"{split}_{v}"][rows], ds.emb[f"train_{v}"]) for v in VIEWS.get(args.baseline, ())}
    if args.baseline == "coreset":  # clustered per shot count: the best 2 need not be a prefix of the best 4
        return [pool.gather(1, pools.coreset_order(ds.emb[split][rows], ds.emb["train"], pool, s)) for s in shots]
    if args.baseline == "mmices":
        order = pools.mmices_order(*emb["image"], *emb["text"], pool, k, args.prefilter)
    elif args.baseline == "mmr":
        order = pools.mmr_order(*emb["image"], pool, k, args.mmr_lambda)
    else:
        order = pools.pool_ranking(*next(iter(emb.values())), pool)[:, :k]
    icds = pool.gather(1, order)  # (n, k) train rows, pick order
    return [icds[:, :s] for s in shots]


def score_all(
    backend,
    split: str,
    rows: Tensor,
    icds_per_shot: list[Tensor],
    batch: int,
    desc: str,
    todo: list[int],
    path: Path,
    header: dict,
    known: dict[int, list[dict]] | None = None,
) -> tuple[dict[int, list[dict]], int, float]:
    """Score the questions `todo` at every shot, appending one line per question to this rank's partial file
    (which starts with `header`, the settings). A prompt `known` already answered (question index -> its shots, from the
    same selector's exactly-k evaluation) is not asked again. Returns what it wrote (question index -> its shots), the
    LVLM sequences asked and the seconds they took."""
    # the first shot count with the same picks (zero-shot's none at every count): each distinct prompt is asked once
    first = [next(t for t in range(s + 1) if torch.equal(icds_per_shot[t], x)) for s, x in enumerate(icds_per_shot)]
    known = known or {}
    bar = tqdm(total=len(todo), desc=desc, unit="question", dynamic_ncols=True)
    start, asked, shots = time.perf_counter(), 0, {}  # the bar's LVLM sequences a second; question -> its shots
    with full_disk_names(path), sharding.own_file(path, header) as f:
        for c in range(0, len(todo), batch):
            idx = todo[c : c + batch]
            shots |= {i: [] for i in idx}
            for s, icds in enumerate(icds_per_shot):
                if first[s] < s:
                    for i in idx:
                        shots[i].append(shots[i][first[s]])
                    continue
                picks = {i: [d for d in icds[i].tolist() if d >= 0] for i in idx}  # a selector that stopped: fewer
                ask = [i for i in idx if i not in known or known[i][s]["icds"] != picks[i]]
                said = {i: (known[i][s]["prediction"], known[i][s]["score"]) for i in idx if i not in ask}
                if ask:
                    res = backend.score(split, rows[ask], icds[ask], gt_prob=False)
                    said |= {i: (res["prediction"][j], round(float(res["acc"][j]), 6)) for j, i in enumerate(ask)}
                    asked += len(ask)
                for i in idx:
                    prediction, score = said[i]
                    shots[i].append({"icds": picks[i], "prediction": prediction, "score": score})
            for i in idx:
                f.write(json.dumps({"i": i, "shots": shots[i]}) + "\n")
            f.flush()
            bar.set_postfix(seq_per_s=f"{asked / (time.perf_counter() - start):.1f}", refresh=False)
            bar.update(len(idx))
    bar.close()
    return shots, asked, time.perf_counter() - start


def partial_path(target: Path, seed: int, rank: int | str) -> Path:
    """The progress file of one rank for one seed of an evaluation file (rank "*" as a glob pattern)."""
    return target.with_name(f"{target.name}.seed{seed}.rank{rank}.partial.jsonl")


def partial_files(target: Path, seed: int) -> list[Path]:
    return sorted(target.parent.glob(partial_path(target, seed, "*").name))


def read_partials(target: Path, seed: int, header: dict) -> dict[int, list[dict]]:
    """Questions already scored (question index -> its shots) by any rank, of this run or of an interrupted one with
    the same settings; a malformed record stops the run with one line (its file was edited or damaged)."""
    done, task = {}, header["task"]
    for i, r in sharding.done(partial_files(target, seed), "i", header).items():
        shots = r.get("shots")
        ok = 0 <= i < header["n"] and isinstance(shots, list) and len(shots) == len(header["shots"])
        for s in shots if ok else ():
            score = s.get("score") if isinstance(s, dict) else None
            ok &= isinstance(score, (int, float)) and not isinstance(score, bool) and 0 <= score <= TOP_SCORE[task]
            ok &= isinstance(s, dict) and isinstance(s.get("icds"), list) and isinstance(s.get("prediction"), str)
        if not ok:
            raise DataError(
                f"{partial_path(target, seed, '*')}: question {i} has a malformed record (expected 'shots': one "
                f"{{'icds', 'prediction', 'score' in [0, {TOP_SCORE[task]:g}]}} per shot); delete these progress files "
                "to redo them"
            )
        done[i] = shots
    return done


def keep_other_settings(target: Path, header: dict) -> None:
    """Never overwrite results made from other inputs or settings (compare.py pairs runs by their files), nor a file
    that is not an evaluation (written atomically, a finished one always parses): refuse instead. Other weights of
    the same run are evaluated anew (a run trained further)."""
    if not target.is_file():
        return
    old = read_json(target)
    if not isinstance(old, dict) or not isinstance(old.get("results"), list):
        raise DataError(
            f"{target}: not an evaluation file (expected an object with 'results'); it is kept: move it away"
        )
    now = header["made_from"]
    fix = "it is kept: evaluate with what made it, or move it away first"
    lineage.check(target, old.get("made_from"), now, fix, names=[k for k in now if k != "selector"])


def run_status(run: Path) -> str:
    """Which epoch a run's model.safetensors is and whether its training finished, from its own files."""
    if not (run / "metrics.jsonl").is_file():
        return "evaluating model.safetensors (no metrics.jsonl: its training history is unknown)"
    epochs = read_metrics(run / "metrics.jsonl")
    left = unfinished(epochs, read_args(run / "config.json") if (run / "config.json").is_file() else None)
    best = epochs[-1].get("best_epoch") if epochs else None
    done = f"UNFINISHED: {left}" if left else "finished"
    return f"evaluating model.safetensors = epoch {best} (the best on validation); training {done}"


@dataclass
class Job:
    """One evaluation file to write: a run's model or epoch checkpoint (`selector`, loaded as `model`: the weights
    of `epoch`, whose weights and settings have the digest `digest`: runs.selector_digest), or a baseline (no
    selector: those are None)."""

    target: Path
    selector: Path | None
    model: PointerSelector | None
    desc: str
    epoch: int | None = None
    digest: str | None = None
    lvlm_calls: int | None = 0  # LVLM prompts that built it (runs.lvlm_spent): 0 for a training-free baseline
    upto: bool = False  # up to k demonstrations: a selector that can stop, or a ceiling's best of 0..k


def plan(args: Args, ds: Dataset) -> list[Job]:
    """Every evaluation asked for, each selector loaded: a damaged one stops the command before any is written."""
    if args.baseline is not None:
        out = args.out or Path("runs") / f"baseline-{args.baseline}"
        if out.exists() and (out / "model.safetensors").exists():
            raise ValueError(f"{out} holds a trained selector; choose another --out for the baseline")
        ceiling = args.baseline in ("oracle", "observable")
        calls = None if ceiling else 0  # the ceilings read the hidden truth
        jobs = [Job(out / "eval" / f"{args.split}.json", None, None, args.baseline, lvlm_calls=calls)]
        if ceiling:  # and may choose fewer than k: the best of 0..k
            jobs.append(replace(jobs[0], target=out / "eval" / f"{args.split}-upto.json", upto=True))
        return jobs
    jobs = []
    for run in args.runs:
        # the epoch model.safetensors holds, as the run's last epoch record says (None without one)
        epochs = read_metrics(run / "metrics.jsonl") if (run / "metrics.jsonl").is_file() else []
        selected = epochs[-1].get("best_epoch") if epochs else None
        target, model, calls = run / "eval" / f"{args.split}.json", load_selector(run), lvlm_total(lvlm_spent(run))
        jobs.append(Job(target, run, model, str(run), selected, selector_digest(run), calls))
        if model.cfg.can_stop:  # its own choice of how many, beside exactly k
            upto = run / "eval" / f"{args.split}-upto.json"
            jobs.append(replace(jobs[-1], target=upto, desc=f"{run} (up to k)", upto=True))
        for e in args.epochs:
            ckpt = run / "ckpt" / f"epoch_{e:03d}.safetensors"
            target = run / "eval" / f"{args.split}-epoch{e:03d}.json"
            calls = lvlm_total(lvlm_spent(ckpt))
            jobs.append(Job(target, ckpt, load_selector(ckpt), f"{run} epoch {e}", e, selector_digest(ckpt), calls))
    return jobs


def job_header(args: Args, ds: Dataset, job: Job, digest: str, lvlm: str) -> dict:
    """The settings an evaluation file and its progress files are made with, and what it is made from (lineage.py:
    the dataset's content `digest`, the answering LVLM `lvlm`, the selector's weights, the flags): a progress file
    left by other inputs is started afresh, and a finished file of other inputs is never overwritten."""
    order = args.order
    if order == "auto":  # how the selector was trained to be read; RICES puts the most similar next to the query
        nearest = args.baseline in RANKED or (job.model is not None and job.model.cfg.pick_order == "nearest_first")
        order = "reversed" if nearest else "selected"
    seeds = list(range(args.seed, args.seed + args.seeds)) if args.baseline == "random" else [args.seed]
    settings = {
        "baseline": args.baseline,
        "upto": job.upto,
        "baseline_settings": {"mmices": {"prefilter": args.prefilter}, "mmr": {"lambda": args.mmr_lambda}}.get(
            args.baseline
        ),
        "split": args.split,
        "order": order,
        "n": max(args.num_samples),
        "num_samples": sorted(args.num_samples),
        "shots": args.shots,
        "seeds": seeds,
    }
    made_from = lineage.of_dataset(ds.meta, digest) | {"lvlm": lvlm, "selector": job.digest, "flags": settings}
    return {
        "made_from": made_from,
        "selector": str(job.selector),
        # which weights: compare.py flags the evaluation as stale once the run's model.safetensors is other weights
        "selector_epoch": job.epoch,
        "selector_digest": job.digest,
        "task": ds.meta["task"],
        **settings,
    }


def evaluate_job(
    args: Args, ds: Dataset, backend, job: Job, header: dict, known: dict | None = None
) -> tuple[dict | None, dict]:
    """Evaluate one run, checkpoint or baseline into job.target (its lock held by the caller); under torchrun every
    rank scores its share and rank 0 writes the file.
    -> the file's contents (None on ranks other than 0) and this rank's answers, seed -> question index -> its shots:
    the `known` answers of the up-to-k evaluation that follows, whose prompts are mostly the same."""
    rank, world = sharding.init()
    target, model, split, seeds, order = job.target, job.model, args.split, header["seeds"], header["order"]
    n, k = header["n"], max(args.shots)
    rows, pool, items = questions(ds, split, n)
    if rank == 0 and job.selector is not None and job.selector.is_dir():
        print(f"{job.selector}: {run_status(job.selector)}", flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    asked, seconds, answers = 0, 0.0, {}  # this process's LVLM sequences, the seconds they took, what it answered
    for seed in seeds:
        if model is not None:  # "up to k": a selector that can stop may use fewer; else exactly k
            picks = greedy_icds(model, ds, split, rows, pool, k, min_picks=0 if job.upto else k)
            icds = [picks[:, :s] for s in args.shots]
        else:
            icds = baseline_icds(args, ds, backend, split, rows, pool, k, seed, job.upto)
        if order == "reversed":
            icds = [reverse_picks(x) for x in icds]
        h = {**header, "seed": seed}
        done = read_partials(target, seed, h)
        path = partial_path(target, seed, rank)
        todo = [i for i in sharding.share(n, rank, world) if i not in done]
        bar = f"{job.desc} seed {seed}" if len(seeds) > 1 else job.desc
        wrote, n_asked, took = score_all(
            backend, split, rows, icds, args.batch_size, bar, todo, path, h, (known or {}).get(seed)
        )
        asked, seconds, answers[seed] = asked + n_asked, seconds + took, done | wrote
    sharding.barrier(world)
    if rank != 0:
        return None, answers
    per_seed = [read_partials(target, seed, {**header, "seed": seed}) for seed in seeds]
    if missing := [i for d in per_seed for i in range(n) if i not in d]:
        raise ValueError(f"{target}: {len(missing)} questions are still unscored; re-run the same command to finish")
    if ds.meta["task"] == "caption":
        corpus_cider(per_seed, items, len(args.shots))
    results = []
    for i, item in enumerate(items):
        for s, shot in enumerate(args.shots):
            picks = [{k: d[i][s][k] for k in ("icds", "prediction", "score")} for d in per_seed]
            score = round(sum(p["score"] for p in picks) / len(picks), 6)
            r = {"question_id": item["question_id"], "row": int(rows[i]), "shot": shot}
            # One seed: its picks and answer. Several (random baseline): every seed's, and the mean score, so no
            # prediction ever sits beside a score it did not get.
            multi = {"score": score, "per_seed": [{"seed": sd, **p} for sd, p in zip(seeds, picks)]}
            results.append(r | (picks[0] if len(picks) == 1 else multi))
    doc = {
        "data": str(ds.folder),  # where it was (compare.py's refresh command); what it was: made_from
        "backend": backend.describe()["lvlm"],
        "simulation": ds.is_sim,
        "backend_info": backend.describe(),
        "self_check": getattr(backend, "check", None),  # the real backend against plain transformers, before the run
        "lvlm_calls": job.lvlm_calls,  # what it cost to build the selector: data, validation and online scoring
        **({"lvlm_seq_per_s": round(asked / seconds, 3)} if asked and not ds.is_sim else {}),  # rank 0's speed
        **header,
        "results": results,
        # a caption's CIDEr-D depends on every question scored with it: compare.py scores other question sets anew
        **({"references": [it["answers"] for it in items]} if ds.meta["task"] == "caption" else {}),
        "summary": summarise(results, args.shots, args.num_samples),
        "demonstrations": demonstrations_used(results, args.shots, args.num_samples),
    }
    atomic_write_text(target, json.dumps(doc) + "\n")
    for seed in seeds:
        for path in partial_files(target, seed):
            path.unlink()
    return doc, answers


def corpus_cider(per_seed: list[dict[int, list[dict]]], items: list[dict], shots: int) -> None:
    """Each caption's score as pycocoevalcap's COCO evaluation gives it, in place: CIDEr-D with document frequencies
    over the references of the questions evaluated (the first n), per seed and shot. Scoring during data generation
    and training fixes them over the train split's references instead, so that a prompt's reward never depends on the
    others it is scored with (icl_select/cider.py); a smaller prefix of the n questions keeps the n's frequencies."""
    references = [it["answers"] for it in items]
    for done in per_seed:
        for s in range(shots):
            _, scores = coco_cider([done[i][s]["prediction"] for i in range(len(items))], references)
            for i, score in enumerate(scores.tolist()):
                done[i][s]["score"] = round(score, 6)


def summarise(results: list[dict], shots: list[int], num_samples: list[int]) -> dict:
    """{"n": {"shot": 100 * mean score over the first n questions}}."""
    by_shot = {s: [r["score"] for r in results if r["shot"] == s] for s in shots}
    return {str(n): {str(s): round(100 * sum(v[:n]) / n, 4) for s, v in by_shot.items()} for n in sorted(num_samples)}


def demonstrations_used(results: list[dict], shots: list[int], num_samples: list[int]) -> dict:
    """{"n": {"shot": mean demonstrations in the prompts of the first n questions}}: the shot count itself, unless a
    selector may stop (up to k) or the ceiling takes the best of 0..k."""
    used = {s: [len((r.get("per_seed") or [r])[0]["icds"]) for r in results if r["shot"] == s] for s in shots}
    return {str(n): {str(s): round(sum(v[:n]) / n, 4) for s, v in used.items()} for n in sorted(num_samples)}


def reroot_images(ds: Dataset, root: Path) -> None:
    """Point every item's image under `root`, keeping its path relative to the data root it was recorded with."""
    if "data_root" not in ds.meta:
        raise ValueError(f"--data-root: {ds.folder} is a simulated dataset; it has no files to relocate")
    old = Path(ds.meta["data_root"])
    for items in ds.items.values():
        for it in items:
            it["image"] = str(Path(root).resolve() / Path(it["image"]).relative_to(old))


def preflight(args: Args, ds: Dataset, jobs: list[Job]) -> None:
    """What can be checked before the LVLM loads: the baseline against the data, the question count, each selector
    against the data (task, encoder, width, picks), the shots against the pools, and on real data every image the
    evaluation may read, so a bad file stops the run at once with its name."""
    rows, pool, items = questions(ds, args.split, max(args.num_samples))
    k = max(args.shots)
    if args.baseline in ("oracle", "observable") and not ds.is_sim:
        raise ValueError(f"--baseline {args.baseline} needs the simulator (it searches the known answer model)")
    if ds.meta["task"] == "caption" and "text" in VIEWS.get(args.baseline, ()):
        raise ValueError(f"--baseline {args.baseline} compares questions; a picture to caption has none")
    for view in VIEWS.get(args.baseline, ()):
        if f"{args.split}_{view}" not in ds.emb:
            raise ValueError(f"{ds.folder}: no '{args.split}_{view}' embeddings for --baseline {args.baseline}")
    for job in (j for j in jobs if j.model is not None):
        check_selector(job.model, job.selector, lineage.reads(ds.meta), ds.folder, ds.emb[args.split].shape[1])
        if k > (picks := job.model.cfg.picks):
            raise ValueError(
                f"--shots {k}: this selector makes {picks} picks ({settings_file(job.selector)}: field 'picks', the "
                f"sequence length it is trained on); evaluate at most {picks} shots"
            )
    smallest = int((pool >= 0).sum(1).min())
    if args.baseline != "zero-shot" and k > smallest:
        raise ValueError(
            f"--shots {k}: the {args.split} pools of {ds.folder} hold {smallest} candidates, fewer than {k} "
            "demonstrations"
        )
    if ds.is_sim:
        return
    paths = [it["image"] for it in items]
    if args.baseline != "zero-shot":
        paths += [ds.items["train"][j]["image"] for j in pool[pool >= 0].tolist()]
    check_images(paths, f"that evaluating {max(args.num_samples)} {args.split} questions of {ds.folder} reads")


def main(args: Args) -> None:
    check_args(args)
    ds = load_dataset(args.data)
    if args.data_root is not None:
        reroot_images(ds, args.data_root)
    jobs = plan(args, ds)
    preflight(args, ds, jobs)
    lvlm, digest = lvlm_identity(ds.meta, args.lvlm), data_digest(ds.folder)
    headers = [job_header(args, ds, job, digest, lvlm) for job in jobs]
    for job, header in zip(jobs, headers):  # every file checked before a model loads or any file is written
        keep_other_settings(job.target, header)
    backend = open_backend(ds.meta, ds.items, ds.emb, args, args.lvlm)
    rank = sharding.init()[0]
    with contextlib.ExitStack() as locks:  # one writer per evaluation file
        for job in jobs:
            locks.enter_context(exclusive(job.target, rank))
        answers = {}  # the last job's: an up-to-k evaluation follows its selector's exactly-k one (`plan`)
        for job, header in zip(jobs, headers):
            doc, answers = evaluate_job(args, ds, backend, job, header, answers if job.upto else None)
            if doc is not None:  # rank 0 (or a single process)
                label = " (simulated LVLM)" if ds.is_sim else f" ({doc['backend']})"
                what = METRIC[ds.meta["task"]]
                print(f"\n{job.desc}: {args.split} {what}{label} -> {job.target}\n{accuracy_table(doc)}")
    sharding.finish(sharding.init()[1])


if __name__ == "__main__":
    run_cli(main, Args)
