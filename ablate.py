"""Ablations on the simulator: each variant against the stage defaults, on several seeds, with paired CIs.

Per simulated world (docs/worlds.md) and seed: a dataset, the default RCE and online GRPO runs, the variants (each
differs from its reference in the flags shown) and the baselines, evaluated on the same 800 validation questions.
Numbers are VQA accuracy (CIDEr-D in a captioning world) averaged over 1-4 shots and over each run's trainings
(--trainings, 2 by default), a delta's 95% CI a bootstrap that resamples seeds, then trainings, then the paired
questions (stats.Bootstrap); a share of a gap resamples the questions of every seed pooled. Runs are cached
in --out, so a re-run resumes; the last tables have one row per world: what each run takes, what each budget of LVLM
calls buys, the rivals, and the selectors that may stop.

Usage:
    python ablate.py                                  # seeds 0 1 2 -> runs/ablate/additive (about 40 min a seed)
    python ablate.py --seeds 3 --only online          # one more seed, one variant
    python ablate.py --worlds copy strong --only online "online, budget 35k"   # other worlds
    python ablate.py --seeds 3 --trainings 3 --only "online, budget 35k"    # each run trained three times
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
import zlib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Literal

import numpy as np
import torch

import evaluate
import gen_rl_data
import grpo
import rce
from icl_select import lineage
from icl_select.backends import LVLMRun
from icl_select.cli import run_cli, side_flags
from icl_select.data import METRIC, data_digest
from icl_select.files import atomic_write_text, read_json, selector_digest
from icl_select.runs import KERNELS, flag_values, git_sha, read_eval, read_metrics
from icl_select.sim import WORLDS
from icl_select.stats import Bootstrap, per_question
from icl_select.tables import md_table


def plain(**flags) -> tuple[str, dict, str]:
    """Online GRPO without replay or the item scores, with `flags`, against that run: the levers below were weighed on
    it, before either was the default."""
    return "grpo", {"online": True, "replay_steps": 0, "item_bias": False, **flags}, "online, no replay"


def budget(calls: int) -> tuple[str, dict, str]:
    """What `grpo.py --online --lvlm-budget <calls>` alone runs, against the offline run its warm start trains: what
    the calls buy over the warm start alone."""
    return "grpo", {"online": True, "lvlm_budget": calls}, "offline"


def on_budget(calls: int = 35_000, **flags) -> tuple[str, dict, str]:
    """What `grpo.py --online --lvlm-budget <calls>` alone runs (replay, the warm start, the item scores), with
    `flags`, against it."""
    return "grpo", {"online": True, "lvlm_budget": calls} | flags, f"online, budget {calls // 1000}k"


def before_items(calls: int = 35_000, **flags) -> tuple[str, dict, str]:
    """What `grpo.py --online --lvlm-budget <calls>` ran before the item scores were its default (replay, the warm
    start), with `flags`, against it: the levers judged in every world (docs/worlds.md) before then."""
    flags = {"online": True, "lvlm_budget": calls, "item_bias": False} | flags
    return "grpo", flags, f"online, budget {calls // 1000}k, no item bias"


BUDGET = before_items(warm_start=False)[1]  # 35k LVLM calls as they ran before the warm start was a budget's default


def cold(**flags) -> tuple[str, dict, str]:
    """Online GRPO on a budget of 35k LVLM calls without the warm start, with `flags`, against that run alone: the
    levers below were weighed on it, before the warm start was the default."""
    return "grpo", BUDGET | flags, "online, budget 35k, replay 4 steps"


def no_replay(**flags) -> tuple[str, dict, str]:
    """Online GRPO on a budget of 35k LVLM calls without replay or warm start, with `flags`, against that run alone."""
    return "grpo", BUDGET | {"replay_steps": 0} | flags, "online, budget 35k, no replay"


# Datasets of other recipes than the seed's own: Lever-LM's InfoScore beams over each anchor's pool as published
# (5,000 anchors, beam 5, 2-shot sequences; docs/rivals.md) and cut to about 35k LVLM calls (90 anchors of 386 calls
# each).
DATASETS = {
    "infoscore": {"groups": "infoscore", "group_size": 5, "seq_len": 2, "num_queries": 5000},
    "infoscore, 35k calls": {"groups": "infoscore", "group_size": 5, "seq_len": 2, "num_queries": 90},
}
# ICD-LM's cross-entropy on Lever-LM's data, asked for 4 picks; its first pick next to the query (weighed on seeds 0-1
# against the prompt order ICD-LM generates in: "lever-lm, as published")
LEVER_LM = {"data": "infoscore", "weights": "uniform", "quality": "all", "pick_order": "nearest_first", "picks": 4}
STOPS = {"init": "rce, can stop"}  # GRPO of a selector that may stop


def rival(baseline: str, **flags) -> tuple[str, dict, str]:
    """A training-free rival with other settings than its default, against it."""
    return "baseline", {"baseline": baseline, **flags}, baseline


# name -> (stage, flags, reference). GRPO variants start from the default RCE run of their seed unless they name
# another init; a "data" flag names the DATASETS recipe a run trains on (it is evaluated on the seed's own dataset).
VARIANTS: dict[str, tuple[str, dict, str | None]] = {
    "rce": ("rce", {}, None),
    "retriever": ("rce", {"retriever": True}, "rce"),
    "retriever, best-sequence credit": ("rce", {"retriever": True, "credit": "best"}, "retriever"),
    "lever-lm": ("rce", LEVER_LM, "rce"),
    "lever-lm, as published": ("rce", LEVER_LM | {"pick_order": "prompt"}, "lever-lm"),
    "lever-lm, 35k calls": ("rce", LEVER_LM | {"data": "infoscore, 35k calls"}, "lever-lm"),
    "rce, can stop": ("rce", {"can_stop": True}, "rce"),
    "mmices, prefilter 8": rival("mmices", prefilter=8),
    "mmices, prefilter 16": rival("mmices", prefilter=16),
    "mmr, lambda 0.25": rival("mmr", mmr_lambda=0.25),
    "mmr, lambda 0.5": rival("mmr", mmr_lambda=0.5),
    "mmr, lambda 0.75": rival("mmr", mmr_lambda=0.75),
    "rce, all groups (Lever-Plus)": ("rce", {"quality": "all"}, "rce"),
    "rce, picks in prompt order": ("rce", {"pick_order": "prompt"}, "rce"),
    "online": ("grpo", {"online": True}, None),
    "online, no item bias": ("grpo", {"online": True, "item_bias": False}, "online"),  # the default before the scores
    "online, no replay": (*plain()[:2], "online, no item bias"),
    "online, beta 0.1": plain(kl_beta=0.1),
    "online, beta 0": plain(kl_beta=0.0),
    "online, cosine lr decay": plain(lr_schedule="cosine"),
    "online, lr 1e-4": plain(lr=1e-4),
    "online, 10 epochs": plain(epochs=10),
    "online, reward hard_plus_soft": plain(reward_mode="hard_plus_soft"),
    "online, anchor queries only": plain(queries="anchors"),
    "online, temperature 0.5": plain(temperature=0.5),
    "online, 2 iterations per batch": plain(num_iterations=2),
    "online, group size 8": plain(group_size=8),
    "online, group size 32": plain(group_size=32),
    "online, picks in prompt order": plain(init="rce, picks in prompt order"),
    "offline": ("grpo", {}, "online"),
    "online, can stop": ("grpo", {"online": True, **STOPS}, "online"),
    "online, budget 35k, can stop": ("grpo", {"online": True, "lvlm_budget": 35_000, **STOPS}, "online, budget 35k"),
    "online, budget 35k, from the retriever": on_budget(init="retriever"),
    "online, budget 35k, no replay": (*no_replay()[:2], "online"),
    "online, budget 35k, replay 4 steps": (*cold()[:2], "online, budget 35k, no replay"),
    # what `grpo.py --online --lvlm-budget 35000` ran before the item scores: replay, and the warm start
    "online, budget 35k, no item bias": (*before_items()[:2], "online, budget 35k, replay 4 steps"),
    # what it runs: the item scores on top
    "online, budget 35k": (*on_budget()[:2], "online, budget 35k, no item bias"),
    "online, budget 35k, no warm start": on_budget(warm_start=False),
    "online, budget 35k, best epoch": on_budget(select_epoch="best"),
    "online, budget 5k, lr 2e-3": on_budget(5_000, lr=2e-3),
    "online, budget 10k, lr 2e-3": on_budget(10_000, lr=2e-3),
    "online, budget 35k, lr 2e-3": on_budget(lr=2e-3),
    "online, budget 100k, lr 2e-3": on_budget(100_000, lr=2e-3),
    "online, budget 35k + batch 16": before_items(batch_size=16),
    "online, budget 35k + 2 iterations per batch": before_items(num_iterations=2),
    "online, budget 35k + replay 8 steps": before_items(replay_steps=8),
    "online, budget 35k + lr 2e-3": before_items(lr=2e-3),
    "online, budget 35k + beta 0.1": before_items(kl_beta=0.1),
    "online, budget 35k + temperature 1.5": before_items(temperature=1.5),
    "online, budget 5k": budget(5_000),
    "online, budget 10k": budget(10_000),
    "online, budget 100k": budget(100_000),
    "online, budget 5k, no item bias": (*before_items(5_000)[:2], "online, budget 5k"),
    "online, budget 10k, no item bias": (*before_items(10_000)[:2], "online, budget 10k"),
    "online, budget 100k, no item bias": (*before_items(100_000)[:2], "online, budget 100k"),
    "online, budget 5k + beta 0.1": before_items(5_000, kl_beta=0.1),
    "online, budget 10k + beta 0.1": before_items(10_000, kl_beta=0.1),
    "online, budget 100k + beta 0.1": before_items(100_000, kl_beta=0.1),
    "online, budget 35k, lr 3e-3 linear decay": no_replay(lr=3e-3, lr_schedule="linear"),
    "online, budget 35k, 4 iterations per batch": no_replay(num_iterations=4),
    "online, budget 35k, groups of 8 x 64 queries": no_replay(group_size=8, batch_size=64),
    "online, budget 35k, beta 0.1": no_replay(kl_beta=0.1),
    "online, budget 35k, from offline GRPO": no_replay(init="offline"),
    "online, budget 35k, replay 2 steps": no_replay(replay_steps=2),
    "online, budget 35k, replay 8 steps": no_replay(replay_steps=8),
    "online, budget 35k, replay 4 steps, lr 2e-3": cold(lr=2e-3),
    "online, budget 35k, replay 4 steps, rewards scaled by the batch std": cold(scale_rewards="batch"),
    "online, budget 35k, replay 4 steps, one epoch": cold(epochs=1),
    "online, budget 35k, replay 4 steps, beta 0.1": cold(kl_beta=0.1),
    "online, budget 35k, replay 4 steps, batch 16": cold(batch_size=16),
    "online, budget 35k, replay 4 steps, groups of 32 x 16 queries": cold(group_size=32, batch_size=16),
    "online, budget 35k, replay 4 steps, rank advantage": cold(rank_advantage=True),
    "online, budget 35k, replay 4 steps, temperature 1.5": cold(temperature=1.5),
    "online, budget 35k, replay 4 steps, frozen backbone": cold(freeze_backbone=True),
    "online, budget 35k, beta 1": no_replay(kl_beta=1.0),
    "online, budget 35k, replay 4 steps, beta 1": cold(kl_beta=1.0),
    "online, budget 35k, replay 4 steps, groups of 8 x 64 queries": cold(group_size=8, batch_size=64),
}
BASELINES = ("zero-shot", "random", "image-sim", "text-sim", "mmices", "mmr", "coreset", "oracle", "observable")
CAPTION_BASELINES = tuple(b for b in BASELINES if b not in ("text-sim", "mmices"))  # a picture to caption: no question
CAPTIONING = {"caption": "base", "caption-instruct": "instruct"}  # --worlds names of the captioning worlds


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """Simulator seeds (each builds its own dataset)."""
    worlds: list[Literal[tuple(WORLDS) + tuple(CAPTIONING)]] = field(default_factory=lambda: ["additive"])  # type: ignore[valid-type]
    """Simulated worlds (gen_rl_data.py --world), each with its own datasets."""
    out: Path = Path("runs/ablate")
    """Folder of the cached datasets and runs (one subfolder per world)."""
    only: list[str] = field(default_factory=list)
    """Train only these variants and their references (none: all); tables show what is finished."""
    references: bool = True
    """Also train each variant's reference, for its delta (an --init is trained either way)."""
    bootstrap: int = 10000
    """Bootstrap resamples for the CIs."""
    how_many: Path | None = None
    """Also draw how many demonstrations the 35k-call selector that may stop gives against what they are worth (PNG)."""
    judge: bool = False
    """Judge the defaults as they stand: --seeds from the reserved block of docs/seeds.json, unused, in every world,
    the recipes run.sh and the README give (JUDGED); writes docs/judged.json and docs/results.md, and records the
    seeds in docs/seeds.json."""
    trainings: int = 2
    """Train each variant this many times on the same data and init (training seeds seed, seed + 1000, ...; the n-th
    in <run>--training-n): a delta is of the trainings' mean, its CI resampling seeds, then trainings, then questions
    (two trainings of one recipe differ at 4 shots by a point or more). Tables show the spread."""


def slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in ".-" else "-" for c in name).strip("-")


def quietly(fn, *a):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return fn(*a)


def sim_args(world: str) -> dict:
    """gen_rl_data.py's flags for a world: a VQA world, or a captioning one (CAPTIONING)."""
    return {"task": "caption", "world": CAPTIONING[world]} if world in CAPTIONING else {"world": world}


# The n-th training of a variant (--trainings) uses training seed seed + (n - 1) * TRAINING_SEEDS.
TRAINING_SEEDS = 1000


def folders(args: Args, name: str) -> list[str]:
    """A run's folders in its seed's: one for a baseline or a training-free rival, one per training otherwise."""
    first = slug(name)
    if name not in VARIANTS or VARIANTS[name][0] == "baseline":
        return [first]
    return [first, *[f"{first}--training-{n}" for n in range(2, args.trainings + 1)]]


def build(args: Args, world: str, seed: int, names: list[str]) -> None:
    """Train and evaluate what is missing for one seed of one world."""
    root = args.out / world / f"seed{seed}"
    data = root / "data"
    if not (data / "meta.json").is_file() or not read_json(data / "meta.json")["complete"]:
        quietly(gen_rl_data.generate, gen_rl_data.Args(out=data, seed=seed, **sim_args(world)))
    for b in BASELINES if world not in CAPTIONING else CAPTION_BASELINES:
        if not evaluated(root / b, data):
            quietly(evaluate.main, evaluate.Args(data=data, baseline=b, out=root / b, num_samples=[800]))
    for name in names:
        stage, flags, _ = VARIANTS[name]
        if stage == "baseline":
            run = root / slug(name)
            if not evaluated(run, data):
                quietly(evaluate.main, evaluate.Args(data=data, out=run, num_samples=[800], **flags))
            continue
        for n, folder in enumerate(folders(args, name)):
            train(root, world, seed, name, root / folder, seed + n * TRAINING_SEEDS)


