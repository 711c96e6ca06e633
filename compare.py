"""Stage 5: one Markdown report over run folders, read top-down: which run won, by how much, and whether it is noise.

Verdict first: whether the best selector beats zero-shot, random demonstrations and RICES, and each selector against
each baseline; where no demonstrations beat every selector, the first line says so; the strongest rival against the
best selector; what choosing how many demonstrations bought. At a glance: a runs x shots table of VQA accuracy (CIDEr-D
for captions) at the largest question count every run has, each cell with its delta to the reference run (the RCE run
by default) and a significance mark, the average likewise, the LVLM calls that built each run, the best run, every
unfinished run and every stale evaluation (of weights the run no longer holds) marked. Then the trained runs (flags
that differ, epochs trained, the selected epoch), paired deltas with 95% CIs against the reference and between trained
runs, the share of the gap to the simulator's ceilings, how often runs pick the same ICDs, and what moved during
training. Tables and rows that say nothing (constant curves, pairs that never pick alike, baselines' share of a gap
they are below) are left out.

One verdict rule, stated once in the report: a delta is significant only when its paired bootstrap 95% CI excludes 0
and its exact sign-test p-value passes Holm's correction over the pair's cells (every shot and their average). Runs
are paired only on the same dataset content (digest) and questions. Deltas come from unrounded accuracies, so every
table agrees with the glance table.

With --out, the report goes to that file and only the verdict, the glance table and the file's path are printed.

Usage:
    python compare.py runs/*
    python compare.py runs/* --baseline runs/rce --out runs/report.md --plot runs/plots
"""

from __future__ import annotations

import copy
import math
import re
import sys
from dataclasses import dataclass, field, replace
from itertools import combinations
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import tyro

from icl_select import lineage
from icl_select.cider import coco_cider
from icl_select.cli import default_is, run_cli, side_flags
from icl_select.data import METRIC
from icl_select.files import atomic_write_text, read_json, selector_digest, sha256
from icl_select.runs import read_args, read_eval, read_metrics, unfinished
from icl_select.stats import (
    Bootstrap,
    Cell,
    accuracy,
    pair_cells,
    scores_by_training,
)
from icl_select.tables import md_table
from icl_select.train_args import TrainArgs


@dataclass
class Args:
    runs: tyro.conf.Positional[list[Path]] = field(default_factory=list)
    """Run folders (folders that are not runs are skipped with a warning)."""
    baseline: Annotated[
        str | None,
        default_is(
            "among the runs most pair with, the RCE run if one is given, else the random baseline, else the first"
        ),
    ] = None
    """Reference run that deltas are taken against (its path, in any spelling, or folder name)."""
    split: Literal["val", "train"] = "val"
    """Which evaluation file to read (eval/<split>.json)."""
    out: Path | None = None
    """Write the report to this file and print only the glance table and the file's path."""
    plot: Path | None = None
    """Write the figures into this folder (accuracy and paired deltas by shot, curves per epoch)."""
    bootstrap: int = 10000
    """Bootstrap resamples for the confidence intervals."""
    seed: int = 0
    """Seed of the bootstrap."""


# The training metrics compare.py reports, in report order, with the words a reader needs (tables, plot axes).
TRAIN_COLUMNS = {
    "val/acc": "validation accuracy (%)",
    "val/reward": "validation reward",
    "val/demos": "demonstrations given on validation (a selector that may stop)",
    "grpo/demos": "demonstrations in a scored sequence",
    "train/loss": "training loss",
    "train/tau": "RCE temperature",
    "grpo/ppo_loss": "PPO loss",
    "grpo/kl_ref": "KL to the reference (nats)",
    "lvlm/calls": "LVLM calls so far",
    "grpo/kl_grad_share": "KL share of the gradient",
    "grpo/approx_kl_old": "approx. KL to the old policy",
    "grpo/ratio_mean": "mean PPO ratio",
    "grpo/adv_std": "advantage std",
    "grpo/adv_abs_max": "largest |advantage|",
    "grpo/clip_frac_low": "clipped share (low)",
    "grpo/clip_frac_high": "clipped share (high)",
    "grpo/entropy": "policy entropy (nats per pick)",
    "grpo/beta": "KL weight beta",
    "grpo/selection_change": "validation queries picked differently from the reference",
    "grpo/zero_std_frac": "groups with one reward for all",
    "grpo/explored": "share of a budget's online groups drawn at random (the policy's samples too few distinct)",
}
CEILINGS = ("oracle", "observable")
VAL_NOTE = (
    "Validation accuracy and reward are measured on held-out train anchors (train questions kept out of training), "
    "a different question set from the test questions of the tables above; the selected epoch is the one that scored "
    "best there, so its validation score is biased upwards and is no estimate of test accuracy."
)


# ----------------------------------------------------------------------------------------------------------------------
# Reading run folders: every field the report uses is checked, and a bad one is one line naming file, line and field


