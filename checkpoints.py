"""Epoch checkpoints and trained selectors on disk, read strictly (what evaluate.py reads without the training loop).

A selector folder holds model.json (its SelectorConfig) and model.safetensors (`PointerSelector.save`).
ckpt/epoch_NNN.safetensors holds the model, the optimizer state, every RNG state and the loop state (best so far,
step, adaptive beta, ...), so a resumed run ends bit-identical to an uninterrupted one. safetensors holds tensors
only (no pickle): the optimizer's non-tensor state and the loop state travel as one JSON string of metadata.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, fields
from pathlib import Path

import torch
from torch import Tensor, nn

from files import DataError, read_json, read_tensors, save_tensors
from model import PointerSelector, SelectorConfig


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
    loop: dict,
    extra: dict[str, Tensor] | None = None,
) -> None:
    """ckpt/epoch_NNN.safetensors: model, optimizer and RNG states, plus loop state (best so far, step, beta...) and
    the trainer's `extra` tensors (stored as "extra.<name>").

    All metadata sits in one JSON string: safetensors writes metadata keys in no fixed order, and a resumed run must
    write byte-identical files.
    """
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    opt_tensors, opt_meta = optimizer_tensors(opt)
    tensors.update(opt_tensors)
    tensors["rng.torch"] = torch.get_rng_state()
    tensors.update({f"rng.{name}": g.get_state() for name, g in rngs.items()})
    tensors.update({f"extra.{name}": v for name, v in (extra or {}).items()})
    (out / "ckpt").mkdir(exist_ok=True)
    meta = {"epoch": epoch, "optimizer": opt_meta, "loop": loop, "config": asdict(model.cfg)}
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
    """The last epoch checkpoint that reads back whole: a damaged one (truncated, empty, foreign: a kill or a full
    disk outside the kit's atomic writes) is passed over with a one-line note for the one before it, which the
    resumed run then recomputes from. None when the run has none; one line when every checkpoint is damaged."""
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
) -> tuple[dict, dict[str, Tensor]]:
    """Restore everything save_checkpoint wrote; returns the loop state and the trainer's `extra` tensors."""
    tensors, meta = read_tensors(path), checkpoint_meta(path)
    load_model_part(model, tensors, path)
    if opt is not None:
        restore_optimizer(opt, tensors, meta["optimizer"])
    torch.set_rng_state(tensors["rng.torch"])
    for name, g in rngs.items():
        g.set_state(tensors[f"rng.{name}"])
    return meta["loop"], {k.removeprefix("extra."): v for k, v in tensors.items() if k.startswith("extra.")}


def load_selector(source: Path) -> PointerSelector:
    """A selector from a run folder (model.json + model.safetensors) or an epoch checkpoint file."""
    source = Path(source)
    if source.is_dir():
        model = PointerSelector(read_config(source / "model.json"))
        load_state_strict(model, read_tensors(source / "model.safetensors"), source / "model.safetensors")
        return model
    if not source.is_file():
        raise FileNotFoundError(f"{source}: no such run folder or checkpoint")
    model = PointerSelector(selector_config(checkpoint_meta(source).get("config"), f"{source} metadata 'checkpoint'"))
    load_model_part(model, read_tensors(source), source)
    return model


def settings_file(source: Path) -> Path:
    """Where the settings of the selector at `source` (as `load_selector` takes it) are read from: a run folder's
    model.json, or the epoch checkpoint itself."""
    return source / "model.json" if source.is_dir() else source


def check_width(model: PointerSelector, source: Path, data: Path, dim: int) -> None:
    """The selector loaded from `source` reads embeddings as wide as those of the dataset `data` (`dim`)."""
    if model.cfg.dim != dim:
        raise DataError(
            f"{settings_file(source)}: field 'dim' is {model.cfg.dim}, but the embeddings of {data} are {dim}-d; "
            "use a selector trained on embeddings of this dataset's encoder"
        )


def read_config(path: Path) -> SelectorConfig:
    """model.json: every field of SelectorConfig, each of its type (int, float or str), and nothing else."""
    return selector_config(read_json(path), str(path))


def selector_config(raw: object, where: str) -> SelectorConfig:
    """Selector settings as read from a file (`where` names it): every field of SelectorConfig, each of its type,
    and nothing else."""
    if not isinstance(raw, dict):
        raise DataError(f"{where}: expected a JSON object of selector settings, got {type(raw).__name__}")
    kinds = {f.name: type(f.default) for f in fields(SelectorConfig)}
    if set(raw) != set(kinds):
        missing, unknown = sorted(set(kinds) - set(raw)), sorted(set(raw) - set(kinds))
        raise DataError(f"{where}: fields missing {missing}, unknown {unknown}; expected {sorted(kinds)}")
    for name, kind in kinds.items():
        value = raw[name]
        if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else kind):
            raise DataError(
                f"{where}: field {name!r} must be {'a number' if kind is float else kind.__name__}, got {value!r}"
            )
    if raw["picks"] < 1:
        raise DataError(f"{where}: field 'picks' must be >= 1, got {raw['picks']}")
    try:
        return SelectorConfig(**raw)
    except ValueError as e:
        raise DataError(f"{where}: {e}") from None


def load_state_strict(model: nn.Module, tensors: dict[str, Tensor], source: Path) -> None:
    """load_state_dict that names every missing, unexpected or mis-shaped tensor instead of skipping it."""
    own = model.state_dict()
    missing = sorted(set(own) - set(tensors))
    unexpected = sorted(set(tensors) - set(own))
    shapes = [
        f"{k}: {tuple(tensors[k].shape)} in file, {tuple(v.shape)} in model"
        for k, v in own.items()
        if k in tensors and tensors[k].shape != v.shape
    ]
    problems = [f"missing tensors {missing}"] * bool(missing) + [f"unexpected tensors {unexpected}"] * bool(unexpected)
    problems += [f"shape mismatch {s}" for s in shapes]
    if problems:
        raise ValueError(f"{source}: does not match the selector architecture: " + "; ".join(problems))
    model.load_state_dict(tensors, strict=True)
