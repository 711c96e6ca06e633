"""Load OK-VQA / VQAv2 splits from the official question, annotation and COCO image files, or from the Hugging Face
`datasets` exports of them (parquet shards with embedded images).

    load_vqa_split("okvqa", Path("/data/okvqa"), "train") -> [{"question_id", "image_id", "question",
                                                             "answers": [10 raw annotator strings], "image": path}]

Official layout under `data_root` (every name can be overridden; relative overrides are taken under `data_root`):
    OK-VQA  OpenEnded_mscoco_{split}2014_questions.json     mscoco_{split}2014_annotations.json
    VQAv2   v2_OpenEnded_mscoco_{split}2014_questions.json  v2_mscoco_{split}2014_annotations.json
    images  {split}2014/COCO_{split}2014_{image_id:012d}.jpg

Without the official files, any `*.parquet` under `data_root` named for the split (`parquet_shards`) is read; each row
needs question, question_id, answers and an image (image_id from its column, else the image's COCO file name). Every
problem with the input raises one ValueError naming the file before any scoring starts, not a KeyError deep inside a
long run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections import Counter
from pathlib import Path

__all__ = ["DATASETS", "check_images", "load_vqa_split", "parquet_shards"]

# dataset -> (questions file, annotations file) name patterns; {split} is "train" or "val".
DATASETS: dict[str, tuple[str, str]] = {
    "okvqa": ("OpenEnded_mscoco_{split}2014_questions.json", "mscoco_{split}2014_annotations.json"),
    "vqav2": ("v2_OpenEnded_mscoco_{split}2014_questions.json", "v2_mscoco_{split}2014_annotations.json"),
}
SPLITS = ("train", "val")
PARQUET_SPLITS = {"train": ("train",), "val": ("validation", "val")}  # how exports name the splits
SHOW = 5  # how many offending ids / paths an error message lists


def _read_json(path: Path, what: str) -> dict:
    """Parse a JSON file, turning a missing file or a syntax error into a ValueError that names it."""
    if not path.is_file():
        raise ValueError(f"{what} file not found: {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{what} file {path} is not valid JSON: {e}") from e


def _records(doc: dict, key: str, fields: tuple[str, ...], path: Path) -> list[dict]:
    """The list under `key`, checking that every record has `fields`."""
    records = doc.get(key) if isinstance(doc, dict) else None
    if not isinstance(records, list):
        raise ValueError(f"{path}: expected a JSON object with a {key!r} list (the official layout)")
    for i, rec in enumerate(records):
        missing = [f for f in fields if not isinstance(rec, dict) or f not in rec]
        if missing:
            raise ValueError(f"{path}: {key}[{i}] lacks field(s) {', '.join(missing)}")
    return records


def _answers(ann: dict, index: int, path: Path) -> list[str]:
    answers = ann["answers"]
    if not isinstance(answers, list) or not answers:
        raise ValueError(f"{path}: annotations[{index}] has no annotator answers")
    if not all(isinstance(a, dict) and isinstance(a.get("answer"), str) for a in answers):
        raise ValueError(f"{path}: annotations[{index}].answers must be objects with an 'answer' string")
    return [a["answer"] for a in answers]


def check_images(paths: list[str], what: str) -> None:
    """One ValueError listing every path in `paths` that is missing or not an image PIL can read (header and
    integrity check, no full decode: seconds for thousands of COCO files), so a long LVLM job stops before it starts
    rather than on the first batch that holds a bad file."""
    from PIL import Image, UnidentifiedImageError

    bad = []
    for p in dict.fromkeys(paths):
        try:
            with Image.open(p) as img:
                img.verify()
        except FileNotFoundError:
            bad.append(f"{p} (not found)")
        except (OSError, SyntaxError, ValueError, UnidentifiedImageError) as e:  # PIL's errors for corrupt files
            bad.append(f"{p} ({str(e).splitlines()[0] if str(e) else type(e).__name__})")
    if bad:
        raise ValueError(f"{len(bad)} of the images {what} are unreadable: {_listing(bad, len(bad))}")


def _listing(values: list, total: int) -> str:
    """'a, b, c, d, e (and 7 more)' for error messages."""
    shown = ", ".join(str(v) for v in values[:SHOW])
    return shown + (f" (and {total - SHOW} more)" if total > SHOW else "")


def load_vqa_split(
    dataset: str,
    data_root: Path,
    split: str,
    questions_file: Path | str | None = None,
    annotations_file: Path | str | None = None,
    image_dir: Path | str | None = None,
) -> list[dict]:
    """The items of one split, in the questions file's order, each with its 10 raw answers and absolute image path."""
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; expected one of {', '.join(DATASETS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    root = Path(data_root).expanduser()
    q_pattern, a_pattern = DATASETS[dataset]
    shards = parquet_shards(root, split)
    if shards and not (root / (questions_file or q_pattern.format(split=split))).exists():
        return load_parquet_split(dataset, shards, split)
    # Path's "/" keeps an absolute override as it is and puts a relative one under the data root.
    q_path = root / (questions_file or q_pattern.format(split=split))
    a_path = root / (annotations_file or a_pattern.format(split=split))
    img_dir = (root / (image_dir or f"{split}2014")).resolve()

    questions = _records(
        _read_json(q_path, f"{dataset} {split} questions"), "questions", ("image_id", "question", "question_id"), q_path
    )
    annotations = _records(
        _read_json(a_path, f"{dataset} {split} annotations"),
        "annotations",
        ("question_id", "image_id", "answers"),
        a_path,
    )
    by_qid = {ann["question_id"]: (i, ann) for i, ann in enumerate(annotations)}

    qids = [q["question_id"] for q in questions]
    if len(set(qids)) != len(qids):
        dups = [qid for qid, n in Counter(qids).items() if n > 1]
        raise ValueError(f"{q_path}: duplicate question ids {_listing(dups, len(dups))}")
    unannotated = [qid for qid in qids if qid not in by_qid]
    if unannotated:
        raise ValueError(
            f"{a_path} has no annotation for {len(unannotated)} question(s) of {q_path}: "
            f"question ids {_listing(unannotated, len(unannotated))}"
        )
    ann_image = {qid: ann["image_id"] for qid, (_, ann) in by_qid.items()}
    mismatched = [
        f"{q['question_id']} (question image {q['image_id']}, annotation image {ann_image[q['question_id']]})"
        for q in questions
        if ann_image[q["question_id"]] != q["image_id"]
    ]
    if mismatched:
        raise ValueError(
            f"image ids differ between {q_path} and {a_path} for {len(mismatched)} question(s): "
            f"{_listing(mismatched, len(mismatched))}"
        )

    items = []
    for q in questions:
        index, ann = by_qid[q["question_id"]]
        items.append(
            {
                "question_id": q["question_id"],
                "image_id": q["image_id"],
                "question": q["question"],
                "answers": _answers(ann, index, a_path),
                "image": str(img_dir / f"COCO_{split}2014_{int(q['image_id']):012d}.jpg"),
            }
        )
    # Check each distinct image once (questions share images), in first-use order for a stable message.
    missing = [p for p in dict.fromkeys(it["image"] for it in items) if not Path(p).is_file()]
    if missing:
        raise ValueError(
            f"{len(missing)} image file(s) of {dataset} {split} missing under {img_dir}: "
            f"{_listing(missing, len(missing))}"
        )
    return items


def parquet_shards(root: Path, split: str) -> list[Path]:
    """The parquet files of `split` under `root`, at any depth: a file or folder name starting with one of the split's
    names (train-00000-of-00004.parquet, data/validation-*.parquet, val2014/0000.parquet)."""
    pattern = re.compile(rf"({'|'.join(PARQUET_SPLITS[split])})(\d*)([-_.]|$)", re.IGNORECASE)
    return [
        f for f in sorted(Path(root).rglob("*.parquet")) if any(pattern.match(p) for p in f.relative_to(root).parts)
    ]


def _image_cache(shards: list[Path]) -> Path:
    """Where the shards' embedded images are written as files: one folder per set of shards (name and size)."""
    key = hashlib.sha256("\n".join(f"{f.resolve()} {f.stat().st_size}" for f in shards).encode()).hexdigest()[:16]
    base = Path(os.environ.get("ICL_SELECT_CACHE", Path.home() / ".cache" / "icl-select")).expanduser()
    return base / "images" / key


def _row_answers(answers, where: str) -> list[str]:
    """Annotator answer strings from an export's answers column: strings, or the official {"answer": ...} objects."""
    if not isinstance(answers, list) or not answers:
        raise ValueError(f"{where}: no annotator answers")
    out = [a.get("answer") if isinstance(a, dict) else a for a in answers]
    if not all(isinstance(a, str) for a in out):
        raise ValueError(f"{where}: answers must be strings or objects with an 'answer' string")
    return out


def load_parquet_split(dataset: str, shards: list[Path], split: str) -> list[dict]:
    """The items of one split of a Hugging Face export, in the shards' order; embedded images written once to files."""
    import datasets

    from icl_select.files import atomic_write_bytes

    where = f"{dataset} {split} ({shards[0].parent})"
    try:
        rows = datasets.load_dataset("parquet", data_files=[str(f) for f in shards], split="train", streaming=True)
        columns = set(rows.column_names or [])
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: the parquet shards do not read ({str(e).splitlines()[0]})") from e
    missing = [c for c in ("question_id", "question", "answers", "image") if c not in columns]
    if missing:
        raise ValueError(f"{where}: the parquet shards lack column(s) {', '.join(missing)} (have {sorted(columns)})")
    rows = rows.cast_column("image", datasets.Image(decode=False))  # the file's bytes, written as they are
    cache = _image_cache(shards)
    cache.mkdir(parents=True, exist_ok=True)
    items, seen = [], set()
    for i, row in enumerate(rows):
        at = f"{where}: row {i} (question_id {row['question_id']})"
        image = row["image"] or {}
        name = Path(image.get("path") or "").name
        if row.get("image_id") is not None:
            image_id = int(row["image_id"])
        elif m := re.search(r"(\d+)\.\w+$", name):  # COCO_val2014_000000297147.jpg
            image_id = int(m.group(1))
        else:
            raise ValueError(f"{at}: no image_id column and no COCO file name to read it from")
        if not image.get("bytes"):
            raise ValueError(f"{at}: the image is not embedded in the shard")
        path = cache / f"{image_id}{Path(name).suffix.lower() or '.img'}"
        if image_id not in seen and not path.is_file():
            atomic_write_bytes(path, image["bytes"])
        seen.add(image_id)
        qid = row["question_id"]
        items.append(
            {
                "question_id": int(qid) if isinstance(qid, str) and qid.isdigit() else qid,
                "image_id": image_id,
                "question": row["question"],
                "answers": _row_answers(row["answers"], at),
                "image": str(path),
            }
        )
    if not items:
        raise ValueError(f"{where}: the parquet shards hold no rows")
    qids = [it["question_id"] for it in items]
    if len(set(qids)) != len(qids):
        dups = [qid for qid, n in Counter(qids).items() if n > 1]
        raise ValueError(f"{where}: duplicate question ids {_listing(dups, len(dups))}")
    check_images([it["image"] for it in items], f"extracted from {where}")
    return items
