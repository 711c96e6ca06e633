"""A training run's folder: where rce.py and grpo.py write, and how a re-run of the same command continues it.

    runs/<name>/config.json          flags, argv, git SHA, library versions, the data's digest, the --init hash
    runs/<name>/metrics.jsonl        one flushed JSON object per epoch (epoch 0 = the starting weights)
    runs/<name>/ckpt/epoch_NNN.safetensors   model, optimizer, RNG and loop state (checkpoints.py)
    runs/<name>/model.safetensors + model.json   the best epoch on held-out anchors
    runs/<name>/scores.safetensors   the LVLM scores the run paid for (rce --val-lvlm, online grpo)

One writer at a time (locks.exclusive); every file is written to a temporary name and renamed (files.py), so a killed
run never leaves a half-written file. Under torchrun every rank holds a RunFolder and rank 0 alone writes: the others'
calls do nothing but share what rank 0 decided, so a training loop handles ranks nowhere else.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from dataclasses import asdict
from importlib.metadata import version
from pathlib import Path

import torch
from tqdm import tqdm

import sharding
from checkpoints import (
    checkpoint_meta,
    last_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    resumable_checkpoint,
    save_checkpoint,
)
from cli import PATH_ARGS, SIDE_ARGS
from data import data_digest
from files import append_line, atomic_write_text, read_json, read_jsonl, read_tensors, save_tensors, sha256
from locks import exclusive
from tracking import open_tracker


def new_loop(state: dict | None = None) -> dict:
    """The loop state every checkpoint saves (`state`: a stage's own, such as GRPO's adaptive beta)."""
    return {"epoch": 0, "step": 0, "best": -math.inf, "best_epoch": None, "state": state or {}}


class RunFolder:
    """`with RunFolder(out, rank, world) as run:` locks and creates `out` (rank 0); if the run then stops with an
    error before its first checkpoint, a folder this process created is removed again, so a failed check never leaves
    a config.json behind. Ctrl-C keeps it (the same command then starts the run again)."""

    def __init__(self, out: Path, rank: int = 0, world: int = 1):
        self.out, self.world, self.lead = Path(out), world, rank == 0
        self.metrics: MetricsLog | None = None
        self.created = False

    def __enter__(self) -> RunFolder:
        if self.lead:
            self.lock = exclusive(self.out)
            self.lock.__enter__()
            self.created = not self.out.exists()
            self.out.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, kind, error, trace) -> None:
        if not self.lead:
            return
        if self.metrics is not None:
            self.metrics.close()
        if isinstance(error, ValueError | OSError) and self.created and last_checkpoint(self.out) is None:
            shutil.rmtree(self.out, ignore_errors=True)
        self.lock.__exit__(kind, error, trace)

    def resume(self, args, ds) -> Path | None:
        """The checkpoint this very run continues from (rank 0 decides, see `resume_point`), or None."""
        return sharding.from_rank0(resume_point(self.out, args, ds) if self.lead else None, self.world)

    def restore(self, resume_from: Path, model, opt, rngs: dict, cache=None) -> tuple[dict, dict]:
        """Model, optimizer, RNGs and loop state from `resume_from`, and the LVLM scores the run had paid for by then
        (so a resumed run neither pays nor counts a score twice); returns the loop state and the extra tensors."""
        loop, extra = load_checkpoint(resume_from, model, opt, rngs)
        if cache is not None and "lvlm_calls" in loop["state"]:
            cache.restore(read_tensors(self.out / "scores.safetensors"), loop["state"]["lvlm_calls"])
        return loop, extra

    def start(self, args, ds, split, loop: dict, resumed: bool, extra: dict | None = None) -> None:
        """config.json for a new run; metrics.jsonl (cut back to the resumed epoch) and the --report-to tracker, which
        a finished run that is re-run does not open."""
        if not self.lead:
            return
        if not resumed:
            write_config(self.out, args, ds, split, extra)
        self.metrics = MetricsLog(self.out / "metrics.jsonl", loop["epoch"] if resumed else None)
        if loop["epoch"] < args.epochs:
            resumed_at = loop["step"] if resumed else None
            self.metrics.tracker = open_tracker(args.report_to, self.out, flag_values(args), resumed_at)

    def log(self, record: dict) -> None:
        if self.lead:
            self.metrics.write(record)

    def progress(self, epoch: int, epochs: int, steps: int):
        desc = f"{self.out.name} epoch {epoch}/{epochs}"
        return tqdm(range(steps), desc=desc, unit="step", dynamic_ncols=True, leave=False, disable=not self.lead)

    def end_epoch(self, record: dict, model, opt, rngs: dict, loop: dict, keep_every: int, cache=None, extra=None):
        """The epoch's record, the selected weights when it is the best so far, the LVLM scores, the checkpoint and
        its pruning, and the epoch's line on the terminal."""
        if not self.lead:
            return
        if loop["best_epoch"] == record["epoch"]:
            model.save(self.out)
        self.metrics.write(record)  # before the checkpoint: a resume from the epoch before drops this line again
        if cache is not None:  # before the checkpoint, which names how many of them are its own
            save_tensors(self.out / "scores.safetensors", cache.state())
        save_checkpoint(self.out, record["epoch"], model, opt, rngs, loop, extra)
        prune_checkpoints(self.out, keep_every, loop["best_epoch"])

    def say(self, text: str) -> None:
        if self.lead:
            print(text, flush=True)


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
        append_line(self.path, json.dumps(record))
        if self.tracker is not None:
            self.tracker.log(record)

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.close()


def git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
        return out.stdout.strip() or None
    except OSError:
        return None


def write_config(out: Path, args, ds, split, extra: dict | None = None) -> None:
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


def resume_point(out: Path, args, ds) -> Path | None:
    """Check the output folder before any work; returns the checkpoint to resume from, if any.

    As in every stage of the kit, re-running the same command continues what it finished: a folder holding a run
    resumes from its last epoch checkpoint (a finished run is left as it is). Only the very same run continues: any
    other flag, other data content or other --init weights are refused (paths may differ: folders can move). A run
    that died before its first checkpoint simply starts again.
    """
    ckpt = resumable_checkpoint(out)
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


def flag_values(args) -> dict:
    """A stage's flags as JSON values (paths as strings), as config.json records them."""
    return json.loads(json.dumps(asdict(args), default=str))


def run_identity(args, ds) -> dict:
    """What a resumed run must share with the run it continues: flags, data content, and the --init weights."""
    init = getattr(args, "init", None)
    init_file = None if init is None else (Path(init) / "model.safetensors" if Path(init).is_dir() else Path(init))
    return {
        "args": {k: v for k, v in flag_values(args).items() if k not in PATH_ARGS},
        "data": data_digest(ds.folder),
        "init": sha256(init_file)[:16] if init_file is not None and init_file.is_file() else None,
    }
