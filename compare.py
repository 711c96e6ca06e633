"""Stage 5: Markdown tables over run folders: accuracy, deltas with paired significance, training curves.

First, at a glance: one runs x shots table at the largest common n, each cell with its delta to the baseline run
(significance-marked), and the training flags that differ between runs. Then, for runs with eval/<split>.json: a
samples x shots accuracy table per run; signed deltas against a baseline run
per (n, shot) with improved/worse/flat counts; at the largest n, per shot, a paired bootstrap 95% CI of the delta
and an exact sign-test p-value over the same questions. One verdict rule everywhere: significant only when the CI
excludes 0 and the sign test passes Holm's correction over all cells of the pair (at n=800 an accuracy's standard
error is ~1.8 points, so +0.07 is noise). Runs are paired only on the same dataset content (digest) and questions.
The identical-selection rate of every pair of runs.
For runs with metrics.jsonl: a per-epoch training table and, across runs, a curve summary per metric (initial,
final, mean, change %, min and its epoch). Per-epoch accuracy tables when eval/<split>-epochNNN.json exist.

Usage:
    python compare.py runs/*
    python compare.py runs/* --baseline runs/rce --out report.md --plot plots/
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import tyro

from cli import SIDE_ARGS, default_is, run_cli
from files import atomic_write_text, read_jsonl
from tables import accuracy_table, md_table


@dataclass
class Args:
    runs: tyro.conf.Positional[list[Path]] = field(default_factory=list)
    """Run folders (folders that are not runs are skipped with a warning)."""
    baseline: Annotated[
        str | None, default_is("the RCE run if one is given, else the random baseline, else the first run")
    ] = None
    """Run to compare against (its path, in any spelling, or folder name)."""
    split: Literal["val", "train"] = "val"
    """Which evaluation file to read (eval/<split>.json)."""
    out: Path | None = None
    """Also write the Markdown to this file."""
    plot: Path | None = None
    """Write the figures into this folder: accuracy vs shots with CIs, validation accuracy per epoch, KL and
    selection change per epoch (one colour per run in every file)."""
    bootstrap: int = 10000
    """Bootstrap resamples for the confidence intervals."""
    seed: int = 0
    """Seed of the bootstrap."""


TRAIN_COLUMNS = (
    "train/loss",
    "val/reward",
    "val/acc",
    "grpo/ppo_loss",
    "grpo/kl_ref",
    "grpo/kl_share",
    "grpo/kl_grad_share",
    "grpo/approx_kl_old",
    "grpo/ratio_mean",
    "grpo/adv_std",
    "grpo/adv_abs_max",
    "grpo/clip_frac_low",
    "grpo/clip_frac_high",
    "grpo/entropy",
    "grpo/beta",
    "grpo/selection_change",
    "grpo/zero_std_frac",
    "train/tau",
)


@dataclass
class Run:
    path: Path
    name: str
    eval: dict | None
    epochs: list[dict]  # metrics.jsonl epoch records
    epoch_evals: dict[int, dict]


def read_run(path: Path, split: str) -> Run | None:
    """A run folder's evaluations and metrics; None (with a warning) if it holds neither."""
    ev = path / "eval" / f"{split}.json"
    metrics = path / "metrics.jsonl"
    if path.is_file():  # `runs/*` also matches files such as the runs/report.md that run.sh writes: not runs
        return None
    if not path.is_dir() or not (ev.is_file() or metrics.is_file()):
        print(f"warning: {path} is not a run folder (no eval/{split}.json, no metrics.jsonl); skipped", file=sys.stderr)
        return None
    epochs = (
        [r for _, r in read_jsonl(metrics, truncated="skip") if r.get("kind") != "step"] if metrics.is_file() else []
    )
    epoch_evals = {}
    for f in sorted(path.glob(f"eval/{split}-epoch*.json")):
        if m := re.fullmatch(rf"{re.escape(split)}-epoch(\d+)\.json", f.name):
            epoch_evals[int(m.group(1))] = json.loads(f.read_text())
    return Run(path, path.name, json.loads(ev.read_text()) if ev.is_file() else None, epochs, epoch_evals)


# ----------------------------------------------------------------------------------------------------------------------
# Statistics


