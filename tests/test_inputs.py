"""Inputs that change under the kit, or arrive another way than the stages give them: each of these once went through
silently or was refused only after work (a resumed evaluation that mixed two datasets, the query's own picture handed
back as a demonstration, caption scores of other questions compared, a killed data build trained on, a captioning
selector on VQA data, refusals after a model loaded, inert flags). Each test fails on the code before its fix.
tests/test_lineage.py holds the general rule: every input of every stage changed, every reader asked."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import SMALL_NET, die_after_first_chunk
from PIL import Image

import ablate
import compare
import evaluate
import gen_rl_data
import grpo
import rce
from icl_select.files import DataError
from icl_select.library import Demonstrations

SIM = dict(num_train=240, num_val=40, num_queries=16, group_size=6, pool_size=12, seq_len=3)
STEPS = dict(batch_size=8, val_frac=0.25, epochs=1)
TRAIN = dict(**STEPS, **SMALL_NET)  # rce.py's: a small selector


def gen(out: Path, **kw) -> Path:
    gen_rl_data.generate(gen_rl_data.Args(out=out, **{**SIM, **kw}))
    return out


def results(out: Path) -> list[dict]:
    return json.loads((out / "eval" / "val.json").read_text())["results"]


def files_under(folder: Path) -> set[Path]:
    return {p.relative_to(folder) for p in folder.rglob("*")}


def test_a_resumed_evaluation_never_mixes_two_datasets(tmp_path, monkeypatch):
    """An evaluation killed part way, its dataset rebuilt at the same path from another seed, the same command again:
    every result is of the new dataset, as a clean evaluation gives them (its progress recorded the folder's path, and
    16 of 80 results once came from the old dataset)."""
    data, out = gen(tmp_path / "data"), tmp_path / "random"
    args = dict(baseline="random", shots=[1, 2, 3], num_samples=[40], batch_size=8)
    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        die_after_first_chunk(m, "evaluate.py", calls=3)  # 3 shots a chunk
        evaluate.main(evaluate.Args(data=data, out=out, **args))
    assert list((out / "eval").glob("*.partial.jsonl"))
    shutil.rmtree(data)
    gen(data, seed=1)
    evaluate.main(evaluate.Args(data=data, out=out, **args))
    evaluate.main(evaluate.Args(data=data, out=tmp_path / "clean", **args))
    assert results(out) == results(tmp_path / "clean")


@pytest.fixture(scope="module")
def image_run(assets, tmp_path_factory):
    """An RCE run over tiny Qwen2.5-VL's scores of the OK-VQA-format fixture, pools by image similarity."""
    from test_real_pipeline import gen_args

    root = tmp_path_factory.mktemp("pictures")
    gen_rl_data.generate(gen_args(assets, root / "data", sampler="image"))
    rce.main(rce.Args(data=root / "data", out=root / "rce", quality="all", **{**TRAIN, "batch_size": 4}))
    return root / "data", root / "rce"


def test_a_library_picture_however_it_arrives_is_the_query_s_own(image_run, tmp_path):
    """A library picture given as its file, a copy, a link or a PIL image: none of the items on that picture is among
    the demonstrations (pools of the two most image-similar items, so every one of them would be). The library once
    matched pictures by path, and a PIL image never: the very item, its answer, came back in the prompt."""
    data, run = image_run
    demos = Demonstrations.from_run(run, pool_size=2)
    items = json.loads((data / "items.json").read_text())["train"]
    for i, item in enumerate(items[::2]):
        copy, link = tmp_path / f"copy{i}.jpg", tmp_path / f"link{i}.jpg"
        shutil.copyfile(item["image"], copy)
        os.symlink(item["image"], link)
        for picture in (item["image"], copy, link, Image.open(item["image"])):
            picked = demos.pick(picture, item["question"])
            assert len(picked) == 2 and all(d.image_id != item["image_id"] for d in picked), (i, picture)


