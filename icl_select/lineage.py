"""What an artifact was made from, by content, and the one check its every reader makes before any work.

Every file or folder a stage writes records `made_from`, each input it was made from by content, not by path:

    "data"      the dataset folder's content digest (`data.data_digest`; a reader refuses an unfinished folder)
    "task"      vqa or caption
    "lvlm"      the LVLM that scored: "sim:<digest of the simulated world's settings>" or "<id>@<revision>" (the Hub
                commit, or a local folder's digest of every file)
    "encoder"   what embedded questions and pictures: "sim" or "<id>@<revision>"
    "init"      SHA-256 of the starting selector's weights (a run's --init), or None
    "selector"  SHA-256 of the evaluated selector's weights, or None for a baseline
    "flags"     the flags that change the result, by name

`made_from(...)` writes the record; `check(where, then, now, fix)` compares what an artifact records with what its
reader has now and stops in one line naming the artifact, the first input that differs and both identities. The
reader then either refuses, or, where the artifact is a cache of its own (a progress file), does the work again.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from icl_select.files import DataError

# An input's name in a refusal; a flag is named as on the command line.
WORDS = {
    "data": "the dataset",
    "complete": "the dataset's completeness",
    "task": "the task",
    "lvlm": "the LVLM",
    "encoder": "the encoder",
    "init": "the --init selector",
    "selector": "the selector",
    "items": "the dataset's source files",
}


class LineageError(DataError):
    """An artifact made from other inputs than its reader has now; the message names the input and both identities."""


def digest(value) -> str:
    """A short content digest of a JSON value (keys sorted)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def model_of(name: str, revision: str | None) -> str:
    """A model by its revision (a Hub commit, or a local folder's digest of its files), named for the reader: the
    same weights wherever their folder lies."""
    return f"{Path(name.rstrip('/')).name}@{revision}"


def lvlm_of(info: dict) -> str:
    """The LVLM's identity from a dataset's meta.json or a backend's describe(): the simulated world's settings, or
    the model at its revision."""
    if info.get("lvlm") == "sim":
        return f"sim:{digest(info['sim_config'])}"
    return model_of(info["lvlm"], info.get("revision"))


def encoder_of(meta: dict) -> str:
    """The encoder's identity from a dataset's meta.json: the simulator's own, or the model at its revision."""
    return "sim" if meta.get("encoder") == "sim" else model_of(meta["encoder"], meta.get("encoder_revision"))


def of_dataset(meta: dict, data: str) -> dict:
    """What a dataset folder is, as every artifact made from it records it: its content digest `data`, its task, the
    LVLM that scored it and the encoder that embedded it."""
    return {"data": data, "task": meta["task"], "lvlm": lvlm_of(meta), "encoder": encoder_of(meta)}


def reads(meta: dict) -> dict:
    """What a selector trained on a dataset reads and is for: its task and its encoder's embeddings. A selector is
    used on other data of the same task and encoder (its model.json records these and the data it learnt from)."""
    return {"task": meta["task"], "encoder": encoder_of(meta)}


def made_from(**inputs) -> dict:
    """The record an artifact keeps: input name -> its identity (a flags dict as it is)."""
    return dict(inputs)


def differences(then: dict, now: dict, names=None) -> list[tuple[str, object, object]]:
    """(name, then, now) of each input whose identity differs, in `now`'s order (or `names`'); flags one by one."""
    out = []
    for name in names or now:
        a, b = then.get(name), now.get(name)
        if isinstance(a, dict) and isinstance(b, dict) and name == "flags":
            out += [(f"--{k.replace('_', '-')}", a.get(k), b.get(k)) for k in b if a.get(k) != b.get(k)]
            out += [(f"--{k.replace('_', '-')}", a[k], None) for k in a if k not in b]
        elif a != b:
            out.append((name, a, b))
    return out


def say(diffs: list[tuple[str, object, object]]) -> str:
    """The first difference in words: "the dataset a1b2... there, c3d4... now"; a flag "--lr 0.001 there, 0.01 now"."""
    name, a, b = diffs[0]
    more = f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else ""
    if name in WORDS:  # an identity, as it is
        return f"{WORDS[name]} {a} there, {b} now{more}"
    return f"{name} {a!r} there, {b!r} now{more}"  # a flag or setting, as Python writes it


def check(where, then: dict | None, now: dict, fix: str, names=None) -> None:
    """Refuse, in one line naming `where`, an artifact whose recorded inputs (`then`) are not `now`'s (only `names`,
    if given); `fix` says what to do. An artifact that records nothing was written by an older kit."""
    if not isinstance(then, dict):
        raise LineageError(f"{where} does not record what it was made from (an older icl-select wrote it); {fix}")
    if diffs := differences(then, now, names):
        raise LineageError(f"{where} was made from other inputs: {say(diffs)}; {fix}")
