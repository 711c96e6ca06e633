"""The official VQA file loader (vqa_data.py): OK-VQA/VQAv2 questions, annotations and COCO images, and one
clear error per kind of broken file. The OK-VQA-format fixture is built offline by icl_select/tiny.py."""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest

from icl_select.vqa_data import load_vqa_split


def test_load_okvqa_fixture(assets):
    root = assets["okvqa"]
    items = {split: load_vqa_split("okvqa", root, split) for split in ("train", "val")}
    questions = json.loads((root / "OpenEnded_mscoco_train2014_questions.json").read_text())["questions"]
    annotations = json.loads((root / "mscoco_train2014_annotations.json").read_text())["annotations"]
    train = items["train"]
    assert [it["question_id"] for it in train] == [q["question_id"] for q in questions]
    by_qid = {a["question_id"]: [x["answer"] for x in a["answers"]] for a in annotations}
    assert all(it["answers"] == by_qid[it["question_id"]] and len(it["answers"]) == 10 for it in train)
    assert max(Counter(it["image_id"] for it in train).values()) > 1  # questions share images
    first = train[0]
    assert Path(first["image"]).is_absolute() and Path(first["image"]).is_file()
    assert Path(first["image"]).name == f"COCO_train2014_{first['image_id']:012d}.jpg"
    assert len(items["val"]) > 0 and "val2014" in items["val"][0]["image"]


def _write_json(path: Path, doc: dict) -> Path:
    path.write_text(json.dumps(doc))
    return path


def _docs(root: Path) -> tuple[dict, dict]:
    q = json.loads((root / "OpenEnded_mscoco_train2014_questions.json").read_text())
    a = json.loads((root / "mscoco_train2014_annotations.json").read_text())
    return q, a


def test_vqa_data_missing_file(assets, tmp_path):
    with pytest.raises(ValueError, match=rf"\bquestions\b.*{re.escape(str(tmp_path / 'nope.json'))}$"):
        load_vqa_split("okvqa", assets["okvqa"], "train", questions_file=tmp_path / "nope.json")
    with pytest.raises(ValueError, match=r"\bannotations\b.*/v2_mscoco_val2014_annotations\.json$"):
        shutil.copy(assets["okvqa"] / "OpenEnded_mscoco_val2014_questions.json", tmp_path / "q.json")
        load_vqa_split("vqav2", tmp_path, "val", questions_file="q.json")


def test_vqa_data_bad_json_and_missing_field(assets, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"questions": [')
    with pytest.raises(ValueError, match=r"/bad\.json\b.*\bJSON\b"):
        load_vqa_split("okvqa", assets["okvqa"], "train", questions_file=bad)
    q, _ = _docs(assets["okvqa"])
    del q["questions"][2]["question"]
    path = _write_json(tmp_path / "q.json", q)
    with pytest.raises(ValueError, match=r"/q\.json\b.*\bquestions\[2\].*\bquestion$"):
        load_vqa_split("okvqa", assets["okvqa"], "train", questions_file=path)


def test_vqa_data_unannotated_and_mismatched_ids(assets, tmp_path):
    q, a = _docs(assets["okvqa"])
    kept = _write_json(tmp_path / "a_missing.json", {"annotations": a["annotations"][6:]})
    first = ", ".join(str(x["question_id"]) for x in a["annotations"][:5])
    with pytest.raises(ValueError, match=rf"/a_missing\.json\b.*\b6\b.*\b{first}\b.*\b1\b"):
        load_vqa_split("okvqa", assets["okvqa"], "train", annotations_file=kept)
    a["annotations"][4]["image_id"] = 1
    moved = _write_json(tmp_path / "a_moved.json", a)
    qid = a["annotations"][4]["question_id"]
    with pytest.raises(ValueError, match=rf"/a_moved\.json\b.*\b1\b.*\b{qid}\b.*\b1\b"):
        load_vqa_split("okvqa", assets["okvqa"], "train", annotations_file=moved)


def test_vqa_data_missing_images(assets, tmp_path):
    images = shutil.copytree(assets["okvqa"] / "train2014", tmp_path / "images")
    gone = sorted(images.iterdir())[:2]
    for path in gone:
        path.unlink()
    with pytest.raises(ValueError, match=r"^2\b.*\bokvqa train\b") as err:
        load_vqa_split("okvqa", assets["okvqa"], "train", image_dir=images)
    assert all(str(path) in str(err.value) for path in gone)


def export_to_parquet(root: Path, out: Path, split: str, answer_objects: bool) -> Path:
    """The official files under `root` re-written as a Hugging Face export does: parquet shards of rows with the
    question, its answers and the image file's bytes embedded (two shards, like a real export's several)."""
    import datasets

    items = load_vqa_split("okvqa", root, split)
    rows = {
        "question_id": [it["question_id"] for it in items],
        "question": [it["question"] for it in items],
        "answers": [[{"answer": a, "answer_id": i + 1} for i, a in enumerate(it["answers"])] for it in items]
        if answer_objects
        else [it["answers"] for it in items],
        "image": [{"bytes": Path(it["image"]).read_bytes(), "path": Path(it["image"]).name} for it in items],
    }
    features = datasets.Features(
        {
            "question_id": datasets.Value("int64"),
            "question": datasets.Value("string"),
            "answers": [{"answer": datasets.Value("string"), "answer_id": datasets.Value("int64")}]
            if answer_objects
            else datasets.Sequence(datasets.Value("string")),
            "image": datasets.Image(),
        }
    )
    table = datasets.Dataset.from_dict(rows, features=features)
    name = "validation" if split == "val" else split
    (out / "data").mkdir(parents=True, exist_ok=True)
    half = len(items) // 2
    table.select(range(half)).to_parquet(out / "data" / f"{name}-00000-of-00002.parquet")
    table.select(range(half, len(items))).to_parquet(out / "data" / f"{name}-00001-of-00002.parquet")
    return out


@pytest.mark.parametrize("answer_objects", [True, False])
def test_hugging_face_parquet_export_reads_as_the_official_files(assets, tmp_path, monkeypatch, answer_objects):
    monkeypatch.setenv("ICL_SELECT_CACHE", str(tmp_path / "cache"))
    for split in ("train", "val"):
        export_to_parquet(assets["okvqa"], tmp_path / "export", split, answer_objects)
    for split in ("train", "val"):
        official = load_vqa_split("okvqa", assets["okvqa"], split)
        exported = load_vqa_split("okvqa", tmp_path / "export", split)
        keys = ("question_id", "image_id", "question", "answers")
        assert [{k: it[k] for k in keys} for it in exported] == [{k: it[k] for k in keys} for it in official]
        assert all(Path(e["image"]).read_bytes() == Path(o["image"]).read_bytes() for e, o in zip(exported, official))
        assert all(str(tmp_path / "cache") in it["image"] for it in exported)


def test_parquet_export_without_a_needed_column_is_one_line(tmp_path):
    import datasets

    (tmp_path / "data").mkdir()
    datasets.Dataset.from_dict({"question": ["a?"], "question_id": [1]}).to_parquet(tmp_path / "data" / "train.parquet")
    with pytest.raises(ValueError, match=r"\bokvqa train\b.*\banswers, image\b"):
        load_vqa_split("okvqa", tmp_path, "train")