def train(root: Path, world: str, seed: int, name: str, run: Path, training_seed: int) -> None:
    """Train and evaluate one training of a variant into `run`, unless it is there (made with the same flags). A GRPO
    variant starts from the first training of its init."""
    stage, flags, _ = VARIANTS[name]
    data = root / "data"
    common = {"data": data, "out": run, "seed": training_seed}
    if "data" in flags:  # trained on a dataset of its own recipe, evaluated on the seed's
        recipe, flags = flags["data"], {k: v for k, v in flags.items() if k != "data"}
        common["data"] = root / f"data-{slug(recipe)}"
        if not (common["data"] / "meta.json").is_file() or not read_json(common["data"] / "meta.json")["complete"]:
            gen = gen_rl_data.Args(out=common["data"], seed=seed, **sim_args(world), **DATASETS[recipe])
            quietly(gen_rl_data.generate, gen)
    if stage == "rce":
        run_args = rce.Args(**common, **flags)
    else:
        run_args = grpo.resolve(grpo.Args(**common, **{**flags, "init": root / slug(flags.get("init", "rce"))}))
    if (run / "config.json").is_file():  # a cached run must have been made with exactly these flags and data
        config = read_json(run / "config.json")
        now = flag_values(run_args)
        planned = ("epochs",) if now.get("lvlm_budget") and now["epochs"] is None else ()  # grpo plans them
        side = (*side_flags(type(run_args)), *(f.name for f in fields(LVLMRun)))  # the real LVLM's: moot here
        if diff := sorted(k for k in now if k not in ("out", *side, *planned) and now[k] != config["args"].get(k)):
            raise ValueError(f"{run} was made with other flags ({', '.join(diff)}): delete it to rebuild it")
        made = {"data": data_digest(common["data"])}
        lineage.check(run / "config.json", config.get("made_from"), made, "delete it to rebuild it", list(made))
    if evaluated(run, data):
        return
    start = time.perf_counter()
    quietly(rce.main if stage == "rce" else grpo.main, run_args)
    quietly(evaluate.main, evaluate.Args(data=data, runs=[run], num_samples=[800]))
    again = run.name.removeprefix(slug(name)).replace("--", ", ")  # ", training-2" for a second training
    print(f"{world} seed {seed}: {name}{again} ({time.perf_counter() - start:.0f} s)", flush=True)


def evaluated(run: Path, data: Path) -> bool:
    """Whether `run` holds its evaluation on `data` as the folder is now (and of the weights the run holds now): the
    cache is used only where it is what this command would make; one made from other inputs is refused."""
    path = run / "eval" / "val.json"
    if not path.is_file():
        return False
    now = {"data": data_digest(data)}
    if (run / "model.safetensors").is_file():
        now["selector"] = selector_digest(run)
    lineage.check(path, read_eval(path)["made_from"], now, "delete it to make it again", list(now))
    return True


def order(names: list[str], references: bool = True) -> list[str]:
    """The variants to train, each after what it starts from (and its reference, with `references`)."""
    need = set(names)
    for name in names:
        stage, flags, ref = VARIANTS[name]
        need |= {stage == "grpo" and "rce", references and ref, flags.get("init")} - {None, False, *BASELINES}
    return [n for n in VARIANTS if n in need]


UPTO = " (up to k)"  # a run's "up to k" evaluation, as compare.py names it


class Per(dict):
    """A run's score per question, the mean over its trainings (keyed by question, or by (seed, question) pooled over
    seeds), and each training's own: `by_seed` {seed: [question -> score, one dict a training]}, which `delta`
    resamples seeds, then trainings, then questions from."""

    def __init__(self, means: dict, by_seed: dict[int, list[dict]]):
        super().__init__(means)
        self.by_seed = by_seed


def scores(
    args: Args, world: str, seed: int, name: str, shots: list[int] | None = None, training: int | None = None
) -> Per | None:
    """Each question's accuracy averaged over `shots` (default 1-4) in a run's evaluation, and over its trainings
    (only the `training`-th, counted from 0, if given); None until each has been evaluated. "<run> (up to k)" reads
    eval/val-upto.json."""
    run, upto = (name.removesuffix(UPTO), True) if name.endswith(UPTO) else (name, False)
    names = folders(args, run) if training is None else folders(args, run)[training : training + 1]
    paths = [args.out / world / f"seed{seed}" / f / "eval" / ("val-upto.json" if upto else "val.json") for f in names]
    if not paths or not all(p.is_file() for p in paths):
        return None
    each = [per_question(read_eval(p), 800, shots) for p in paths]
    return Per({q: float(np.mean([e[q] for e in each])) for q in each[0]}, {seed: each})


