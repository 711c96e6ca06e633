"""Validation: the expected reward over the scored sequences and, where something can answer them, the true accuracy
of the greedy picks, which chooses a run's best epoch."""

from __future__ import annotations

import torch
from torch import Tensor

from icl_select.backends import ScoreCache, open_backend
from icl_select.batches import Split, make_batch
from icl_select.data import Dataset
from icl_select.pools import CHUNK_ELEMENTS
from icl_select.train_args import TrainArgs
from model import DECODE_CHUNK, PointerSelector, slices


@torch.no_grad()
def greedy_icds(
    model: PointerSelector, ds: Dataset, split: str, rows: Tensor, pool: Tensor, k: int, min_picks: int = 0
) -> Tensor:
    """The selector's greedy demonstrations for the questions `rows` (n,) of `split` from their pools (n, K) of train
    rows (-1 = padding) -> (n, k) train rows in pick order, -1 after a stop (`min_picks` as in
    `PointerSelector.greedy`: a selector that can stop makes at least that many).
    Gathered slice by slice (`model.slices`), never for all n at once, each question decoded in the slice one whole call
    would put it in."""
    emb, (n, K) = ds.emb, pool.shape
    part = DECODE_CHUNK * max(1, CHUNK_ELEMENTS // (DECODE_CHUNK * K * emb["train"].shape[1]))
    model.eval()
    picks = []
    for s in slices(n, part):
        query, pool_emb = emb[split][rows[s]], emb["train"][pool[s].clamp_min(0)]  # (P, d), (P, K, d)
        picks.append(model.greedy(query, pool_emb, pool[s] >= 0, k, min_picks)[0])  # (P, k)
    picks = torch.cat(picks)  # (n, k) pool positions, -1 after a stop
    return pool.gather(1, picks.clamp_min(0)).where(picks >= 0, -1)


def prefix_accuracy(model: PointerSelector, backend, queries: Tensor, icds: Tensor, shots: range) -> list[Tensor]:
    """Accuracy of each question `queries` (n,) given the first k of its picks `icds` (n, S) (train rows in pick
    order), answered by `backend`: one (n,) per k in `shots`."""
    return [backend.score("train", queries, model.cfg.to_prompt(icds[:, :k]))["acc"] for k in shots]


@torch.no_grad()
def validate(
    model: PointerSelector, ds: Dataset, split: Split, backend=None, max_queries: int | None = None, min_picks: int = 0
) -> dict:
    """val/reward = mean over validation queries of sum_i softmax_i(log pi(seq_i)) r_i (the policy's expected
    reward when restricted to the scored sequences); with a backend, val/acc_k = VQA accuracy (%) of the greedy
    picks' first k on (the first `max_queries` of) the validation anchors, and val/acc = its mean over k; for a
    selector that may stop, val/demos = the demonstrations its greedy picks give, at least `min_picks` (the sequence
    length: its picks alone, judged as those of a selector that cannot stop)."""
    model.eval()
    b = make_batch(ds, split.val, split.reward, model.cfg)
    logp = model.log_probs(b.query, b.pool, b.pool_mask, b.seqs, b.seq_mask).sum(-1)  # (B, G)
    w = logp.masked_fill(~b.seq_mask, float("-inf")).softmax(-1)
    out = {"val/reward": float((w * b.reward).sum(-1).mean()), "select_metric": selection_metric(backend)}
    if backend is not None:
        n = max_queries or len(split.val)
        queries, pools = ds.groups.queries[split.val[:n]], ds.groups.pools[split.val[:n]]
        icds = greedy_icds(model, ds, "train", queries, pools, ds.seq_len, min_picks)  # (n, S) train rows, pick order
        accs = [100 * float(a.mean()) for a in prefix_accuracy(model, backend, queries, icds, range(1, ds.seq_len + 1))]
        out.update({f"val/acc_{k}": a for k, a in enumerate(accs, 1)}, **{"val/acc": sum(accs) / len(accs)})
        if model.cfg.can_stop:  # how many it gives, up to the data's sequence length
            out["val/demos"] = float((icds >= 0).sum(-1).double().mean())
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
    """What chooses the best epoch: the true accuracy of the greedy picks when they can be answered, else the expected
    reward over the scored validation groups (a proxy: it need not move the greedy picks). Epoch 0 is logged but never a
    candidate: a trained start was chosen on these anchors, so its score there is biased upwards."""
    return "val/reward" if backend is None else "val/acc"
