"""Captioning through the stages on the simulated captioning world: the task in meta.json, CIDEr-D in the scored data,
evaluation scored as pycocoevalcap scores it, the report labelled by its metric, and the refusals of what a caption
cannot be given."""

import json
import math

import pytest
import torch
from pycocoevalcap.cider.cider import Cider

import compare
import evaluate
import rce
from gen_rl_data import Args, check_args, generate
from icl_select.cider import ptb_tokenize
from icl_select.data import load_dataset
from icl_select.vqa import postprocess

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


def test_the_ceilings_choose_how_many_in_a_caption_world(captions, tmp_path):
    """The oracle's up-to-k evaluation takes the best of 0..k by the simulator's CIDEr-D (train-split frequencies), so
    it scores at least zero-shot and exactly k under the evaluation's own frequencies too (here, not by a theorem)."""
    for b in ("zero-shot", "oracle", "observable"):
        evaluate.main(evaluate.Args(data=captions, baseline=b, out=tmp_path / b, num_samples=[40], shots=[1, 2]))

    def read(b: str, name: str) -> dict:
        return json.loads((tmp_path / b / "eval" / name).read_text())["summary"]["40"]

    zero, exact, upto = read("zero-shot", "val.json"), read("oracle", "val.json"), read("oracle", "val-upto.json")
    for shot in ("1", "2"):
        assert upto[shot] >= max(exact[shot], zero[shot]) - 1e-9, (zero, exact, upto)
    assert (tmp_path / "observable" / "eval" / "val-upto.json").is_file()


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


# ----------------------------------------------------------------------------------------------------------------------
# The real backend: COCO caption files as downloaded, a tiny random-weight Qwen2.5-VL and CLIP built offline


@pytest.fixture(scope="module")
def coco(tmp_path_factory):
    from icl_select.tiny import build_coco_captions_fixture

    return build_coco_captions_fixture(tmp_path_factory.mktemp("coco") / "coco")


def test_an_lvlm_captions_as_plain_transformers_and_scores_the_first_reference(assets, coco):
    """The greedy caption is model.generate()'s on the rendered prompt alone, with no demonstration, one, or two in one
    left-padded batch; gt_prob is the geometric mean of the first reference's token probabilities (its stop token
    included) from one plain forward pass; acc is the caption's CIDEr-D against the query's references."""
    from test_families import MAX_NEW, Reference, rgb_images

    from icl_select.caption_data import load_caption_split
    from icl_select.cider import CiderD
    from icl_select.lvlm import LVLMBackend, PromptTemplate

    items = {split: load_caption_split("coco2014", coco, split) for split in ("train", "val")}
    template = PromptTemplate(icd="Caption: {answer}", query="Caption:")
    backend = LVLMBackend(str(assets["qwen"]), items, 4, MAX_NEW, template=template, task="caption")
    queries, icds = torch.tensor([0, 1, 2]), torch.tensor([[-1, -1], [3, -1], [4, 5]])
    got = backend.score("val", queries, icds)
    ref = Reference(assets["qwen"])
    references = [ptb_tokenize(it["answers"]) for it in items["train"]]
    for i, (q, row) in enumerate(zip(queries.tolist(), icds.tolist())):
        query, demos = items["val"][q], [items["train"][j] for j in row if j >= 0]
        chat = backend.messages(query, demos)
        assert [m for m in chat[-1]["content"] if m["type"] == "text"][-1]["text"] == "Caption:"
        assert got["prediction"][i] == postprocess(ref.answer(chat, rgb_images(query, demos)))
        logps = ref.token_log_probs(chat, rgb_images(query, demos), query["answers"][0])
        assert got["gt_prob"][i].item() == pytest.approx(math.exp(sum(logps) / len(logps)), rel=1e-4)
        cider = CiderD(references).score(ptb_tokenize([got["prediction"][i]]), [ptb_tokenize(query["answers"])])
        assert got["acc"][i].item() == pytest.approx(float(cider[0]), abs=1e-6)
    assert got["correct"].tolist() == (got["acc"] >= 1).tolist()
    assert backend.describe()["generation"]["max_new_tokens"] == MAX_NEW and backend.self_check()["answers_differ"] == 0


def test_gen_rl_data_builds_a_caption_folder_from_coco_files(assets, coco, tmp_path):
    """COCO caption files as downloaded through gen_rl_data.py --task caption: the folder records the task, the
    caption prompt and length, and the selector's embeddings are the pictures' alone."""
    out = tmp_path / "data"
    real = dict(lvlm=str(assets["qwen"]), dataset="coco2014", data_root=coco, encoder=str(assets["clip"]))
    generate(Args(out=out, task="caption", num_queries=4, pool_size=6, group_size=3, seq_len=2, chunk=2, **real))
    ds = load_dataset(out)
    assert ds.meta["task"] == "caption" and ds.meta["source"] == "coco2014"
    assert ds.meta["prompt_template"]["query"] == "Caption:" and ds.meta["generation"]["max_new_tokens"] == 30
    assert torch_equal(ds.emb["val"], ds.emb["val_image"]) and not torch_equal(ds.emb["train"], ds.emb["train_text"])
    assert len(ds.groups) == 4 and ds.meta["self_check"]["answers_differ"] == 0
