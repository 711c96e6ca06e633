"""Training data: the train/validation split of the anchor queries and the batches gathered from it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from icl_select.data import Dataset, compute_reward, filter_queries
from icl_select.train_args import TrainArgs
from model import SelectorConfig, reward_spread


@dataclass
class Split:
    """Train and validation queries (indices into the dataset's groups) and every group's reward."""

    train: Tensor  # (Q_train,)
    val: Tensor  # (Q_val,)
    reward: Tensor  # (Q, G) float64, 0 where padded


def image_index(ds: Dataset, anchors: Tensor) -> Tensor:
    """Each of these anchors' image, numbered 0..m-1 among them: (n,) -> (n,). Splits go by image, so that questions
    on one image never straddle them."""
    image = ds.picture_ids["train"][ds.groups.queries[anchors]]
    return image.unique(return_inverse=True)[1]


def split_queries(ds: Dataset, args: TrainArgs) -> Split:
    """Validation queries held out by image (questions on one image never straddle the split), fixed by the seed;
    the curriculum filters apply to the training part only."""
    g = ds.groups
    n = len(g)
    target = int(round(n * args.val_frac))
    image = image_index(ds, torch.arange(n))  # (Q,)
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


def steps_per_epoch(train: Tensor, batch_size: int) -> int:
    """Batches in a pass over the training anchors `train` (the last may be smaller)."""
    return math.ceil(len(train) / batch_size)


def pass_batches(train: Tensor, batch: int, shuffle: torch.Generator) -> list[tuple[Tensor, bool]]:
    """An epoch without a budget: one shuffled pass over the training anchors in batches (the last may be smaller),
    each with whether it is the epoch's last."""
    parts = train[torch.randperm(len(train), generator=shuffle)].split(batch)
    return [(idx, i == len(parts) - 1) for i, idx in enumerate(parts)]


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
    in the pick order of a selector configured by `cfg`. Every selector learns from the sequences of full length
    alone: one that may stop learns its picks as one that cannot, and its stop online (grpo.py)."""
    g, emb = ds.groups, ds.emb["train"]
    pool_ids = g.pools[idx]  # (B, K)
    seqs = cfg.from_prompt(g.seqs[idx])  # (B, G, S)
    mask = g.seq_mask[idx] & (seqs >= 0).all(-1)  # (B, G)
    return Batch(emb[g.queries[idx]], emb[pool_ids.clamp_min(0)], g.pool_mask[idx], seqs, mask, reward[idx])