def test_caption_scores_are_compared_on_the_same_questions(tmp_path):
    """Two zero-shot caption evaluations, on 40 and on the first 20 of those questions, give the same captions: they
    are level. CIDEr-D's document frequencies come from the questions scored together, so the first 20 of 40 once
    scored otherwise than 20 alone, and compare.py reported a delta and crowned one."""
    data = gen(tmp_path / "data", task="caption", seq_len=2)
    for n in (40, 20):
        evaluate.main(evaluate.Args(data=data, baseline="zero-shot", out=tmp_path / f"z{n}", num_samples=[n]))
    text = compare.report(compare.Args(runs=[tmp_path / "z40", tmp_path / "z20"], bootstrap=200))
    rows = [r.replace("**", "").strip(" |").split(" | ") for r in text.splitlines() if r.startswith(("| z", "| **z"))]
    (z40, *scores), (z20, *against) = ((r[0], *r[3:]) for r in rows[:2])
    assert z40.startswith("z40") and z20.startswith("z20")
    assert against == [f"{s} (+0.00)" for s in scores]  # the same scores on the same questions: level


def test_a_shot_count_given_twice_is_refused(small_data, tmp_path):
    """--shots 2 2 3 once summarised shot 2 over both copies (56.50 where 48.25 was right)."""
    with pytest.raises(ValueError, match=r"^--shots 2 2 3 names 2 twice$"):
        evaluate.main(
            evaluate.Args(data=small_data, baseline="random", out=tmp_path / "r", shots=[2, 2, 3], num_samples=[150])
        )
    with pytest.raises(ValueError, match=r"^--num-samples 100 100 names 100 twice$"):
        evaluate.main(evaluate.Args(data=small_data, baseline="random", out=tmp_path / "r", num_samples=[100, 100]))
    assert not (tmp_path / "r").exists()


def test_a_killed_data_build_is_trained_on_by_no_stage(tmp_path, monkeypatch, small_data):
    """gen_rl_data.py killed half way (meta.json's "complete": false): rce.py, grpo.py and evaluate.py refuse it
    before any work, naming how to finish it; --report reads it and says it is unfinished."""
    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        die_after_first_chunk(m, "gen_rl_data.py")
        gen(tmp_path / "data", chunk=4)
    data = tmp_path / "data"
    assert not json.loads((data / "meta.json").read_text())["complete"]
    finish = r"^\S+data: its build has not finished .*re-run the gen_rl_data\.py command that builds it"
    init = tmp_path / "rce"
    rce.main(rce.Args(data=small_data, out=init, **TRAIN))
    for stage, args in (
        (rce, rce.Args(data=data, out=tmp_path / "r", quality="all", **TRAIN)),
        (grpo, grpo.Args(data=data, init=init, out=tmp_path / "r", online=True, **STEPS)),
        (evaluate, evaluate.Args(data=data, baseline="random", out=tmp_path / "r")),
        (evaluate, evaluate.Args(data=data, runs=[init])),
    ):
        with pytest.raises(DataError, match=finish):
            stage.main(args)
        assert not (tmp_path / "r").exists() and not (init / "eval").exists()
    assert "| anchor queries | 4 of 16: UNFINISHED |" in gen_rl_data.report(data, gen_rl_data.Args())


def test_a_captioning_selector_is_refused_on_questions(small_data, tmp_path):
    """A selector trained on caption data reads embeddings as wide as a VQA dataset's, and was once taken by
    evaluate.py, grpo.py --init and gen_rl_data.py --init alike; each refuses it now, before any work, naming its
    model.json, and so does a VQA selector on caption data."""
    captions = gen(tmp_path / "captions", task="caption")
    rce.main(rce.Args(data=captions, out=tmp_path / "cap", **TRAIN))
    rce.main(rce.Args(data=small_data, out=tmp_path / "vqa", **TRAIN))
    refused = r"^\S+/{}/model\.json was made from other inputs: the task {} there, {} now"
    for data, run, (then, now) in ((small_data, "cap", ("caption", "vqa")), (captions, "vqa", ("vqa", "caption"))):
        init, out = tmp_path / run, tmp_path / "out"
        for stage, args in (
            (evaluate, evaluate.Args(data=data, runs=[init], shots=[1, 2, 3], num_samples=[40])),
            (grpo, grpo.Args(data=data, init=init, out=out, online=True, **STEPS)),
            (rce, rce.Args(data=data, init=init, out=out, **TRAIN)),
            (gen_rl_data, gen_rl_data.Args(out=out, init=init, **({"task": "caption"} if now == "caption" else {}))),
        ):
            with pytest.raises(DataError, match=refused.format(run, then, now)):
                stage.main(args)
            assert not out.exists() and not (init / "eval").exists()