def scores(doc: dict, shot: int, n: int) -> dict:
    """question_id -> score for one shot, first n questions of the fixed order."""
    rows = [r for r in doc["results"] if r["shot"] == shot][:n]
    return {r["question_id"]: r["score"] for r in rows}


def paired(a: dict, b: dict) -> np.ndarray:
    """Per-question differences b - a over the questions both runs answered."""
    common = [q for q in a if q in b]
    return np.array([b[q] - a[q] for q in common], dtype=np.float64)


def bootstrap_ci(d: np.ndarray, resamples: int, rng: np.random.Generator) -> tuple[float, float]:
    """95% percentile bootstrap CI of the mean of d (resampling questions)."""
    idx = rng.integers(0, len(d), size=(resamples, len(d)))
    means = d[idx].mean(1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def sign_test(d: np.ndarray) -> float:
    """Exact two-sided sign test on the non-zero differences (McNemar's test when scores are 0/1)."""
    pos, neg = int((d > 0).sum()), int((d < 0).sum())
    n = pos + neg
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(pos, neg) + 1)) / 2**n
    return min(1.0, 2 * tail)


def holm(pvalues: list[float], alpha: float = 0.05) -> list[bool]:
    """Holm's step-down test: which hypotheses are rejected at family-wise error `alpha` (input order)."""
    reject = [False] * len(pvalues)
    for rank, i in enumerate(sorted(range(len(pvalues)), key=pvalues.__getitem__)):
        if pvalues[i] > alpha / (len(pvalues) - rank):
            break
        reject[i] = True
    return reject


def verdict_rule(cells: int) -> str:
    return (
        "A delta is significant (\\*) only when both tests agree: its paired bootstrap 95% CI excludes 0, and its "
        f"exact sign-test p-value passes Holm's correction at 5% over the {cells} cells compared for this pair."
    )


# ----------------------------------------------------------------------------------------------------------------------
# Tables


def signed(x: float) -> str:
    return f"{x:+.2f}"


def not_comparable(a: dict, b: dict) -> str | None:
    """Why two evaluations cannot be paired question by question (None when they can)."""
    for key in ("split", "backend", "simulation"):
        if a.get(key) != b.get(key):
            return f"different {key}: {a.get(key)!r} vs {b.get(key)!r}"
    # Same question ids are not enough: folders with other pools (another sampler or seed) pose other problems.
    if a.get("data_digest") and b.get("data_digest") and a["data_digest"] != b["data_digest"]:
        return f"different dataset content (digest {a['data_digest']} vs {b['data_digest']})"
    qa, qb = ([r["question_id"] for r in d["results"] if r["shot"] == d["shots"][0]] for d in (a, b))
    n = min(len(qa), len(qb))
    if qa[:n] != qb[:n]:
        return "different questions (another dataset folder or question order)"
    return None


def pair_stats(base: Run, run: Run, args: Args, rng: np.random.Generator) -> tuple[dict, dict]:
    """Every (n, shot) cell of run vs base: (per-question differences, CI low, CI high, sign-test p), and its verdict
    (better / worse / within noise) under the one rule: the CI excludes 0 and Holm over the pair's cells passes."""
    a, b = base.eval, run.eval
    shots = [s for s in a["shots"] if s in b["shots"]]
    ns = [n for n in a["summary"] if n in b["summary"]]
    cells = {}
    for n in ns:
        for s in shots:
            d = paired(scores(a, s, int(n)), scores(b, s, int(n)))
            cells[n, s] = (d, *bootstrap_ci(100 * d, args.bootstrap, rng), sign_test(d))
    keys = list(cells)
    holm_ok = dict(zip(keys, holm([cells[k][3] for k in keys])))
    verdict = {}
    for k, (_, lo, hi, _) in cells.items():
        sure = holm_ok[k] and (lo > 0 or hi < 0)
        verdict[k] = "within noise" if not sure else ("better" if lo > 0 else "worse")
    return cells, verdict


