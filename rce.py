"""Stage 2: reward-weighted cross-entropy (RCE) warm-up of the pointer selector, or a retriever on the same data.

Loss per query: sum_i w_i * (-log pi(seq_i)) over its group of scored sequences, w = softmax(reward / tau) over the
group's valid sequences, tau annealed linearly from --temp-start to --temp-end over all steps. `--weights top1` is plain
cross-entropy on each group's best sequence (a supervised baseline), `--weights uniform` on every sequence alike
(ICD-LM's objective on Lever-LM's InfoScore beams, docs/rivals.md). It trains on the groups whose rewards differ and
keeps the best epoch on held-out anchors; docs/design.md says why each choice differs from Lever-Plus. A selector that
may stop (--can-stop) learns its picks here as one that fills every slot does, from the same loss on its picks given
that it goes on. Its stop at each step is then set from cross-fitting, alike for every question: two more selectors,
each trained on half of the training anchors, pick for the other half, answered at 0..S shots, and after t picks it goes
on with p = what going on won there (the later steps deciding as set), as a share of all it won or lost
(`icl_select.stops.set_stops`; S + 1 LVLM prompts an anchor, the simulator's or --val-lvlm's; without either its stop
stays untrained). grpo.py --online then fits which questions to give none.

`--retriever` trains a bi-encoder on the same scored groups instead (MSIER / EPR): no cross-attention and no state
update, so the query scores each candidate alone and the top k are its picks. Each demonstration is credited with a
share of its group's rewards (`--credit`), and the loss is the cross-entropy of the candidates' softmax against
softmax(credit / tau) over the candidates the group scored.

Usage:
    python rce.py                                  # data/sim -> runs/rce
    python rce.py --weights top1 --out runs/sup    # supervised top-1 baseline
    python rce.py --retriever                      # -> runs/retriever, the bi-encoder rival
    python rce.py                                  # again: continues an interrupted run, leaves a finished one
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Literal

import torch
import tyro
from torch import Tensor
from torch.optim import AdamW
from tqdm import tqdm

from icl_select import lineage
from icl_select.batches import Batch, Split, image_index, make_batch, pass_batches, split_queries, steps_per_epoch
from icl_select.cli import alias, default_is, help_first, run_cli
from icl_select.data import Quality, load_dataset
from icl_select.epochs import EpochMeans, log_line, lr_factor, stop_if_diverged
from icl_select.runs import Loop, RunFolder, check_continues, check_selector, load_selector, read_metrics
from icl_select.stops import set_stops
from icl_select.train_args import TrainArgs, check_train_args
from icl_select.validation import (
    greedy_icds,
    prefix_accuracy,
    selection_metric,
    validate,
    validation_backend,
)
from model import Credit, PointerSelector, SelectorConfig, demo_credits, going_on_logp, rce_weights

SHOWN = ("train/loss", "train/tau")  # on the progress bar and the epoch line


@help_first("data", "out", "init")
@dataclass
class Args(TrainArgs, SelectorConfig):
    """The selector's settings (--hidden, --num-layers, --num-heads, --dropout, --temperature, --pick-order) shape a
    fresh selector; --init starts from a trained one instead."""

    out: Annotated[Path | None, alias("--output-dir"), default_is("runs/rce, or runs/retriever (--retriever)")] = None
    """Run folder."""
    temp_start: float = 2.0
    """RCE temperature at the first step."""
    temp_end: float = 0.5
    """RCE temperature at the last step (linear annealing)."""
    quality: Quality = "varied"
    """Training queries; varied = those whose rewards are not all equal (docs/flags.md)."""
    weights: Literal["reward", "top1", "uniform"] = "reward"
    """How a group's sequences are weighted: softmax(reward / tau), the best one alone, or all alike."""
    retriever: bool = False
    """Train a bi-encoder retriever (no cross-attention, no state update) on demonstration credits instead."""
    credit: Credit = "mean"
    """--retriever: how a sequence's reward is credited to its demonstrations (docs/rivals.md)."""
    init: Path | None = None
    """Start from this selector (run folder or epoch checkpoint) instead of a fresh one."""
    dim: tyro.conf.Suppress[int] = 0
    """Not a flag: a fresh selector takes the data's embedding size."""
    picks: int = 0
    """Demonstrations the selector may be asked for, at least the data's sequence length (0 = that length, or
    --init's own count where that is more)."""

    def fixed_length_reason(self) -> str | None:
        return "RCE anneals tau over all steps of the run"