def test_what_needs_no_model_is_refused_before_one_loads(assets, small_data, tmp_path, monkeypatch):
    """A refusal that needs only flags, files and meta.json comes before any model loads and any file (a lock
    included) is written: once --baseline oracle on a real LVLM loaded it and ran its self-check first, text baselines
    on captions left lock files, too many --num-queries loaded the LVLM, and so did a run continued with other flags;
    ablate.py --seeds with no value printed tables of nan."""
    from test_real_pipeline import gen_args

    from icl_select import backends

    real = tmp_path / "real"
    gen_rl_data.generate(gen_args(assets, real, skip_self_check=True))
    captions = gen(tmp_path / "captions", task="caption")
    lvlm = dict(val_lvlm=True, val_max_queries=2, skip_self_check=True, quality="all")
    rce.main(rce.Args(data=real, out=tmp_path / "rce", **lvlm, **{**TRAIN, "batch_size": 4}))

    def no_model(*a, **kw):
        raise AssertionError("an LVLM was loaded")

    monkeypatch.setattr(backends, "lvlm_backend", no_model)
    monkeypatch.setattr(gen_rl_data, "lvlm_backend", no_model)
    runs = tmp_path / "runs"
    for data, baseline, says in (
        (real, "oracle", r"^--baseline oracle needs the simulator"),
        (real, "observable", r"^--baseline observable needs the simulator"),
        (captions, "text-sim", r"^--baseline text-sim compares questions"),
        (captions, "mmices", r"^--baseline mmices compares questions"),
    ):
        with pytest.raises(ValueError, match=says):
            evaluate.main(evaluate.Args(data=data, baseline=baseline, out=runs / baseline, num_samples=[8]))
    assert not runs.exists()
    with pytest.raises(ValueError, match=r"^--num-queries 1000 exceeds the \d+ train items$"):
        gen_rl_data.generate(gen_args(assets, tmp_path / "more", num_queries=1000))
    assert not (tmp_path / "more").exists() and not (tmp_path / ".more.lock").exists()
    with pytest.raises(
        ValueError, match=r"^\S+/rce/config\.json was made from other inputs: --lr 0\.0001 there, 0\.01 now"
    ):
        rce.main(rce.Args(data=real, out=tmp_path / "rce", lr=1e-2, **lvlm, **{**TRAIN, "batch_size": 4}))
    for flag in ("seeds", "worlds"):
        with pytest.raises(ValueError, match=rf"^--{flag} needs at least one value$"):
            ablate.main(ablate.Args(out=tmp_path / "ablate", **{flag: []}))
    assert not (tmp_path / "ablate").exists()


def test_an_adaptive_beta_needs_a_beta_to_adapt(small_data, tmp_path):
    """--kl-target moves beta by factors of 1.5 from --kl-beta: from 0 it stayed 0, and the target did nothing while
    the KL to the reference climbed."""
    rce.main(rce.Args(data=small_data, out=tmp_path / "rce", **TRAIN))
    with pytest.raises(ValueError, match=r"^--kl-target moves beta .* from --kl-beta 0 it would stay 0"):
        grpo.main(grpo.Args(data=small_data, init=tmp_path / "rce", kl_target=0.01, kl_beta=0.0, out=tmp_path / "g"))
    assert not (tmp_path / "g").exists()


def test_a_selector_changed_after_its_evaluation_is_named_stale_in_the_verdict(small_data, tmp_path):
    """A run whose model.safetensors changed after its evaluation: the verdict names it as STALE wherever it names it
    (the glance table did; the verdict once crowned it unmarked)."""
    run = tmp_path / "rce"
    rce.main(rce.Args(data=small_data, out=run, **TRAIN))
    evaluate.main(evaluate.Args(data=small_data, runs=[run], num_samples=[150]))
    evaluate.main(evaluate.Args(data=small_data, baseline="zero-shot", out=tmp_path / "zero", num_samples=[150]))
    with torch.no_grad():
        from icl_select.runs import load_selector

        model = load_selector(run)
        model.in_proj.weight.add_(1.0)
        model.save(run)
    verdict = compare.report(compare.Args(runs=[run, tmp_path / "zero"], bootstrap=200)).split("## At a glance")[0]
    assert "rce (STALE evaluation)" in verdict and verdict.count("rce") == verdict.count("rce (STALE evaluation)")
