"""A run's folder: its files, how they are written, and how they are read back.

    runs/<name>/config.json          flags, argv, git SHA, library versions, what it is made from (lineage.py)
    runs/<name>/metrics.jsonl        one flushed JSON object per epoch (epoch 0 = the starting weights)
    runs/<name>/ckpt/epoch_NNN.safetensors   model, optimizer, RNG and loop state
    runs/<name>/model.safetensors + model.json   the best epoch on held-out anchors (`PointerSelector.save`)
    runs/<name>/scores.safetensors   the LVLM scores the run paid for (rce --val-lvlm, online grpo)
    runs/<name>/eval/<split>.json    evaluate.py's results (a baseline's folder holds only these)

One writer at a time (locks.exclusive), every file written whole (files.py). Under torchrun rank 0 alone writes; the
other ranks' calls only share what it decided, so a training loop handles ranks nowhere else.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

from icl_select import lineage, sharding
from icl_select.cli import PATH_ARGS, side_flags
from icl_select.data import data_digest
from icl_select.files import (
    DataError,
    append_line,
    atomic_write_text,
    read_json,
    read_jsonl,
    read_tensors,
    save_tensors,
    selector_digest,
)
from icl_select.locks import exclusive
from icl_select.tracking import open_tracker
from model import PointerSelector, load_state_strict, selector_config


@dataclass
class Loop:
    """Where a training run stands, as every checkpoint saves it: the epochs and steps done, the best epoch so far by
    its validation metric, the LVLM calls the run has paid for (a resume restores the score cache to them), and
    GRPO's beta (it moves only with --kl-target)."""

    epoch: int = 0
    step: int = 0
    best: float = -math.inf
    best_epoch: int | None = None
    lvlm_calls: int | None = None
    beta: float | None = None


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

    def restore(self, resume_from: Path, model, opt, rngs: dict, cache=None) -> tuple[Loop, dict]:
        """Model, optimizer, RNGs and loop state from `resume_from`, and the LVLM scores the run had paid for by then
        (so a resumed run neither pays nor counts a score twice); returns the loop state and the extra tensors."""
        loop, extra = load_checkpoint(resume_from, model, opt, rngs)
        if cache is not None and loop.lvlm_calls is not None:
            cache.restore(read_tensors(self.out / "scores.safetensors"), loop.lvlm_calls)
        return loop, extra

    def start(self, args, ds, split, loop: Loop, resumed: bool, extra: dict | None = None) -> None:
        """config.json for a new run; metrics.jsonl (cut back to the resumed epoch) and the --report-to tracker, which
        a finished run that is re-run does not open."""
        if not self.lead:
            return
        if not resumed:
            write_config(self.out, args, ds, split, extra)
        # what the selector's weights read and were trained for, in its model.json and checkpoints
        self.selector_made_from = selector_made_from(ds)
        self.metrics = MetricsLog(self.out / "metrics.jsonl", loop.epoch if resumed else None)
        if loop.epoch < args.epochs:
            resumed_at = loop.step if resumed else None
            self.metrics.tracker = open_tracker(args.report_to, self.out, flag_values(args), resumed_at)

    def log(self, record: dict) -> None:
        if self.lead:
            self.metrics.write(record)

    def progress(self, epoch: int, epochs: int, total: int, unit: str = "step"):
        """The epoch's bar over `total` steps (or, for a budget, LVLM calls), advanced by the caller."""
        desc = f"{self.out.name} epoch {epoch}/{epochs}"
        return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, leave=False, disable=not self.lead)

    def end_epoch(self, record: dict, model, opt, rngs: dict, loop: Loop, keep_every: int, cache=None, extra=None):
        """The epoch's record, the selected weights when it is the best so far, the LVLM scores, the checkpoint and
        its pruning, and the epoch's line on the terminal."""
        if not self.lead:
            return
        model.made_from = self.selector_made_from
        if loop.best_epoch == record["epoch"]:
            model.save(self.out)
        self.metrics.write(record)  # before the checkpoint: a resume from the epoch before drops this line again
        if cache is not None:  # before the checkpoint, which names how many of them are its own
            save_tensors(self.out / "scores.safetensors", cache.state())
        save_checkpoint(self.out, record["epoch"], model, opt, rngs, loop, extra)
        prune_checkpoints(self.out, keep_every, loop.best_epoch)

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