def top1_weights(reward: Tensor, mask: Tensor) -> Tensor:
    """One-hot on each group's best valid sequence (the first one on ties): (B, G) -> (B, G)."""
    best = reward.masked_fill(~mask, float("-inf")).argmax(-1)  # (B,)
    return torch.nn.functional.one_hot(best, reward.shape[1]).to(reward.dtype)


def sequence_loss(model: PointerSelector, b: Batch, args: Args, tau: float) -> Tensor:
    """sum_i w_i * (-log pi(seq_i)) per group, averaged over the batch; w by --weights."""
    if model.cfg.can_stop:
        logp = going_on_logp(model(b.query, b.pool, b.pool_mask, b.seqs, b.seq_mask, True), b.seqs)
    else:
        logp = model.log_probs(b.query, b.pool, b.pool_mask, b.seqs, b.seq_mask).sum(-1)  # (B, G)
    if args.weights == "top1":
        w = top1_weights(b.reward, b.seq_mask)
    elif args.weights == "uniform":
        w = b.seq_mask / b.seq_mask.sum(-1, keepdim=True)
    else:
        w = rce_weights(b.reward, b.seq_mask, tau)
    return -(w.to(logp.dtype) * logp).sum(-1).mean()


def retriever_loss(model: PointerSelector, b: Batch, args: Args, tau: float) -> Tensor:
    """Cross-entropy of the selector's first-step distribution over the candidates the group scored against
    softmax(credit / tau) over them, averaged over the batch."""
    credit, seen = demo_credits(b.seqs, b.seq_mask, b.reward, b.pool.shape[1], args.credit)  # (B, K) x2
    target = (credit / tau).masked_fill(~seen, float("-inf")).softmax(-1)  # (B, K)
    s, keys, prior = model.encode(b.query, b.pool, b.pool_mask)
    log_dist = model.step_log_dist(s[:, None], keys, prior, (seen & b.pool_mask)[:, None])[:, 0]  # (B, K)
    return -(target.to(log_dist.dtype) * log_dist.masked_fill(~seen, 0.0)).sum(-1).mean()


def starting_selector(args: Args, ds) -> PointerSelector | None:
    """--init's selector, checked against the data and the flags that shape a fresh one (None without --init). Such a
    flag, set to other than its default and other than --init's value, is refused: it would be silently ignored."""
    if args.init is None:
        return None
    model = load_selector(args.init)
    check_selector(model, args.init, lineage.reads(ds.meta), ds.folder, ds.emb["train"].shape[1])
    shaped = [f for f in fields(SelectorConfig) if f.name not in ("dim", "picks")]
    if given := [f.name for f in shaped if getattr(args, f.name) not in (f.default, getattr(model.cfg, f.name))]:
        flag = given[0].replace("_", "-")
        raise ValueError(
            f"--{flag} shapes a fresh selector; --init {args.init} brings its own ({given[0]}="
            f"{getattr(model.cfg, given[0])!r}): drop --{flag}, or train a fresh selector without --init"
        )
    if args.retriever and model.cfg.state_update:
        raise ValueError(f"--retriever trains a bi-encoder; --init {args.init} is a pointer selector (state_update)")
    return model


def new_selector(args: Args, ds, init: PointerSelector | None, picks: int) -> tuple[PointerSelector, AdamW]:
    """--init's selector (a copy), or a fresh one shaped by the flags, and its optimizer; the stop is not trained here
    (`set_stops` sets it after)."""
    if init is not None:
        model = copy.deepcopy(init)
        model.set_picks(picks)  # what it may be asked for from here on
    else:
        settings = {f.name: getattr(args, f.name) for f in fields(SelectorConfig)}
        settings |= {"dim": ds.emb["train"].shape[1], "picks": picks}
        if args.retriever:  # the query scores each candidate alone: the top k are its picks
            settings |= {"num_layers": 0, "state_update": False}
        model = PointerSelector(SelectorConfig(**settings))
    for p in model.stop_parameters():
        p.requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    return model, AdamW(trained, lr=args.lr, weight_decay=args.weight_decay)