def pool_seeds(per_seed: dict[int, Per]) -> Per:
    """Scores of several seeds as one, keyed by (seed, question)."""
    means = {(s, q): v for s, d in per_seed.items() for q, v in d.items()}
    return Per(means, {s: t for d in per_seed.values() for s, t in d.by_seed.items()})


def figure_rng(*key) -> np.random.Generator:
    """A bootstrap's own generator, seeded by what the figure measures: it comes out the same whichever other
    variants, seeds or worlds a command asks for."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def delta(pairs: list[tuple[Per, Per]], resamples: int, *key) -> str:
    """Mean of b - a over the seeds of every (a, b) pair and their common questions, with a 95% CI that resamples
    seeds, then each side's trainings, then questions (`stats.Bootstrap`): a seed or a training that came out high or
    low widens it as a question does."""
    point, lo, hi = Bootstrap(resamples, figure_rng("delta", *key)).ci([x for a, b in pairs for x in nested(a, b)])
    return f"{100 * point:+.2f} [{100 * lo:+.2f}, {100 * hi:+.2f}]"


def share(a: Per, b: Per, top: Per, resamples: int, *key) -> str:
    """b's share of the a -> top gap over the seeds all three ran, its CI resampling seeds, then trainings, then
    questions."""
    s, lo, hi = Bootstrap(resamples, figure_rng("share", *key)).share(nested(a, b, top))
    return f"{100 * s:.0f}% [{100 * lo:.0f}, {100 * hi:.0f}]"


def nested(*runs: Per) -> list[tuple[np.ndarray, ...]]:
    """Per seed every run has, each run's (trainings, questions) scores on the questions all their trainings share."""
    out = []
    for seed in sorted(set.intersection(*(set(r.by_seed) for r in runs))):
        trainings = [r.by_seed[seed] for r in runs]
        common = [q for q in trainings[0][0] if all(q in t for side in trainings for t in side)]
        out.append(tuple(np.array([[t[q] for q in common] for t in side]) for side in trainings))
    return out


def tables(args: Args, world: str) -> str:
    seeds = args.seeds
    got = {(s, n): scores(args, world, s, n) for s in seeds for n in [*VARIANTS, *BASELINES]}

    def acc(s, n):
        return f"{100 * np.mean(list(got[s, n].values())):.2f}" if got[s, n] else "-"

    head = ["run", *[f"seed {s}" for s in seeds]]
    rows = [[n, *[acc(s, n) for s in seeds]] for n in [*BASELINES, *VARIANTS] if any(got[s, n] for s in seeds)]
    metric = METRIC["caption" if world in CAPTIONING else "vqa"]
    out = [f"## World {world}", "", f"{metric}, mean over 1-4 shots, 800 validation questions", ""]
    out += [md_table(head, rows), ""]
    rows = []
    for name, (_, _, ref) in VARIANTS.items():
        pairs = {s: (got[s, ref], got[s, name]) for s in seeds if ref and got[s, ref] and got[s, name]}
        if pairs:
            cells = [delta([pairs[s]], args.bootstrap, world, name, ref, s) if s in pairs else "-" for s in seeds]
            pooled = delta(list(pairs.values()), args.bootstrap, world, name, ref, *pairs) if len(pairs) > 1 else "-"
            rows.append([name, ref, *cells, pooled])
    if rows:
        head = ["variant", "against", *[f"seed {s}" for s in seeds], "pooled over seeds"]
        out += ["Deltas (points) with paired bootstrap 95% CIs", "", md_table(head, rows), ""]
    if args.trainings > 1:
        out += [training_spread(args, world)]
    rows = []
    for s in seeds:
        r, o, img = got[s, "rce"], got[s, "online"], got[s, "image-sim"]
        if r and o and img and got[s, "oracle"] and got[s, "observable"]:
            rows.append(
                [
                    str(s),
                    delta([(img, r)], args.bootstrap, world, "rce", "image-sim", s),
                    share(r, o, got[s, "oracle"], args.bootstrap, world, "online", "oracle", s),
                    share(r, o, got[s, "observable"], args.bootstrap, world, "online", "observable", s),
                ]
            )
    if rows:
        head = ["seed", "rce - image-sim", "online: share of rce->oracle gap", "online: share of rce->observable gap"]
        out += ["Targets", "", md_table(head, rows), ""]
    rows = []
    for name, (_, flags, _) in VARIANTS.items():  # what each budget buys, against what the full default run takes
        done = [s for s in seeds if all(got[s, n] for n in (name, "rce", "oracle"))]
        if (name == "online" or "lvlm_budget" in flags) and done:
            cells = [
                f"{share(got[s, 'rce'], got[s, name], got[s, 'oracle'], args.bootstrap, world, name, 'oracle', s)} "
                f"({calls(args, world, s, name):,})"
                if s in done
                else "-"
                for s in seeds
            ]
            pooled = [pool_seeds({s: got[s, n] for s in done}) for n in ("rce", name, "oracle")]
            whole = share(*pooled, args.bootstrap, world, name, "oracle", *done) if len(done) > 1 else "-"
            rows.append([name, *cells, whole])
    if rows:
        head = ["run", *[f"seed {s}" for s in seeds], "pooled over seeds"]
        out += ["Share of the rce->oracle gap (LVLM calls)", "", md_table(head, rows), ""]
    return "\n".join(out)


def training_spread(args: Args, world: str) -> str:
    """Each later training of a variant minus its first (same data, init and flags; another training seed), per seed
    and pooled: how far a recipe's own run-to-run noise moves it."""
    rows = []
    for name in [n for n in VARIANTS if len(folders(args, n)) > 1]:
        for n in range(1, args.trainings):
            cells, pooled, at4 = [], [], []
            for s in args.seeds:
                a, b = (scores(args, world, s, name, None, t) for t in (0, n))
                a4, b4 = (scores(args, world, s, name, [4], t) for t in (0, n))
                cells.append(delta([(a, b)], args.bootstrap, world, name, n, s) if a and b else "-")
                pooled += [(a, b)] if a and b else []
                at4 += [(a4, b4)] if a4 and b4 else []
            if pooled:
                key = (world, name, n, *args.seeds)
                rows.append(
                    [
                        f"{name}: training {n + 1} - 1",
                        *cells,
                        delta(pooled, args.bootstrap, *key),
                        delta(at4, args.bootstrap, 4, *key) if at4 else "-",
                    ]
                )
    if not rows:
        return ""
    head = ["run", *[f"seed {s}" for s in args.seeds], "pooled over seeds", "pooled, at 4 shots"]
    return "\n".join(
        ["Trainings of one recipe (another training seed, same data and init)", "", md_table(head, rows), ""]
    )


