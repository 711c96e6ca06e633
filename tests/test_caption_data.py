"""The captioning readers (caption_data.py): official COCO caption files (2017 and 2014 layouts), the Karpathy split
file, and Hugging Face parquet exports with embedded images, on tiny files written here; and one DataError line naming
the file and the field for each kind of bad input."""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path

import pytest
from PIL import Image

from icl_select.caption_data import load_caption_split
from icl_select.files import DataError

# image id -> reference captions, as an official file holds them (raw: case, punctuation, trailing spaces)
CAPTIONS = {
    139: ["A woman stands in the dining area at the table.", "A room with chairs, a table, and a woman in it. "],
    285: ["A big burly grizzly bear is show with grass in the background.", "The large brown bear has a black nose."],
    632: ["Bedroom scene with a bookcase, blue comforter and window.", "A bedroom with a bookshelf full of books."],
}
KARPATHY_SPLIT = {139: "val", 285: "train", 632: "restval", 724: "test", 776: "train"}


def png_bytes(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8 + seed % 5, 6), (seed % 256, 40, 90)).save(buf, format="PNG")
    return buf.getvalue()


def write_coco(root: Path, year: int = 2017, split: str = "val", under_annotations: bool = True) -> Path:
    """An official captions_{split}{year}.json with its image folder; annotations interleave the images."""
    folder = root / f"{split}{year}"
    folder.mkdir(parents=True)
    images = []
    for image_id in CAPTIONS:
        name = f"{image_id:012d}.jpg" if year == 2017 else f"COCO_{split}{year}_{image_id:012d}.jpg"
        (folder / name).write_bytes(png_bytes(image_id))  # PIL reads by content, not by the suffix
        images.append({"id": image_id, "file_name": name, "height": 6, "width": 8, "license": 1})
    annotations = [
        {"image_id": image_id, "id": 1000 * k + image_id, "caption": caps[k]}
        for k in range(2)
        for image_id, caps in CAPTIONS.items()
    ]
    out = root / "annotations" if under_annotations else root
    out.mkdir(exist_ok=True)
    path = out / f"captions_{split}{year}.json"
    path.write_text(json.dumps({"info": {}, "licenses": [], "images": images, "annotations": annotations}))
    return path


def write_karpathy(root: Path) -> Path:
    records = []
    for k, (image_id, split) in enumerate(KARPATHY_SPLIT.items()):
        folder = "val2014" if split in ("val", "test", "restval") else "train2014"
        name = f"COCO_{folder}_{image_id:012d}.jpg"
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / name).write_bytes(png_bytes(image_id))
        raws = CAPTIONS.get(image_id, [f"Caption {j} of image {image_id}." for j in range(5)])
        sentences = [
            {"tokens": r.lower().split(), "raw": r, "imgid": k, "sentid": 10 * k + j} for j, r in enumerate(raws)
        ]
        records.append(
            {
                "filepath": folder,
                "sentids": [s["sentid"] for s in sentences],
                "filename": name,
                "imgid": k,
                "split": split,
                "sentences": sentences,
                "cocoid": image_id,
            }
        )
    path = root / "dataset_coco.json"
    path.write_text(json.dumps({"images": records, "dataset": "coco"}))
    return path


def expected(ids) -> list[dict]:
    return [{"question_id": i, "image_id": i, "question": "", "answers": CAPTIONS[i]} for i in ids]


def strip_images(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in it.items() if k != "image"} for it in items]


def test_official_coco_2017_captions(tmp_path):
    write_coco(tmp_path)
    items = load_caption_split("coco2017", tmp_path, "val")
    assert strip_images(items) == expected(CAPTIONS)
    for it in items:
        path = Path(it["image"])
        assert path.is_absolute() and path == (tmp_path / "val2017" / f"{it['image_id']:012d}.jpg").resolve()
        assert path.read_bytes() == png_bytes(it["image_id"])
    assert all(type(it["question_id"]) is int and type(it["image_id"]) is int for it in items)