# CPU kernels are chosen by instruction set, and AVX-512's round otherwise than AVX2's: a training held to AVX2 kernels
# and one thread (which every x86-64 machine the kit targets has) gives the same bytes on each. run.sh and
# `ablate.py --judge` set these; a run's config.json says which kernels made it.
KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2", "OMP_NUM_THREADS": "1"}


def kernels() -> dict:
    """The CPU kernels this process runs on: ATen's instruction set, its threads and the settings of KERNELS."""
    env = {k: os.environ.get(k) for k in KERNELS}
    return {"capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(), "env": env}


def git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
        return out.stdout.strip() or None
    except OSError:
        return None


def write_config(out: Path, args, ds, split, extra: dict | None = None) -> None:
    """config.json of a new run (a resumed run keeps the one it started with)."""
    made_from = run_made_from(args, ds)
    config = {
        "args": flag_values(args),
        "argv": sys.argv,
        "git_sha": git_sha(),
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            **{pkg: version(pkg) for pkg in ("transformers", "tqdm", "safetensors", "tyro")},
        },
        "kernels": kernels(),
        "made_from": made_from,
        "data": {"folder": str(ds.folder), "digest": made_from["data"], "simulation": ds.is_sim},
        # how its data was made (encoder, pools, prompts): what using the selector elsewhere needs (library.py)
        "dataset": {k: ds.meta[k] for k in DATASET_SETTINGS if k in ds.meta},
        "lvlm_calls_before": lvlm_before(ds, made_from["data"], getattr(args, "init", None)),
        "queries": {"train": len(split.train), "val": len(split.val)},
        **(extra or {}),
    }
    atomic_write_text(out / "config.json", json.dumps(config, indent=2) + "\n")


def lvlm_before(ds, digest: str, init: Path | None) -> dict | None:
    """The LVLM prompts spent before a run starts: {"data": {digest: calls} of every dataset folder its chain was
    built from, "training": the calls of every stage before it}; None where some cost is unknown (a dataset or an
    --init that does not record it)."""
    spent = {"data": {}, "training": 0} if init is None else lvlm_spent(Path(init))
    if spent is None or "lvlm_calls" not in ds.meta:
        return None
    return {"data": spent["data"] | {digest: ds.meta["lvlm_calls"]}, "training": spent["training"]}


def lvlm_spent(source: Path) -> dict | None:
    """What built the selector at `source` (a run folder: all its epochs; an epoch checkpoint: the epochs up to it),
    as `lvlm_before` counts it, its own calls included (validation, online scoring); None where unknown."""
    run = Path(source) if Path(source).is_dir() else Path(source).parent.parent
    if not (run / "config.json").is_file() or not (run / "metrics.jsonl").is_file():
        return None
    before = read_json(run / "config.json").get("lvlm_calls_before")
    epochs = read_metrics(run / "metrics.jsonl")
    if Path(source).is_file():
        epochs = [r for r in epochs if r["epoch"] <= checkpoint_meta(Path(source))["epoch"]]
    if before is None or not epochs:
        return None
    return {"data": before["data"], "training": before["training"] + epochs[-1].get("lvlm/calls", 0)}


def lvlm_total(spent: dict | None) -> int | None:
    """All the LVLM prompts an `lvlm_spent` record counts."""
    return None if spent is None else sum(spent["data"].values()) + spent["training"]


# meta.json fields a run's config.json copies: enough to embed, pool and prompt as the run did, wherever it goes
DATASET_SETTINGS = (
    "task",
    "source",
    "lvlm",
    "revision",
    "encoder",
    "encoder_revision",
    "sampler",
    "pool_size",
    "seq_len",
    "min_shots",
    "seed",
    "prompt_template",
    "system_prompt",
    "generation",
)