@dataclass(eq=False)  # runs are compared by identity (and hashed so)
class Run:
    path: Path
    name: str
    eval: dict | None
    epochs: list[dict]  # metrics.jsonl epoch records, epoch 0 = the starting weights
    epoch_evals: dict[int, dict]
    args: dict | None  # config.json "args" (None without config.json)
    weights: str | None = None  # the digest of the run's selector now (runs.selector_digest; None without one)
    task: str | None = None  # vqa or caption (its evaluation's, or its dataset's as config.json records it)
    eval_sha: str | None = None  # SHA-256 of the evaluation file read: what the report was made from
    upto: bool = False  # its "up to k" evaluation (eval/<split>-upto.json): it chose how many, k at most
    filled: bool = False  # it could stop, and its "up to k" evaluation filled every slot (the same picks as exactly k)
    recipe: str | None = None  # what it was made from but its training seed (config.json): its trainings share it
    trainings: list[Run] = field(default_factory=list)  # the other trainings of its recipe, judged with it

    @property
    def evals(self) -> list[dict]:
        """The evaluations of every training of its recipe (itself first): what its scores and CIs are made from."""
        return [self.eval, *(t.eval for t in self.trainings)]

    @property
    def phase(self) -> str | None:
        """ "rce" / "grpo" for a training run, None for a baseline."""
        return self.epochs[0].get("phase") if self.epochs else None

    @property
    def ceiling(self) -> bool:
        return self.eval is not None and self.eval.get("baseline") in CEILINGS

    @property
    def rival(self) -> bool:
        """A baseline that picks demonstrations, or a selector trained otherwise than by the kit's RCE and GRPO: the
        retriever, or cross-entropy with other weights (Lever-LM's uniform ones, top-1)."""
        if self.eval is not None and self.eval.get("baseline"):
            return self.eval["baseline"] not in (*CEILINGS, "zero-shot")
        args = self.args or {}
        return self.phase == "rce" and (args.get("retriever", False) or args.get("weights", "reward") != "reward")

    @property
    def calls(self) -> str:
        """The LVLM prompts that built it (data, validation, online scoring), in short: 13.6k, 1.93M; '?' unknown."""
        n = None if self.eval is None else self.eval.get("lvlm_calls")
        if n is None:
            return "-" if self.ceiling else "?"
        return f"{n / 1e6:.3g}M" if n >= 1e6 else f"{n / 1e3:.3g}k" if n >= 1e3 else str(n)

    @property
    def label(self) -> str:
        """Its name as the verdict says it: a stale evaluation is marked wherever the run is named."""
        return self.name + " (STALE evaluation)" * self.stale

    @property
    def selected(self) -> int | None:
        """The epoch model.safetensors holds (the best on validation), as the last epoch record says."""
        return self.epochs[-1].get("best_epoch") if self.epochs else None

    @property
    def unfinished(self) -> str | None:
        return unfinished(self.epochs, self.args)

    @property
    def stale(self) -> bool:
        """Whether the run's model.safetensors (or a training's of its recipe) holds other weights than its evaluation
        evaluated (training went on after it, or the evaluation does not say which weights it evaluated)."""
        own = self.eval is not None and self.weights is not None and self.eval.get("selector_digest") != self.weights
        return own or any(t.stale for t in self.trainings)

    def refresh(self) -> str:
        """The evaluate.py command that evaluates the run's model.safetensors again with its evaluation's settings."""
        doc = self.eval
        flags = [f"--data {doc['data']}"] * ("data" in doc) + ["--split train"] * (doc.get("split") == "train")
        flags += [f"--shots {' '.join(map(str, doc['shots']))}"]
        flags += [f"--num-samples {' '.join(sorted(doc['summary'], key=int))}"]
        return f"python evaluate.py {self.path} {' '.join(flags)}"

    def used(self, n: int, shot: int) -> float:
        """Demonstrations per prompt on the first n questions at `shot` (fewer where it stopped early), from its
        results: n need not be a count its summary has."""
        rows = [r for r in self.eval["results"] if r["shot"] == shot][:n]
        return float(np.mean([len((r.get("per_seed") or [r])[0]["icds"]) for r in rows]))

    def kind(self) -> str:
        if self.eval is not None and self.eval.get("baseline"):
            return ("simulator ceiling" if self.ceiling else "baseline") + ", best of 0..k" * self.upto
        args = self.args or {}
        weights = args.get("weights", "reward")
        rce = "retriever" if args.get("retriever") else "RCE" + f", {weights} weights" * (weights != "reward")
        mode = "flags unknown: no config.json" if self.args is None else "online" if args.get("online") else "offline"
        stage = {"rce": rce, "grpo": f"GRPO {mode}" if self.args is not None else f"GRPO ({mode})"}
        what = stage.get(self.phase, "selector") + ", up to k" * self.upto
        if self.unfinished:
            return f"{what}, UNFINISHED: {self.unfinished}"
        done = self.epochs[-1]["epoch"] if self.epochs else 0
        return f"{what}, {done} epoch{'s' * (done != 1)}" if self.epochs else what


def read_run(path: Path, split: str) -> Run | None:
    """A run folder's evaluations, metrics and flags; None (with a warning) if it holds neither."""
    ev, metrics, config = path / "eval" / f"{split}.json", path / "metrics.jsonl", path / "config.json"
    if path.is_file():  # `runs/*` also matches files such as the runs/report.md that run.sh writes: not runs
        return None
    if not path.is_dir() or not (ev.is_file() or metrics.is_file()):
        print(f"warning: {path} is not a run folder (no eval/{split}.json, no metrics.jsonl); skipped", file=sys.stderr)
        return None
    epoch_evals = {}
    for f in sorted(path.glob(f"eval/{split}-epoch*.json")):
        if m := re.fullmatch(rf"{re.escape(split)}-epoch(\d+)\.json", f.name):
            epoch_evals[int(m.group(1))] = read_eval(f)
    doc = read_eval(ev) if ev.is_file() else None
    args = read_args(config) if config.is_file() else None
    settings = read_json(config) if args is not None else {}
    task = doc["task"] if doc else (settings.get("dataset") or {}).get("task")
    made = settings.get("made_from")
    return Run(
        path,
        path.name,
        doc,
        read_metrics(metrics) if metrics.is_file() else [],
        epoch_evals,
        args,
        selector_digest(path) if (path / "model.safetensors").is_file() else None,
        task,
        sha256(ev) if doc else None,
        recipe=recipe_of(made) if isinstance(made, dict) else None,
    )


def recipe_of(made_from: dict) -> str:
    """A run's recipe: what it was made from (lineage.py), its training seed aside."""
    flags = {k: v for k, v in made_from.get("flags", {}).items() if k != "seed"}
    return lineage.digest({**made_from, "flags": flags})


def gather_trainings(runs: list[Run]) -> list[Run]:
    """The runs with every training of one recipe folded into its first (by name): it is judged on all of them."""
    first: dict[tuple, Run] = {}
    out = []
    for r in sorted(runs, key=lambda r: r.name):
        key = (r.recipe, r.upto)
        if r.recipe is not None and key in first:
            first[key].trainings.append(r)
        else:
            first[key] = r
            out.append(r)
    return [r for r in runs if r in out]


