"""What a training epoch does besides its steps: the learning-rate schedule, epoch means, the stop on divergence, the
printed line."""

from __future__ import annotations

import math
from pathlib import Path

from icl_select.runs import last_checkpoint


def lr_factor(schedule: str, step: int, total: int) -> float:
    """Multiplier of the base learning rate at `step` (0-based) of `total` steps."""
    done = step / max(total, 1)
    return {"constant": 1.0, "linear": 1.0 - done, "cosine": 0.5 * (1.0 + math.cos(math.pi * done))}[schedule]


class EpochMeans:
    """An epoch's metrics from its steps' metrics: the mean of each, the maximum of those named *_max."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.maxes: dict[str, float] = {}

    def add(self, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            if k.endswith("_max"):
                self.maxes[k] = max(self.maxes.get(k, -math.inf), v)
            else:
                self.sums[k], self.counts[k] = self.sums.get(k, 0.0) + v, self.counts.get(k, 0) + 1

    def result(self) -> dict[str, float]:
        return {**{k: v / self.counts[k] for k, v in self.sums.items()}, **self.maxes}


def stop_if_diverged(metrics: dict[str, float], phase: str, epoch: int, step: int, out: Path, hint: str) -> None:
    """One line naming the step where the loss or the gradient norm stopped being finite, and the last good
    checkpoint (a non-finite gradient has skipped its optimizer step, so the weights are still finite)."""
    for key, what in (("train/loss", "loss"), ("train/grad_norm", "gradient norm")):
        if not math.isfinite(metrics.get(key, 0.0)):
            last = last_checkpoint(out)
            raise ValueError(
                f"{phase}: the {what} became {metrics[key]} at epoch {epoch}, step {step}; stopping. "
                f"The last good checkpoint is {last or 'none (no epoch finished)'}; {hint}"
            )


def log_line(record: dict, keys: tuple[str, ...]) -> str:
    return " ".join(f"{k.split('/')[-1]}={record[k]:.4g}" for k in keys if k in record)
