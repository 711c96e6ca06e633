"""The flags rce.py and grpo.py share, and their checks (`Named`: how grpo.py names a run folder after one)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from icl_select.backends import LVLMRun, check_lvlm_run
from icl_select.cli import SIDE, CpuArgs, Named, alias
from icl_select.data import DEFAULT_DATA, Quality, RewardArgs
from icl_select.tracking import ReportTo, check_installed


@dataclass
class TrainArgs(RewardArgs, LVLMRun, CpuArgs):
    data: Path = DEFAULT_DATA
    """Dataset folder written by gen_rl_data.py."""
    epochs: Annotated[int, alias("--num-train-epochs")] = 10
    """Passes over the training queries."""
    batch_size: Annotated[int, alias("--per-device-train-batch-size")] = 32
    """Queries per optimisation step (each brings its whole group of sequences)."""
    lr: Annotated[float, alias("--learning-rate")] = 1e-4
    """AdamW learning rate."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    grad_clip: Annotated[float, alias("--max-grad-norm")] = 1.0
    """Clip the global gradient norm to this (0 = off)."""
    keep_every: Annotated[int, SIDE] = 5
    """Keep every N-th epoch's checkpoint besides the best and the last two (0 = only those)."""
    lr_schedule: Annotated[Literal["constant", "linear", "cosine"], Named("lr-{}")] = "constant"
    """Learning rate over the run: constant, or decayed to 0 at the last step (linear, cosine; with --lvlm-budget, at
    the budget's last call)."""
    seed: Annotated[int, Named("seed{}")] = 0
    """Seed of the init, the train/val split, the shuffling and dropout."""
    val_frac: float = 0.1
    """Share of anchor queries held out (fixed by seed) to select the best epoch."""
    quality: Annotated[Quality, Named("q-{}")] = "all"
    """Curriculum filter on training anchors (tiers: docs/flags.md and the data report; online GRPO with --queries
    train draws its questions unfiltered, and the filter sets how many steps make an epoch)."""
    require_positive: Annotated[bool, Named("pos")] = False
    """Train only on queries with at least one correct sequence."""
    val_lvlm: bool = False
    """Real data: pick the best epoch by the LVLM's accuracy on validation anchors (docs/flags.md)."""
    val_max_queries: int = 200
    """--val-lvlm: validation anchors answered per epoch (the first N held out)."""
    report_to: Annotated[ReportTo, SIDE] = "none"
    """Also log to TensorBoard (<out>/tensorboard) or Weights & Biases (project icl-select)."""

    def fixed_length_reason(self) -> str | None:
        """Why a schedule of this run depends on its total length (then --epochs cannot change on resume), or None."""
        if self.lr_schedule != "constant":
            return f"--lr-schedule {self.lr_schedule} decays over all steps of the run"
        return None


def check_train_args(args: TrainArgs) -> None:
    check_lvlm_run(args)
    for name in ("epochs", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:  # None: planned later (grpo --lvlm-budget)
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.keep_every < 0:
        raise ValueError(f"--keep-every must be >= 0, got {args.keep_every}")
    if not 0 < args.val_frac < 1:
        raise ValueError(f"--val-frac must be in (0, 1), got {args.val_frac}")
    if args.val_max_queries < 1:
        raise ValueError(f"--val-max-queries must be >= 1, got {args.val_max_queries}")
    for flag, value in (("--lr", args.lr), ("--weight-decay", args.weight_decay), ("--grad-clip", args.grad_clip)):
        if not math.isfinite(value):  # NaN passes every comparison below
            raise ValueError(f"{flag} must be a finite number, got {value}")
    if args.lr <= 0 or args.weight_decay < 0 or args.grad_clip < 0:
        raise ValueError("--lr must be > 0, --weight-decay and --grad-clip >= 0")
    check_installed(args.report_to)