def delta_section(base: Run, run: Run, stats: tuple[dict, dict]) -> str:
    a, b = base.eval, run.eval
    title = f"### {run.name} vs {base.name}"
    if why := not_comparable(a, b):
        return f"{title}\n\nNot compared: {why}."
    cells, verdict = stats
    shots = [s for s in a["shots"] if s in b["shots"]]
    ns = [n for n in a["summary"] if n in b["summary"]]
    rows = []
    for n in ns:
        deltas = [b["summary"][n][str(s)] - a["summary"][n][str(s)] for s in shots]
        marks = ["*" if verdict[n, s] != "within noise" else "" for s in shots]
        rows.append([n, *[signed(x) + m for x, m in zip(deltas, marks)], signed(sum(deltas) / len(deltas))])
    counts = {v: sum(x == v for x in verdict.values()) for v in ("better", "worse", "within noise")}
    out = [
        title,
        "",
        md_table(["n"] + [f"shot {s}" for s in shots] + ["avg"], rows),
        "",
        f"{verdict_rule(len(cells))} Cells better / worse / within noise: "
        f"{counts['better']} / {counts['worse']} / {counts['within noise']}",
        "",
    ]
    n = max(ns, key=int)
    sig_rows = []
    for s in shots:
        d, lo, hi, p = cells[n, s]
        if len(d):
            sig = "significant" if verdict[n, s] != "within noise" else "n.s."
            counts_qs = f"{int((d > 0).sum())} / {int((d < 0).sum())}"
            sig_rows.append([str(s), signed(100 * d.mean()), f"[{lo:+.2f}, {hi:+.2f}]", f"{p:.3g}", counts_qs, sig])
    common = max(len(cells[n, s][0]) for s in shots)
    out += [
        f"Paired significance at n = {n} ({common} common questions):",
        "",
        md_table(
            ["shot", "delta", "95% CI (bootstrap)", "sign-test p", "better / worse questions", "verdict"], sig_rows
        ),
        "",
        verdict_rule(len(cells)),
    ]
    return "\n".join(out)


def phase(run: Run) -> str | None:
    """ "rce" / "grpo" for a training run (from metrics.jsonl), None for a baseline."""
    return run.epochs[0].get("phase") if run.epochs else None


def per_question(doc: dict, n: int) -> dict:
    """question_id -> mean score over the evaluated shots, first n questions."""
    per_shot = [scores(doc, s, n) for s in doc["shots"]]
    return {q: sum(d[q] for d in per_shot) / len(per_shot) for q in per_shot[0]}


def common_n(runs: list[Run]) -> int:
    """The largest question count every run's evaluation summarises."""
    return min(max(map(int, r.eval["summary"])) for r in runs)


def gap_share(a: dict, b: dict, top: dict, resamples: int, rng: np.random.Generator) -> tuple[float, float, float]:
    """Share of the mean a -> top gap that b closes over their common questions, with a paired bootstrap 95% CI
    (questions resampled together for the three runs)."""
    x = np.array([[a[q], b[q], top[q]] for q in a if q in b and q in top])  # (n, 3)
    boot = x[rng.integers(0, len(x), size=(resamples, len(x)))].mean(1)  # (R, 3)
    with np.errstate(divide="ignore", invalid="ignore"):
        share, shares = ((m[..., 1] - m[..., 0]) / (m[..., 2] - m[..., 0]) for m in (x.mean(0), boot))
    lo, hi = np.nanpercentile(shares, [2.5, 97.5])
    return float(share), float(lo), float(hi)


