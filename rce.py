"""Stage 2: reward-weighted cross-entropy (RCE) warm-up of the pointer selector.

Loss per query: sum_i w_i * (-log pi(seq_i)) over its group of scored sequences, w = softmax(reward / tau) over
the group's valid sequences, tau annealed linearly from --temp-start to --temp-end over all steps. `--top1` is
plain cross-entropy on each group's best sequence (a supervised baseline).

Departures from Lever-Plus's trainer, each measured on the simulator (README, "What moves the learning"):
- only groups whose rewards differ are trained on (--quality varied). In a group where every sequence scored the
  same, softmax(reward / tau) is uniform and its cross-entropy pulls the selector towards the uniform policy over
  random sequences; with 60% of the groups tied, that pull dominated and the warm-up barely moved from its init;
- a fresh selector reads its picks nearest-first (model.json pick_order): the first pick sits next to the query,
  so the greedy decode's best pick stays there in every k-shot prompt (k-shot = the first k picks);
- the best epoch is chosen by the true accuracy of the greedy picks on held-out anchor queries when the backend
  can answer them (always on the simulator; --val-lvlm on real data), else by validation reward; never by the RCE
  loss, never on the evaluation questions.

Usage:
    python rce.py                                  # data/sim -> runs/rce
    python rce.py --top1 --out runs/sup            # supervised top-1 baseline
    python rce.py                                  # again: continues an interrupted run, leaves a finished one
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import torch
from torch import Tensor

from checkpoints import load_selector
from cli import alias, help_first, run_cli
from data import Quality
from model import PickOrder, PointerSelector, SelectorConfig, rce_weights
from training import (
    Loop,
    TrainArgs,
    adamw,
    check_train_args,
    clipped_step,
    make_batch,
    open_run,
    run_training,
    steps_per_epoch,
)


@help_first("data", "out")
@dataclass
class Args(TrainArgs):
    out: Annotated[Path, alias("--output-dir")] = Path("runs/rce")
    """Run folder."""
    temp_start: float = 2.0
    """RCE temperature at the first step."""
    temp_end: float = 0.5
    """RCE temperature at the last step (linear annealing)."""
    quality: Quality = "varied"
    """Training queries: varied (default) = those whose scored sequences do not all share one reward. In an
    all-equal group softmax(reward / tau) is uniform, and its cross-entropy pulls the selector towards the uniform
    policy over random sequences without saying which demonstrations help; high / medium / all as in grpo.py."""
    top1: bool = False
    """Plain cross-entropy on each group's best sequence instead of reward weighting."""
    init: Path | None = None
    """Start from this selector (run folder or epoch checkpoint) instead of a fresh one."""
    hidden: int = 256
    """Selector width (fresh selectors only)."""
    num_layers: int = 1
    """Cross-attention layers (fresh selectors only)."""
    num_heads: int = 4
    """Attention heads (fresh selectors only)."""
    dropout: float = 0.1
    """Dropout during RCE training (fresh selectors only)."""
    pick_order: PickOrder = "nearest_first"
    """Fresh selectors: nearest_first = the first pick sits next to the query (prompt = picks reversed), so every
    k-shot prefix of a greedy decode keeps the best pick next to the query; prompt = picks in prompt order."""

    def fixed_length_reason(self) -> str | None:
        return "RCE anneals tau over all steps of the run"


def top1_weights(reward: Tensor, mask: Tensor) -> Tensor:
    """One-hot on each group's best valid sequence (the first one on ties): (B, G) -> (B, G)."""
    best = reward.masked_fill(~mask, float("-inf")).argmax(-1)  # (B,)
    return torch.nn.functional.one_hot(best, reward.shape[1]).to(reward.dtype)


def main(args: Args) -> None:
    check_train_args(args)
    if args.temp_start <= 0 or args.temp_end <= 0:
        raise ValueError("--temp-start and --temp-end must be > 0")
    run = open_run(args, args.out)
    ds, split = run.ds, run.split
    if args.init is not None:
        model = load_selector(args.init)
    else:
        cfg = SelectorConfig(
            dim=ds.emb["train"].shape[1],
            hidden=args.hidden,
            num_layers=args.num_layers,
            num_heads=args.num_heads,
            dropout=args.dropout,
            pick_order=args.pick_order,
        )
        model = PointerSelector(cfg)
    opt = adamw(model.parameters(), args.lr, args.weight_decay)
    total = args.epochs * steps_per_epoch(split, args.batch_size)

    def step(idx: Tensor, step: int, state: dict) -> dict[str, float]:
        model.train()  # dropout on: the warm-up is plain supervised learning
        tau = args.temp_start + (args.temp_end - args.temp_start) * step / max(total - 1, 1)
        b = make_batch(ds, idx, split.reward, model.cfg)
        logp = model.log_probs(b.query, b.pool, b.pool_mask, b.seqs, b.seq_mask).sum(-1)  # (B, G)
        w = top1_weights(b.reward, b.seq_mask) if args.top1 else rce_weights(b.reward, b.seq_mask, tau)  # (B, G)
        loss = -(w.to(logp.dtype) * logp).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = clipped_step(opt, list(model.parameters()), args.grad_clip)
        return {"train/loss": loss.item(), "train/tau": tau, "train/grad_norm": norm}

    run_training(
        Loop(args=args, start=run, model=model, opt=opt, phase="rce", step=step, postfix=("train/loss", "train/tau"))
    )


if __name__ == "__main__":
    run_cli(main, Args)
