"""Captioning through the stages on the simulated captioning world: the task in meta.json, CIDEr-D in the scored data,
evaluation scored as pycocoevalcap scores it, the report labelled by its metric, and the refusals of what a caption
cannot be given."""

import json

import pytest
from pycocoevalcap.cider.cider import Cider

import compare
import evaluate
import rce
from gen_rl_data import Args, check_args, generate
from icl_select.cider import ptb_tokenize
from icl_select.data import load_dataset

SMALL = dict(num_train=300, num_val=60, num_queries=32, group_size=6, pool_size=16)


@pytest.fixture(scope="module")
def captions(tmp_path_factory):
    out = tmp_path_factory.mktemp("captions") / "data"
    generate(Args(out=out, task="caption", **SMALL))
    return out


def test_a_caption_folder_records_its_task_and_scores_captions_by_cider(captions):
    ds = load_dataset(captions)
    assert ds.meta["task"] == "caption" and ds.meta["sim_config"]["world"] == "base"
    assert ds.items["val"][0]["question"] == "" and len(ds.items["val"][0]["answers"]) == 5
    acc = ds.groups.fields["acc"][ds.groups.seq_mask]
    assert acc.max() > 1  # CIDEr-D, not a share: a caption can score above 1
    assert torch_equal(ds.emb["train"], ds.emb["train_image"])  # the selector reads the picture alone


def torch_equal(a, b) -> bool:
    return bool((a == b).all())


def test_evaluation_scores_each_caption_as_pycocoevalcap_does(captions, tmp_path):
    """Each question's score is pycocoevalcap's own per-image CIDEr-D over the evaluated questions, on the PTB tokens
    of the captions the LVLM gave and of the references; the summary is their mean x 100."""
    n = 40
    evaluate.main(evaluate.Args(data=captions, baseline="random", out=tmp_path / "random", num_samples=[n]))
    doc = json.loads((tmp_path / "random" / "eval" / "val.json").read_text())
    ds = load_dataset(captions)
    refs = [ds.items["val"][i]["answers"] for i in range(n)]
    flat = iter(ptb_tokenize([r for rs in refs for r in rs]))
    tokens = {i: [next(flat) for _ in rs] for i, rs in enumerate(refs)}
    for shot in doc["shots"]:
        rows = [r for r in doc["results"] if r["shot"] == shot][:n]
        candidates = dict(enumerate(ptb_tokenize([r["prediction"] for r in rows])))
        mean, per = Cider().compute_score(tokens, {i: [c] for i, c in candidates.items()})
        assert [r["score"] for r in rows] == pytest.approx(list(per), abs=1e-6)
        assert doc["summary"][str(n)][str(shot)] == pytest.approx(100 * mean, abs=1e-3)


def test_the_report_names_cider_and_text_baselines_are_refused(captions, tmp_path):
    rce.main(rce.Args(data=captions, out=tmp_path / "rce", epochs=1, batch_size=8, val_frac=0.25))
    evaluate.main(evaluate.Args(data=captions, runs=[tmp_path / "rce"], num_samples=[40]))
    evaluate.main(evaluate.Args(data=captions, baseline="image-sim", out=tmp_path / "rices", num_samples=[40]))
    text = compare.report(compare.Args(runs=[tmp_path / "rce", tmp_path / "rices"], bootstrap=100))
    assert "Each cell: CIDEr-D x100 on the first 40" in text and "VQA accuracy" not in text.split("## Trained")[0]
    with pytest.raises(ValueError, match=r"^--baseline text-sim compares questions; a picture to caption has none$"):
        evaluate.main(evaluate.Args(data=captions, baseline="text-sim", out=tmp_path / "text", num_samples=[40]))


@pytest.mark.parametrize(
    "flags, pattern",
    [
        (dict(world="additive"), r"^--world additive is not a caption one; --task caption takes base, instruct, .*$"),
        (dict(sampler="text"), r"^--sampler text compares captions, .*: use image or random$"),
        (dict(lvlm="x", data_root=".", dataset="okvqa"), r"^--dataset okvqa is not a caption one; .*karpathy$"),
    ],
)
def test_what_a_caption_cannot_be_given_is_one_line(flags, pattern):
    with pytest.raises(ValueError, match=pattern) as e:
        check_args(Args(task="caption", **flags))
    assert "\n" not in str(e.value)