def resume_point(out: Path, args, ds) -> Path | None:
    """Check the output folder before any work; returns the checkpoint to resume from, if any. Only the very same run
    continues (same flags, data content and --init weights: `run_made_from`; paths may differ); a run that died before
    its first checkpoint starts again."""
    ckpt = resumable_checkpoint(out)
    if ckpt is None:
        if (out / "metrics.jsonl").exists():
            print(f"note: {out} has no checkpoint yet (killed during epoch 1); starting it again", file=sys.stderr)
        return None
    config = read_json(out / "config.json")
    if not isinstance(config, dict) or not isinstance(config.get("args"), dict):
        raise ValueError(f"{out / 'config.json'}: field 'args' is missing or not an object; is this a run folder?")
    then, now = config.get("made_from"), run_made_from(args, ds)
    done = checkpoint_meta(ckpt)["epoch"]
    if isinstance(then, dict) and [d[0] for d in lineage.differences(then, now)] == ["--epochs"]:
        continue_with_more_or_fewer_epochs(out, done, args, config)
    else:
        same_run(out, then, now)
    news = "has finished all its epochs; nothing to train" if done >= args.epochs else f"resumes after epoch {done}"
    print(f"note: {out} holds this run (same flags and data): it {news} (another --out starts anew)", file=sys.stderr)
    return ckpt


def check_continues(out: Path, args, ds) -> None:
    """Before any model loads: refuse to continue a run in `out` made from other inputs or flags than `args` and `ds`
    (`resume_point` checks again as the run starts, and decides about --epochs, which a budget plans later)."""
    if not (out / "config.json").is_file() or last_checkpoint(out) is None:
        return
    config = read_json(out / "config.json")
    then = config.get("made_from") if isinstance(config, dict) else None
    if not isinstance(then, dict):
        return  # resume_point says what is wrong with it
    same_run(out, then, run_made_from(args, ds), but=("epochs",))


def same_run(out: Path, then: dict | None, now: dict, but: tuple[str, ...] = ()) -> None:
    """Refuse in one line to continue the run in `out`, made from `then` (its config.json's record), with the inputs
    and flags `now` where they differ, the flags `but` aside."""
    if isinstance(then, dict):
        then, now = ({**m, "flags": {k: v for k, v in m["flags"].items() if k not in but}} for m in (then, now))
    fix = f"continue it as it was started, or start a new run in another --out (--init {out} starts from it)"
    lineage.check(out / "config.json", then, now, fix)


def continue_with_more_or_fewer_epochs(out: Path, done: int, args, config: dict) -> None:
    """A resumed run with another --epochs, recorded in config.json; refused where a schedule is spread over all steps
    (RCE's tau, a decaying learning rate), which would have taken other values at every step already trained."""
    before = config["args"]["epochs"]
    why = args.fixed_length_reason() or (f"it has already trained {done} epochs" if args.epochs < done else None)
    if why:
        raise ValueError(
            f"{out} was started with --epochs {before}, and {why}, so it cannot continue to --epochs "
            f"{args.epochs}; start a new run with --init {out}"
        )
    config["args"]["epochs"] = config["made_from"]["flags"]["epochs"] = args.epochs
    config.setdefault("epochs_changed", []).append({"from": before, "to": args.epochs, "after_epoch": done})
    atomic_write_text(out / "config.json", json.dumps(config, indent=2) + "\n")
    print(f"note: {out}: --epochs {before} -> {args.epochs}, continuing after epoch {done}", file=sys.stderr)


def flag_values(args) -> dict:
    """A stage's flags as JSON values (paths as strings), as config.json records them."""
    return json.loads(json.dumps(asdict(args), default=str))


def run_made_from(args, ds) -> dict:
    """What a run is made from (lineage.py): its dataset, its --init weights and every flag that changes what it
    trains (paths name places, and side flags what is kept or shown: neither is an input)."""
    init = getattr(args, "init", None)
    flags = {k: v for k, v in flag_values(args).items() if k not in PATH_ARGS and k not in side_flags(type(args))}
    return lineage.of_dataset(ds.meta, data_digest(ds.folder)) | {
        "init": selector_digest(init)[:16] if init is not None and Path(init).exists() else None,
        "flags": flags,
    }


def selector_made_from(ds) -> dict:
    """What a selector trained on `ds` records in its model.json: what it reads (the task, the encoder's embeddings)
    and the data it learnt from."""
    return lineage.reads(ds.meta) | {"data": data_digest(ds.folder)}


# ----------------------------------------------------------------------------------------------------------------------
# Checkpoints and selectors


def optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, Tensor], dict]:
    """Flatten an optimizer state_dict into tensors + JSON-able rest (safetensors holds tensors only; no pickle)."""
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"optim.{pid}.{k}"] = v
            else:
                scalars[f"{pid}.{k}"] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def restore_optimizer(opt: torch.optim.Optimizer, tensors: dict[str, Tensor], info: dict) -> None:
    state: dict[int, dict] = {}
    for name, v in tensors.items():
        if name.startswith("optim."):
            _, pid, k = name.split(".", 2)
            state.setdefault(int(pid), {})[k] = v
    for key, v in info["scalars"].items():
        pid, k = key.split(".", 1)
        state.setdefault(int(pid), {})[k] = v
    opt.load_state_dict({"state": state, "param_groups": info["param_groups"]})


def save_checkpoint(
    out: Path,
    epoch: int,
    model: PointerSelector,
    opt: torch.optim.Optimizer,
    rngs: dict[str, torch.Generator],
    loop: Loop,
    extra: dict[str, Tensor] | None = None,
) -> None:
    """ckpt/epoch_NNN.safetensors: model, optimizer and RNG states, the loop state and the trainer's `extra` tensors
    ("extra.<name>"). All metadata is one JSON string: safetensors orders metadata keys freely, and a resumed run must
    write byte-identical files."""
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    opt_tensors, opt_meta = optimizer_tensors(opt)
    tensors.update(opt_tensors)
    tensors["rng.torch"] = torch.get_rng_state()
    tensors.update({f"rng.{name}": g.get_state() for name, g in rngs.items()})
    tensors.update({f"extra.{name}": v for name, v in (extra or {}).items()})
    (out / "ckpt").mkdir(exist_ok=True)
    meta = {"epoch": epoch, "optimizer": opt_meta, "loop": asdict(loop), "config": asdict(model.cfg)}
    meta |= {"made_from": model.made_from} if model.made_from is not None else {}
    save_tensors(out / "ckpt" / f"epoch_{epoch:03d}.safetensors", tensors, {"checkpoint": json.dumps(meta)})


def checkpoint_meta(path: Path) -> dict:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as e:  # safetensors' own error types for truncated or foreign files
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
    if "checkpoint" not in meta:
        raise ValueError(f"{path}: not an icl-select epoch checkpoint (no 'checkpoint' metadata)")
    return json.loads(meta["checkpoint"])


def checkpoints(out: Path) -> dict[int, Path]:
    """A run folder's epoch checkpoints, epoch -> file, in epoch order (by number: epoch_1000 after epoch_999)."""
    found = {}
    for p in (out / "ckpt").glob("epoch_*.safetensors"):
        number = p.stem.removeprefix("epoch_")
        if not number.isdigit():
            raise ValueError(
                f"{p}: not an epoch checkpoint of this kit (epoch_NNN.safetensors); move it out of {p.parent}"
            )
        found[int(number)] = p
    return dict(sorted(found.items()))


def prune_checkpoints(out: Path, keep_every: int, best_epoch: int | None) -> None:
    """Delete epoch checkpoints other than the last two (resume needs the last, or the one before when the last is
    damaged), the best and every keep_every-th."""
    for epoch, path in list(checkpoints(out).items())[:-2]:
        if epoch != best_epoch and (keep_every == 0 or epoch % keep_every):
            path.unlink()


def last_checkpoint(out: Path) -> Path | None:
    return next(reversed(checkpoints(out).values()), None)


def resumable_checkpoint(out: Path) -> Path | None:
    """The last epoch checkpoint that reads back whole: a damaged one (a kill or a full disk outside the kit's atomic
    writes) is passed over, with a one-line note, for the one before it. None without checkpoints; one line when every
    one is damaged."""
    damaged = []
    for path in reversed(checkpoints(out).values()):
        try:
            read_tensors(path)
            checkpoint_meta(path)
        except (ValueError, OSError, KeyError) as e:
            damaged.append(path)
            print(
                f"note: {path} is damaged ({str(e).splitlines()[0]}); trying the checkpoint before it", file=sys.stderr
            )
            continue
        return path
    if damaged:
        raise ValueError(
            f"every epoch checkpoint of {out} is damaged ({damaged[-1].name} ... {damaged[0].name}); "
            "move the ckpt folder away to start the run again"
        )
    return None


def load_model_part(model: PointerSelector, tensors: dict[str, Tensor], path: Path) -> None:
    """The checkpoint's "model." tensors into `model`, strictly."""
    load_state_strict(model, {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}, path)


