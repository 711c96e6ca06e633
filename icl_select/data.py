"""Dataset folders: reading, strict validation, rewards, and tensors ready for training.

A dataset folder holds meta.json, items.json, embeddings.safetensors, rl_data.jsonl and eval_pools.json (and, on
real data, picture_stamps.json: its picture files as embedded, by which readers see that none changed). Each
rl_data.jsonl line is one anchor query: {"query", "pool", "zero_shot_gt_prob" (its gt_prob with no ICDs), "seqs":
[{"icds", "source", "acc", "correct", "gt_prob", "rel", "prediction"}, ...]}, gt_prob at full float precision. Every
malformed input raises one `DataError` naming the file, the line (jsonl) and the field; stages call
`load_dataset` before writing anything, so bad input never leaves a half-made run behind. Rewards are computed
here from the stored fields (the modes and why info_score is what it is: docs/flags.md).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import torch
from torch import Tensor

from icl_select.files import DataError, read_json, read_jsonl, read_tensors
from icl_select.pictures import check_pictures, same_picture_ids
from icl_select.sim import SimConfig
from icl_select.sim_caption import CaptionConfig
from model import reward_spread

FORMAT_VERSION = 2  # 2: gt_prob at full precision, and each query's zero-shot gt_prob
RewardMode = Literal[
    "hard_plus_soft",
    "separated",
    "hard_only",
    "soft_only",
    "hard_plus_gtprob",
    "hard_plus_gtprob_plus_rel",
    "info_score",
]
REWARD_MODES: tuple[str, ...] = get_args(RewardMode)
Quality = Literal["high", "medium", "varied", "all"]
SEQ_FIELDS = ("acc", "correct", "gt_prob", "rel")  # what a backend scores for every sequence
ZERO_SHOT = "zero_shot_gt_prob"  # gt_prob of an anchor query with no ICDs: one per rl_data line
INFO_FLOOR = 1e-6  # info_score's floor on both probabilities: a stored 0 (an underflow) has no logarithm
DEFAULT_DATA = Path("data/sim")  # the dataset folder every stage reads and gen_rl_data.py writes by default
# What a task's LVLM is scored by, as every table names it: VQA accuracy in [0, 1] and CIDEr-D in [0, 10] per prompt,
# both shown x100 (percent; CIDEr as papers report it).
METRIC = {"vqa": "VQA accuracy %", "caption": "CIDEr-D x100"}
TOP_SCORE = {"vqa": 1.0, "caption": 10.0}


@dataclass
class RewardArgs:
    """How a scored sequence becomes a scalar reward (shared by rce.py, grpo.py and the data report)."""

    reward_mode: RewardMode = "hard_plus_soft"
    """How a scored sequence becomes a reward (formulas: docs/flags.md)."""
    hard_weight: float = 1.0
    """Weight of `correct` (0/1) in the modes that have one."""
    soft_weight: float = 1.0
    """Weight of the soft term (acc, gt_prob or info_score's log ratio)."""
    rel_weight: float = 0.2
    """hard_plus_gtprob_plus_rel: weight of a wrong answer's closeness to the truth."""


def compute_reward(fields: dict[str, Tensor], args: RewardArgs) -> Tensor:
    """Per-sequence reward from the stored fields (any shape, e.g. (Q, G)); info_score also reads ZERO_SHOT, the
    query's zero-shot gt_prob broadcast to the same shape."""
    c, acc, p, rel = (fields[k].double() for k in ("correct", "acc", "gt_prob", "rel"))
    h, s, w = args.hard_weight, args.soft_weight, args.rel_weight
    match args.reward_mode:
        case "hard_plus_soft":
            return h * c + s * acc
        case "separated":
            return 2 * c + acc
        case "hard_only":
            return c
        case "soft_only":
            return acc
        case "hard_plus_gtprob":
            return h * c + s * p
        case "hard_plus_gtprob_plus_rel":
            return h * c + s * p + w * (1 - c) * rel
        case "info_score":
            if ZERO_SHOT not in fields:
                raise ValueError(f"reward mode info_score needs each query's zero-shot gt_prob ('{ZERO_SHOT}')")
            p0 = fields[ZERO_SHOT].double()
            return s * (p.clamp_min(INFO_FLOOR).log() - p0.clamp_min(INFO_FLOOR).log())
    raise ValueError(f"unknown reward mode {args.reward_mode!r}")


# ----------------------------------------------------------------------------------------------------------------------
# Reading and validating the folder


# meta.json fields every dataset has, with their types; a wrong one is one line naming it, never a traceback later.
META_FIELDS = {
    "format_version": int,
    "task": str,
    "source": str,
    "lvlm": str,
    "sampler": str,
    "groups": str,
    "pool_size": int,
    "group_size": int,
    "seq_len": int,
    "min_shots": int,
    "num_queries": int,
    "seed": int,
    "complete": bool,
    "settings": dict,
}
META_OPTIONAL = {
    "calibration": dict,
    "counts": dict,
    "sim_config": dict,
    "prompt_template": dict,
    "generation": dict,
    "lvlm_calls": int,
}
TYPE_NAMES = {
    int: "an integer",
    float: "a number",
    str: "a string",
    bool: "true or false",
    dict: "an object",
    list: "a list",
}


def _typed(value, kind: type, where: str):
    """`value` if it has the JSON type `kind` (float: any number; a bool is never a number), else one DataError."""
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if not ok:
        raise DataError(f"{where}: expected {TYPE_NAMES[kind]}, got {value!r:.80}")
    return value


def _finite(value, where: str, field: str = "") -> None:
    """No NaN or infinity anywhere in a JSON document (json.loads accepts them)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise DataError(f"{where}: field '{field}' is {value}, expected a finite number")
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        _finite(v, where, f"{field}[{k}]" if isinstance(k, int) else f"{field}.{k}" if field else k)


def read_meta(folder: Path) -> dict:
    path = folder / "meta.json"
    meta = read_json(path)
    if not isinstance(meta, dict) or "format_version" not in meta:
        raise DataError(f"{path}: field 'format_version' is missing; is this an icl-select dataset?")
    if meta["format_version"] != FORMAT_VERSION:
        raise DataError(
            f"{path}: field 'format_version' is {meta['format_version']!r}, this kit reads version "
            f"{FORMAT_VERSION}; regenerate the folder with gen_rl_data.py"
        )
    _finite(meta, str(path))
    for key, kind in (META_FIELDS | {k: v for k, v in META_OPTIONAL.items() if k in meta}).items():
        if key not in meta:
            raise DataError(f"{path}: field '{key}' is missing")
        _typed(meta[key], kind, f"{path}: field '{key}'")
    for key in ("pool_size", "group_size", "seq_len", "num_queries"):
        if meta[key] < 1:
            raise DataError(f"{path}: field '{key}' is {meta[key]}, expected an integer >= 1")
    if meta["task"] not in METRIC:
        raise DataError(f"{path}: field 'task' is {meta['task']!r}, expected one of {', '.join(METRIC)}")
    if not 0 <= meta["min_shots"] <= meta["seq_len"]:
        raise DataError(f"{path}: field 'min_shots' is {meta['min_shots']}, expected 0 to seq_len {meta['seq_len']}")
    for name, value in meta.get("calibration", {}).items():
        _typed(value, float, f"{path}: field 'calibration.{name}'")
    if meta["source"] != "sim":  # what backends.open_backend rebuilds the real LVLM's prompts from
        for group, key, kind in (
            ("prompt_template", "icd", str),
            ("prompt_template", "query", str),
            ("prompt_template", "style", str),
            ("generation", "max_new_tokens", int),
        ):
            value = meta.get(group, {}).get(key)
            _typed(value, kind, f"{path}: field '{group}.{key}'")
    if "sim_config" in meta:
        config = CaptionConfig if meta["task"] == "caption" else SimConfig  # the simulator of the task
        known = {f.name: f.default for f in dataclasses.fields(config)}
        if unknown := sorted(meta["sim_config"].keys() - known.keys()):
            raise DataError(f"{path}: field 'sim_config.{unknown[0]}' is not a simulator setting")
        if missing := [k for k in known if k not in meta["sim_config"]]:
            raise DataError(
                f"{path}: field 'sim_config.{missing[0]}' is missing; regenerate the folder with gen_rl_data.py"
            )
        for name, default in known.items():
            value = meta["sim_config"][name]
            where = f"{path}: field 'sim_config.{name}'"
            if isinstance(default, tuple):
                for v in _typed(value, list, where):
                    _typed(v, float, where)
            else:
                _typed(value, {float: float, int: int, str: str}[type(default)], where)
        try:  # the ranges, where the config keeps them
            config(**{k: tuple(v) if isinstance(v, list) else v for k, v in meta["sim_config"].items()})
        except ValueError as e:
            raise DataError(f"{path}: field 'sim_config': {e}") from None
    return meta


def read_rl_data(path: Path, allow_truncated: bool) -> list[tuple[int, dict]]:
    hint = "; re-run gen_rl_data.py with the same flags to finish it"
    return read_jsonl(path, "warn" if allow_truncated else "error", hint)


def _ids(value, where: str, n: int, distinct: bool = True) -> list[int]:
    """A list of ints in [0, n), distinct unless told otherwise."""
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise DataError(f"{where}: expected a list of integers, got {value!r:.80}")
    if bad := [v for v in value if not 0 <= v < n]:
        raise DataError(f"{where}: id {bad[0]} is out of range 0..{n - 1}")
    if distinct and len(set(value)) != len(value):
        dup = next(v for v in value if value.count(v) > 1)
        raise DataError(f"{where}: id {dup} is repeated in {value}")
    return value


def _number(value, where: str, lo: float = 0.0, hi: float = 1.0) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise DataError(f"{where}: expected a finite number, got {value!r}")
    if not lo <= value <= hi:
        raise DataError(f"{where}: {value} is outside [{lo}, {hi}]")
    return float(value)


@dataclass
class Groups:
    """Padded anchor-query groups (Q queries, up to G scored sequences each, S steps, pools of up to K)."""

    queries: Tensor  # (Q,) train rows of the anchor queries
    pools: Tensor  # (Q, K) train rows, -1 where padded
    pool_mask: Tensor  # (Q, K) bool
    seqs: Tensor  # (Q, G, S) pool positions, -1 where padded
    seq_mask: Tensor  # (Q, G) bool
    fields: dict[str, Tensor]  # acc, correct, gt_prob, rel, ZERO_SHOT (per query, repeated): (Q, G), 0 where padded
    sources: list[list[str]]  # per query, per sequence

    def __len__(self) -> int:
        return len(self.queries)


def parse_groups(
    path: Path, records: list[tuple[int, dict]], num_train: int, seq_len: int, min_shots: int, top: float = 1.0
) -> Groups:
    """Validate rl_data.jsonl records and pad them into tensors; sequences hold min_shots..seq_len demonstrations,
    -1 after the last of a shorter one, and an acc of at most `top` (the task's TOP_SCORE)."""
    queries, pools, seqs, sources, zero_shot = [], [], [], [], []
    fields = {k: [] for k in SEQ_FIELDS}
    seen: dict[int, int] = {}
    for line, rec in records:
        at = f"{path} line {line}"
        if not isinstance(rec, dict):
            raise DataError(f"{at}: expected a JSON object")
        for key in ("query", "pool", ZERO_SHOT, "seqs"):
            if key not in rec:
                raise DataError(f"{at}: field '{key}' is missing")
        [q] = _ids([rec["query"]], f"{at}: field 'query'", num_train)
        if q in seen:
            raise DataError(
                f"{at}: field 'query': query {q} already appears on line {seen[q]} (two writers?); re-run the "
                "gen_rl_data.py command that built the folder: it keeps one line per query"
            )
        seen[q] = line
        pool = _ids(rec["pool"], f"{at}: field 'pool'", num_train)
        if q in pool:
            raise DataError(f"{at}: field 'pool' contains the query itself ({q})")
        if len(pool) < seq_len:
            raise DataError(f"{at}: field 'pool' has {len(pool)} candidates, fewer than the sequence length {seq_len}")
        zero_shot.append(_number(rec[ZERO_SHOT], f"{at}: field '{ZERO_SHOT}'"))
        if not isinstance(rec["seqs"], list) or not rec["seqs"]:
            raise DataError(f"{at}: field 'seqs' must be a non-empty list")
        group, codes = [], set()
        for j, s in enumerate(rec["seqs"]):
            where = f"{at}: field 'seqs[{j}]"
            if not isinstance(s, dict):
                raise DataError(f"{where}': expected an object")
            for key in ("icds", *SEQ_FIELDS):
                if key not in s:
                    raise DataError(f"{where}.{key}' is missing")
            icds = _ids(s["icds"], f"{where}.icds'", len(pool))
            if not min_shots <= len(icds) <= seq_len:
                span = f"{min_shots} to {seq_len}" if min_shots < seq_len else f"the sequence length {seq_len}"
                raise DataError(f"{where}.icds' has {len(icds)} picks, expected {span}")
            if tuple(icds) in codes:
                raise DataError(f"{where}.icds' repeats an earlier sequence of this group: {icds}")
            codes.add(tuple(icds))
            group.append(icds)
            for key in SEQ_FIELDS:
                fields[key].append((len(queries), j, _number(s[key], f"{where}.{key}'", hi=top if key == "acc" else 1)))
            if s["correct"] not in (0, 1):
                raise DataError(f"{where}.correct': expected 0 or 1, got {s['correct']!r}")
        queries.append(q)
        pools.append(pool)
        seqs.append(group)
        sources.append([str(s.get("source", "")) for s in rec["seqs"]])
    if not queries:
        raise DataError(f"{path}: no anchor queries")
    Q, K, G = len(queries), max(map(len, pools)), max(map(len, seqs))
    pool_t = torch.full((Q, K), -1, dtype=torch.long)
    seq_t = torch.full((Q, G, seq_len), -1, dtype=torch.long)
    seq_mask = torch.zeros(Q, G, dtype=torch.bool)
    for i, (p, g) in enumerate(zip(pools, seqs)):
        pool_t[i, : len(p)] = torch.tensor(p)
        seq_mask[i, : len(g)] = True
        for j, icds in enumerate(g):
            seq_t[i, j, : len(icds)] = torch.tensor(icds, dtype=torch.long)
    field_t = {}
    for key, entries in fields.items():
        t = torch.zeros(Q, G, dtype=torch.float64)
        i, j, v = zip(*entries)
        t[list(i), list(j)] = torch.tensor(v, dtype=torch.float64)
        field_t[key] = t
    field_t[ZERO_SHOT] = torch.tensor(zero_shot, dtype=torch.float64)[:, None].expand(Q, G) * seq_mask  # (Q, G)
    return Groups(torch.tensor(queries), pool_t, pool_t >= 0, seq_t, seq_mask, field_t, sources)


@dataclass
class Dataset:
    folder: Path
    meta: dict
    items: dict[str, list[dict]]
    emb: dict[str, Tensor]  # "train" (N_train, d), "val" (N_val, d) (+ optional image/text views)
    groups: Groups
    eval_pools: Tensor  # (N_val, K) train rows

    @property
    def seq_len(self) -> int:
        return self.meta["seq_len"]

    @property
    def is_sim(self) -> bool:
        return self.meta.get("source") == "sim"

    @functools.cached_property
    def picture_ids(self) -> dict[str, Tensor]:
        return picture_ids(self.items)


def picture_ids(items: dict[str, list[dict]]) -> dict[str, Tensor]:
    """Each item's picture per split, (N,): items that share an image id or their pixels (items.json's "picture",
    which gen_rl_data.py writes for real data) are one picture, numbered by their smallest image id. Pools, splits and
    online queries keep a question's own picture out by these."""
    rows = [it for split in items.values() for it in split]
    ids = torch.tensor(same_picture_ids([it["image_id"] for it in rows], [it.get("picture") for it in rows]))
    return dict(zip(items, ids.split([len(split) for split in items.values()])))


def load_dataset(folder: str | Path, allow_unfinished: bool = False) -> Dataset:
    """Read and validate a whole dataset folder (raises DataError on the first problem). A folder whose build has not
    finished (meta.json's "complete") is refused, unless `allow_unfinished` (gen_rl_data.py --report), where a
    truncated last line of rl_data.jsonl (a killed write) is left out with a warning."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"{folder}: no such dataset folder (build one with: python gen_rl_data.py --out {folder})")
    meta = read_meta(folder)
    if not meta["complete"] and not allow_unfinished:
        raise DataError(
            f"{folder}: its build has not finished (meta.json field 'complete' is false: gen_rl_data.py was stopped); "
            "re-run the gen_rl_data.py command that builds it to finish it"
        )
    items = read_items(folder / "items.json")
    check_pictures(folder, items)  # what an LVLM is shown later are the pictures the folder was built on
    emb = read_embeddings(folder / "embeddings.safetensors", {k: len(v) for k, v in items.items()})
    n_train = len(items["train"])
    records = read_rl_data(folder / "rl_data.jsonl", allow_unfinished)
    groups = parse_groups(
        folder / "rl_data.jsonl", records, n_train, meta["seq_len"], meta["min_shots"], TOP_SCORE[meta["task"]]
    )
    eval_pools = read_eval_pools(folder / "eval_pools.json", len(items["val"]), n_train)
    return Dataset(folder, meta, items, emb, groups, eval_pools)


def read_items(path: Path) -> dict[str, list[dict]]:
    items = read_json(path)
    if not isinstance(items, dict):
        raise DataError(f"{path}: expected an object with 'train' and 'val' lists")
    for split in ("train", "val"):
        rows = items.get(split)
        if not isinstance(rows, list) or not rows:
            raise DataError(f"{path}: field '{split}' must be a non-empty list of items")
        for i, it in enumerate(rows):
            for key in ("question_id", "image_id", "question", "answers"):
                if not isinstance(it, dict) or key not in it:
                    raise DataError(f"{path}: field '{split}[{i}].{key}' is missing")
            _typed(it["image_id"], int, f"{path}: field '{split}[{i}].image_id'")  # pools compare image ids
            _typed(it["question"], str, f"{path}: field '{split}[{i}].question'")
            if "picture" in it:  # its pixel digest, which pools compare too
                _typed(it["picture"], str, f"{path}: field '{split}[{i}].picture'")
            answers = it["answers"]
            if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
                raise DataError(f"{path}: field '{split}[{i}].answers' must be a non-empty list of strings")
    return items


def read_embeddings(path: Path, counts: dict[str, int]) -> dict[str, Tensor]:
    try:
        emb = read_tensors(path)
    except (FileNotFoundError, ValueError) as e:
        raise DataError(str(e)) from None
    dims = set()
    for name, t in emb.items():
        split = name.split("_")[0]
        if split not in counts:
            continue
        if t.dim() != 2 or t.shape[0] != counts[split]:
            raise DataError(
                f"{path}: tensor '{name}' has shape {tuple(t.shape)}, but items.json has {counts[split]} "
                f"'{split}' items (expected ({counts[split]}, d))"
            )
        if not torch.isfinite(t).all():
            row = int((~torch.isfinite(t)).any(-1).nonzero()[0, 0])
            raise DataError(f"{path}: tensor '{name}' row {row} contains NaN or inf")
        dims.add(t.shape[1])
    for split in counts:
        if split not in emb:
            raise DataError(f"{path}: tensor '{split}' is missing")
    if len(dims) > 1:
        raise DataError(f"{path}: embeddings have different widths {sorted(dims)}")
    return {k: v.float() for k, v in emb.items()}


def read_eval_pools(path: Path, n_val: int, n_train: int) -> Tensor:
    raw = read_json(path)
    pools = raw.get("pools") if isinstance(raw, dict) else None
    if not isinstance(pools, list) or len(pools) != n_val:
        got = len(pools) if isinstance(pools, list) else "none"
        raise DataError(f"{path}: field 'pools' must hold one pool per val item ({n_val}), got {got}")
    for i, p in enumerate(pools):
        _ids(p, f"{path}: field 'pools[{i}]'", n_train)
    if len({len(p) for p in pools}) != 1:
        raise DataError(f"{path}: field 'pools': all pools must have the same size")
    return torch.tensor(pools, dtype=torch.long)


# ----------------------------------------------------------------------------------------------------------------------
# Query statistics shared by the data report and the curriculum filters


def group_stats(groups: Groups, reward: Tensor) -> dict[str, Tensor]:
    """Per query (Q,): reward gap (max - min), positives (correct) and negatives among its valid sequences."""
    m = groups.seq_mask
    gap = reward_spread(reward, m)
    pos = ((groups.fields["correct"] > 0) & m).sum(-1)
    return {"gap": gap, "positives": pos, "negatives": m.sum(-1) - pos}


# Quality tiers of a query's scored group: (name, smallest reward gap max - min, smallest count of correct and of
# wrong sequences, how the data report describes it); a query takes the first tier it meets, else "low".
QUALITY_TIERS = (
    ("high", 1.5, 3, "gap >= 1.5, >= 3 positives and >= 3 negatives"),
    ("medium", 1.0, 2, "gap >= 1.0, >= 2 of each"),
)


def quality_labels(groups: Groups, reward: Tensor) -> list[str]:
    """Each query's tier (QUALITY_TIERS), "low" for the rest."""
    st = group_stats(groups, reward)
    both = torch.minimum(st["positives"], st["negatives"])
    labels = ["low"] * len(groups)
    for name, gap, count, _ in reversed(QUALITY_TIERS):  # the first tier a query meets wins
        for i in ((st["gap"] >= gap) & (both >= count)).nonzero()[:, 0].tolist():
            labels[i] = name
    return labels


def filter_queries(groups: Groups, reward: Tensor, quality: Quality, require_positive: bool) -> Tensor:
    """Indices of the queries kept by the curriculum filters: quality high (high only), medium (high + medium),
    varied (every query whose sequences do not all share one reward), all."""
    if quality in ("high", "medium"):
        allowed = {"high": {"high"}, "medium": {"high", "medium"}}[quality]
        keep = torch.tensor([lab in allowed for lab in quality_labels(groups, reward)], dtype=torch.bool)
    else:
        keep = (
            group_stats(groups, reward)["gap"] > 0 if quality == "varied" else torch.ones(len(groups), dtype=torch.bool)
        )
    if require_positive:
        keep &= group_stats(groups, reward)["positives"] > 0
    return keep.nonzero()[:, 0]


DATA_FILES = ("items.json", "embeddings.safetensors", "rl_data.jsonl", "eval_pools.json")


def data_digest(folder: Path) -> str:
    """Hash of what training reads from a dataset folder: its data files and its settings (meta.json without when it
    was written and how fast), so regenerating identical data keeps the digest and any edited reward changes it. Each
    folder is read once per process while no file in it changes (size, modification time, inode)."""
    folder = Path(folder).resolve()
    stats = tuple(
        (n, st.st_size, st.st_mtime_ns, st.st_ino) for n in ("meta.json", *DATA_FILES) for st in [(folder / n).stat()]
    )
    return _data_digest(folder, stats)


@functools.cache
def _data_digest(folder: Path, stats: tuple) -> str:
    h = hashlib.sha256()
    meta = json.loads((folder / "meta.json").read_text())
    meta = {k: v for k, v in meta.items() if k not in ("created_at", "lvlm_seq_per_s")}
    h.update(json.dumps(meta, sort_keys=True).encode())
    for name in DATA_FILES:
        with open(folder / name, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()[:16]