# ----------------------------------------------------------------------------------------------------------------------
# Statistics


def not_comparable(a: dict, b: dict) -> str | None:
    """Why two evaluations cannot be paired question by question (None when they can): other inputs (lineage.py: the
    task, the LVLM's weights, the dataset's content, whose pools and questions they are), another split or other
    questions."""
    if diffs := lineage.differences(a["made_from"], b["made_from"], names=("data", "task", "lvlm")):
        return f"made from other inputs: {lineage.say(diffs)}"
    if a.get("split") != b.get("split"):
        return f"different split: {a.get('split')!r} vs {b.get('split')!r}"
    qa, qb = ([r["question_id"] for r in d["results"] if r["shot"] == d["shots"][0]] for d in (a, b))
    n = min(len(qa), len(qb))
    if qa[:n] != qb[:n]:
        return "different questions (another dataset folder or question order)"
    return None


def on_questions(doc: dict, n: int) -> dict:
    """The evaluation as its first n questions alone would have scored: a caption's CIDEr-D takes its document
    frequencies from every question scored with it, so the first n of a larger evaluation score otherwise than n
    evaluated alone, and a caption score is only compared with one of the same questions; it is scored again here
    from the file's captions and references. VQA accuracy is a mean of per-question scores: the same."""
    k = len(doc["shots"])
    if doc["task"] != "caption" or len(doc["results"]) == n * k:
        return doc
    references = doc["references"][:n]
    results = copy.deepcopy(doc["results"][: n * k])
    for s in range(k):
        rows = results[s::k]  # (n,) this shot's results, question order
        seeds = [r.get("per_seed", [r]) for r in rows]
        for j in range(len(seeds[0])):
            _, scores = coco_cider([p[j]["prediction"] for p in seeds], references)
            for p, score in zip(seeds, scores.tolist()):
                p[j]["score"] = round(score, 6)
        for r, p in zip(rows, seeds):
            r["score"] = round(sum(x["score"] for x in p) / len(p), 6)
    summary = {str(n): {str(shot): round(accuracy({**doc, "results": results}, shot, n), 4) for shot in doc["shots"]}}
    return {**doc, "results": results, "summary": summary, "rescored_on": n}


def common_n(runs: list[Run]) -> int:
    """The largest question count every run's evaluation summarises."""
    return min(max(map(int, r.eval["summary"])) for r in runs)


# ----------------------------------------------------------------------------------------------------------------------
# The comparison: one question count, one reference, the pairs that say something


@dataclass
class Comparison:
    evaluated: list[Run]
    base: Run
    n: int
    shots: list[int]
    acc: dict[str, dict]  # run name -> {shot or "avg": accuracy (%)}
    pairs: list[tuple[Run, Run, dict]]  # (run, against, cells): against the reference first, then trained vs trained
    apart: dict[Run, str]  # the evaluated runs that cannot be paired with the reference -> why
    questions: str  # what the evaluation questions are, in words
    metric: str  # what a cell holds: VQA accuracy %, or CIDEr-D x100 for captions
    boot: Bootstrap  # the CIs' draws, shared by every pair of the report

    def cells(self, run: Run) -> dict | None:
        return next((c for r, a, c in self.pairs if r is run and a is self.base), None)

    def best(self) -> list[Run]:
        """The runs with the highest average accuracy, the simulator's ceilings aside."""
        real = [r for r in self.evaluated if not r.ceiling]
        top = max((self.acc[r.name]["avg"] for r in real), default=None)
        return [r for r in real if self.acc[r.name]["avg"] == top]


def reference(evaluated: list[Run], want: str | None) -> Run:
    """--baseline if given; else, among the largest set of runs that pair with one another (runs of several dataset
    folders or tasks: the one most runs share), the RCE warm-up (what GRPO must beat; a rival trained by rce.py is
    none), else the random baseline, else the first evaluated run; never whatever a glob happens to list first."""
    if want is not None:
        match = [r for r in evaluated if r.name == want or r.path.resolve() == Path(want).resolve()]
        if not match:
            raise ValueError(f"--baseline {want}: not among the evaluated runs {[r.name for r in evaluated]}")
        return match[0]
    evaluated = max(([r for r in evaluated if not not_comparable(a.eval, r.eval)] for a in evaluated), key=len)
    rce = [r for r in evaluated if r.phase == "rce" and not r.rival and not r.upto]
    random = [r for r in evaluated if r.eval.get("baseline") == "random"]
    return (rce or random or evaluated)[0]


def compare(runs: list[Run], args: Args) -> Comparison | None:
    evaluated = gather_trainings([r for r in runs if r.eval is not None])
    if not evaluated:
        return None
    base = reference(evaluated, args.baseline)
    # only the runs paired with the reference are judged, tabled and crowned; the rest are named, with why
    apart = {r: why for r in evaluated if r is not base and (why := not_comparable(base.eval, r.eval))}
    evaluated = [r for r in evaluated if r not in apart]
    n = common_n(evaluated)
    for r in evaluated:  # caption scores of the very questions compared
        for t in [r, *r.trainings]:
            t.eval = on_questions(t.eval, n)
    shots = sorted(set.intersection(*(set(r.eval["shots"]) for r in evaluated)))
    if not shots:
        raise ValueError(f"no shot count is evaluated in every run: {[(r.name, r.eval['shots']) for r in evaluated]}")
    acc = {r.name: {s: float(np.mean([accuracy(d, s, n) for d in r.evals])) for s in shots} for r in evaluated}
    for r in evaluated:
        acc[r.name]["avg"] = float(np.mean([acc[r.name][s] for s in shots]))
    boot = Bootstrap(args.bootstrap, np.random.default_rng(args.seed))  # one draw of questions for every pair
    pairs = [(r, base) for r in evaluated if r is not base]
    trained = [r for r in evaluated if r.phase is not None and r is not base]
    pairs += [(b, a) for a, b in combinations(trained, 2)]
    pairs = [(b, a, pair_cells(a.evals, b.evals, shots, n, boot)) for b, a in pairs]
    questions = "test questions (val split)" if args.split == "val" else "questions of the train split"
    metric = METRIC[base.eval.get("task", "vqa")]
    return Comparison(evaluated, base, n, shots, acc, pairs, apart, questions, metric, boot)


