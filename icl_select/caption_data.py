"""Load COCO captioning splits from the official caption files, the Karpathy split file, or Hugging Face `datasets`
exports of them (parquet shards with embedded images), as items every stage reads like VQA ones: one per image.

    load_caption_split("coco2017", Path("/data/coco"), "val") -> [{"question_id": image id, "image_id": image id,
                                                                   "question": "", "answers": [its reference captions,
                                                                   as in the file], "image": absolute path}]

Layouts under `data_root` (the file and image folder can be overridden; relative overrides are taken under it):
    coco2017, coco2014  annotations/captions_{split}{year}.json (as the official zip unpacks; or directly under
                        data_root), images {split}{year}/<the file_name of its "images" record>; split train or val
    karpathy            dataset_coco.json, images <filepath>/<filename> of each record (train2014/..., val2014/...);
                        split train (the records of `train_splits`, by default train and restval, as usual), val or test

Without those files, any `*.parquet` under `data_root` named for the split (train-00000-of-00002.parquet,
data/validation-*.parquet, restval.parquet for a Karpathy train split) is read. A row needs an image embedded as
the `datasets` Image feature stores it ({bytes, path}), its captions in the first of the columns `captions`, `caption`,
`sentences`, `answer` that exists (a list of strings or of Karpathy sentence objects {"raw": ...}, or one such caption
per row: rows of the same image are merged), and its image id in `image_id` or `cocoid`, else in the COCO file name
of the image, `file_name`, `filename` or a string `question_id` (the exports on the Hub that were looked at:
Karpathy-style ones with image, caption(s)/sentences and cocoid columns; lmms-lab's COCO-Caption with image, answer and
the file name as question_id). The embedded images are written once to files under the cache (`ICL_SELECT_CACHE`), as
vqa_data does. Every problem with the input stops before any scoring with one line naming the file and the field.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from icl_select.files import DataError, atomic_write_bytes, read_json
from icl_select.vqa_data import _image_cache, _listing, check_images

__all__ = [
    "DATASETS",
    "KARPATHY_SPLITS",
    "caption_parquet_shards",
    "load_caption_split",
    "load_coco_captions",
    "load_karpathy_split",
    "load_parquet_captions",
]

# dataset -> (captions file name pattern, the splits it has)
DATASETS: dict[str, tuple[str, tuple[str, ...]]] = {
    "coco2017": ("captions_{split}2017.json", ("train", "val")),
    "coco2014": ("captions_{split}2014.json", ("train", "val")),
    "karpathy": ("dataset_coco.json", ("train", "val", "test")),
}
KARPATHY_SPLITS = ("train", "restval", "val", "test")  # the values of a record's "split"
PARQUET_NAMES = {"train": ("train",), "restval": ("restval",), "val": ("validation", "val"), "test": ("test",)}
CAPTION_COLUMNS = ("captions", "caption", "sentences", "answer")


def _field(record: object, key: str, kind: type, where: str) -> object:
    """record[key], checked to be a `kind` (an int is not a bool): one DataError naming `where` and the field."""
    if not isinstance(record, dict) or key not in record:
        raise DataError(f"{where} lacks field {key!r}")
    value = record[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise DataError(f"{where}.{key}: expected {kind.__name__}, got {type(value).__name__} {value!r:.40}")
    return value


def _list(doc: object, key: str, path: Path) -> list:
    if not isinstance(doc, dict) or not isinstance(doc.get(key), list):
        raise DataError(f"{path}: expected a JSON object with a {key!r} list")
    return doc[key]


def _unique_ids(ids: list[int], what: str) -> None:
    if len(set(ids)) != len(ids):
        dups = [i for i, n in Counter(ids).items() if n > 1]
        raise DataError(f"{what}: duplicate image ids {_listing(dups, len(dups))}")


def _check_files(items: list[dict], what: str) -> None:
    missing = [it["image"] for it in items if not Path(it["image"]).is_file()]
    if missing:
        raise DataError(f"{len(missing)} image file(s) of {what} missing: {_listing(missing, len(missing))}")


def _item(image_id: int, captions: list[str], image: Path | str) -> dict:
    return {"question_id": image_id, "image_id": image_id, "question": "", "answers": captions, "image": str(image)}


def load_coco_captions(captions_file: Path, image_dir: Path) -> list[dict]:
    """The images of an official captions_{split}{year}.json, in its "images" order, each with its captions in the
    order of the "annotations" list and its file under `image_dir`."""
    doc = read_json(captions_file)
    images, annotations = _list(doc, "images", captions_file), _list(doc, "annotations", captions_file)
    ids, names = [], []
    for i, rec in enumerate(images):
        ids.append(_field(rec, "id", int, f"{captions_file}: images[{i}]"))
        names.append(_field(rec, "file_name", str, f"{captions_file}: images[{i}]"))
    _unique_ids(ids, f"{captions_file}: images")
    captions: dict[int, list[str]] = {i: [] for i in ids}
    for i, rec in enumerate(annotations):
        image_id = _field(rec, "image_id", int, f"{captions_file}: annotations[{i}]")
        caption = _field(rec, "caption", str, f"{captions_file}: annotations[{i}]")
        if image_id not in captions:
            raise DataError(f"{captions_file}: annotations[{i}].image_id {image_id} is not an id of its images")
        captions[image_id].append(caption)
    uncaptioned = [i for i in ids if not captions[i]]
    if uncaptioned:
        raise DataError(
            f"{captions_file}: {len(uncaptioned)} image(s) without an annotation's caption: images.id "
            f"{_listing(uncaptioned, len(uncaptioned))}"
        )
    image_dir = Path(image_dir).resolve()
    items = [_item(i, captions[i], image_dir / name) for i, name in zip(ids, names)]
    _check_files(items, f"{captions_file} under {image_dir}")
    return items


def load_karpathy_split(karpathy_file: Path, image_root: Path, splits: Sequence[str]) -> list[dict]:
    """The records of the Karpathy split file whose "split" is in `splits`, in the file's order, each with the raw
    text of its sentences and its file image_root/filepath/filename."""
    unknown = [s for s in splits if s not in KARPATHY_SPLITS]
    if unknown or not splits:
        raise DataError(f"Karpathy splits {list(splits)}: expected some of {', '.join(KARPATHY_SPLITS)}")
    records = _list(read_json(karpathy_file), "images", karpathy_file)
    image_root = Path(image_root).resolve()
    items = []
    for i, rec in enumerate(records):
        where = f"{karpathy_file}: images[{i}]"
        split = _field(rec, "split", str, where)
        if split not in KARPATHY_SPLITS:
            raise DataError(f"{where}.split: expected one of {', '.join(KARPATHY_SPLITS)}, got {split!r}")
        image_id = _field(rec, "cocoid", int, where)
        image = image_root / _field(rec, "filepath", str, where) / _field(rec, "filename", str, where)
        sentences = _field(rec, "sentences", list, where)
        if not sentences:
            raise DataError(f"{where}.sentences: the image has no caption")
        raws = [_field(s, "raw", str, f"{where}.sentences[{j}]") for j, s in enumerate(sentences)]
        if split in splits:
            items.append(_item(image_id, raws, image))
    _unique_ids([it["image_id"] for it in items], f"{karpathy_file}: images.cocoid")
    if not items:
        raise DataError(f"{karpathy_file}: no image of split(s) {', '.join(splits)}")
    _check_files(items, f"{karpathy_file} under {image_root}")
    return items


def caption_parquet_shards(root: Path, splits: Sequence[str]) -> list[Path]:
    """The parquet files under `root`, at any depth, of the given Karpathy-style splits: a file or folder name that
    starts with a split's name (train-00000-of-00004.parquet, data/validation-*.parquet, restval.parquet)."""
    files = sorted(Path(root).rglob("*.parquet"))
    shards: list[Path] = []
    for split in splits:  # split by split, so that train's rows come before restval's, as in the Karpathy file
        pattern = re.compile(rf"({'|'.join(PARQUET_NAMES[split])})(\d*)([-_.]|$)", re.IGNORECASE)
        shards += [f for f in files if f not in shards and any(pattern.match(p) for p in f.relative_to(root).parts)]
    return shards