def calls(args: Args, world: str, seed: int, name: str) -> int:
    """The LVLM calls a run spent, validation included."""
    return read_metrics(args.out / world / f"seed{seed}" / slug(name) / "metrics.jsonl")[-1]["lvlm/calls"]


def started(args: Args, names) -> list[str]:
    """The runs of `names` that have a folder in some world and seed of `args`, in their order."""
    return [
        n for n in names if any((args.out / w / f"seed{s}" / slug(n)).is_dir() for w in args.worlds for s in args.seeds)
    ]


def over_seeds(args: Args, world: str, names) -> tuple[dict, dict]:
    """Each run's per-question scores on every seed (None where it has not run) and pooled over the seeds, keyed by
    (seed, question)."""
    got = {n: [scores(args, world, s, n) for s in args.seeds] for n in names}
    return got, {n: pool_seeds({s: d for s, d in zip(args.seeds, got[n]) if d}) for n in got}


# The worlds table: what each run takes in every world, pooled over seeds.
WORLD_RUNS = ("zero-shot", "random", "image-sim", "rce", "offline", "online", "online, budget 35k")
SHARES = (
    "offline",
    "online",
    "online, no item bias",
    "online, no replay",
    "online, budget 35k",
    "online, budget 35k, no item bias",
    "online, budget 35k, no warm start",
    "online, budget 35k, best epoch",
)


def worlds_table(args: Args) -> str:
    """One row per world: mean accuracy of each run over the seeds, the rce->oracle gap and each GRPO run's share of
    it (pooled over the questions of all seeds, paired bootstrap 95% CI)."""
    runs = [*WORLD_RUNS, "observable", "oracle"]
    shares = started(args, SHARES)
    rows = []
    for world in args.worlds:
        got, pooled = over_seeds(args, world, {*runs, *shares})
        mean = {n: f"{100 * np.mean(list(pooled[n].values())):.2f}" if all(got[n]) else "-" for n in got}
        row = [world, *[mean[n] for n in runs]]
        if all(got["rce"]) and all(got["oracle"]):
            row.append(
                f"{100 * (np.mean(list(pooled['oracle'].values())) - np.mean(list(pooled['rce'].values()))):.2f}"
            )
            row += [
                share(pooled["rce"], pooled[n], pooled["oracle"], args.bootstrap, world, n, "oracle", *args.seeds)
                if all(got[n])
                else "-"
                for n in shares
            ]
        rows.append(row + ["-"] * (len(runs) + 2 + len(shares) - len(row)))
    head = ["world", *runs, "gap rce->oracle", *[f"share: {n}" for n in shares]]
    seeds = " ".join(map(str, args.seeds))
    return "\n".join([f"## Every world, seeds {seeds} pooled", "", md_table(head, rows), ""])


# What a budget of LVLM calls buys, from none (offline GRPO asks only for its validations) to the full default run.
BUDGET_RUNS = (
    "offline",
    "online, budget 5k",
    "online, budget 10k",
    "online, budget 35k",
    "online, budget 100k",
    "online",
)


def budget_table(args: Args) -> str:
    """One row per world: each budget's share of the rce->oracle gap pooled over the seeds (paired bootstrap 95% CI)
    and the LVLM calls it spent, the mean over the seeds; empty until a budget other than 35k has run."""
    found = started(args, BUDGET_RUNS)
    if not {*found} - {"offline", "online, budget 35k", "online"}:
        return ""
    rows = []
    for world in args.worlds:
        got, pooled = over_seeds(args, world, {"rce", "oracle", *found})
        row = [world]
        for n in found:
            if not (all(got[n]) and all(got["rce"]) and all(got["oracle"])):
                row.append("-")
                continue
            spent = np.mean([calls(args, world, s, n) for s in args.seeds])
            gap = share(pooled["rce"], pooled[n], pooled["oracle"], args.bootstrap, world, n, "oracle", *args.seeds)
            row.append(f"{gap} ({spent / 1000:.1f}k)")
        rows.append(row)
    seeds = " ".join(map(str, args.seeds))
    head = ["world", *found]
    return "\n".join([f"## What a budget buys, seeds {seeds} pooled", "", md_table(head, rows), ""])


# The rivals (docs/rivals.md): training-free, then trained on LVLM calls of their own
TRAINING_FREE = ("random", "image-sim", "text-sim", "mmices", "mmr", "coreset")
CAPTION_TRAINING_FREE = tuple(b for b in TRAINING_FREE if b in CAPTION_BASELINES)
RIVALS = (*TRAINING_FREE, "retriever", "lever-lm", "lever-lm, 35k calls")
KIT = ("offline", "online, budget 35k", "online, budget 35k, from the retriever", "online")  # fewest calls first


def rivals_table(args: Args) -> str:
    """Per world, pooled over the seeds: each rival's and the kit's accuracy (mean over 1-4 shots) with the LVLM calls
    that built it (the mean over the seeds), then each of the kit's GRPO runs against the strongest rival and offline
    GRPO against the retriever at equal calls (paired bootstrap 95% CIs); empty until the rivals have run."""
    found = [r for r in (rivals_rows(args, w) for w in args.worlds) if r is not None]
    if not found:
        return ""
    head = ["world", "best training-free", "retriever", "Lever-LM", "Lever-LM, 35k", "RCE", *KIT]
    head2 = ["world", "strongest rival", *[f"{n} - it" for n in KIT], "offline - retriever (equal calls)"]
    seeds = " ".join(map(str, args.seeds))
    return "\n".join(
        [
            f"## The rivals, seeds {seeds} pooled",
            "",
            "VQA accuracy % (CIDEr-D x100 in a captioning world), mean over 1-4 shots; in brackets the LVLM calls that "
            "built the run, its data included.",
            "",
            md_table(head, [a for a, _ in found]),
            "",
            md_table(head2, [b for _, b in found]),
            "",
        ]
    )


