"""What rce.py and grpo.py share: arguments, run folders, batches, validation, checkpoints with exact resume.

Run folder: config.json, metrics.jsonl (one flushed JSON object per logged epoch), ckpt/epoch_NNN.safetensors (model
+ optimizer + RNG state + loop state, so re-running an interrupted command ends bit-identical to an uninterrupted
run), and model.safetensors + model.json = the best trained epoch by the true accuracy of its greedy picks on
held-out anchor queries when the backend can answer them (else by validation reward).
Every file is written to a temporary name and renamed, so a killed run never leaves a half-written file.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import math
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Annotated, Literal

import torch
from torch import Tensor

from backends import ScoreCache, open_backend
from checkpoints import (
    checkpoint_meta,
    last_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from cli import PATH_ARGS, SIDE_ARGS, CpuArgs, alias
from data import DEFAULT_DATA, Dataset, Quality, RewardArgs, compute_reward, data_digest, filter_queries, load_dataset
from files import atomic_write_text, read_json, read_jsonl
from locks import exclusive
from model import (
    PointerSelector,
    SelectorConfig,
    reward_spread,
)
from tracking import ReportTo, check_installed, open_tracker


@dataclass
class TrainArgs(RewardArgs, CpuArgs):
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
    keep_every: int = 1
    """Checkpoints kept: every N-th epoch's, plus the best and the last (0 = only those two; 1 = all, 8 MB each at
    the defaults)."""
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
    resume: bool = False
    """Not needed any more: re-running a command continues its run (accepted so that older scripts still work)."""
    report_to: ReportTo = "none"
    """Also send every logged record to TensorBoard (<out>/tensorboard) or Weights & Biases (project icl-select),
    if that package is installed; metrics.jsonl is always written."""

    def fixed_length_reason(self) -> str | None:
        """Why a schedule of this run depends on its total length (then --epochs cannot change on resume), or None."""
        if self.lr_schedule != "constant":
            return f"--lr-schedule {self.lr_schedule} decays over all steps of the run"
        return None


def check_train_args(args: TrainArgs) -> None:
    for name in ("epochs", "batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.keep_every < 0:
        raise ValueError(f"--keep-every must be >= 0, got {args.keep_every}")
    if not 0 < args.val_frac < 1:
        raise ValueError(f"--val-frac must be in (0, 1), got {args.val_frac}")
    if args.val_max_queries < 1:
        raise ValueError(f"--val-max-queries must be >= 1, got {args.val_max_queries}")
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
def greedy_picks(model: PointerSelector, ds: Dataset, idx: Tensor) -> Tensor:
    """Greedy pool positions (B, S) for the queries `idx`."""
    b = make_batch(ds, idx, torch.zeros(len(ds.groups), 1), model.cfg)
    return model.greedy(b.query, b.pool, b.pool_mask, ds.seq_len)[0]


@torch.no_grad()
def validate(model: PointerSelector, ds: Dataset, split: Split, backend=None, max_queries: int | None = None) -> dict:
    """val/reward = mean over validation queries of sum_i softmax_i(log pi(seq_i)) r_i (the policy's expected
    reward when restricted to the scored sequences); with a backend, val/acc_k = VQA accuracy (%) of the greedy
    picks' first k on (the first `max_queries` of) the validation anchors, and val/acc = its mean over k."""
    model.eval()
    b = make_batch(ds, split.val, split.reward, model.cfg)
    logp = model.log_probs(b.query, b.pool, b.pool_mask, b.seqs, b.seq_mask).sum(-1)  # (B, G)
    w = logp.masked_fill(~b.seq_mask, float("-inf")).softmax(-1)
    out = {"val/reward": float((w * b.reward).sum(-1).mean())}
    if backend is not None:
        n = max_queries or len(split.val)
        picks = model.greedy(b.query[:n], b.pool[:n], b.pool_mask[:n], ds.seq_len)[0]  # (n, S) pick order
        icds = ds.groups.pools[split.val[:n]].gather(1, picks)  # (n, S) train rows in pick order
        queries = ds.groups.queries[split.val[:n]]
        accs = [
            100 * float(backend.score("train", queries, model.cfg.to_prompt(icds[:, :k]))["acc"].mean())
            for k in range(1, ds.seq_len + 1)
        ]
        out.update({f"val/acc_{k}": a for k, a in enumerate(accs, 1)}, **{"val/acc": sum(accs) / len(accs)})
    return out