def gap_section(evaluated: list[Run], args: Args, rng: np.random.Generator) -> str | None:
    """How much of the room above the RCE run each run takes, against the simulator's two ceilings.

    share = (acc(run) - acc(RCE)) / (acc(ceiling) - acc(RCE)), accuracy averaged over shots at the largest common n;
    95% CI by a paired bootstrap over questions (the three runs answer the same questions).
    """
    ceilings = {r.eval.get("baseline"): r for r in evaluated if r.eval.get("baseline") in ("oracle", "observable")}
    start = next((r for r in evaluated if phase(r) == "rce"), None)
    if start is None or not ceilings:
        return None
    others = [r for r in evaluated if r is not start and r not in ceilings.values()]
    names = [c for c in ("oracle", "observable") if c in ceilings]
    n = common_n([start, *others, *ceilings.values()])
    rows = []
    for run in others:
        cells = []
        for c in names:
            trio = (start, run, ceilings[c])
            if any(not_comparable(start.eval, r.eval) for r in trio[1:]):
                cells.append("not comparable")
                continue
            share, lo, hi = gap_share(*(per_question(r.eval, n) for r in trio), args.bootstrap, rng)
            cells.append(f"{100 * share:.0f}% [{100 * lo:.0f}, {100 * hi:.0f}]")
        rows.append([run.name, f"{100 * np.mean(list(per_question(run.eval, n).values())):.2f}", *cells])
    header = ["run", f"avg acc (n={n})"] + [f"share of the {start.name} -> {c} gap closed" for c in names]
    note = (
        f"Share of the room between the RCE run ({start.name}) and each simulator ceiling that a run takes, accuracy "
        "averaged over shots; [95% CI] by a paired bootstrap over questions. oracle searches the planted answer "
        "model; observable searches the same way with the latents that probes read off the embeddings (an estimate "
        "of what embeddings reveal, not a bound)."
    )
    return md_table(header, rows) + "\n\n" + note


def selection_table(runs: list[Run]) -> str:
    """Share of common questions where two runs chose exactly the same ICDs, per shot (largest common n)."""
    rows = []
    shots = sorted({s for r in runs for s in r.eval["shots"]})
    for a, b in combinations(runs, 2):
        cells = []
        for s in shots:
            # A multi-seed random baseline has no single selection (its results hold per_seed picks): "-".
            ia = {r["question_id"]: r["icds"] for r in a.eval["results"] if r["shot"] == s and "icds" in r}
            ib = {r["question_id"]: r["icds"] for r in b.eval["results"] if r["shot"] == s and "icds" in r}
            common = [q for q in ia if q in ib]
            cells.append(f"{100 * sum(ia[q] == ib[q] for q in common) / len(common):.1f}%" if common else "-")
        rows.append([f"{a.name} / {b.name}"] + cells)
    return md_table(["runs"] + [f"shot {s}" for s in shots], rows)


def fmt(x) -> str:
    return f"{x:.4g}" if isinstance(x, (int, float)) else "-"


def training_table(run: Run) -> str:
    cols = [c for c in TRAIN_COLUMNS if any(c in r for r in run.epochs)]
    rows = [[str(r["epoch"])] + [fmt(r.get(c)) for c in cols] for r in run.epochs]
    return md_table(["epoch"] + cols, rows)


def curve_summary(runs: list[Run]) -> str:
    """Per metric and run: initial (epoch 0, the starting policy, where logged), final, mean, change %, min."""
    rows = []
    for c in TRAIN_COLUMNS:
        for run in runs:
            pts = [(r["epoch"], r[c]) for r in run.epochs if c in r]
            if not pts:
                continue
            vals = [v for _, v in pts]
            first, last = vals[0], vals[-1]
            change = f"{100 * (last - first) / abs(first):+.1f}%" if first else "-"
            e_min, v_min = min(pts, key=lambda p: p[1])
            rows.append(
                [
                    c,
                    run.name,
                    fmt(first),
                    fmt(last),
                    fmt(sum(vals) / len(vals)),
                    change,
                    f"{fmt(v_min)} (epoch {e_min})",
                ]
            )
    return md_table(["metric", "run", "initial", "final", "mean", "change", "min (epoch)"], rows)


def epoch_accuracy_table(run: Run) -> str:
    docs = dict(sorted(run.epoch_evals.items()))
    n = max(next(iter(docs.values()))["summary"], key=int)
    shots = next(iter(docs.values()))["shots"]
    rows = []
    for e, doc in [*docs.items(), ("selected", run.eval)]:
        if doc is None or n not in doc["summary"]:
            continue
        vals = [doc["summary"][n][str(s)] for s in shots]
        rows.append([str(e)] + [f"{v:.2f}" for v in vals] + [f"{sum(vals) / len(vals):.2f}"])
    return f"n = {n}\n\n" + md_table(["epoch"] + [f"shot {s}" for s in shots] + ["avg"], rows)