def rivals_rows(args: Args, world: str) -> tuple[list[str], list[str]] | None:
    """`rivals_table`'s two rows of one world, None until its rivals and the kit's runs have all finished."""
    got, pooled = over_seeds(args, world, {*RIVALS, "rce", *KIT})
    done = [n for n in (*RIVALS, "rce", *KIT) if all(got[n])]
    if not {"retriever", "lever-lm", "offline", "online"} <= set(done):
        return None
    mean = {n: float(np.mean(list(pooled[n].values()))) for n in done}

    def cell(n: str) -> str:
        if n not in done:
            return "-"
        calls = np.mean([spent(args, world, s, n) for s in args.seeds])
        return f"{100 * mean[n]:.2f}" + ("" if n in TRAINING_FREE else f" ({calls / 1e3:.0f}k)")

    free = max((n for n in TRAINING_FREE if n in done), key=mean.get)
    rival = max((n for n in RIVALS if n in done), key=mean.get)
    pairs = [
        delta([(pooled[rival], pooled[n])], args.bootstrap, world, n, rival, *args.seeds) if n in done else "-"
        for n in KIT
    ]
    equal = delta(
        [(pooled["retriever"], pooled["offline"])], args.bootstrap, world, "offline", "retriever", *args.seeds
    )
    return [world, f"{free}: {cell(free)}", *[cell(n) for n in (*RIVALS[-3:], "rce", *KIT)]], [
        world,
        rival,
        *pairs,
        equal,
    ]


def spent(args: Args, world: str, seed: int, name: str) -> int:
    """The LVLM calls that built a run, as its evaluation records them (runs.lvlm_spent)."""
    return read_eval(args.out / world / f"seed{seed}" / slug(name) / "eval" / "val.json")["lvlm_calls"]


# Selectors that fill every slot, against which one that may stop is judged (baselines included)
FIXED = ("random", "image-sim", "text-sim", "mmices", "mmr", "coreset", "rce", "retriever", "lever-lm", "offline")
FIXED += ("online", "online, budget 35k")


def stop_table(args: Args) -> str:
    """One row per world: what a selector that may stop takes up to k, against zero-shot, against the best run that
    fills every slot (mean over 1-4 shots, and at 4 shots alone), against the same recipe filling every slot and against
    its own picks filling every slot (the same training: the choice alone), at 4 shots, pooled over the seeds with
    paired bootstrap 95% CIs, and the demonstrations it uses at 4; empty until a run that may stop has finished."""
    runs = [n for n in ("rce, can stop", "online, can stop", "online, budget 35k, can stop") if started(args, [n])]
    rows, seed_rows = [], []
    for world in args.worlds:
        for run in runs:
            stop = f"{run}{UPTO}"
            got, pooled = over_seeds(args, world, {stop, "zero-shot", *FIXED})
            at4 = {
                n: pool_seeds({s: d for s in args.seeds if (d := scores(args, world, s, n, [4]))})
                for n in (stop, run, *FIXED)
            }
            if not all(got[stop]) or not all(got["zero-shot"]):
                continue
            seed_rows.append(
                [world, run]
                + [
                    delta([(got["zero-shot"][i], got[stop][i])], args.bootstrap, world, stop, "zero-shot", s)
                    for i, s in enumerate(args.seeds)
                ]
            )
            fixed = [n for n in FIXED if all(got[n])]
            best = max(fixed, key=lambda n: np.mean(list(pooled[n].values())))
            best4 = max(fixed, key=lambda n: np.mean(list(at4[n].values())))
            used = np.mean([demos(args, world, s, run) for s in args.seeds])
            same = VARIANTS[run][2]  # the same recipe filling every slot
            rows.append(
                [
                    world,
                    run,
                    f"{100 * np.mean(list(pooled[stop].values())):.2f} ({used:.2f})",
                    delta([(pooled["zero-shot"], pooled[stop])], args.bootstrap, world, stop, "zero-shot", *args.seeds),
                    f"{best}: " + delta([(pooled[best], pooled[stop])], args.bootstrap, world, stop, best, *args.seeds),
                    f"{best4}: " + delta([(at4[best4], at4[stop])], args.bootstrap, world, stop, best4, 4, *args.seeds),
                    delta([(at4[same], at4[stop])], args.bootstrap, world, stop, same, 4, *args.seeds)
                    if all(got[same])
                    else "-",
                    delta([(at4[run], at4[stop])], args.bootstrap, world, stop, run, 4, *args.seeds),
                ]
            )
    if not rows:
        return ""
    head = [
        "world",
        "run",
        "up to k: accuracy (demonstrations at 4)",
        "- zero-shot",
        "- best fixed k, avg 1-4",
        "- best fixed k, at 4",
        "- the same recipe filling k, at 4",
        "- its own picks filling k, at 4",
    ]
    seeds = " ".join(map(str, args.seeds))
    per_seed = md_table(["world", "run", *[f"seed {s}: - zero-shot" for s in args.seeds]], seed_rows)
    return "\n".join([f"## A selector that may stop, seeds {seeds} pooled", "", md_table(head, rows), "", per_seed, ""])


def demos(args: Args, world: str, seed: int, name: str) -> float:
    """Demonstrations per question a run's "up to k" evaluation used at 4 shots, on the first 800 questions (the mean
    over its trainings)."""
    docs = [read_eval(args.out / world / f"seed{seed}" / f / "eval" / "val-upto.json") for f in folders(args, name)]
    return float(np.mean([d["demonstrations"]["800"]["4"] for d in docs]))


HOW_MANY = "online, budget 35k, can stop"


