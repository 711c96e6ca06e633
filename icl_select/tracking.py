"""Experiment trackers beside metrics.jsonl (--report-to tensorboard | wandb), imported only when asked for;
metrics.jsonl stays the record of truth. Epoch records go out at the run's global step, step records (grpo --kl-target)
as "steps/<name>"; a resumed run's TensorBoard log drops what the killed run logged past its checkpoint, and W&B ignores
steps it has. The W&B path is untested (no account or network here).
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path
from typing import Literal

ReportTo = Literal["none", "tensorboard", "wandb"]
NOT_SCALARS = ("phase", "kind", "epoch", "step", "best_epoch", "select_metric", "warnings")


def scalars(record: dict) -> dict[str, float]:
    prefix = "steps/" if record.get("kind") == "step" else ""
    return {
        prefix + k: float(v)
        for k, v in record.items()
        if k not in NOT_SCALARS and isinstance(v, int | float) and not isinstance(v, bool)
    }


class TensorBoard:
    def __init__(self, out: Path, config: dict, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: events at later steps, written by a run killed after its last checkpoint, are dropped (all of
        # them when a run killed before its first checkpoint starts again)
        purge = 0 if resume_step is None else resume_step + 1
        self.writer = SummaryWriter(str(out / "tensorboard"), purge_step=purge)
        if resume_step is None:
            self.writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in config.items()))

    def log(self, record: dict) -> None:
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandB:
    def __init__(self, out: Path, config: dict):
        import wandb

        # one W&B run per run folder, continued on resume (W&B ignores records at steps it already has)
        run_id = hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:16]
        self.run = wandb.init(
            project="icl-select", name=out.name, dir=str(out), config=config, id=run_id, resume="allow"
        )

    def log(self, record: dict) -> None:
        self.run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


def check_installed(kind: ReportTo) -> None:
    """Before any work: the package --report-to needs (tensorboard or wandb) must be importable."""
    if kind != "none" and importlib.util.find_spec(kind) is None:
        raise ValueError(f"--report-to {kind} needs the {kind} package: pip install {kind}")


def open_tracker(kind: ReportTo, out: Path, config: dict, resume_step: int | None):
    """The tracker for --report-to, or None; `resume_step` = the global step of the checkpoint a run resumes from."""
    if kind == "tensorboard":
        return TensorBoard(out, config, resume_step)
    return WandB(out, config) if kind == "wandb" else None
