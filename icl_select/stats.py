"""Paired statistics over evaluations: per-question scores, paired differences, bootstrap CIs, the sign test with
Holm's correction, and the share of a gap one run closes."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def scores(doc: dict, shot: int, n: int) -> dict:
    """question_id -> score for one shot, first n questions of the fixed order."""
    rows = [r for r in doc["results"] if r["shot"] == shot][:n]
    return {r["question_id"]: r["score"] for r in rows}


def per_question(doc: dict, n: int, shots: list[int] | None = None) -> dict:
    """question_id -> mean score over `shots` (default: every evaluated shot), first n questions."""
    per_shot = [scores(doc, s, n) for s in shots or doc["shots"]]
    return {q: sum(d[q] for d in per_shot) / len(per_shot) for q in per_shot[0]}


def accuracy(doc: dict, shot: int | str, n: int) -> float:
    """VQA accuracy (%) at one shot ("avg": averaged over the file's shots), unrounded, first n questions."""
    per_q = per_question(doc, n) if shot == "avg" else scores(doc, shot, n)
    return 100 * float(np.mean(list(per_q.values())))


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


@dataclass
class Cell:
    """One paired comparison (one shot, or the average over shots): points, 95% CI, sign-test p, verdict."""

    delta: float
    lo: float
    hi: float
    p: float
    significant: bool = False


def pair_cells(a: dict, b: dict, shots: list[int], n: int, resamples: int, rng: np.random.Generator) -> dict:
    """b - a at every shot and on the average over shots (first n questions), under the one verdict rule: the CI
    excludes 0 and the sign test passes Holm's correction over these cells."""
    diffs = {s: paired(scores(a, s, n), scores(b, s, n)) for s in shots}
    diffs["avg"] = paired(per_question(a, n, shots), per_question(b, n, shots))
    cells = {}
    for k, d in diffs.items():
        lo, hi = bootstrap_ci(100 * d, resamples, rng)
        cells[k] = Cell(100 * float(d.mean()), lo, hi, sign_test(d))
    for c, ok in zip(cells.values(), holm([c.p for c in cells.values()])):
        c.significant = ok and (c.lo > 0 or c.hi < 0)
    return cells


def gap_share(a: dict, b: dict, top: dict, resamples: int, rng: np.random.Generator) -> tuple[float, float, float]:
    """Share of the mean a -> top gap that b closes over their common questions, with a paired bootstrap 95% CI
    (questions resampled together for the three runs)."""
    x = np.array([[a[q], b[q], top[q]] for q in a if q in b and q in top])  # (n, 3)
    boot = x[rng.integers(0, len(x), size=(resamples, len(x)))].mean(1)  # (R, 3)
    with np.errstate(divide="ignore", invalid="ignore"):
        share, shares = ((m[..., 1] - m[..., 0]) / (m[..., 2] - m[..., 0]) for m in (x.mean(0), boot))
    lo, hi = np.nanpercentile(shares, [2.5, 97.5])
    return float(share), float(lo), float(hi)