def test_official_coco_2014_captions_at_the_root(tmp_path):
    write_coco(tmp_path, year=2014, split="train", under_annotations=False)
    items = load_caption_split("coco2014", tmp_path, "train")
    assert strip_images(items) == expected(CAPTIONS)
    assert Path(items[0]["image"]).name == "COCO_train2014_000000000139.jpg"


def test_karpathy_splits(tmp_path):
    write_karpathy(tmp_path)
    train = load_caption_split("karpathy", tmp_path, "train")
    assert [it["image_id"] for it in train] == [285, 632, 776]  # train and restval, in the file's order
    assert train[0]["answers"] == CAPTIONS[285] and len(train[2]["answers"]) == 5
    assert Path(train[1]["image"]) == (tmp_path / "val2014" / "COCO_val2014_000000000632.jpg").resolve()
    assert [it["image_id"] for it in load_caption_split("karpathy", tmp_path, "train", train_splits=["train"])] == [
        285,
        776,
    ]
    assert strip_images(load_caption_split("karpathy", tmp_path, "val")) == expected([139])
    assert [it["image_id"] for it in load_caption_split("karpathy", tmp_path, "test")] == [724]


def write_parquet(root: Path, split_name: str, rows: dict, features: dict, shards: int = 2) -> None:
    import datasets

    table = datasets.Dataset.from_dict(rows, features=datasets.Features(features))
    (root / "data").mkdir(parents=True, exist_ok=True)
    bounds = [len(table) * k // shards for k in range(shards + 1)]
    for k in range(shards):
        table.select(range(bounds[k], bounds[k + 1])).to_parquet(
            root / "data" / f"{split_name}-{k:05d}-of-{shards:05d}.parquet"
        )


@pytest.mark.parametrize("schema", ["karpathy", "caption_per_row", "lmms"])
def test_parquet_exports_read_as_the_official_files(tmp_path, monkeypatch, schema):
    """Three shapes of Hugging Face exports: Karpathy-style rows (sentences objects, cocoid), one caption per row
    (image_id), and lmms-lab's (answer list, the COCO file name as question_id, no image id column)."""
    import datasets

    monkeypatch.setenv("ICL_SELECT_CACHE", str(tmp_path / "cache"))
    ids = list(CAPTIONS)
    image = [{"bytes": png_bytes(i), "path": f"{i:012d}.png"} for i in ids]
    string = datasets.Value("string")
    if schema == "karpathy":
        rows = {
            "image": image,
            "cocoid": ids,
            "sentences": [[{"raw": c, "tokens": c.split()} for c in CAPTIONS[i]] for i in ids],
        }
        features = {
            "image": datasets.Image(),
            "cocoid": datasets.Value("int64"),
            "sentences": [{"raw": string, "tokens": datasets.Sequence(string)}],
        }
    elif schema == "caption_per_row":
        pairs = [(i, c) for k in range(2) for i in ids for c in CAPTIONS[i][k : k + 1]]
        rows = {
            "image": [image[ids.index(i)] for i, _ in pairs],
            "image_id": [i for i, _ in pairs],
            "caption": [c for _, c in pairs],
        }
        features = {"image": datasets.Image(), "image_id": datasets.Value("int64"), "caption": string}
    else:
        rows = {
            "question_id": [f"{i:012d}.jpg" for i in ids],
            "image": [{"bytes": b["bytes"], "path": None} for b in image],
            "question": ["Provide a one-sentence caption."] * 3,
            "answer": [CAPTIONS[i] for i in ids],
        }
        features = {
            "question_id": string,
            "image": datasets.Image(),
            "question": string,
            "answer": datasets.Sequence(string),
        }
    write_parquet(tmp_path / "export", "validation", rows, features)
    items = load_caption_split("coco2017", tmp_path / "export", "val")
    assert strip_images(items) == expected(ids)
    assert all(Path(it["image"]).read_bytes() == png_bytes(it["image_id"]) for it in items)
    assert all(str(tmp_path / "cache") in it["image"] for it in items)


def test_karpathy_parquet_train_is_train_and_restval(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setenv("ICL_SELECT_CACHE", str(tmp_path / "cache"))
    features = {
        "image": datasets.Image(),
        "cocoid": datasets.Value("int64"),
        "caption": datasets.Sequence(datasets.Value("string")),
    }
    for name, ids in (("train", [285]), ("restval", [632]), ("test", [139])):
        rows = {
            "image": [{"bytes": png_bytes(i), "path": None} for i in ids],
            "cocoid": ids,
            "caption": [CAPTIONS[i] for i in ids],
        }
        write_parquet(tmp_path, name, rows, features, shards=1)
    assert strip_images(load_caption_split("karpathy", tmp_path, "train")) == expected([285, 632])
    assert strip_images(load_caption_split("karpathy", tmp_path, "test")) == expected([139])


# ---------------------------------------------------------------------------------------------------------------------
# Bad input: one line naming the file and the field


def one_line(err: pytest.ExceptionInfo, pattern: str) -> None:
    message = str(err.value)
    assert "\n" not in message and re.fullmatch(pattern, message), message


def rewrite(path: Path, edit) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


COCO_BREAKS = [
    (
        lambda d: d["annotations"][1].pop("caption"),
        r".*/captions_val2017\.json: annotations\[1\] lacks field 'caption'",
    ),
    (
        lambda d: d["images"][2].update(id="632"),
        r".*/captions_val2017\.json: images\[2\]\.id: expected int, got str '632'",
    ),
    (
        lambda d: d["annotations"][4].update(caption=["a", "b"]),
        r".*/captions_val2017\.json: annotations\[4\]\.caption: expected str, got list .*",
    ),
    (
        lambda d: d["annotations"][3].update(image_id=999),
        r".*/captions_val2017\.json: annotations\[3\]\.image_id 999 is not an id of its images",
    ),
    (
        lambda d: d.update(annotations=[a for a in d["annotations"] if a["image_id"] != 285]),
        r".*/captions_val2017\.json: 1 image\(s\) without an annotation's caption: images\.id 285",
    ),
    (lambda d: d["images"].append(dict(d["images"][0])), r".*/captions_val2017\.json: images: duplicate image ids 139"),
    (lambda d: d.pop("annotations"), r".*/captions_val2017\.json: expected a JSON object with a 'annotations' list"),
]


@pytest.mark.parametrize(("edit", "pattern"), COCO_BREAKS)
def test_bad_coco_file_is_one_line(tmp_path, edit, pattern):
    rewrite(write_coco(tmp_path), edit)
    with pytest.raises(DataError) as err:
        load_caption_split("coco2017", tmp_path, "val")
    one_line(err, pattern)


def test_missing_coco_file_and_images_are_one_line(tmp_path):
    with pytest.raises(DataError) as err:
        load_caption_split("coco2017", tmp_path, "val")
    one_line(err, rf"{re.escape(str(tmp_path / 'captions_val2017.json'))}: missing file")
    write_coco(tmp_path)
    (tmp_path / "val2017" / "000000000285.jpg").unlink()
    with pytest.raises(DataError) as err:
        load_caption_split("coco2017", tmp_path, "val")
    one_line(err, r"1 image file\(s\) of .*/captions_val2017\.json under .*/val2017 missing: .*/000000000285\.jpg")
    (tmp_path / "annotations" / "captions_val2017.json").write_text('{"images": [')
    with pytest.raises(DataError) as err:
        load_caption_split("coco2017", tmp_path, "val")
    one_line(err, r".*/captions_val2017\.json: not valid JSON \(.*\)")


KARPATHY_BREAKS = [
    (
        lambda d: d["images"][1].update(split="training"),
        r".*/dataset_coco\.json: images\[1\]\.split: expected one of train, restval, val, test, got 'training'",
    ),
    (lambda d: d["images"][0].pop("cocoid"), r".*/dataset_coco\.json: images\[0\] lacks field 'cocoid'"),
    (
        lambda d: d["images"][2].update(sentences=[]),
        r".*/dataset_coco\.json: images\[2\]\.sentences: the image has no caption",
    ),
    (
        lambda d: d["images"][3]["sentences"][1].pop("raw"),
        r".*/dataset_coco\.json: images\[3\]\.sentences\[1\] lacks field 'raw'",
    ),
    (lambda d: d["images"][4].update(cocoid=285), r".*/dataset_coco\.json: images\.cocoid: duplicate image ids 285"),
]


@pytest.mark.parametrize(("edit", "pattern"), KARPATHY_BREAKS)
def test_bad_karpathy_file_is_one_line(tmp_path, edit, pattern):
    rewrite(write_karpathy(tmp_path), edit)
    with pytest.raises(DataError) as err:
        load_caption_split("karpathy", tmp_path, "train")
    one_line(err, pattern)


def test_karpathy_missing_image_and_bad_splits_are_one_line(tmp_path):
    write_karpathy(tmp_path)
    with pytest.raises(DataError) as err:
        load_caption_split("karpathy", tmp_path, "train", train_splits=["train", "extra"])
    one_line(err, r"Karpathy splits \['train', 'extra'\]: expected some of train, restval, val, test")
    with pytest.raises(DataError) as err:
        load_caption_split("karpathy", tmp_path, "testing")
    one_line(err, r"unknown split 'testing' of karpathy; expected one of train, val, test")
    shutil.rmtree(tmp_path / "train2014")
    with pytest.raises(DataError) as err:
        load_caption_split("karpathy", tmp_path, "train")
    one_line(
        err, r"2 image file\(s\) of .*/dataset_coco\.json under .* missing: .*/COCO_train2014_000000000285\.jpg, .*"
    )


def test_bad_parquet_export_is_one_line(tmp_path, monkeypatch):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setenv("ICL_SELECT_CACHE", str(tmp_path / "cache"))
    string = datasets.Value("string")
    image, caption, where = datasets.Image(), {"caption": ["a cat"]}, r"coco2017 val \(.*/data\)"
    cases = [
        (
            {"image": [{"bytes": png_bytes(1), "path": "1.png"}], "text": ["a cat"]},
            {"image": image, "text": string},
            rf"{where}: the parquet shards need an 'image' column and a captions column \(one of captions, caption, "
            r"sentences, answer\); have \['image', 'text'\]",
        ),
        (
            {"image": [{"bytes": None, "path": "000000000005.jpg"}], **caption},
            None,  # an image that is only a path: written with pyarrow (datasets would read the file to embed it)
            rf"{where}: row 0: column 'image' has no embedded bytes \(image id 5\)",
        ),
        (
            {"image": [{"bytes": png_bytes(1), "path": None}], **caption},
            {"image": image, "caption": string},
            rf"{where}: row 0: no image_id or cocoid column and no COCO file name to read the image id from",
        ),
        (
            {"image": [{"bytes": png_bytes(1), "path": None}], "image_id": [7], "captions": [[]]},
            {"image": image, "image_id": datasets.Value("int64"), "captions": datasets.Sequence(string)},
            rf"{where}: row 0: column 'captions' holds no caption strings \(got \[\]\)",
        ),
    ]
    for k, (rows, features, pattern) in enumerate(cases):
        root = tmp_path / f"case{k}"
        if features is None:
            (root / "data").mkdir(parents=True)
            pq.write_table(pa.table(rows), root / "data" / "validation.parquet")
        else:
            write_parquet(root, "validation", rows, features, shards=1)
        with pytest.raises(DataError) as err:
            load_caption_split("coco2017", root, "val")
        one_line(err, pattern)