def write_plots(runs: list[Run], folder: Path, bootstrap: int, seed: int) -> list[Path]:
    """The three figures a researcher opens, one colour per run in every file, constant series left out:
    accuracy vs shots with 95% CIs (largest common n), validation accuracy per epoch, and the KL to the reference
    and the share of changed selections per epoch (GRPO runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    colour = {str(r.path): plt.get_cmap("tab10")(i % 10) for i, r in enumerate(runs)}
    rng, written = np.random.default_rng(seed), []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(folder / name, dpi=110)
        plt.close(fig)
        written.append(folder / name)

    evaluated = [r for r in runs if r.eval is not None]
    if evaluated:
        n = common_n(evaluated)
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in evaluated:
            shots = r.eval["shots"]
            means, errs = [], [[], []]
            for s in shots:
                x = 100 * np.array(list(scores(r.eval, s, n).values()))
                lo, hi = bootstrap_ci(x, bootstrap, rng)
                means.append(x.mean())
                errs[0].append(x.mean() - lo)
                errs[1].append(hi - x.mean())
            ax.errorbar(shots, means, yerr=errs, marker="o", capsize=3, label=r.name, color=colour[str(r.path)])
        ax.set(
            title=f"VQA accuracy vs shots (first {n} questions, 95% CI)", xlabel="shots (ICDs)", ylabel="VQA acc. (%)"
        )
        ax.set_xticks(sorted({s for r in evaluated for s in r.eval["shots"]}))
        ax.legend(fontsize=7, loc="best")
        save(fig, "accuracy_vs_shots.png")

    def curves(metric: str) -> list[tuple[Run, list]]:
        out = []
        for r in runs:
            pts = [(e["epoch"], e[metric]) for e in r.epochs if e.get(metric) is not None]
            if len({round(v, 12) for _, v in pts}) > 1:  # a constant series says nothing: left out
                out.append((r, pts))
        return out

    panels = [(m, label) for m, label in (("val/acc", "greedy accuracy on validation anchors (%)"),) if curves(m)]
    panels += [
        (m, label)
        for m, label in (
            ("grpo/kl_ref", "KL to the reference (nats)"),
            ("grpo/selection_change", "selections changed vs reference"),
        )
        if curves(m)
    ]
    for group, name in ((panels[:1], "val_acc_per_epoch.png"), (panels[1:], "kl_and_selection_per_epoch.png")):
        if not group:
            continue
        fig, axes = plt.subplots(1, len(group), figsize=(6 * len(group), 4.2), squeeze=False)
        for ax, (metric, label) in zip(axes[0], group):
            for r, pts in curves(metric):
                ax.plot(*zip(*pts), marker="o", markersize=3, label=r.name, color=colour[str(r.path)])
            ax.set(title=label, xlabel="epoch", ylabel=metric)
            ax.legend(fontsize=7, loc="best")
        save(fig, name)
    return written


def summary_section(evaluated: list[Run], base: Run, stats: dict) -> str:
    """Runs x shots at the largest n every run has, each cell with its delta to the baseline (* = significant)."""
    n = str(common_n(evaluated))
    shots = sorted({s for r in evaluated for s in r.eval["shots"]})
    rows = []
    for r in evaluated:
        cells = []
        for s in shots:
            value = r.eval["summary"].get(n, {}).get(str(s))
            cell = "-" if value is None else f"{value:.2f}"
            pair = stats.get(str(r.path))
            if pair and value is not None and str(s) in base.eval["summary"].get(n, {}):
                mark = "*" if pair[1].get((n, s), "within noise") != "within noise" else ""
                cell += f" ({signed(value - base.eval['summary'][n][str(s)])}{mark})"
            cells.append(cell)
        known = [r.eval["summary"].get(n, {}).get(str(s)) for s in shots]
        avg = f"{np.mean(known):.2f}" if None not in known else "-"
        rows.append([r.name + (" (baseline)" if r is base else ""), *cells, avg])
    table = md_table(["run"] + [f"shot {s}" for s in shots] + ["avg"], rows)
    return (
        f"## At a glance: VQA accuracy (%) at n = {n}, (delta to {base.name})\n\n{table}\n\n"
        "\\* significant under the rule stated with the deltas below."
    )


def flags_section(runs: list[Run]) -> list[str]:
    """The training flags that differ between runs (a 2-epoch run must not sit silently beside a 10-epoch one)."""
    flags = {}
    for r in runs:
        if (r.path / "config.json").is_file():
            args = json.loads((r.path / "config.json").read_text()).get("args", {})
            flags[r.name] = {
                "stage": phase(r) or "?",
                **{k: v for k, v in args.items() if k not in ("out", *SIDE_ARGS)},
            }
    if len(flags) < 2:
        return []
    keys = sorted({k for f in flags.values() for k in f}, key=lambda k: (k != "stage", k))
    # A flag only one stage has (RCE's tau, GRPO's epsilon) is not a difference; one that two runs set apart is.
    differ = [k for k in keys if len({json.dumps(f[k]) for f in flags.values() if k in f}) > 1]
    if not differ:
        return []
    rows = [[name, *[str(f.get(k, "-")) for k in differ]] for name, f in flags.items()]
    return ["## Flags that differ between the trained runs", "", md_table(["run", *differ], rows), ""]


def default_baseline(evaluated: list[Run]) -> Run:
    """What deltas are taken against when --baseline is not given: the RCE warm-up (what GRPO must beat), else the
    random baseline, else the first evaluated run; never whatever a glob happens to list first."""
    rce = [r for r in evaluated if phase(r) == "rce"]
    random = [r for r in evaluated if r.eval.get("baseline") == "random"]
    return (rce or random or evaluated)[0]


def report(args: Args) -> str:
    runs = [r for r in (read_run(p, args.split) for p in args.runs) if r is not None]
    if not runs:
        raise ValueError("no run folders to compare")
    evaluated = [r for r in runs if r.eval is not None]
    sim = any(r.eval.get("simulation") for r in evaluated)
    parts = [f"# Comparison ({args.split} split{', simulated LVLM' if sim else ''})", ""]
    if evaluated:
        parts += ["## Accuracy (VQA %, first n questions of the fixed order)", ""]
        for r in evaluated:
            parts += [f"### {r.name}", "", accuracy_table(r.eval), ""]
        base = default_baseline(evaluated)
        if args.baseline is not None:
            want = Path(args.baseline).resolve()
            match = [r for r in evaluated if r.name == args.baseline or r.path.resolve() == want]
            if not match:
                raise ValueError(
                    f"--baseline {args.baseline}: not among the evaluated runs {[r.name for r in evaluated]}"
                )
            base = match[0]
        others = [r for r in evaluated if r is not base]
        rng = np.random.default_rng(args.seed)
        stats = {str(r.path): pair_stats(base, r, args, rng) for r in others if not not_comparable(base.eval, r.eval)}
        parts[2:2] = [summary_section(evaluated, base, stats), "", *flags_section(runs)]  # the tables at a glance
        if others:
            parts += [f"## Deltas against {base.name} (points)", ""]
            for r in others:
                parts += [delta_section(base, r, stats.get(str(r.path))), ""]
            parts += ["## Identical ICD selections (share of questions)", "", selection_table(evaluated), ""]
        if gaps := gap_section(evaluated, args, np.random.default_rng(args.seed)):
            parts += ["## Room taken (simulator ceilings)", "", gaps, ""]
    trained = [r for r in runs if r.epochs]
    if trained:
        parts += ["## Training", ""]
        for r in trained:
            parts += [f"### {r.name}", "", training_table(r), ""]
        parts += ["### Curve summary", "", curve_summary(trained), ""]
    for r in runs:
        if r.epoch_evals:
            parts += [f"## Accuracy per epoch: {r.name}", "", epoch_accuracy_table(r), ""]
    skipped = [r.name for r in runs if r.eval is None]
    if skipped:
        parts += [f"Runs without eval/{args.split}.json (training tables only): {', '.join(skipped)}", ""]
    return "\n".join(parts)


def main(args: Args) -> None:
    text = report(args)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out, text + "\n")
    if args.plot is not None:
        runs = [r for r in (read_run(p, args.split) for p in args.runs) if r is not None]
        for path in write_plots(runs, args.plot, args.bootstrap, args.seed):
            print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    run_cli(main, Args)