def how_many_figure(args: Args, path: Path) -> None:
    """Demonstrations the 35k-call selector that may stop gives a question at up to 4 (the mean over the questions of
    every seed), against what one demonstration can be worth for that question: the best single one's gain over
    zero-shot (the oracle's 1-shot score minus zero-shot's), and zero-shot's own score; a line per world."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for i, world in enumerate(args.worlds):
        gain, zero, used = [], [], []
        for s in args.seeds:
            root = args.out / world / f"seed{s}"
            path_upto = root / slug(HOW_MANY) / "eval" / "val-upto.json"
            if not path_upto.is_file():
                continue
            z, one = scores(args, world, s, "zero-shot", [1]), scores(args, world, s, "oracle", [1])
            given = {r["question_id"]: len(r["icds"]) for r in read_eval(path_upto)["results"] if r["shot"] == 4}
            for q in given:
                gain.append(100 * (one[q] - z[q]))
                zero.append(100 * z[q])
                used.append(given[q])
        if not used:
            continue
        gain, zero, used = map(np.array, (gain, zero, used))
        for ax, x, edges in ((left, gain, np.linspace(-100, 100, 11)), (right, zero, np.linspace(0, 100, 6))):
            bins = np.clip(np.digitize(x, edges[1:-1]), 0, len(edges) - 2)
            full = [b for b in range(len(edges) - 1) if (bins == b).sum() >= 20]
            mids, means = [(edges[b] + edges[b + 1]) / 2 for b in full], [used[bins == b].mean() for b in full]
            # hollow markers of their own shape and size, so that worlds giving as many stay visible on each other
            ax.plot(mids, means, marker="osD^v"[i % 5], markersize=9 - i, fillstyle="none", label=world)
    left.set(xlabel="the best single demonstration's gain over zero-shot (points)", ylabel="demonstrations given")
    right.set(xlabel="zero-shot score of the question (%)")
    left.set_title("against what the best single demonstration adds", fontsize=10)
    right.set_title("against how well the question goes without any", fontsize=10)
    left.legend(fontsize=8, frameon=False)
    for ax in (left, right):
        ax.set_ylim(0, 4.1)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{HOW_MANY}, up to 4, seeds {' '.join(map(str, args.seeds))} (bins of 20 questions or more)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# The recipes the docs' findings are made of, as run.sh and the README give them: the default run (a selector that may
# stop, online, no budget), the 35k run (the same on --lvlm-budget 35000) and the same budget filling every slot, RCE
# and offline GRPO, and the trained rivals, Lever-LM also on 35k calls (the training-free ones are every seed's).
JUDGED = (
    "rce",
    "offline",
    "retriever",
    "lever-lm",
    "lever-lm, 35k calls",
    "rce, can stop",
    "online, can stop",
    "online, budget 35k, can stop",
    "online, budget 35k",
)
JUDGED_WORLDS = ("additive", "copy", "saturating", "strong", "order", "harmful", "caption")
LEDGER, JUDGEMENT, RESULTS = Path("docs/seeds.json"), Path("docs/judged.json"), Path("docs/results.md")


def ledger_check(seeds: list[int], commit: str | None) -> dict:
    """docs/seeds.json, once `seeds` are known to lie in its reserved block and to have judged nothing before (the same
    judgement of the same commit may be written again)."""
    ledger = read_json(LEDGER)
    lo, hi = ledger["reserved"]
    if outside := [s for s in seeds if not lo <= s <= hi]:
        raise ValueError(f"--judge --seeds: {outside} lie outside the reserved block {lo}-{hi} of {LEDGER}")
    for use in ledger["uses"]:
        a, b = use["seeds"]
        if (seen := [s for s in seeds if a <= s <= b]) and use.get("commit") != commit:
            raise ValueError(f"--judge --seeds: {seen} {use['did']} before ({use['what']}); {LEDGER} lists them")
    return ledger


def commit_of(args: Args) -> str | None:
    """The commit every judged run was trained at on run.sh's kernels (their config.json); None before any is."""
    made = {
        (config["git_sha"], config.get("kernels", {}).get("env") == KERNELS)
        for w in args.worlds
        for s in args.seeds
        for n in JUDGED
        for f in folders(args, n)
        if (p := args.out / w / f"seed{s}" / f / "config.json").is_file() and (config := read_json(p))
    }
    if len(made) > 1 or made and not next(iter(made))[1]:
        raise ValueError(f"the runs in {args.out} were trained at several commits or off run.sh's kernels: delete them")
    return made.pop()[0] if made else None