# ----------------------------------------------------------------------------------------------------------------------
# Figures


def styles(runs: list[Run], best: list[Run]) -> dict[str, dict]:
    """Matplotlib line styles per run name, the same in every figure: trained runs in solid colours (the best one
    thickest), baselines dashed in greys, the simulator's ceilings in black."""
    import matplotlib.pyplot as plt

    colours = [plt.get_cmap("tab10")(i) for i in (0, 3, 2, 1, 4, 5, 6, 8, 9)]  # tab10 without its grey
    greys, marks = ["0.3", "0.5", "0.65", "0.4"], ["s", "^", "v", "D", "P", "X"]
    ceiling = {"oracle": dict(linestyle=":", marker="x"), "observable": dict(linestyle="-.", marker="+")}
    out, t, b = {}, 0, 0
    for r in runs:
        if r.ceiling:
            out[r.name] = dict(color="black", linewidth=1.2, markersize=6, **ceiling[r.eval["baseline"]])
        elif r.phase is None:
            out[r.name] = dict(color=greys[b % 4], linestyle="--", marker=marks[b % 6], linewidth=1.2, markersize=5)
            b += 1
        else:
            out[r.name] = dict(color=colours[t % len(colours)], linestyle="-", marker="o", linewidth=1.8)
            t += 1
        if r in best:
            out[r.name].update(linewidth=3.0, zorder=5)
    return out


