"""The official VQA file loader (vqa_data.py): OK-VQA/VQAv2 questions, annotations and COCO images, and one
clear error per kind of broken file. The OK-VQA-format fixture is built offline by tests/real_fixtures.py."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from vqa_data import load_vqa_split


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
    with pytest.raises(ValueError, match=r"questions file not found: .*nope\.json"):
        load_vqa_split("okvqa", assets["okvqa"], "train", questions_file=tmp_path / "nope.json")
    with pytest.raises(ValueError, match=r"annotations file not found: .*v2_mscoco_val2014_annotations\.json"):
        shutil.copy(assets["okvqa"] / "OpenEnded_mscoco_val2014_questions.json", tmp_path / "q.json")
        load_vqa_split("vqav2", tmp_path, "val", questions_file="q.json")


def test_vqa_data_bad_json_and_missing_field(assets, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"questions": [')
    with pytest.raises(ValueError, match=r"bad\.json is not valid JSON"):
        load_vqa_split("okvqa", assets["okvqa"], "train", questions_file=bad)
    q, _ = _docs(assets["okvqa"])
    del q["questions"][2]["question"]
    path = _write_json(tmp_path / "q.json", q)
    with pytest.raises(ValueError, match=r"q\.json: questions\[2\] lacks field\(s\) question"):
        load_vqa_split("okvqa", assets["okvqa"], "train", questions_file=path)


def test_vqa_data_unannotated_and_mismatched_ids(assets, tmp_path):
    q, a = _docs(assets["okvqa"])
    kept = _write_json(tmp_path / "a_missing.json", {"annotations": a["annotations"][6:]})
    first = ", ".join(str(x["question_id"]) for x in a["annotations"][:5])
    with pytest.raises(ValueError, match=rf"no annotation for 6 question\(s\).*ids {first} \(and 1 more\)"):
        load_vqa_split("okvqa", assets["okvqa"], "train", annotations_file=kept)
    a["annotations"][4]["image_id"] = 1
    moved = _write_json(tmp_path / "a_moved.json", a)
    qid = a["annotations"][4]["question_id"]
    with pytest.raises(
        ValueError, match=rf"image ids differ .* 1 question\(s\): {qid} \(question image \d+, annotation image 1\)"
    ):
        load_vqa_split("okvqa", assets["okvqa"], "train", annotations_file=moved)


def test_vqa_data_missing_images(assets, tmp_path):
    images = shutil.copytree(assets["okvqa"] / "train2014", tmp_path / "images")
    gone = sorted(images.iterdir())[:2]
    for path in gone:
        path.unlink()
    with pytest.raises(ValueError, match=r"2 image file\(s\) of okvqa train missing") as err:
        load_vqa_split("okvqa", assets["okvqa"], "train", image_dir=images)
    assert all(str(path) in str(err.value) for path in gone)
