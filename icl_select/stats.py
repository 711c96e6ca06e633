"""Paired statistics over evaluations: per-question scores, paired differences, bootstrap CIs, the sign test with
Holm's correction, and the share of a gap one run closes (`Bootstrap`: seeds, then trainings, then questions)."""

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


def bootstrap_ci(d: np.ndarray, resamples: int, rng: np.random.Generator) -> tuple[float, float]:
    """95% percentile bootstrap CI of the mean of d (resampling questions)."""
    idx = rng.integers(0, len(d), size=(resamples, len(d)))
    means = d[idx].mean(1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


class Bootstrap:
    """Percentile bootstrap CIs of b - a, the scores nested as seeds > trainings > questions and each level resampled
    with replacement in turn: seeds, then each chosen seed's trainings of a and of b, then its questions (one draw for
    every training of the seed: they answered the same questions). The statistic is the mean over seeds of the mean of
    b's trainings less the mean of a's, each over the drawn questions; so a seed or a training that came out high or
    low widens the interval as a question does. One training a side and one seed: the plain paired bootstrap over
    questions.

    rliable's stratified bootstrap (Agarwal et al., NeurIPS 2021) resamples runs within each task; here two recipes
    are paired question by question, so the questions are a level of their own below the trainings.

    Each draw (of Q questions, or of T trainings, for a seed's place) is made once and shared by every CI this object
    gives: a report's comparisons resample the same questions, as paired comparisons should, at one matrix product
    each."""

    def __init__(self, resamples: int, rng: np.random.Generator, level: float = 95):
        self.resamples, self.rng, self.level = resamples, rng, level
        self.drawn: dict[tuple, np.ndarray] = {}

    def weights(self, n: int, key: tuple) -> np.ndarray:
        """(n, R) how often each of n items is drawn in each resample, over n: the same for the same key."""
        if key not in self.drawn:
            idx = self.rng.integers(0, n, size=(self.resamples, n))  # (R, n)
            counts = np.zeros((self.resamples, n))
            np.add.at(counts, (np.arange(self.resamples)[:, None], idx), 1)
            self.drawn[key] = counts.T / n
        return self.drawn[key]

    def inner(self, groups: list[tuple[np.ndarray, ...]]) -> np.ndarray:
        """(sides, slots, seeds, R): each side's mean over one draw of its trainings and of the questions, for every
        slot a seed may fill (an independent draw each); `groups` per seed, a (trainings, questions) array a side."""
        S, R = len(groups), self.resamples
        out = np.empty((len(groups[0]), S, S, R))
        for s, sides in enumerate(groups):
            for slot in range(S):
                questions = self.weights(sides[0].shape[1], ("questions", sides[0].shape[1], slot))  # (Q, R)
                for side, x in enumerate(sides):
                    means = x @ questions  # (T, R) each training's mean over the drawn questions
                    w = self.weights(len(x), ("trainings", len(x), slot, side)) if len(x) > 1 else 1.0  # (T, R)
                    out[side, slot, s] = (means * w).sum(0)  # (R,) the drawn trainings' mean
        return out

    def over_seeds(self, inner: np.ndarray) -> np.ndarray:
        """(..., R): the mean of `inner` (..., slots, seeds, R) over S seeds drawn with replacement, a slot each."""
        S, R = inner.shape[-2], self.resamples
        chosen = self.rng.integers(0, S, size=(R, S)) if S > 1 else np.zeros((R, 1), dtype=int)  # (R, S) seeds drawn
        return inner[..., np.arange(S)[None, :], chosen, np.arange(R)[:, None]].mean(-1)

    def ci(self, pairs: list[tuple[np.ndarray, np.ndarray]]) -> tuple[float, float, float]:
        """The mean of b - a and its CI: `pairs` per seed (a, b), each (trainings, questions) per-question scores."""
        a, b = self.inner(pairs)
        means = self.over_seeds(b - a)  # (R,)
        point = float(np.mean([(b.mean(0) - a.mean(0)).mean() for a, b in pairs]))
        lo, hi = np.percentile(means, [(100 - self.level) / 2, (100 + self.level) / 2])
        return point, float(lo), float(hi)

    def share(self, triples: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> tuple[float, float, float]:
        """The share of the a -> top gap that b closes, (b - a) / (top - a) of their means over seeds, trainings and
        questions, and its CI (each resample's ratio of its own means): `triples` per seed, as `ci`'s pairs."""
        means = self.over_seeds(self.inner(triples))  # (3, R)
        a, b, top = (np.mean([x[i].mean(0).mean() for x in triples]) for i in range(3))
        with np.errstate(divide="ignore", invalid="ignore"):
            shares = (means[1] - means[0]) / (means[2] - means[0])  # (R,)
        lo, hi = np.nanpercentile(shares, [(100 - self.level) / 2, (100 + self.level) / 2])
        return float((b - a) / (top - a)), float(lo), float(hi)


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


def pair_cells(a: list[dict], b: list[dict], shots: list[int], n: int, boot: Bootstrap) -> dict:
    """b - a at every shot and on the average over shots (first n questions), each side a recipe's trainings (their
    evaluations, one or more), under the one verdict rule: the CI (`Bootstrap`: trainings, then questions) excludes 0
    and the sign test on the trainings' mean per question passes Holm's correction over these cells."""
    cells = {}
    for k in [*shots, "avg"]:
        sides = [scores_by_training(docs, k, n, shots) for docs in (a, b)]  # (T, Q) each
        delta, lo, hi = boot.ci([(sides[0], sides[1])])
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