def write_plots(runs: list[Run], c: Comparison | None, folder: Path) -> list[Path]:
    """The figures a researcher opens, one style per run in every file, constant series left out: accuracy vs shots
    beside the paired deltas to the reference with their paired 95% CIs (trained runs and the strongest baseline);
    validation accuracy per epoch; the KL to the reference and the share of validation queries whose picks a GRPO
    run left as the reference's, per epoch. The selected epoch is starred."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    folder.mkdir(parents=True, exist_ok=True)
    style = styles(runs, c.best() if c else [])
    written = []
    shots_label = "shots (ICDs in the prompt)"

    def save(fig, name: str, handles: list) -> None:
        # The legend sits under the panels, never over the data.
        ncol = min(len(handles), max(2, int(fig.get_figwidth() / 2.6)))
        fig.legend(handles=handles, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
        fig.tight_layout(rect=(0, 0.045 * math.ceil(len(handles) / ncol) + 0.01, 1, 1))
        fig.savefig(folder / name, dpi=150)
        plt.close(fig)
        written.append(folder / name)

    def handle(r: Run) -> Line2D:
        label = r.name + (" (reference)" if c and r is c.base else "") + (" (unfinished)" if r.unfinished else "")
        return Line2D([], [], label=label, **style[r.name])

    if c is not None:
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.6))
        for r in c.evaluated:
            left.plot(c.shots, [c.acc[r.name][s] for s in c.shots], **style[r.name])
        left.set(title=f"{c.metric}, first {c.n} {c.questions}", xlabel=shots_label, ylabel=c.metric)
        against = {r: cells for r, a, cells in c.pairs if a is c.base and not r.ceiling}
        baselines = [r for r in against if r.phase is None]
        strongest = max(baselines, key=lambda r: c.acc[r.name]["avg"], default=None)
        shown = [r for r in against if r.phase is not None or r is strongest]
        for i, r in enumerate(shown):
            cells, s = against[r], style[r.name]
            x = np.array(c.shots) + (i - (len(shown) - 1) / 2) * 0.5 / len(shown)  # side by side, not on top
            y = np.array([cells[k].delta for k in c.shots])
            err = [y - [cells[k].lo for k in c.shots], [cells[k].hi for k in c.shots] - y]
            line = dict(color=s["color"], linestyle=s["linestyle"], linewidth=s["linewidth"] * 0.7)
            right.errorbar(x, y, yerr=err, capsize=2, **line)
            for xi, k in zip(x, c.shots):  # filled: significant under the report's rule; hollow: within noise
                face = s["color"] if cells[k].significant else "white"
                right.plot(xi, cells[k].delta, marker=s["marker"], color=s["color"], markerfacecolor=face, zorder=6)
        right.axhline(0, color=style[c.base.name]["color"], linewidth=1.2)
        right.set(title=f"Paired delta to {c.base.name}, 95% CI (filled: significant)", xlabel=shots_label)
        right.set(ylabel=f"{c.metric} minus {c.base.name} (points)")
        for ax in (left, right):
            ax.set_xticks(c.shots)
        save(fig, "accuracy_vs_shots.png", [handle(r) for r in c.evaluated])

    def curve(r: Run, key: str) -> dict[int, float]:
        pts = {e["epoch"]: e[key] for e in r.epochs if key in e}
        if key == "grpo/selection_change":  # as the share of queries still picked as the reference picks them
            pts = {e: 100 * (1 - v) for e, v in pts.items() if e > 0}  # (epoch 0 is the reference: 100%)
        return pts if len(pts) > 1 and moves(list(pts.values())) else {}  # a flat series says nothing

    panels = {
        "val/acc": (
            column_label("val/acc", [r for r in runs if curve(r, "val/acc")]),
            "Validation score per epoch\n(held-out train anchors, not test questions)",
        ),
        "grpo/kl_ref": ("KL to the reference (nats)", "KL to the reference policy"),
        "grpo/selection_change": (
            "validation queries (%)",
            "Validation queries whose picks\nare still the reference's",
        ),
    }
    for keys, file in (
        (("val/acc",), "val_acc_per_epoch.png"),
        (("grpo/kl_ref", "grpo/selection_change"), "kl_and_selection_per_epoch.png"),
    ):
        keys = [k for k in keys if any(curve(r, k) for r in runs)]
        if not keys:
            continue
        fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4.4), squeeze=False)
        shown = []
        for ax, key in zip(axes[0], keys):
            for r in runs:
                if not (pts := curve(r, key)):
                    continue
                s = style[r.name] | dict(marker="o", markersize=2.5)
                ax.plot(list(pts), list(pts.values()), **s)
                if r.selected in pts:
                    star = dict(marker="*", markersize=14, markeredgecolor="black", linestyle="none", zorder=7)
                    ax.plot(r.selected, pts[r.selected], color=s["color"], **star)
                shown += [r] if r not in shown else []
            ylabel, title = panels[key]
            ax.set(xlabel="epoch (0 = starting weights)", ylabel=ylabel)
            ax.set_title(title, fontsize=10)
        star = dict(marker="*", markersize=11, color="white", markeredgecolor="black", linestyle="none")
        save(fig, file, [handle(r) for r in shown] + [Line2D([], [], label="selected epoch", **star)])
    return written


# ----------------------------------------------------------------------------------------------------------------------
# Report sections


def signed(x: float) -> str:
    return f"{x:+.2f}"


def rule(cells: int) -> str:
    return (
        "\\* significant: the paired bootstrap 95% CI over questions excludes 0 and the exact sign-test p-value "
        f"passes Holm's correction at 5% over the pair's {cells} cells (each shot and the average)."
    )


# What each baseline is, in the verdict's words.
BASELINE_WORDS = {
    "zero-shot": "zero-shot (no demonstrations)",
    "random": "random demonstrations",
    "image-sim": "RICES (most image-similar)",
    "text-sim": "most text-similar",
    "mmices": "MMICES (image prefilter, text rerank)",
    "mmr": "MMR (relevance minus redundancy)",
    "coreset": "a clustered coreset",
}


def verdict_section(c: Comparison, args: Args) -> str:
    """The report's first lines: does the best selector beat zero-shot, random and RICES (paired, one rule), and
    what every selector does against each. Where no demonstrations beat every selector, that comes first."""
    selectors = [r for r in c.evaluated if r.phase is not None and not r.rival]
    baselines = [r for r in c.evaluated if r.eval.get("baseline") in BASELINE_WORDS]
    rivals = [r for r in c.evaluated if r.rival]
    if not selectors or not baselines:
        return ""
    avg = {
        (r.name, b.name): pair_cells(b.evals, r.evals, c.shots, c.n, c.boot)["avg"]
        for r in selectors
        for b in baselines
    }

    def words(x: Cell) -> str:
        verdict = ("better" if x.delta > 0 else "worse") if x.significant else "no significant difference"
        return f"{verdict}, {signed(x.delta)} [{signed(x.lo)}, {signed(x.hi)}]"

    best = max(selectors, key=lambda r: c.acc[r.name]["avg"])
    zero = next((b for b in baselines if b.eval["baseline"] == "zero-shot"), None)
    lines = []
    if zero is not None and (x := avg.get((best.name, zero.name))) is not None and not (x.significant and x.delta > 0):
        if x.significant:
            lines.append(
                f"**Zero-shot wins.** Without demonstrations the LVLM scores {c.acc[zero.name]['avg']:.2f}; every "
                f"selector scores less, the best ({best.label}) by {-x.delta:.2f} points [{-x.hi:.2f}, {-x.lo:.2f}]. "
                "Demonstrations hurt on these questions."
            )
        else:
            lines.append(
                f"**No selector beats zero-shot.** The best, {best.label}, is {signed(x.delta)} points "
                f"[{signed(x.lo)}, {signed(x.hi)}] from zero-shot ({c.acc[zero.name]['avg']:.2f}): not significant."
            )
    beaten = [b for b in baselines if (x := avg.get((best.name, b.name))) and x.significant and x.delta > 0]
    if beaten and len(beaten) == len(baselines):
        lines.append(f"**{best.label} beats every baseline** ({', '.join(b.name for b in baselines)}).")
    elif not lines:
        lines.append(
            f"**{best.label} beats {', '.join(b.name for b in beaten) or 'no baseline'}** and not "
            f"{', '.join(b.name for b in baselines if b not in beaten)}."
        )
    k = max(c.shots)
    if best.upto:  # it chose how many: say how many, and what choosing bought against filling every slot
        fixed = [r for r in selectors if not r.upto]
        line = f"{best.label} chose how many: {best.used(c.n, k):.2f} demonstrations per question at up to {k}"
        # its own picks filling every slot are the same training: the difference is the choice alone, where two
        # trainings of one recipe differ by more than the questions' noise
        if own := next((r for r in fixed if r.path == best.path), None):
            x = pair_cells(own.evals, best.evals, c.shots, c.n, c.boot)["avg"]
            line += f"; against its own picks filling every slot: {words(x)}"
        top = max(fixed, key=lambda r: c.acc[r.name]["avg"], default=None)
        if top is not None and top is not own:
            x = pair_cells(top.evals, best.evals, c.shots, c.n, c.boot)["avg"]
            line += f"; against the best selector that fills every slot, {top.label}: {words(x)}"
        lines.append(line + ".")
    elif best.filled:
        lines.append(f"{best.label} could stop, and gave every question {k} demonstrations at up to {k}.")
    if rivals:  # the strongest rival, whichever it is, against the best of the kit's selectors
        top = max(rivals, key=lambda r: c.acc[r.name]["avg"])
        x = pair_cells(top.evals, best.evals, c.shots, c.n, c.boot)["avg"]
        lines.append(
            f"**Strongest rival: {top.label}** ({c.acc[top.name]['avg']:.2f}, built with {top.calls} LVLM calls); "
            f"{best.label} ({c.acc[best.name]['avg']:.2f}, {best.calls} calls) against it: {words(x)}."
        )
    lines.append("")
    for r in selectors:
        against = [f"{BASELINE_WORDS[b.eval['baseline']]}: {words(avg[r.name, b.name])}" for b in baselines]
        lines.append(f"- {r.label} ({c.acc[r.name]['avg']:.2f}) against " + "; ".join(against) + ".")
    lines += [
        "",
        f"Average over {', '.join(map(str, c.shots))} shots, first {c.n} questions, points. {rule(len(c.shots) + 1)}",
        trainings_note(selectors),
    ]
    return "## Verdict\n\n" + "\n".join(lines) + "\n"


def trainings_note(selectors: list[Run]) -> str:
    """How many trainings each selector's verdict rests on, and so what its CI covers."""
    several = [f"{r.label} on {1 + len(r.trainings)}" for r in selectors if r.trainings]
    one = [r.label for r in selectors if not r.trainings]
    parts = []
    if several:
        parts.append(
            f"Judged on the trainings of one recipe (another --seed each), the CI resampling trainings, then "
            f"questions: {', '.join(several)}."
        )
    if one:
        parts.append(
            f"Judged on one training: {', '.join(one)}; its CI covers the questions, not another training's spread "
            "(train it again with another --seed into another --out to include that)."
        )
    return " ".join(parts)


