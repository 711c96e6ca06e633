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


def nested_ci(
    pairs: list[tuple[np.ndarray, np.ndarray]], resamples: int, rng: np.random.Generator, level: float = 95
) -> tuple[float, float, float]:
    """The mean of b - a and its percentile bootstrap CI, the scores nested as seeds > trainings > questions and each
    level resampled with replacement in turn: seeds, then each chosen seed's trainings of a and of b, then its questions
    (one draw for every training of the seed: they answered the same questions). `pairs`: per seed (a, b), each
    (trainings, questions) per-question scores. The statistic is the mean over seeds of the mean of b's trainings
    less the mean of a's, each over the drawn questions; so a seed or a training that came out high or low widens the
    interval as a question does. One training a side and one seed: the plain paired bootstrap over questions.

    rliable's stratified bootstrap (Agarwal et al., NeurIPS 2021) resamples runs within each task; here two recipes
    are paired question by question, so the questions are a level of their own below the trainings."""
    S = len(pairs)
    inner = np.empty((S, S, resamples))  # (slot, seed, R): an independent inner draw for every slot a seed may fill
    for s, (a, b) in enumerate(pairs):
        Q = a.shape[1]
        for slot in range(S):
            questions = rng.multinomial(Q, np.full(Q, 1 / Q), size=resamples).T / Q  # (Q, R) weights
            drawn = []
            for x in (a, b):
                T = x.shape[0]
                trainings = rng.multinomial(T, np.full(T, 1 / T), size=resamples) / T  # (R, T) weights
                drawn.append((trainings * (x @ questions).T).sum(1))  # (R,)
            inner[slot, s] = drawn[1] - drawn[0]
    chosen = rng.integers(0, S, size=(resamples, S))  # (R, S) the seed each slot draws
    means = inner[np.arange(S)[None, :], chosen, np.arange(resamples)[:, None]].mean(1)  # (R,)
    point = float(np.mean([(b.mean(0) - a.mean(0)).mean() for a, b in pairs]))
    lo, hi = np.percentile(means, [(100 - level) / 2, (100 + level) / 2])
    return point, float(lo), float(hi)


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
    trainings: tuple[int, int] = (1, 1)  # the trainings each side rests on


def pair_cells(
    a: list[dict], b: list[dict], shots: list[int], n: int, resamples: int, rng: np.random.Generator
) -> dict:
    """b - a at every shot and on the average over shots (first n questions), each side a recipe's trainings (their
    evaluations, one or more), under the one verdict rule: the CI (`nested_ci`: trainings, then questions) excludes 0
    and the sign test on the trainings' mean per question passes Holm's correction over these cells."""
    cells = {}
    for k in [*shots, "avg"]:
        sides = [scores_by_training(docs, k, n, shots) for docs in (a, b)]  # (T, Q) each
        delta, lo, hi = nested_ci([(sides[0], sides[1])], resamples, rng)
        d = sides[1].mean(0) - sides[0].mean(0)  # (Q,) per question, over the trainings
        cells[k] = Cell(100 * delta, 100 * lo, 100 * hi, sign_test(d), trainings=(len(a), len(b)))
    for c, ok in zip(cells.values(), holm([c.p for c in cells.values()])):
        c.significant = ok and (c.lo > 0 or c.hi < 0)
    return cells


def scores_by_training(docs: list[dict], shot: int | str, n: int, shots: list[int]) -> np.ndarray:
    """(trainings, questions) scores at one shot ("avg": the mean over `shots`) on the first n questions."""
    per = [per_question(d, n, shots) if shot == "avg" else scores(d, shot, n) for d in docs]
    common = [q for q in per[0] if all(q in p for p in per)]
    return np.array([[p[q] for q in common] for p in per], dtype=np.float64)


def gap_share(a: dict, b: dict, top: dict, resamples: int, rng: np.random.Generator) -> tuple[float, float, float]:
    """Share of the mean a -> top gap that b closes over their common questions, with a paired bootstrap 95% CI
    (questions resampled together for the three runs)."""
    x = np.array([[a[q], b[q], top[q]] for q in a if q in b and q in top])  # (n, 3)
    boot = x[rng.integers(0, len(x), size=(resamples, len(x)))].mean(1)  # (R, 3)
    with np.errstate(divide="ignore", invalid="ignore"):
        share, shares = ((m[..., 1] - m[..., 0]) / (m[..., 2] - m[..., 0]) for m in (x.mean(0), boot))
    lo, hi = np.nanpercentile(shares, [2.5, 97.5])
    return float(share), float(lo), float(hi)
