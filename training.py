"""What rce.py and grpo.py share: flags, the train/validation split, batches, validation, run folders, metrics log.

The training loops themselves live in rce.py and grpo.py, top to bottom. A run folder holds config.json,
metrics.jsonl (one flushed JSON object per logged epoch), ckpt/epoch_NNN.safetensors (checkpoints.py: model,
optimizer, RNG and loop state, so a re-run of an interrupted command ends bit-identical to an uninterrupted run) and
model.safetensors + model.json, the best trained epoch on held-out anchor queries. Every file is written to a
temporary name and renamed, so a killed run never leaves a half-written file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import torch
from torch import Tensor

from backends import LVLMRun, ScoreCache, check_lvlm_run, open_backend
from checkpoints import last_checkpoint
from cli import CpuArgs, alias
from data import DEFAULT_DATA, Dataset, Quality, RewardArgs, compute_reward, filter_queries
from model import DECODE_CHUNK, PointerSelector, SelectorConfig, reward_spread, slices
from pools import CHUNK_ELEMENTS
from tracking import ReportTo, check_installed


@dataclass
class TrainArgs(RewardArgs, LVLMRun, CpuArgs):
    """Flags common to rce.py and grpo.py."""

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
    keep_every: int = 5
    """Checkpoints kept (model, optimizer and RNG state, for resuming and for evaluate.py --epochs): every N-th
    epoch's, plus the best, the last and the one before it (0 = only those; 1 = every epoch's)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning rate over the run: constant, or decayed to 0 at the last step (linear as TRL's default, cosine)."""
    seed: int = 0
    """Seed of the init, the train/val split, the shuffling and dropout."""
    val_frac: float = 0.1
    """Share of anchor queries held out (fixed by seed) to select the best epoch."""
    quality: Quality = "all"
    """Curriculum filter on training queries: high (high only), medium (high + medium), varied (rewards not all
    equal), all; see the data report."""
    require_positive: bool = False
    """Train only on queries with at least one correct sequence."""
    allow_truncated: bool = False
    """Ignore a truncated last line of rl_data.jsonl (an interrupted gen_rl_data run) instead of failing."""
    val_lvlm: bool = False
    """Real data: each epoch, also ask the dataset's LVLM to answer the validation anchors with the greedy picks
    (1..S shots, at most --val-max-queries anchors, each distinct prompt once per process) and choose the best
    epoch by that accuracy. The simulator always does this (it answers instantly)."""
    val_max_queries: int = 200
    """--val-lvlm: validation anchors answered per epoch (the first N of the held-out split)."""
    report_to: ReportTo = "none"
    """Also send every logged record to TensorBoard (<out>/tensorboard) or Weights & Biases (project icl-select),
    if that package is installed; metrics.jsonl is always written."""

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


# ----------------------------------------------------------------------------------------------------------------------
# Data for training


@dataclass
class Split:
    """Train and validation queries (indices into the dataset's groups) and every group's reward."""

    train: Tensor  # (Q_train,)
    val: Tensor  # (Q_val,)
    reward: Tensor  # (Q, G) float64, 0 where padded


def split_queries(ds: Dataset, args: TrainArgs) -> Split:
    """Validation queries held out by image (questions on one image never straddle the split), fixed by the seed;
    the curriculum filters apply to the training part only."""
    g = ds.groups
    n = len(g)
    target = int(round(n * args.val_frac))
    image = torch.tensor([ds.items["train"][q]["image_id"] for q in g.queries.tolist()])
    _, image = image.unique(return_inverse=True)  # (Q,) image index of each query
    order = torch.randperm(int(image.max()) + 1, generator=torch.Generator().manual_seed(args.seed))
    taken = torch.bincount(image, minlength=len(order))[order].cumsum(0)  # queries held out after each image
    val_images = order[: int((taken < target).sum()) + 1] if target > 0 else order[:0]
    is_val = torch.isin(image, val_images)
    val, train = is_val.nonzero()[:, 0], (~is_val).nonzero()[:, 0]
    if len(val) == 0 or len(train) == 0:
        raise ValueError(
            f"--val-frac {args.val_frac} of {n} anchor queries leaves {len(val)} for validation and "
            f"{len(train)} for training; both need at least one"
        )
    reward = compute_reward(g.fields, args).where(g.seq_mask, 0.0)
    keep = filter_queries(g, reward, args.quality, args.require_positive)
    train = train[torch.isin(train, keep)]
    if len(train) == 0:
        flags = f"--quality {args.quality}{' --require-positive' if args.require_positive else ''}"
        hint = (
            f"; every group's sequences share one {args.reward_mode} reward, so there is nothing to learn from "
            "(a graded reward such as --reward-mode hard_plus_gtprob may separate them; --quality all trains anyway)"
            if args.quality == "varied" and not (reward_spread(reward, g.seq_mask) > 0).any()
            else ""
        )
        raise ValueError(f"no training query passes {flags}{hint}")
    return Split(train, val, reward)


def steps_per_epoch(split: Split, batch_size: int) -> int:
    return math.ceil(len(split.train) / batch_size)


@dataclass
class Batch:
    query: Tensor  # (B, d)
    pool: Tensor  # (B, K, d)
    pool_mask: Tensor  # (B, K)
    seqs: Tensor  # (B, G, S)
    seq_mask: Tensor  # (B, G)
    reward: Tensor  # (B, G)


def make_batch(ds: Dataset, idx: Tensor, reward: Tensor, cfg: SelectorConfig) -> Batch:
    """Gather the embeddings of the queries `idx` (indices into ds.groups), their pools, and their scored sequences
    in the pick order of a selector configured by `cfg`."""
    g, emb = ds.groups, ds.emb["train"]
    pool_ids = g.pools[idx]  # (B, K)
    seqs = cfg.from_prompt(g.seqs[idx])  # (B, G, S)
    return Batch(emb[g.queries[idx]], emb[pool_ids.clamp_min(0)], g.pool_mask[idx], seqs, g.seq_mask[idx], reward[idx])


# ----------------------------------------------------------------------------------------------------------------------
# Validation: expected reward over the scored sequences, and (simulator) true accuracy of the greedy choice


@torch.no_grad()
def greedy_icds(model: PointerSelector, ds: Dataset, split: str, rows: Tensor, pool: Tensor, k: int) -> Tensor:
    """The selector's greedy demonstrations for the questions `rows` (n,) of `split`, from their pools (n, K) of train
    rows (-1 = padding): (n, k) train rows in pick order.

    The pools' embeddings are gathered for parts of whole decoder slices (DECODE_CHUNK rows, `model.slices`), never
    for all n questions at once, and every question is decoded in the slice one whole call would put it in."""
    emb, (n, K) = ds.emb, pool.shape
    part = DECODE_CHUNK * max(1, CHUNK_ELEMENTS // (DECODE_CHUNK * K * emb["train"].shape[1]))
    model.eval()
    picks = []
    for s in slices(n, part):
        query, pool_emb = emb[split][rows[s]], emb["train"][pool[s].clamp_min(0)]  # (P, d), (P, K, d)
        picks.append(model.greedy(query, pool_emb, pool[s] >= 0, k)[0])  # (P, k)
    return pool.gather(1, torch.cat(picks))


@torch.no_grad()
def validate(model: PointerSelector, ds: Dataset, split: Split, backend=None, max_queries: int | None = None) -> dict:
    """val/reward = mean over validation queries of sum_i softmax_i(log pi(seq_i)) r_i (the policy's expected
    reward when restricted to the scored sequences); with a backend, val/acc_k = VQA accuracy (%) of the greedy
    picks' first k on (the first `max_queries` of) the validation anchors, and val/acc = its mean over k."""
    model.eval()
    b = make_batch(ds, split.val, split.reward, model.cfg)
    logp = model.log_probs(b.query, b.pool, b.pool_mask, b.seqs, b.seq_mask).sum(-1)  # (B, G)
    w = logp.masked_fill(~b.seq_mask, float("-inf")).softmax(-1)
    out = {"val/reward": float((w * b.reward).sum(-1).mean()), "select_metric": selection_metric(backend)}
    if backend is not None:
        n = max_queries or len(split.val)
        queries, pools = ds.groups.queries[split.val[:n]], ds.groups.pools[split.val[:n]]
        icds = greedy_icds(model, ds, "train", queries, pools, ds.seq_len)  # (n, S) train rows in pick order
        accs = [
            100 * float(backend.score("train", queries, model.cfg.to_prompt(icds[:, :k]))["acc"].mean())
            for k in range(1, ds.seq_len + 1)
        ]
        out.update({f"val/acc_{k}": a for k, a in enumerate(accs, 1)}, **{"val/acc": sum(accs) / len(accs)})
    return out


def dataset_backend(ds: Dataset, args: TrainArgs) -> ScoreCache:
    """The backend that scored the dataset (the simulator, or its LVLM with the run's flags), behind a score cache."""
    backend = open_backend(ds.meta, ds.items, ds.emb, args)
    return ScoreCache(backend)


def validation_backend(ds: Dataset, args: TrainArgs) -> ScoreCache | None:
    """What answers the validation anchors' greedy picks (cached): the simulator of a simulated dataset, the
    dataset's LVLM with --val-lvlm, else None (then the best epoch is chosen by val/reward)."""
    return dataset_backend(ds, args) if ds.is_sim or args.val_lvlm else None


def selection_metric(backend) -> str:
    """What chooses the best epoch: the true accuracy of the greedy picks when they can be answered, else the
    expected reward over the scored validation groups (a proxy: it rewards probability on the better *scored*
    sequences, which need not move the greedy picks the evaluation uses). Never the loss, never test questions.

    Epoch 0 (the starting weights) is logged but never a candidate: a trained start was itself chosen as the best
    of its run on these same anchors, so its score there is biased upwards and would beat a better later epoch by
    chance. Whether training helped is for evaluate.py and compare.py to say, with paired tests."""
    return "val/reward" if backend is None else "val/acc"


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