def _row_captions(value: object, at: str, column: str) -> list[str]:
    """Caption strings of one row: a string, a {"raw": ...} sentence, or a list of either."""
    values = value if isinstance(value, list) else [value]
    out = [v.get("raw") if isinstance(v, dict) else v for v in values]
    if not out or not all(isinstance(c, str) for c in out):
        raise DataError(f"{at}: column {column!r} holds no caption strings (got {value!r:.60})")
    return out


def _row_image_id(row: dict, name: str, at: str) -> int:
    """The row's COCO image id: its image_id or cocoid column, else the number in a COCO file name."""
    for key in ("image_id", "cocoid"):
        if row.get(key) is not None:
            try:
                return int(row[key])
            except (TypeError, ValueError):
                raise DataError(f"{at}: column {key!r} is not an image id (got {row[key]!r:.40})") from None
    for candidate in (name, row.get("file_name"), row.get("filename"), row.get("question_id")):
        if isinstance(candidate, str) and (m := re.search(r"(\d+)\.\w+$", candidate)):  # COCO_val2014_000000297147.jpg
            return int(m.group(1))
    raise DataError(f"{at}: no image_id or cocoid column and no COCO file name to read the image id from")


def load_parquet_captions(shards: list[Path], what: str) -> list[dict]:
    """The images of a Hugging Face export's shards, in first-seen order, their captions merged over rows; the
    embedded images written once to files."""
    import datasets

    where = f"{what} ({shards[0].parent})"
    try:
        rows = datasets.load_dataset("parquet", data_files=[str(f) for f in shards], split="train", streaming=True)
        columns = set(rows.column_names or [])
    except (OSError, ValueError) as e:
        raise DataError(f"{where}: the parquet shards do not read ({str(e).splitlines()[0]})") from e
    column = next((c for c in CAPTION_COLUMNS if c in columns), None)
    if "image" not in columns or column is None:
        raise DataError(
            f"{where}: the parquet shards need an 'image' column and a captions column (one of "
            f"{', '.join(CAPTION_COLUMNS)}); have {sorted(columns)}"
        )
    rows = rows.cast_column("image", datasets.Image(decode=False))  # the file's bytes, written as they are
    cache = _image_cache(shards)
    cache.mkdir(parents=True, exist_ok=True)
    captions: dict[int, list[str]] = {}
    paths: dict[int, Path] = {}
    for i, row in enumerate(rows):
        at = f"{where}: row {i}"
        image = row["image"] or {}
        name = Path(image.get("path") or "").name
        image_id = _row_image_id(row, name, at)
        if image_id not in paths:
            if not image.get("bytes"):
                raise DataError(f"{at}: column 'image' has no embedded bytes (image id {image_id})")
            paths[image_id] = cache / f"{image_id}{Path(name).suffix.lower() or '.img'}"
            if not paths[image_id].is_file():
                atomic_write_bytes(paths[image_id], image["bytes"])
        captions.setdefault(image_id, []).extend(_row_captions(row[column], at, column))
    if not captions:
        raise DataError(f"{where}: the parquet shards hold no rows")
    items = [_item(i, caps, paths[i]) for i, caps in captions.items()]
    check_images([it["image"] for it in items], f"extracted from {where}")
    return items