def validation_backend(ds: Dataset, args: TrainArgs) -> ScoreCache | None:
    """What answers the validation anchors' greedy picks (cached): the simulator of a simulated dataset, the
    dataset's LVLM with --val-lvlm, else None (then the best epoch is chosen by val/reward)."""
    if ds.is_sim or args.val_lvlm:
        return ScoreCache(open_backend(ds.meta, ds.items, ds.emb))
    return None


def selection_metric(backend) -> str:
    """True accuracy of the greedy picks when they can be answered, else the expected reward over scored data.

    val/reward is a poor proxy: it rewards putting probability on the better *scored* sequences, which need not
    move the greedy picks the evaluation uses (on the simulator it chose epoch 1 of online GRPO runs whose
    accuracy kept rising for 20 epochs)."""
    return "val/reward" if backend is None else "val/acc"


# ----------------------------------------------------------------------------------------------------------------------
# Run folders and checkpoints


def git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
        return out.stdout.strip() or None
    except OSError:
        return None


@contextlib.contextmanager
def run_folder(out: Path):
    """Locks and creates the run folder `out` (one writer at a time: see locks.py); if the run then stops with an
    error before its first checkpoint, a folder this process created is removed again, so a failed check never
    leaves a config.json behind. Ctrl-C keeps it (the same command then starts the run again)."""
    with exclusive(out):
        created = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        try:
            yield out
        except (ValueError, OSError):
            if created and last_checkpoint(out) is None:
                shutil.rmtree(out, ignore_errors=True)
            raise


def write_config(out: Path, args, ds: Dataset, split: Split, extra: dict | None = None) -> None:
    """config.json of a new run (a resumed run keeps the one it started with)."""
    ident = run_identity(args, ds)
    config = {
        "args": flag_values(args),
        "argv": sys.argv,
        "git_sha": git_sha(),
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            **{pkg: version(pkg) for pkg in ("transformers", "tqdm", "safetensors", "tyro")},
        },
        "data": {"folder": str(ds.folder), "digest": ident["data"], "simulation": ds.is_sim},
        "init_sha256": ident["init"],
        "queries": {"train": len(split.train), "val": len(split.val)},
        **(extra or {}),
    }
    atomic_write_text(out / "config.json", json.dumps(config, indent=2) + "\n")


class MetricsLog:
    """metrics.jsonl, one flushed line per record; on resume, records past the resumed epoch are dropped. Each record
    also goes to the --report-to tracker, if any."""

    def __init__(self, path: Path, keep_through_epoch: int | None = None):
        self.path, self.tracker = path, None
        if keep_through_epoch is not None and path.exists():
            kept = [r for _, r in read_jsonl(path, truncated="skip") if r.get("epoch", 0) <= keep_through_epoch]
            atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
        elif keep_through_epoch is None:
            atomic_write_text(path, "")

    def write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
        if self.tracker is not None:
            self.tracker.log(record)

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.close()


def prepare_out(out: Path, args, ds: Dataset) -> Path | None:
    """Check the output folder before any work; returns the checkpoint to resume from, if any.

    As in every stage of the kit, re-running the same command continues what it finished: a folder holding a run
    resumes from its last epoch checkpoint (a finished run is left as it is). Only the very same run continues: any
    other flag, other data content or other --init weights are refused (paths may differ: folders can move). A run
    that died before its first checkpoint simply starts again.
    """
    ckpt = last_checkpoint(out)
    if ckpt is None:
        if (out / "metrics.jsonl").exists():
            print(f"note: {out} has no checkpoint yet (killed during epoch 1); starting it again", file=sys.stderr)
        return None
    config = read_json(out / "config.json")
    for name in ("args", "data"):
        if not isinstance(config, dict) or not isinstance(config.get(name), dict):
            raise ValueError(
                f"{out / 'config.json'}: field {name!r} is missing or not an object; is this a run folder?"
            )
    now = run_identity(args, ds)
    then = {
        "args": {k: v for k, v in config["args"].items() if k not in PATH_ARGS},
        "data": config["data"].get("digest"),
        "init": config.get("init_sha256"),
    }
    if then["data"] is None:
        raise ValueError(
            f"{out} was started by an older icl-select that identified its data differently; "
            "start a new run (--init can start from its checkpoint)"
        )
    done = checkpoint_meta(ckpt)["epoch"]
    diff = sorted(k for k in now["args"] if k not in SIDE_ARGS and now["args"][k] != then["args"].get(k))
    if diff == ["epochs"]:
        continue_with_more_or_fewer_epochs(out, done, args, config)
        diff = []
    if diff:
        details = "; ".join(
            f"--{k.replace('_', '-')}: run has {then['args'].get(k)!r}, now {now['args'][k]!r}" for k in diff
        )
        raise ValueError(
            f"{out} holds a run started with other flags ({details}); continue it with the same flags, or "
            f"start a new run in another --out (--init {out} starts from it)"
        )
    if now["data"] != then["data"] or now["init"] != then["init"]:
        what = "dataset" if now["data"] != then["data"] else "--init selector"
        raise ValueError(f"{out}: the {what} changed since this run was started; start a new run in another --out")
    news = "has finished all its epochs; nothing to train" if done >= args.epochs else f"resumes after epoch {done}"
    print(f"note: {out} holds this run (same flags and data): it {news} (another --out starts anew)", file=sys.stderr)
    return ckpt