def glance_section(c: Comparison) -> str:
    best = c.best()
    rows = []
    several_lvlms = len({r.eval["backend"] for r in [*c.evaluated, *c.apart]}) > 1  # a selector moved to another LVLM

    def what(r: Run) -> str:
        return r.kind() + (f", answered by {Path(r.eval['backend']).name}" if several_lvlms else "")

    for r in c.evaluated:
        cells = c.cells(r)
        row = []
        for k in [*c.shots, "avg"]:
            text = f"{c.acc[r.name][k]:.2f}"
            if cells is not None:
                text += f" ({signed(cells[k].delta)}{'*' if cells[k].significant else ''})"
            row.append(f"**{text}**" if r in best and k == "avg" else text)
        name = f"**{r.name}** (best)" if r in best else r.name
        name += " (reference)" if r is c.base else ""
        k = max(c.shots)
        used = f", {r.used(c.n, k):.2f} demonstrations at {k}" if r.used(c.n, k) != k else ""
        rows.append([name, what(r) + used + ", STALE evaluation" * r.stale, r.calls, *row])
    header = ["run", "what", "LVLM calls", *[f"{s}-shot" for s in c.shots], "avg"]
    notes = [
        f"Each cell: {c.metric} on the first {c.n} {c.questions}, the largest count every run has, and "
        f"in brackets its delta in points to {c.base.name}. {rule(len(c.shots) + 1)} Best: the highest average, "
        "simulator ceilings aside. LVLM calls: the prompts the LVLM scored to build the run (its data, validations "
        "and online scoring, along its --init chain), 0 for a training-free baseline."
    ]
    if c.apart:  # shown apart, never judged: a delta or a crown across them would compare other questions or LVLMs
        notes += [
            f"\n**Not paired with {c.base.name}**, so neither in the table above nor judged (the average over each "
            "run's own shots and questions; compare them in a report of their own, runs of one dataset folder and "
            "LVLM):\n",
            md_table(
                ["run", "what", "avg", "why not paired"],
                [
                    [r.name, what(r), f"{accuracy(r.eval, 'avg', max(map(int, r.eval['summary']))):.2f}", why]
                    for r, why in c.apart.items()
                ],
            ),
            "",
        ]
    notes += [
        f"**Unfinished:** {r.name} trained {r.unfinished}; its model is epoch {r.selected}, the best of those."
        for r in c.evaluated
        if r.unfinished
    ]
    notes += [
        f"**Stale:** {r.name}'s evaluation is of {evaluated_weights(r.eval)}, but its model.safetensors has changed "
        f"since (now epoch {r.selected}); its row is of the old weights. Refresh it: `{r.refresh()}`."
        for r in c.evaluated
        if r.stale
    ]
    return f"## At a glance\n\n{md_table(header, rows)}\n\n" + "\n".join(notes)


def evaluated_weights(doc: dict) -> str:
    """Which weights an evaluation says it evaluated, in words."""
    if doc.get("selector_digest") is None:
        return "weights it does not name"
    return f"epoch {doc['selector_epoch']}" if doc.get("selector_epoch") is not None else "other weights"


def trained_section(runs: list[Run]) -> list[str]:
    """Each trained run's stage, epochs trained, selected epoch and the flags that differ between runs (a 2-epoch run
    must not sit silently beside a 10-epoch one)."""
    trained = [r for r in runs if r.epochs]
    if not trained:
        return []
    side = ("out", "epochs", *side_flags(TrainArgs))  # what is kept or shown, not trained
    flags = {r.name: {k: v for k, v in (r.args or {}).items() if k not in side} for r in runs}
    keys = sorted({k for r in trained for k in flags[r.name]})
    # A flag only one stage has (RCE's tau, GRPO's epsilon) is not a difference; one that two runs set apart is.
    differ = [k for k in keys if len({repr(flags[r.name][k]) for r in trained if k in flags[r.name]}) > 1]
    # What a run cost: the LVLM calls (scored sequences after the cache, its validations' included), where logged.
    calls = {r.name: r.epochs[-1].get("lvlm/calls") for r in trained}
    rows = []
    for r in trained:
        done = f"UNFINISHED: {r.unfinished}" if r.unfinished else f"{r.epochs[-1]['epoch']}"
        selected = "-" if r.selected is None else str(r.selected)
        selected += f" (evaluated: {evaluated_weights(r.eval)}, STALE)" if r.stale else ""
        spent = [f"{calls[r.name]:,}" if calls[r.name] is not None else "-"] if any(calls.values()) else []
        rows.append(
            [r.name, r.kind().split(",")[0], done, selected, *spent, *[str(flags[r.name].get(k, "-")) for k in differ]]
        )
    header = [
        "run",
        "stage",
        "epochs trained",
        "selected epoch",
        *(["own LVLM calls"] if any(calls.values()) else []),
        *differ,
    ]
    notes = "Selected epoch: the one model.safetensors holds, the best on validation or, with --select-epoch last (the"
    notes += " default with --lvlm-budget), the last (see Training)."
    if any(calls.values()):
        notes += (
            " Own LVLM calls: sequences the LVLM scored during this run's training and validation (after the score"
            " cache); the glance table's count adds its data and its --init's."
        )
    return ["## Trained runs", "", md_table(header, rows), "", notes, ""]