def load_caption_split(
    dataset: str,
    data_root: Path,
    split: str,
    captions_file: Path | str | None = None,
    image_dir: Path | str | None = None,
    train_splits: Sequence[str] = ("train", "restval"),
) -> list[dict]:
    """The items of one split: one per image with its reference captions and absolute image path. For the Karpathy
    file, `train_splits` are the records that make up "train"; `image_dir` is the folder holding train2014/ and
    val2014/ (default: data_root)."""
    if dataset not in DATASETS:
        raise DataError(f"unknown captioning dataset {dataset!r}; expected one of {', '.join(DATASETS)}")
    pattern, splits = DATASETS[dataset]
    if split not in splits:
        raise DataError(f"unknown split {split!r} of {dataset}; expected one of {', '.join(splits)}")
    root = Path(data_root).expanduser()
    name = captions_file or pattern.format(split=split)
    # Path's "/" keeps an absolute override as it is and puts a relative one under the data root.
    path = root / "annotations" / name if (root / "annotations" / name).is_file() else root / name
    members = tuple(train_splits) if dataset == "karpathy" and split == "train" else (split,)
    if not path.exists() and (shards := caption_parquet_shards(root, members)):
        return load_parquet_captions(shards, f"{dataset} {split}")
    if dataset == "karpathy":
        return load_karpathy_split(path, root / (image_dir or ""), members)
    return load_coco_captions(path, root / (image_dir or f"{split}{dataset[-4:]}"))