def train_step(model, opt, ds, idx: Tensor, reward: Tensor, args: Args, step: int, total: int):
    """One RCE (or retriever) step on the anchors `idx` at `step` of `total`: -> loss, gradient norm, tau."""
    for group in opt.param_groups:  # a function of the step alone, so a resumed run follows it
        group["lr"] = args.lr * lr_factor(args.lr_schedule, step, total)
    tau = args.temp_start + (args.temp_end - args.temp_start) * step / max(total - 1, 1)
    model.train()  # dropout on: the warm-up is plain supervised learning
    b = make_batch(ds, idx, reward, model.cfg)
    loss = (retriever_loss if args.retriever else sequence_loss)(model, b, args, tau)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or math.inf))
    if math.isfinite(norm):  # a NaN/inf gradient skips the step; the run stops where the caller checks
        opt.step()
    return loss, norm, tau


def held_out_accuracy(
    args: Args, ds, split: Split, backend, init: PointerSelector | None, picks: int, cap: int | None
) -> Tensor:
    """Cross-fitting: the anchors outside validation, halved by image; a selector trained as this run's (its last
    epoch) on one half's training anchors picks for the other half's anchors (the first `cap` of them, or all), and
    back. -> per anchor, the accuracy of the picks' first 0..S (n, S + 1), each answered by `backend` (S + 1 prompts an
    anchor)."""
    rest = torch.ones(len(ds.groups), dtype=torch.bool).index_fill(0, split.val, False).nonzero()[:, 0]  # (n,)
    image = image_index(ds, rest)  # (n,)
    side = torch.randperm(int(image.max()) + 1, generator=torch.Generator().manual_seed(args.seed + 2))[image] % 2
    accs = []
    # each half: its training epochs, then its anchors at 0..S shots (on real data the LVLM's prompts, the long part)
    bar = tqdm(total=2 * (args.epochs + ds.seq_len + 1), desc="cross-fit: epochs, then shots", leave=False)
    for h in (0, 1):
        rows = split.train[torch.isin(split.train, rest[side == h])]
        steps = steps_per_epoch(rows, args.batch_size)
        torch.manual_seed(args.seed + 3 + h)
        model, opt = new_selector(args, ds, init, picks)
        shuffle = torch.Generator().manual_seed(args.seed + 5 + h)
        for epoch in range(args.epochs):
            for i, (idx, _) in enumerate(pass_batches(rows, args.batch_size, shuffle)):
                train_step(model, opt, ds, idx, split.reward, args, epoch * steps + i, args.epochs * steps)
            bar.update()
        other = rest[side != h][:cap]
        queries, pools = ds.groups.queries[other], ds.groups.pools[other]
        icds = greedy_icds(model, ds, "train", queries, pools, ds.seq_len, min_picks=ds.seq_len)  # (m, S) pick order
        acc = []  # S + 1 of (m,)
        for k in range(ds.seq_len + 1):
            acc += prefix_accuracy(model, backend, queries, icds, range(k, k + 1))
            bar.update()
        accs.append(torch.stack(acc, -1).double())  # (m, S + 1)
    bar.close()
    return torch.cat(accs)