def delta_cell(x: Cell) -> str:
    return f"{signed(x.delta)}{'*' if x.significant else ''} [{signed(x.lo)}, {signed(x.hi)}] p={x.p:.2g}"


def deltas_section(c: Comparison) -> list[str]:
    if not c.pairs:
        return []
    rows = [[r.name, a.name, *[delta_cell(cells[k]) for k in [*c.shots, "avg"]]] for r, a, cells in c.pairs]
    header = ["run", "minus", *[f"{s}-shot" for s in c.shots], "avg"]
    return [
        f"## Paired deltas (points, first {c.n} questions)",
        "",
        md_table(header, rows),
        "",
        "Each cell: mean per-question difference [paired bootstrap 95% CI] and the exact sign-test p-value; * as in "
        "the glance table.",
        "",
    ]


def gap_section(c: Comparison) -> list[str]:
    """The share of the gap above the RCE run each trained run takes, against the simulator's two ceilings.

    share = (acc(run) - acc(RCE)) / (acc(ceiling) - acc(RCE)), accuracy averaged over shots and each recipe's
    trainings; 95% CI by a paired bootstrap over trainings, then questions (the three runs answer the same questions).
    Baselines below RCE are left out: a share of a gap they are under says nothing."""
    ceilings = {r.eval["baseline"]: r for r in c.evaluated if r.ceiling}
    start = next((r for r in c.evaluated if r.phase == "rce" and not r.rival and not r.upto), None)
    runs = [r for r in c.evaluated if r.phase is not None and r is not start]
    if start is None or not ceilings or not runs:
        return []
    names = [k for k in CEILINGS if k in ceilings]
    rows = []
    for run in runs:
        cells = []
        for k in names:
            trio = tuple(scores_by_training(r.evals, "avg", c.n, c.shots) for r in (start, run, ceilings[k]))
            share, lo, hi = c.boot.share([trio])
            cells.append(f"{100 * share:.0f}% [{100 * lo:.0f}, {100 * hi:.0f}]")
        rows.append([run.name, *cells])
    header = ["run"] + [f"share of the gap {start.name} -> {k} ({c.acc[ceilings[k].name]['avg']:.2f})" for k in names]
    note = (
        f"Share of the gap between {start.name} ({c.acc[start.name]['avg']:.2f}) and each simulator ceiling that a "
        "run takes, accuracy averaged over shots and trainings; [95% CI] by a paired bootstrap over trainings, then "
        "questions. oracle searches the planted answer model; observable searches the same way with the latents that "
        "probes read off the embeddings (an estimate of what embeddings reveal, not a bound: a selector that also "
        "learns a score per train item, as online GRPO does, can pass it)."
    )
    return ["## Share of the gap (simulator ceilings)", "", md_table(header, rows), "", note, ""]


def picks(doc: dict, shot: int, n: int) -> dict:
    """question_id -> the ICDs one run chose at one shot (first n questions)."""
    return {r["question_id"]: r["icds"] for r in [r for r in doc["results"] if r["shot"] == shot][:n] if "icds" in r}


def selection_section(c: Comparison) -> list[str]:
    """How often two trained runs pick exactly the same ICDs (GRPO that changes nothing shows here)."""
    rows = []
    for a, b in combinations([r for r in c.evaluated if r.phase is not None], 2):
        shares = []
        for s in c.shots:
            pa, pb = picks(a.eval, s, c.n), picks(b.eval, s, c.n)
            common = [q for q in pa if q in pb]
            shares.append(f"{100 * sum(pa[q] == pb[q] for q in common) / len(common):.1f}%" if common else "-")
        rows.append([f"{b.name} / {a.name}", *shares])
    if not rows:
        return []
    note = f"Share of the first {c.n} questions on which two trained runs chose exactly the same ICDs."
    return ["## Same ICDs chosen", "", md_table(["runs", *[f"{s}-shot" for s in c.shots]], rows), "", note, ""]


def moves(values: list[float]) -> bool:
    """Whether a curve moves by more than 1% of its largest magnitude (and more than rounding noise)."""
    return max(values) - min(values) > max(1e-6, 0.01 * max(map(abs, values)))


def fmt(x: float, sign: str = "") -> str:
    """Four significant digits; a whole number (a count such as LVLM calls) in full, with thousands separators as
    the trained-runs table writes them."""
    return f"{x:{sign},.0f}" if float(x).is_integer() else f"{x:{sign}.4g}"


def column_label(key: str, runs: list[Run]) -> str:
    """A training metric in words; validation accuracy is CIDEr-D for runs that caption."""
    if key != "val/acc":
        return TRAIN_COLUMNS[key]
    tasks = {r.task or "vqa" for r in runs}
    return f"validation {METRIC[tasks.pop()]}" if len(tasks) == 1 else "validation score (VQA accuracy % or CIDEr-D)"


def curve_section(runs: list[Run]) -> list[str]:
    """Per metric and trained run: the start (epoch 0), the selected epoch, the last epoch and the change; metrics
    that barely move are left out."""
    rows = []
    for key in TRAIN_COLUMNS:
        for r in runs:
            label = column_label(key, [r])
            pts = {e["epoch"]: e[key] for e in r.epochs if key in e}
            if len(pts) < 2 or not moves(list(pts.values())):
                continue
            first, last = next(iter(pts.items())), list(pts.items())[-1]
            sel = f"{fmt(pts[r.selected])} (epoch {r.selected})" if r.selected in pts else "-"
            start = fmt(first[1]) if first[0] == 0 else f"{fmt(first[1])} (epoch {first[0]})"
            end = fmt(last[1]) + (f" (epoch {last[0]}, UNFINISHED)" if r.unfinished else "")
            rows.append([label, r.name, start, sel, end, fmt(last[1] - first[1], "+")])
    if not rows:
        return []
    header = ["metric", "run", "start (epoch 0)", "selected epoch", "last epoch", "change, last - start"]
    note = (
        f"{VAL_NOTE} Metrics that move by less than 1% of their size over a run are left out; every epoch of a run "
        "is in its metrics.jsonl and the --plot figures."
    )
    return ["## Training", "", md_table(header, rows), "", note, ""]


