"""The whole pipeline on the real backend: tiny random-weight Qwen2.5-VL + CLIP built offline, OK-VQA-format files."""

import json
import re

import pytest

import compare
import evaluate
import grpo
import rce
from gen_rl_data import Args, generate
from icl_select import clip, lvlm, pictures
from icl_select.backends import LVLMRun, open_backend
from icl_select.data import load_dataset
from icl_select.files import folder_digest
from model import PointerSelector


def gen_args(assets, out, **kw):
    base = dict(
        lvlm=str(assets["qwen"]),
        dataset="okvqa",
        data_root=assets["okvqa"],
        encoder=str(assets["clip"]),
        num_queries=8,
        pool_size=6,
        group_size=3,
        seq_len=2,
        lvlm_batch_size=4,
    )
    return Args(out=out, **{**base, **kw})


@pytest.fixture(scope="module")
def data(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("real-data") / "okvqa-tiny"
    generate(gen_args(assets, out))
    return out


def test_dataset_folder_records_the_real_backend(data, assets, monkeypatch):
    ds = load_dataset(data)
    meta = ds.meta
    assert meta["source"] == "okvqa" and meta["lvlm"] == str(assets["qwen"]) and not meta["simulation"]
    assert meta["prompt_template"]["query"].endswith("Short answer:") and meta["generation"]["max_new_tokens"] == 10
    assert meta["encoder"] == str(assets["clip"]) and "revision" in meta and "calibration" not in meta
    # a local folder has no hub commit: it is who its files are (tests/test_library.py changes its weights)
    assert meta["encoder_revision"] == folder_digest(assets["clip"]) and meta["revision"] == folder_digest(
        assets["qwen"]
    )
    assert meta["prompt_template"]["style"] == "single-turn"
    check = meta["self_check"]  # the fast path against plain transformers on 8 prompts, before the long run
    assert check["prompts"] == 8 and check["answers_differ"] == 0 and check["max_abs_logp_diff"] < 1e-3
    # evaluate.py and online GRPO rebuild the backend from meta.json, prompt style included
    turns = dict(meta, prompt_template=dict(meta["prompt_template"], style="turn-per-demo"))
    assert open_backend(turns, ds.items, ds.emb, LVLMRun(device="cpu")).template.style == "turn-per-demo"
    assert len(ds.groups) == 8 and ds.groups.seqs.shape[1:] == (3, 2)
    assert ds.emb["train"].shape[0] == len(ds.items["train"]) == 32 and "val_image" in ds.emb
    assert all(it["image"].endswith(".jpg") for it in ds.items["train"])
    # re-running the same command resumes: nothing is recomputed, the CLIP embeddings are reused
    monkeypatch.setattr(clip, "clip_embed", lambda *a, **k: pytest.fail("embeddings recomputed"))
    before = {p.name: p.read_bytes() for p in data.iterdir()}
    generate(gen_args(assets, data))
    assert {p.name: p.read_bytes() for p in data.iterdir()} == before


def test_train_evaluate_compare(data, assets, tmp_path):
    small = dict(data=data, epochs=1, batch_size=4, val_frac=0.25)
    with pytest.raises(ValueError, match=r"--quality varied\b.*\bhard_plus_soft\b.*--quality all\b"):
        rce.main(rce.Args(out=tmp_path / "flat", hidden=32, num_heads=2, **small))  # a random LVLM ties them all
    rce.main(rce.Args(out=tmp_path / "rce", hidden=32, num_heads=2, quality="all", **small))
    grpo.main(grpo.Args(init=tmp_path / "rce", out=tmp_path / "grpo", **small))
    offline = [json.loads(x) for x in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()][-1]
    assert "val/acc" not in offline and offline["select_metric"] == "val/reward"  # the LVLM is not asked by default
    online_args = dict(online=True, group_size=2, val_lvlm=True, val_max_queries=2, skip_self_check=True, **small)
    batches = []
    with pytest.MonkeyPatch.context() as m:  # --skip-self-check and --lvlm-batch-size reach online GRPO's backend
        m.setattr(lvlm.LVLMBackend, "self_check", lambda *a: pytest.fail("self-check run despite --skip-self-check"))
        init = lvlm.LVLMBackend.__init__
        m.setattr(lvlm.LVLMBackend, "__init__", lambda self, *a, **k: batches.append(a[2]) or init(self, *a, **k))
        grpo.main(grpo.Args(init=tmp_path / "rce", out=tmp_path / "online", lvlm_batch_size=3, **online_args))
    assert batches == [3]  # one LVLM for training and validation, 3 prompts per forward pass
    online = [json.loads(x) for x in (tmp_path / "online" / "metrics.jsonl").read_text().splitlines()][-1]
    assert online["grpo/group_size"] <= 2 and online["select_metric"] == "val/acc" and 0 <= online["val/acc"] <= 100
    ev = dict(data=data, shots=[1, 2], num_samples=[4, 8])
    evaluate.main(evaluate.Args(runs=[tmp_path / "rce", tmp_path / "grpo"], **ev))
    evaluate.main(evaluate.Args(baseline="image-sim", out=tmp_path / "sim", **ev))
    doc = json.loads((tmp_path / "grpo" / "eval" / "val.json").read_text())
    assert doc["backend"] == str(assets["qwen"])
    assert not doc["simulation"] and len(doc["results"]) == 16 and doc["backend_info"]["prompt_template"]
    assert doc["self_check"]["answers_differ"] == 0
    text = compare.report(compare.Args(runs=[tmp_path / "rce", tmp_path / "grpo", tmp_path / "sim"]))
    assert "| grpo | rce |" in text and "simulated" not in text.splitlines()[0]


def test_moved_data_root_and_corrupt_image(assets, tmp_path, monkeypatch):
    import shutil

    orig, moved = tmp_path / "orig", tmp_path / "moved"
    shutil.copytree(assets["okvqa"], orig)
    data = tmp_path / "data"
    generate(gen_args(assets, data, data_root=orig))
    ev = dict(data=data, baseline="random", shots=[1], num_samples=[4])
    evaluate.main(evaluate.Args(out=tmp_path / "a", **ev))
    orig.rename(moved)  # the dataset moved: its recorded image paths are gone
    pictures.DECODED_IMAGES.clear()
    # the question count, the split, the dataset and a missing image under the old root
    gone = rf"\b4\b.*\bval\b.*{re.escape(str(data))}\b.*{re.escape(str(orig))}/\S+ \(not found\)"
    with pytest.raises(ValueError, match=gone):
        evaluate.main(evaluate.Args(out=tmp_path / "b", **ev))
    assert not (tmp_path / "b").exists()
    evaluate.main(evaluate.Args(out=tmp_path / "b", data_root=moved, **ev))
    a, b = (json.loads((tmp_path / d / "eval" / "val.json").read_text())["results"] for d in "ab")
    assert a == b
    broken = sorted((moved / "train2014").glob("*.jpg"))[3]
    broken.write_bytes(b"not a jpeg")
    pictures.DECODED_IMAGES.clear()
    pool_images = {str(p) for p in (moved / "train2014").glob("*.jpg")}  # evaluation reads pools of train images
    assert str(broken) in pool_images
    with (
        monkeypatch.context() as m,
        pytest.raises(ValueError, match=rf"^1\b.*{re.escape(str(broken))}\b"),
    ):
        m.setattr(evaluate, "open_backend", lambda *a, **k: pytest.fail("the LVLM was loaded before the image check"))
        evaluate.main(evaluate.Args(out=tmp_path / "c", data_root=moved, **ev))
    with pytest.raises(ValueError, match=rf"{re.escape(str(broken))}\b"):
        generate(gen_args(assets, tmp_path / "new", data_root=moved))
    assert not (tmp_path / "new").exists() and not (tmp_path / "new.building").exists()


def test_bad_model_writes_nothing(assets, tmp_path):
    out = tmp_path / "bad"
    args = gen_args(assets, out)
    args.lvlm = str(assets["text_lm"])
    with pytest.raises(ValueError, match="Qwen2ForCausalLM"):
        generate(args)
    args.lvlm = str(tmp_path / "no-such-model")
    with pytest.raises((ValueError, FileNotFoundError), match="no-such-model"):
        generate(args)
    assert not out.exists()


def test_selector_transfers_to_another_lvlm(data, family_models, tmp_path):
    """A selector trained on Qwen2.5-VL's scores picks demonstrations that LLaVA-1.5 answers with (evaluate.py
    --lvlm): the evaluation file names the evaluating model and the prompt layout its template gets."""
    small = dict(data=data, epochs=1, batch_size=4, val_frac=0.25)
    rce.main(rce.Args(out=tmp_path / "rce", hidden=32, num_heads=2, quality="all", **small))
    llava = str(family_models["llava"])
    evaluate.main(evaluate.Args(runs=[tmp_path / "rce"], data=data, shots=[1, 2], num_samples=[4], lvlm=llava))
    doc = json.loads((tmp_path / "rce" / "eval" / "val.json").read_text())
    assert doc["backend"] == llava and len(doc["results"]) == 8
    assert doc["backend_info"]["prompt_template"]["style"] == "turn-per-demo" and doc["backend_info"]["prompt_note"]
    ev = dict(data=data, shots=[1, 2], num_samples=[4], skip_self_check=True)
    evaluate.main(evaluate.Args(baseline="image-sim", out=tmp_path / "sim", **ev))  # the dataset's own Qwen2.5-VL
    text = compare.report(compare.Args(runs=[tmp_path / "rce", tmp_path / "sim"]))
    assert "answered by llava" in text and "answered by qwen" in text


def test_fast_path_that_disagrees_stops_before_anything_is_written(assets, tmp_path, monkeypatch):
    """A family whose batched scoring drifts from plain transformers stops gen_rl_data in one line, folder unmade;
    --skip-self-check runs anyway."""
    run = lvlm.LVLMBackend.run

    def drifting(self, examples, replies=None, answer=True):
        texts, probs = run(self, examples, replies, answer)
        return texts, [p * 0.5 for p in probs]

    monkeypatch.setattr(lvlm.LVLMBackend, "run", drifting)
    out = tmp_path / "drift"
    with pytest.raises(ValueError, match=rf"^{re.escape(str(assets['qwen']))}: .*\b0\.693\b.*--skip-self-check\b"):
        generate(gen_args(assets, out))
    assert not out.exists() and not (tmp_path / "drift.building").exists()
    generate(gen_args(assets, out, skip_self_check=True, num_queries=2))
    assert "self_check" not in load_dataset(out).meta


def test_gen_rl_data_reads_a_hugging_face_export(assets, tmp_path, monkeypatch):
    from test_vqa_data import export_to_parquet

    monkeypatch.setenv("ICL_SELECT_CACHE", str(tmp_path / "cache"))
    for split in ("train", "val"):
        export_to_parquet(assets["okvqa"], tmp_path / "export", split, answer_objects=True)
    out = tmp_path / "from-parquet"
    generate(gen_args(assets, out, data_root=tmp_path / "export", num_queries=2, skip_self_check=True))
    ds = load_dataset(out)
    assert len(ds.groups) == 2 and all(it["image"].startswith(str(tmp_path / "cache")) for it in ds.items["train"])


def test_a_budget_on_the_real_backend_stays_within_it_and_scores_the_train_items_it_met(data, tmp_path):
    """`grpo.py --online --lvlm-budget N` alone on the real backend: the warm start, then the online run, within N
    LVLM calls; the item scores are keyed by the dataset's CLIP embeddings, so a train item scores, a val item not."""
    small = dict(data=data, batch_size=4, val_frac=0.25)
    rce.main(rce.Args(out=tmp_path / "rce", hidden=32, num_heads=2, quality="all", epochs=1, **small))
    online = dict(online=True, lvlm_budget=100, group_size=2, val_lvlm=True, val_max_queries=2, skip_self_check=True)
    grpo.main(grpo.Args(init=tmp_path / "rce", out=tmp_path / "online", **online, **small))
    last = json.loads((tmp_path / "online" / "metrics.jsonl").read_text().splitlines()[-1])
    config = json.loads((tmp_path / "online" / "config.json").read_text())
    assert 0 < config["warm_start"]["lvlm_calls"] < last["lvlm/calls"] <= 100
    assert PointerSelector.load(config["warm_start"]["run"]).items is None  # the offline warm start learns none
    ds, policy = load_dataset(data), PointerSelector.load(tmp_path / "online")
    train, val = (policy.items(ds.emb[split][None])[0] for split in ("train", "val"))  # (N,) each item's score
    assert (train != 0).any() and (val == 0).all()
    evaluate.main(evaluate.Args(runs=[tmp_path / "online"], data=data, shots=[1, 2], num_samples=[4]))
    assert len(json.loads((tmp_path / "online" / "eval" / "val.json").read_text())["results"]) == 8