def continue_with_more_or_fewer_epochs(out: Path, done: int, args, config: dict) -> None:
    """A resumed run with another --epochs, where the schedule can be continued honestly; the run's config.json then
    records the new total and when it changed. Refused where a schedule is spread over all steps of the run: RCE's
    tau anneal and a decaying learning rate would have taken other values at every step already trained."""
    before = config["args"]["epochs"]
    why = args.fixed_length_reason() or (f"it has already trained {done} epochs" if args.epochs < done else None)
    if why:
        raise ValueError(
            f"{out} was started with --epochs {before}, and {why}, so it cannot continue to --epochs "
            f"{args.epochs}; start a new run with --init {out}"
        )
    config["args"]["epochs"] = args.epochs
    config.setdefault("epochs_changed", []).append({"from": before, "to": args.epochs, "after_epoch": done})
    atomic_write_text(out / "config.json", json.dumps(config, indent=2) + "\n")
    print(f"note: {out}: --epochs {before} -> {args.epochs}, continuing after epoch {done}", file=sys.stderr)


def file_sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def flag_values(args) -> dict:
    """A stage's flags as JSON values (paths as strings), as config.json records them."""
    return json.loads(json.dumps(asdict(args), default=str))


def run_identity(args, ds: Dataset) -> dict:
    """What a resumed run must share with the run it continues: flags, data content, and the --init weights."""
    init = getattr(args, "init", None)
    init_file = None if init is None else (Path(init) / "model.safetensors" if Path(init).is_dir() else Path(init))
    return {
        "args": {k: v for k, v in flag_values(args).items() if k not in PATH_ARGS},
        "data": data_digest(ds.folder),
        "init": file_sha(init_file) if init_file is not None and init_file.is_file() else None,
    }


def lr_factor(schedule: str, step: int, total: int) -> float:
    """Multiplier of the base learning rate at `step` (0-based) of `total` steps."""
    done = step / max(total, 1)
    return {"constant": 1.0, "linear": 1.0 - done, "cosine": 0.5 * (1.0 + math.cos(math.pi * done))}[schedule]


def adamw(params, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """torch's AdamW, kept from importing torch._dynamo, which took 1.0-1.2 s of every run's start-up here.

    torch 2.13 wraps Optimizer.add_param_group, zero_grad, state_dict and load_state_dict so that torch.compile
    leaves them alone; the wrapper imports torch._dynamo at its first call and caches what it builds on the function
    as `__dynamo_disable`. This kit never compiles, so that cache is filled with the function itself; `clipped_step`
    calls AdamW's own step without its compile-only wrapper. The arithmetic is torch's, unchanged."""
    for name in ("add_param_group", "zero_grad", "state_dict", "load_state_dict"):
        fn = inspect.unwrap(getattr(torch.optim.Optimizer, name))
        fn.__dynamo_disable = fn
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def clipped_step(opt: torch.optim.Optimizer, params, grad_clip: float) -> float:
    """Clip the gradient norm and step; a NaN/inf gradient skips the step (the weights stay finite) and is
    returned, so the loop stops before a poisoned checkpoint can be written."""
    norm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip or float("inf")))
    if math.isfinite(norm):
        with torch.no_grad():  # what step()'s wrapper does, besides importing torch._dynamo (see `adamw`)
            inspect.unwrap(type(opt).step)(opt)
    return norm