def judge(args: Args) -> None:
    """Train what the judgement lacks, then write its figures (docs/judged.json), docs/results.md made of them, and the
    seeds' use in docs/seeds.json."""
    ledger_check(args.seeds, commit_of(args) or git_sha())  # runs already there were trained at their commit
    for world in args.worlds:
        for seed in args.seeds:
            build(args, world, seed, list(JUDGED))
    commit = commit_of(args)
    ledger = ledger_check(args.seeds, commit)
    figures = judged_figures(args)
    doc = {"command": judge_command(args), "commit": commit, "seeds": args.seeds, "figures": figures}
    atomic_write_text(JUDGEMENT, json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    use = {"seeds": [min(args.seeds), max(args.seeds)], "did": "judged", "commit": commit}
    use["what"] = f"the defaults as they stood at {commit[:7]}, every world, by `{judge_command(args)}`"
    ledger["uses"] = [u for u in ledger["uses"] if u.get("commit") != commit or u["did"] != "judged"] + [use]
    atomic_write_text(LEDGER, ledger_text(ledger))
    atomic_write_text(RESULTS, results_page(doc, ledger))
    print(f"wrote {JUDGEMENT}, {RESULTS} and {LEDGER}")


def ledger_text(ledger: dict) -> str:
    """docs/seeds.json as people read and diff it: one use a line."""
    head = {k: v for k, v in ledger.items() if k != "uses"}
    lines = [f"  {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}," for k, v in head.items()]
    uses = ",\n".join(f"    {json.dumps(u, ensure_ascii=False)}" for u in ledger["uses"])
    return "\n".join(["{", *lines, '  "uses": [', uses, "  ]", "}"]) + "\n"


def judge_command(args: Args) -> str:
    return f"python ablate.py --judge --seeds {' '.join(map(str, args.seeds))}"


def judged_figures(args: Args) -> dict[str, dict[str, dict[str, str]]]:
    """Every figure the docs' findings cite: table -> world -> column -> its text (accuracy, or a delta [95% CI]
    pooled over the seeds and each recipe's trainings)."""
    out: dict[str, dict[str, dict[str, str]]] = {"accuracy": {}, "calls": {}, "default run": {}, "35k run": {}}
    out["how many"] = {}
    default, budgeted = "online, can stop", "online, budget 35k, can stop"
    for world in args.worlds:
        training_free = CAPTION_TRAINING_FREE if world in CAPTIONING else TRAINING_FREE
        runs = ["zero-shot", *training_free, *JUDGED, "oracle", default + UPTO, budgeted + UPTO]
        got, pooled = over_seeds(args, world, runs)
        mean = {n: 100 * float(np.mean(list(pooled[n].values()))) for n in runs if all(got[n])}
        best = max(training_free, key=mean.get)
        out["accuracy"][world] = {n: f"{v:.2f}" for n, v in mean.items()} | {"best training-free": best}
        out["calls"][world] = {n: f"{np.mean([spent(args, world, s, n) for s in args.seeds]):,.0f}" for n in JUDGED}
        for key, run in (("default run", default + UPTO), ("35k run", budgeted + UPTO)):
            against = {"zero-shot": "zero-shot", f"best training-free ({best})": best, "Lever-LM": "lever-lm"}
            against |= {"Lever-LM, 35k calls": "lever-lm, 35k calls"} if key == "35k run" else {}
            against |= {"retriever": "retriever", "RCE": "rce"}
            out[key][world] = {f"- {k}": judged_delta(args, world, pooled, run, a) for k, a in against.items()}
        given = {n: np.mean([demos(args, world, s, n) for s in args.seeds]) for n in (default, budgeted)}
        out["how many"][world] = {
            "default run: demonstrations at 4": f"{given[default]:.2f}",
            "35k run: demonstrations at 4": f"{given[budgeted]:.2f}",
            "35k run - the same budget filling every slot, at 4": judged_delta(
                args, world, None, budgeted + UPTO, "online, budget 35k", [4]
            ),
            "offline - retriever (equal calls)": judged_delta(args, world, pooled, "offline", "retriever"),
        }
    return out


def judged_delta(args: Args, world: str, pooled: dict | None, b: str, a: str, shots: list[int] | None = None) -> str:
    """b - a pooled over the seeds, averaged over 1-4 shots (`pooled`: over_seeds' scores) or over `shots`."""
    if shots is not None:
        pooled = {n: pool_seeds({s: scores(args, world, s, n, shots) for s in args.seeds}) for n in (a, b)}
    return delta([(pooled[a], pooled[b])], args.bootstrap, world, b, a, *(shots or []), *args.seeds)


# The rows of the judgement's table of every world: what judged_figures names each run, and what the page calls it
PAGE_ROWS = {
    "zero-shot": "zero-shot",
    "best training-free": "best training-free",
    "rce": "RCE",
    "offline": "offline GRPO",
    "retriever": "retriever",
    "lever-lm": "Lever-LM",
    "lever-lm, 35k calls": "Lever-LM, 35k calls",
    "online, can stop (up to k)": "**default run**",
    "online, budget 35k, can stop (up to k)": "**35k run**",
    "online, budget 35k": "the 35k run filling every slot",
    "oracle": "oracle",
}


def results_page(doc: dict, ledger: dict) -> str:
    """docs/results.md: the judgement's tables, every figure from docs/judged.json, and the seed table of the ledger."""
    f, seeds, commit = doc["figures"], doc["seeds"], doc["commit"][:7]
    worlds = list(f["accuracy"])
    out = [
        "# Results: the defaults, judged",
        "",
        f"Written by `{doc['command']}` at commit {commit} (checked out, the same command reproduces every figure on "
        f"any x86-64 CPU), on seeds {min(seeds)}–{max(seeds)}, kept for judging: none chose or judged anything before. "
        "Each recipe is trained twice a seed: the default run is run.sh's (online, may stop, up to k), the 35k run "
        "the same on `--lvlm-budget 35000`. The simulated LVLM's figures ([worlds.md](worlds.md)): VQA accuracy (%), "
        "CIDEr-D ×100 in `caption`, over 1–4 shots on 800 validation questions, pooled over seeds and trainings; a "
        "delta's [95% CI] resamples seeds, then trainings, then questions.",
        "",
        "## Every world",
        "",
    ]
    rows = []
    for run, label in PAGE_ROWS.items():
        cells = []
        for w in worlds:
            a = f["accuracy"][w]
            cells.append(f"{a[a[run]]} ({a[run]})" if run == "best training-free" else a.get(run, "-"))
        rows.append([label, *cells])
    out += [md_table(["run", *worlds], rows), ""]
    names = PAGE_ROWS | {"rce, can stop": "RCE, may stop", "online, can stop": "default run"}
    names |= {"online, budget 35k, can stop": "35k run"}

    def span(n: str) -> str:  # fewest–most over the worlds
        c = sorted((f["calls"][w][n] for w in worlds), key=lambda s: int(s.replace(",", "")))
        return c[0] if c[0] == c[-1] else f"{c[0]}–{c[-1]}"

    calls = [[names.get(n, n), span(n)] for n in JUDGED]
    out += [md_table(["run", "LVLM calls that built it (its data's included), fewest–most over the worlds"], calls), ""]
    for key in ("default run", "35k run"):
        cols = [c if not c.startswith("- best training-free") else "- best training-free" for c in f[key][worlds[0]]]
        rows = [[w, *f[key][w].values()] for w in worlds]
        out += [f"## The {key} against zero-shot and every rival", "", md_table(["world", *cols], rows), ""]
    cols = list(f["how many"][worlds[0]])
    rows = [[w, *f["how many"][w].values()] for w in worlds]
    out += ["## How many demonstrations, and equal calls", "", md_table(["world", *cols], rows), ""]
    lo, hi = ledger["reserved"]
    uses = [["–".join(map(str, dict.fromkeys(u["seeds"]))), u["did"], u["what"]] for u in ledger["uses"]]  # 95, 0–4
    out += [
        "## Which seeds did what",
        "",
        f"From [seeds.json](seeds.json); seeds {lo}–{hi} judge the defaults as they stand, each block once, by this "
        "command.",
        "",
        md_table(["seeds", "did", "what"], uses),
        "",
    ]
    return "\n".join(out)


def main(args: Args) -> None:
    if args.judge:
        args = replace(args, worlds=list(JUDGED_WORLDS), trainings=max(args.trainings, 2), references=False)
        judge(args)
        return
    if unknown := [n for n in args.only if n not in VARIANTS]:
        raise ValueError(f"--only: unknown variants {unknown}; known: {list(VARIANTS)}")
    if args.trainings < 1:
        raise ValueError(f"--trainings must be at least 1, got {args.trainings}")
    for flag, values in (("--seeds", args.seeds), ("--worlds", args.worlds)):
        if not values:
            raise ValueError(f"{flag} needs at least one value")
        if len(set(values)) < len(values):
            raise ValueError(f"{flag} names {max(values, key=values.count)} twice")
    torch.set_num_threads(1)
    names = order(args.only or list(VARIANTS), args.references)
    for world in args.worlds:
        for seed in args.seeds:
            build(args, world, seed, names)
    tail = [worlds_table(args), budget_table(args), rivals_table(args), stop_table(args)]
    print("\n".join([*[tables(args, w) for w in args.worlds], *tail]))
    if args.how_many is not None:
        how_many_figure(args, args.how_many)


if __name__ == "__main__":
    if "--judge" in sys.argv and any(os.environ.get(k) != v for k, v in KERNELS.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], os.environ | KERNELS)  # run.sh's kernels, from the start
    run_cli(main, Args)