def load_checkpoint(
    path: Path, model: PointerSelector, opt: torch.optim.Optimizer | None, rngs: dict[str, torch.Generator]
) -> tuple[Loop, dict[str, Tensor]]:
    """Restore everything save_checkpoint wrote; returns the loop state and the trainer's `extra` tensors."""
    tensors, meta = read_tensors(path), checkpoint_meta(path)
    load_model_part(model, tensors, path)
    if opt is not None:
        restore_optimizer(opt, tensors, meta["optimizer"])
    torch.set_rng_state(tensors["rng.torch"])
    for name, g in rngs.items():
        g.set_state(tensors[f"rng.{name}"])
    return Loop(**meta["loop"]), {k.removeprefix("extra."): v for k, v in tensors.items() if k.startswith("extra.")}


def load_selector(source: Path) -> PointerSelector:
    """A selector from a run folder (model.json + model.safetensors) or an epoch checkpoint file."""
    source = Path(source)
    if source.is_dir():
        return PointerSelector.load(source)
    if not source.is_file():
        raise FileNotFoundError(f"{source}: no such run folder or checkpoint")
    meta = checkpoint_meta(source)
    model = PointerSelector(selector_config(meta.get("config"), f"{source} metadata 'checkpoint'"))
    load_model_part(model, read_tensors(source), source)
    model.made_from = meta.get("made_from")
    return model


def settings_file(source: Path) -> Path:
    """Where the settings of the selector at `source` (as `load_selector` takes it) are read from: a run folder's
    model.json, or the epoch checkpoint itself."""
    return source / "model.json" if source.is_dir() else source


def check_selector(model: PointerSelector, source: Path, reads: dict, where, dim: int | None) -> None:
    """The selector loaded from `source` was trained for the task and on embeddings of the encoder that `where` (a
    dataset folder or a library) has (`reads`: lineage.reads), as wide (`dim`, unless None: not known yet): one line
    naming what differs."""
    fix = "use a selector trained on this task and on embeddings of this encoder"
    lineage.check(settings_file(source), model.made_from, reads, fix, names=("task", "encoder"))
    if dim is not None and model.cfg.dim != dim:
        raise DataError(
            f"{settings_file(source)}: field 'dim' is {model.cfg.dim}, but the embeddings of {where} are {dim}-d; {fix}"
        )


# ----------------------------------------------------------------------------------------------------------------------
# Reading a run back (evaluate.py, compare.py, ablate.py)


def kit_json(path: Path, keys: tuple[str, ...], writer: str) -> dict:
    """A JSON object the kit wrote, as it is; a damaged or foreign file is one line naming what it lacks."""
    doc = read_json(path)
    missing = [k for k in keys if k not in doc] if isinstance(doc, dict) else list(keys)
    if missing:
        raise DataError(f"{path}: not a file {writer} writes (no field {missing[0]!r})")
    return doc


def read_eval(path: Path) -> dict:
    """An evaluation file as evaluate.py wrote it, with what it was made from (lineage.py)."""
    doc = kit_json(path, ("shots", "results", "summary"), "evaluate.py")
    lineage.check(path, doc.get("made_from"), {}, "evaluate again with this version")
    return doc


def read_args(path: Path) -> dict:
    """config.json's recorded flags."""
    return kit_json(path, ("args",), "rce.py or grpo.py")["args"]


def read_metrics(path: Path) -> list[dict]:
    """metrics.jsonl's epoch records (step records left out)."""
    records = []
    for line, r in read_jsonl(path, truncated="warn"):
        if not isinstance(r, dict) or "epoch" not in r and r.get("kind") != "step":
            raise DataError(f"{path} line {line}: not a record rce.py or grpo.py writes (no field 'epoch')")
        if r.get("kind") != "step":
            records.append(r)
    return records


def unfinished(epochs: list[dict], args: dict | None) -> str | None:
    """'8 of 30 epochs' for a run whose training stopped before its planned epochs, else None: from its epoch
    records (`read_metrics`) and flags (`read_args`, None without config.json)."""
    planned = (args or {}).get("epochs")
    trained = epochs[-1]["epoch"] if epochs else 0
    return f"{trained} of {planned} epochs" if planned is not None and trained < planned else None