def is_bad(x: float) -> bool:
    return not math.isfinite(x)


def log_line(record: dict, keys: tuple[str, ...]) -> str:
    return " ".join(f"{k.split('/')[-1]}={record[k]:.4g}" for k in keys if k in record)


# ----------------------------------------------------------------------------------------------------------------------
# The epoch loop shared by rce.py and grpo.py


@dataclass
class Start:
    """What every training stage opens with, before it builds its model (see `open_run`)."""

    out: Path
    ds: Dataset
    split: Split
    resume_from: Path | None  # the checkpoint a re-run continues from; None for a new run
    backend: ScoreCache | None  # what answers the validation anchors (`validation_backend`)


def open_run(args: TrainArgs, out: Path) -> Start:
    """The prologue of rce.py and grpo.py: read and check the data, split it, check the run folder (resume or new),
    open the validation backend, seed torch. Nothing is written yet."""
    ds = load_dataset(args.data, args.allow_truncated)
    split = split_queries(ds, args)
    resume_from = prepare_out(out, args, ds)
    backend = validation_backend(ds, args)
    torch.manual_seed(args.seed)
    return Start(out, ds, split, resume_from, backend)


@dataclass(kw_only=True)
class Loop:
    """A training run for `fit`: what it trains and how its steps are logged, checked and resumed."""

    args: TrainArgs
    start: Start
    model: PointerSelector
    opt: torch.optim.Optimizer
    phase: str  # "rce" | "grpo": the "phase" of every metrics record
    step: Callable[[Tensor, int, dict], dict[str, float]]
    """step(idx (B,) query indices, global step, state) -> float metrics including "train/loss". It sets the
    model's mode itself (RCE trains with dropout, GRPO takes every log-prob without)."""
    state: dict = field(default_factory=dict)
    """Mutable loop state saved in every checkpoint and handed to `step` (e.g. GRPO's adaptive beta)."""
    rngs: dict[str, torch.Generator] = field(default_factory=dict)
    """Generators besides the shuffle's, saved in every checkpoint."""
    epoch_extra: Callable[[], dict] | None = None
    """Extra metrics per epoch (e.g. the share of validation picks that changed)."""
    check: Callable[[dict], list[str]] | None = None
    """Plain-words warnings about an epoch's record."""
    postfix: tuple[str, ...] = ("train/loss",)
    """Metrics shown on the progress bar and the epoch line."""
    log_steps: bool = False
    """Also write every step's metrics ("kind": "step")."""
    diverged_hint: str = "try a lower --lr"
    """What the message of a NaN/inf loss or gradient suggests."""
    config_extra: dict = field(default_factory=dict)
    """More fields for config.json."""


def run_training(run: Loop) -> dict:
    """Write config.json (a new run), run `fit` in the locked run folder, and say where the best epoch went."""
    out = run.start.out
    with run_folder(out):
        if run.start.resume_from is None:
            write_config(out, run.args, run.start.ds, run.start.split, run.config_extra)
        loop = fit(run)
    print(f"best epoch {loop['best_epoch']} ({loop['metric']} {loop['best']:.4f}) -> {out}/model.safetensors")
    return loop