def epoch_section(run: Run) -> list[str]:
    """Test accuracy of earlier epochs (evaluate.py --epochs), beside the selected model's."""
    docs = {f"epoch {e}": d for e, d in sorted(run.epoch_evals.items())}
    if run.stale:
        docs[f"evaluated ({evaluated_weights(run.eval)}, STALE)"] = run.eval
    elif run.eval is not None:
        docs[f"selected (epoch {run.selected})" if run.selected is not None else "selected"] = run.eval
    n = min(max(map(int, d["summary"])) for d in docs.values())
    shots = sorted(set.intersection(*(set(d["shots"]) for d in docs.values())))
    rows = [
        [e, *[f"{accuracy(d, s, n):.2f}" for s in shots], f"{np.mean([accuracy(d, s, n) for s in shots]):.2f}"]
        for e, d in docs.items()
    ]
    header = ["epoch", *[f"{s}-shot" for s in shots], "avg"]
    return [f"## Test accuracy per epoch: {run.name} (first {n} questions)", "", md_table(header, rows), ""]


def count_section(c: Comparison) -> list[str]:
    """Average accuracy at every question count each run was evaluated on: how far the numbers still move with n."""
    ns = sorted({int(n) for r in c.evaluated for n in r.eval["summary"]})
    if len(ns) < 2:
        return []
    rows = []
    for r in c.evaluated:
        have = {int(n) for n in r.eval["summary"]}
        rows.append([r.name, *[f"{accuracy(r.eval, 'avg', n):.2f}" if n in have else "-" for n in ns]])
    header = ["run", *[f"n = {n}" for n in ns]]
    return ["## Average accuracy by question count", "", md_table(header, rows), ""]


def report_parts(runs: list[Run], c: Comparison | None, args: Args) -> tuple[str, list[str]]:
    """The glance section and the rest of the report."""
    sim = c is not None and any(r.eval.get("simulation") for r in c.evaluated)
    title = f"# Comparison ({args.split} split{', simulated LVLM' if sim else ''})"
    if c is None:
        glance = f"No run has eval/{args.split}.json: training only."
    else:
        glance = "\n".join(x for x in (verdict_section(c, args), glance_section(c)) if x)
    rest = trained_section([r for r in runs if not r.upto])  # an "up to k" row is its run's training again
    if c is not None:
        rest += deltas_section(c) + gap_section(c) + selection_section(c)
    rest += curve_section([r for r in runs if r.epochs and not r.upto])
    for r in runs:
        if r.epoch_evals:
            rest += epoch_section(r)
    if c is not None:
        rest += count_section(c)
    if skipped := [r.name for r in runs if r.eval is None]:
        rest += [f"Runs without eval/{args.split}.json (training only): {', '.join(skipped)}", ""]
    return f"{title}\n\n{glance}\n", rest + made_from_section(runs, args.split)


def made_from_section(runs: list[Run], split: str) -> list[str]:
    """What the report was made from: each evaluation file by its SHA-256, and what that file was made from."""
    rows = []
    for r in (r for r in runs if r.eval is not None):
        m = r.eval["made_from"]
        weights = (m.get("selector") or "-")[:16]
        rows.append([r.name, r.eval_sha[:16], m["data"], m["lvlm"], weights])
    if not rows:
        return []
    header = ["run", f"eval/{split}.json sha256", "dataset content", "LVLM", "selector weights sha256"]
    note = "Every number above comes from these files; a file whose digest differs is another evaluation."
    return ["## Made from", "", md_table(header, rows), "", note, ""]


def same_picks(a: dict, b: dict | None) -> bool:
    """Whether two evaluations picked the very same demonstrations everywhere (an up-to-k one that never stopped)."""
    return b is not None and [r.get("icds") for r in a["results"]] == [r.get("icds") for r in b["results"]]


def read_runs(args: Args) -> list[Run]:
    """Every run folder once (a folder named twice, as by `runs/* runs/rce`, is read once), and beside each run that
    chose how many demonstrations (a selector that can stop, a ceiling's best of 0..k) its "up to k" evaluation as a
    row of its own; two folders of one name are refused, since every table names runs by folder name."""
    paths = list({p.resolve(): p for p in args.runs}.values())
    runs = []
    for r in (read_run(p, args.split) for p in paths):
        if r is None:
            continue
        runs.append(r)
        upto = r.path / "eval" / f"{args.split}-upto.json"
        if not upto.is_file():
            continue
        if same_picks(doc := read_eval(upto), r.eval):
            r.filled = True
        else:
            runs.append(
                replace(
                    r,
                    name=f"{r.name} (up to k)",
                    eval=doc,
                    eval_sha=sha256(upto),
                    epoch_evals={},
                    upto=True,
                    trainings=[],
                )
            )
    if not runs:
        raise ValueError("no run folders to compare")
    for a, b in combinations(runs, 2):
        if a.name == b.name:
            raise ValueError(f"{a.path} and {b.path} share the folder name {a.name!r}, which names a run in the tables")
    return runs


def report(args: Args) -> str:
    runs = read_runs(args)
    glance, rest = report_parts(runs, compare(runs, args), args)
    return "\n".join([glance, *rest])


def main(args: Args) -> None:
    if args.out is not None and args.out.is_dir():
        raise ValueError(f"--out {args.out}: is a folder; give a file name, such as {args.out / 'report.md'}")
    if args.bootstrap < 1:
        raise ValueError(f"--bootstrap must be >= 1, got {args.bootstrap}")
    if args.plot is not None and args.plot.exists() and not args.plot.is_dir():
        raise ValueError(f"--plot {args.plot}: is a file; give a folder for the figures")
    runs = read_runs(args)
    c = compare(runs, args)
    glance, rest = report_parts(runs, c, args)
    if args.out is None:
        print("\n".join([glance, *rest]))
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out, "\n".join([glance, *rest]) + "\n")
        print(f"{glance}\nFull report: {args.out}")
    if args.plot is not None:
        for path in write_plots(runs, c, args.plot):
            print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    run_cli(main, Args)