def main(args: Args) -> None:
    check_train_args(args)
    if not (0 < args.temp_start < math.inf and 0 < args.temp_end < math.inf):  # NaN fails every comparison
        raise ValueError(f"--temp-start and --temp-end must be finite and > 0, got {args.temp_start}, {args.temp_end}")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("rce.py trains in one process (its data is scored already): run it without torchrun")
    if args.retriever and args.can_stop:
        raise ValueError(
            "--retriever scores each demonstration alone and learns from no sequence, so it cannot learn when to stop "
            "(--can-stop): train the pointer selector for that"
        )
    out = args.out or Path("runs/retriever" if args.retriever else "runs/rce")

    # data and split
    ds = load_dataset(args.data)
    init = starting_selector(args, ds)
    # Lever-LM trains on 2 demonstrations and is asked for more; a selector keeps the count it was made with
    picks = args.picks or max(ds.seq_len, init.cfg.picks if init is not None else 0)
    if picks < ds.seq_len:
        raise ValueError(f"--picks {args.picks} is below the sequence length {ds.seq_len} of {ds.folder}")
    split = split_queries(ds, args)
    steps = steps_per_epoch(split.train, args.batch_size)
    total = args.epochs * steps
    check_continues(out, args, ds)  # before a model loads
    backend = validation_backend(ds, args)  # answers the validation anchors' greedy picks, where it can
    metric = selection_metric(backend)
    cap = None if ds.is_sim else args.val_max_queries
    # A may-stop selector's picks train alone here, its stop set after: they are judged, and its best epoch chosen,
    # filling every slot (by a stop --init brought, that epoch would be chance's).
    min_picks = ds.seq_len

    with RunFolder(out) as run:
        resume_from = run.resume(args, ds)  # the last checkpoint of this very run, if a re-run continues it

        # model and optimizer
        torch.manual_seed(args.seed)
        model, opt = new_selector(args, ds, init, picks)

        # resume
        rngs = {"shuffle": torch.Generator().manual_seed(args.seed + 1)}
        loop = Loop()
        if resume_from is not None:
            loop, _ = run.restore(resume_from, model, opt, rngs, backend)
        run.start(args, ds, split, loop, resume_from is not None)
        if resume_from is None:  # epoch 0 = the initial selector, the start of every curve
            record = {"phase": "rce", "epoch": 0, "step": 0, **validate(model, ds, split, backend, cap, min_picks)}
            run.log(record | ({"lvlm/calls": backend.calls} if backend else {}))

        for epoch in range(loop.epoch + 1, args.epochs + 1):
            means = EpochMeans()
            bar = run.progress(epoch, args.epochs, steps)
            for idx, _ in pass_batches(split.train, args.batch_size, rngs["shuffle"]):
                loss, norm, tau = train_step(model, opt, ds, idx, split.reward, args, loop.step, total)
                loop.step += 1
                m = {"train/loss": loss.item(), "train/tau": tau, "train/grad_norm": norm}
                stop_if_diverged(m, "rce", epoch, loop.step, out, "try a lower --lr")
                means.add(m)
                bar.set_postfix_str(log_line(m, SHOWN), refresh=False)  # drawn at the bar's next timed redraw
                bar.update()
            bar.close()

            # validation, best and checkpoint
            record = {"phase": "rce", "epoch": epoch, "step": loop.step, **means.result()}
            record.update(validate(model, ds, split, backend, cap, min_picks))
            if backend is not None:  # cumulative over the run, as grpo logs it
                record["lvlm/calls"] = loop.lvlm_calls = backend.calls
            if record[metric] > loop.best:  # epoch 0 is no candidate: see validation.selection_metric
                loop.best, loop.best_epoch = record[metric], epoch
            record["best_epoch"] = loop.best_epoch
            loop.epoch = epoch
            run.end_epoch(record, model, opt, rngs, loop, args.keep_every, backend)
            run.say(f"{out.name} epoch {epoch}: {log_line(record, (*SHOWN, 'val/reward', 'val/acc'))}")
        run.say(f"best epoch {loop.best_epoch} ({metric} {loop.best:.4f}) -> {out}/model.safetensors")

        # the stop at each step, from what picks like its own win on anchors they never trained on (once: its record,
        # with the calls it took, ends metrics.jsonl)
        if (
            model.cfg.can_stop
            and backend is not None
            and loop.best_epoch is not None
            and "stop/go_on" not in read_metrics(out / "metrics.jsonl")[-1]
        ):
            acc = held_out_accuracy(args, ds, split, backend, init, picks, cap)  # (n, S + 1)
            best = load_selector(out)
            go, _ = set_stops(best, acc)
            best.save(out)
            keep = {"epoch": loop.epoch, "step": loop.step, "best_epoch": loop.best_epoch}
            gain = float((acc[:, 1:].mean(-1) - acc[:, 0]).mean())  # over zero-shot, 1..S shots
            run.log({"phase": "rce", **keep, "lvlm/calls": backend.calls, "stop/gain": gain, "stop/go_on": go})
            run.say(
                f"the stop: on {len(acc)} training anchors, picks trained without them gain {100 * gain:+.2f} points "
                f"over zero-shot (1..{ds.seq_len} shots); after 0..{ds.seq_len - 1} picks it goes on with p = "
                f"{' '.join(f'{p:.2f}' for p in go)}, going on's wins' share of all it won or lost"
            )
        elif model.cfg.can_stop and backend is None:
            run.say("its stop stays untrained: nothing answers the training anchors to weigh it (--val-lvlm would)")


if __name__ == "__main__":
    run_cli(main, Args)