def train_epoch(run: Loop, log: MetricsLog, loop: dict, order: Tensor, epoch: int) -> dict[str, float]:
    """One epoch of steps over the training queries in `order`; returns the epoch's metrics: the mean of each step
    metric, the maximum of those named *_max. Stops with one line if the loss or the gradient norm is not finite."""
    from tqdm import tqdm

    args, out = run.args, run.start.out
    steps = steps_per_epoch(run.start.split, args.batch_size)
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    maxes: dict[str, float] = {}
    bar = tqdm(
        range(steps), desc=f"{out.name} epoch {epoch}/{args.epochs}", unit="step", dynamic_ncols=True, leave=False
    )
    for i in bar:
        for group in run.opt.param_groups:  # a function of the step alone, so a resumed run follows it exactly
            group["lr"] = args.lr * lr_factor(args.lr_schedule, loop["step"], args.epochs * steps)
        m = run.step(order[i * args.batch_size : (i + 1) * args.batch_size], loop["step"], loop["state"])
        loop["step"] += 1
        if run.log_steps:
            log.write({"phase": run.phase, "kind": "step", "epoch": epoch, "step": loop["step"], **m})
        if is_bad(m["train/loss"]) or is_bad(m.get("train/grad_norm", 0.0)):
            last = last_checkpoint(out)
            what = "loss" if is_bad(m["train/loss"]) else "gradient norm"
            raise ValueError(
                f"{run.phase}: the {what} became {m['train/loss'] if what == 'loss' else m['train/grad_norm']} "
                f"at epoch {epoch}, step {loop['step']}; stopping. "
                f"The last good checkpoint is {last or 'none (no epoch finished)'}; {run.diverged_hint}"
            )
        for k, v in m.items():
            if k.endswith("_max"):
                maxes[k] = max(maxes.get(k, -math.inf), v)
            else:
                sums[k], counts[k] = sums.get(k, 0.0) + v, counts.get(k, 0) + 1
        bar.set_postfix_str(log_line(m, run.postfix), refresh=False)  # shown at the bar's next timed redraw
    bar.close()
    return {**{k: v / counts[k] for k, v in sums.items()}, **maxes}


def fit(run: Loop) -> dict:
    """Epochs over the training queries, validation, best-model selection (`selection_metric`), checkpoints, resume.
    Returns the final loop state.

    Epoch 0 (the starting weights) is logged but never selected: a trained start was itself chosen as the best of
    its run on these same validation anchors, so its score there is biased upwards (the winner's curse) and would
    beat a better later epoch by chance. Whether training helped is for evaluate.py and compare.py to say, on the
    evaluation questions, with paired tests.
    """
    args, out, ds, split = run.args, run.start.out, run.start.ds, run.start.split
    metric = selection_metric(run.start.backend)
    cap = None if ds.is_sim else args.val_max_queries

    def evaluated(record: dict) -> dict:
        """The record with validation and then the stage's epoch metrics added (validation puts the model in eval
        mode, which the stage's metrics rely on)."""
        record = {**record, **validate(run.model, ds, split, run.start.backend, cap), "select_metric": metric}
        return {**record, **(run.epoch_extra() if run.epoch_extra else {})}

    rngs = {"shuffle": torch.Generator().manual_seed(args.seed + 1), **run.rngs}
    loop = {"epoch": 0, "step": 0, "best": -math.inf, "best_epoch": None, "state": run.state}
    resumed = run.start.resume_from is not None
    if resumed:
        loop = load_checkpoint(run.start.resume_from, run.model, run.opt, rngs)
    log = MetricsLog(out / "metrics.jsonl", loop["epoch"] if resumed else None)
    with contextlib.closing(log):
        if loop["epoch"] < args.epochs:  # a finished run that is re-run logs nothing, so it opens no tracker
            log.tracker = open_tracker(args.report_to, out, flag_values(args), loop["step"] if resumed else None)
        if not resumed:  # epoch 0 = the initial policy, the start of every curve
            log.write(evaluated({"phase": run.phase, "epoch": 0, "step": 0}))
        for epoch in range(loop["epoch"] + 1, args.epochs + 1):
            order = split.train[torch.randperm(len(split.train), generator=rngs["shuffle"])]
            means = train_epoch(run, log, loop, order, epoch)
            record = evaluated({"phase": run.phase, "epoch": epoch, "step": loop["step"], **means})
            warnings = run.check(record) if run.check else []
            if warnings:
                record["warnings"] = warnings
            if record[metric] > loop["best"]:
                loop["best"], loop["best_epoch"] = record[metric], epoch
                run.model.save(out)
            record["best_epoch"] = loop["best_epoch"]
            loop["epoch"] = epoch
            log.write(record)  # before the checkpoint: a resume from epoch-1 drops this line again if we die in between
            save_checkpoint(out, epoch, run.model, run.opt, rngs, loop)
            prune_checkpoints(out, args.keep_every, loop["best_epoch"])
            summary = log_line(record, (*run.postfix, "val/reward", "val/acc"))
            print(f"{out.name} epoch {epoch}: {summary}" + "".join(f"\n  warning: {w}" for w in warnings), flush=True)
    loop["metric"] = metric
    return loop
