"""icl_select/library.py: a trained selector picks demonstrations for new questions from a library.

On the simulator: the picks are evaluate.py's for the same validation questions (their stored pools, and pools built
afresh), random pools are a function of the query alone, a small library works, bad input stops in one line. On the
real backend (tiny offline CLIP and LVLMs): a picture and a question get what an independent CLIP, ranking and decoding
give, the library's embeddings are cached and made again when it changes, and the LVLM answers with the picked
demonstrations as the kit's own scoring and plain transformers do.
"""

import json
import re
import shutil
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from test_families import Reference, rgb_images
from test_real_pipeline import gen_args

import evaluate
import rce
from gen_rl_data import Args as GenArgs
from gen_rl_data import generate
from icl_select import clip as clip_module
from icl_select import hf
from icl_select.backends import LVLMRun, open_backend
from icl_select.data import data_digest, load_dataset
from icl_select.library import CACHE, Demonstrations, Library
from icl_select.vqa import postprocess
from model import PointerSelector


def train_and_evaluate(data, run, num_samples):
    rce.main(rce.Args(data=data, out=run, epochs=2, batch_size=8, val_frac=0.25))
    evaluate.main(evaluate.Args(runs=[run], data=data, num_samples=[num_samples]))
    return run, json.loads((run / "eval" / "val.json").read_text())


@pytest.fixture(scope="module")
def random_run(small_data, tmp_path_factory):
    """An RCE run on the shared simulated dataset (random pools), evaluated on its 150 validation questions."""
    return train_and_evaluate(small_data, tmp_path_factory.mktemp("lib") / "rce", 150)


@pytest.fixture(scope="module")
def image_run(tmp_path_factory):
    """An RCE run on a simulated dataset whose pools are the most image-similar train rows, evaluated."""
    root = tmp_path_factory.mktemp("lib-image")
    small = dict(num_train=600, num_val=100, num_queries=48, group_size=8, pool_size=24)
    generate(GenArgs(out=root / "data", sampler="image", **small))
    return (root / "data", *train_and_evaluate(root / "data", root / "rce", 100))


def eval_icds(doc) -> dict[tuple[int, int], list[int]]:
    return {(r["row"], r["shot"]): r["icds"] for r in doc["results"]}


def rows(picked) -> list[list[int]]:
    return [[d.row for d in demos] for demos in picked]


def in_prompt_order(demos: Demonstrations, picks: torch.Tensor) -> torch.Tensor:
    """Picks (n, k) in pick order as the prompt shows them: a nearest_first selector's first pick next to the query."""
    return picks.flip(-1) if demos.selector.cfg.pick_order == "nearest_first" else picks


# ----------------------------------------------------------------------------------------------------------------------
# The simulator


def test_val_picks_are_what_evaluate_picks(random_run):
    """Every validation question at every shot: the same rows in the same order as eval/val.json, asked one question
    at a time or all at once."""
    run, doc = random_run
    demos = Demonstrations.from_run(run)
    assert (demos.sampler, demos.pool_size) == ("random", 24)
    want = eval_icds(doc)
    for k in doc["shots"]:
        assert rows(demos.pick_val(range(150), k)) == [want[r, k] for r in range(150)]
    for r in range(0, 150, 7):
        for k in doc["shots"]:
            assert rows(demos.pick_val([r], k)) == [want[r, k]]
    probs = [d.prob for picked in demos.pick_val(range(150)) for d in picked]
    assert all(0 < p <= 1 for p in probs)


def test_pools_built_afresh_pick_what_evaluate_picks(image_run):
    """Queries given as embeddings get pools from the library (the image sampler's, as evaluate.py's were made) and the
    same picks; a train question's pool is its most image-similar rows off its own picture, ranked in the test."""
    data, run, doc = image_run
    ds, demos = load_dataset(data), Demonstrations.from_run(run)
    view = {"fused": ds.emb["val"], "image": ds.emb["val_image"], "text": ds.emb["val_text"]}
    want = eval_icds(doc)
    for k in doc["shots"]:
        assert rows(demos.pick_embedded(view, k)) == [want[r, k] for r in range(100)]
    anchors = torch.arange(0, 600, 37)
    image_ids = torch.tensor([it["image_id"] for it in ds.items["train"]])
    train = {v: ds.emb[f"train_{v}"][anchors] for v in ("image", "text")} | {"fused": ds.emb["train"][anchors]}
    [(idx, pool)] = demos.pools(train, image_ids[anchors], [0] * len(anchors), 4)  # one group: all pools of 24
    for i, a in zip(idx.tolist(), anchors.tolist()):
        sims = ds.emb["train_image"] @ ds.emb["train_image"][a]  # (N,)
        sims[image_ids == image_ids[a]] = -float("inf")
        # the most similar 24, most similar first (questions on one picture tie: compare similarities)
        assert torch.equal(sims[pool[i]], sims.sort(descending=True).values[:24])
    picked = demos.pick_embedded(train, 4, image_ids[anchors])
    assert all(ds.items["train"][d.row]["image_id"] != image_ids[a] for a, p in zip(anchors, picked) for d in p)


@pytest.fixture(scope="module")
def stopping_run(tmp_path_factory):
    """A selector that may stop, its picks trained by RCE, its stop then set so that its greedy choice gives half the
    questions none and the others two (a trained one need not be so even), saved and evaluated exactly k and up to k."""
    root = tmp_path_factory.mktemp("lib-stop")
    small = dict(num_train=600, num_val=100, num_queries=48, group_size=8, pool_size=24)
    generate(GenArgs(out=root / "data", **small))
    run = root / "rce"
    rce.main(rce.Args(data=root / "data", out=run, can_stop=True, epochs=1, batch_size=8, val_frac=0.25))
    model, ds = PointerSelector.load(run), load_dataset(root / "data")
    pool = ds.eval_pools
    query, pool_emb = ds.emb["val"], ds.emb["train"][pool]
    with torch.no_grad():  # before the first pick a stop that differs by question, then on, on, stop
        model.stop_weight.copy_(0.1 * torch.randn(model.cfg.hidden, generator=torch.Generator().manual_seed(0)))
        z = model.encode(query, pool_emb, pool >= 0)[0] @ model.stop_weight  # (V,)
        model.stop_bias.copy_(torch.tensor([-float(z.median()), -1.0, 1.0, 1.0]))
    model.save(run)
    evaluate.main(evaluate.Args(runs=[run], data=root / "data", num_samples=[100]))
    return run, *(json.loads((run / "eval" / f"val{s}.json").read_text()) for s in ("", "-upto"))


def test_a_selector_that_may_stop_gives_what_evaluate_gives_and_only_library_items(stopping_run):
    """Up to k (its own choice, fewer or none) as eval/val-upto.json holds it, exactly k as eval/val.json does; every
    demonstration a library item of the question's pool, none twice, each with its probability at its step (never a
    placeholder for a stop, whose -1 once became the library's last item)."""
    run, exact, upto = stopping_run
    demos = Demonstrations.from_run(run)
    ds = load_dataset(demos.data)
    used = {len(r["icds"]) for r in upto["results"] if r["shot"] == 4}
    assert used == {0, 2}  # the fixture gives none or fewer
    for doc, exactly in ((exact, True), (upto, False)):
        want = eval_icds(doc)
        for k in doc["shots"]:
            picked = demos.pick_val(range(100), k, exactly=exactly)
            assert rows(picked) == [want[r, k] for r in range(100)]
            for r, demos_r in enumerate(picked):
                allowed = set(ds.eval_pools[r].tolist()) - {-1}
                assert {d.row for d in demos_r} <= allowed and len({d.row for d in demos_r}) == len(demos_r)
                assert all(0 < d.prob <= 1 and d.item == ds.items["train"][d.row] for d in demos_r)
    # the probabilities in prompt order, as teacher forcing gives them step by step
    model, pool = demos.selector, ds.eval_pools[:100]
    picks = model.greedy(ds.emb["val"][:100], ds.emb["train"][pool], pool >= 0, 4)[0]  # (100, 4) pick order
    steps = model.log_probs(ds.emb["val"][:100], ds.emb["train"][pool], pool >= 0, picks[:, None], pool[:, :1] >= 0)
    for r, picked in enumerate(demos.pick_val(range(100))):
        n = int((picks[r] >= 0).sum())
        want = steps[r, 0, :n].exp().tolist()
        assert [d.prob for d in picked] == pytest.approx(
            want[::-1] if model.cfg.pick_order == "nearest_first" else want
        )
    # pick_embedded, pools built afresh from the library: the same guarantees
    view = {"fused": ds.emb["val"][:100]}
    for exactly in (True, False):
        for picked in demos.pick_embedded(view, exactly=exactly):
            assert len(picked) == 4 if exactly else len(picked) <= 4
            assert all(0 <= d.row < len(ds.items["train"]) for d in picked) and len({d.row for d in picked}) == len(
                picked
            )


@pytest.fixture(scope="module")
def random_demos(random_run):
    demos = Demonstrations.from_run(random_run[0])
    return demos, load_dataset(demos.data)


@settings(max_examples=10)
@given(st.integers(0, 2**32 - 1))
def test_random_pools_depend_on_the_query_alone(random_demos, seed):
    """A random-sampler run draws each query's pool from its own generator: the picks of a query are the same alone
    and in any batch, and queries get pools of their own."""
    demos, ds = random_demos
    g = torch.Generator().manual_seed(seed)
    queries = torch.randperm(150, generator=g)[:6]
    view = {"fused": ds.emb["val"][queries]}
    batch = rows(demos.pick_embedded(view))
    alone = [rows(demos.pick_embedded({"fused": view["fused"][i : i + 1]}))[0] for i in range(6)]
    order = torch.randperm(6, generator=g)
    shuffled = rows(demos.pick_embedded({"fused": view["fused"][order]}))
    assert batch == alone == [shuffled[order.tolist().index(i)] for i in range(6)]
    [(_, pool)] = demos.pools(view, torch.full((6,), demos.no_picture), list(range(6)), 4)
    assert len({tuple(p) for p in pool.sort(-1).values.tolist()}) == 6  # six different pools


def test_a_library_smaller_than_the_pool(random_demos):
    """12 demonstrations for pools of 24: a query's pool is every one of them not on its picture, and the selector picks
    from it as it would from that pool given directly; fewer than k allowed stops in one line."""
    demos, ds = random_demos
    few = Library(ds.items["train"][:12], {"fused": ds.emb["train"][:12]}, "sim", where="twelve items")
    small = Demonstrations(demos.selector, few, "random", 24, source=demos.source)
    image_ids = torch.tensor([it["image_id"] for it in ds.items["train"][:12]])
    for query, image in ((ds.emb["val"][3], small.no_picture), (ds.emb["train"][5], int(image_ids[5]))):
        allowed = (image_ids != image).nonzero()[:, 0]  # (M,) the library rows a pool may hold
        picks, _ = demos.selector.greedy(
            query[None], ds.emb["train"][allowed][None], torch.ones(1, len(allowed)) > 0, 4
        )
        want = allowed[in_prompt_order(demos, picks)].tolist()
        assert rows(small.pick_embedded({"fused": query[None]}, image_ids=torch.tensor([image]))) == want
    with pytest.raises(ValueError, match=r"^pick_val picks from the evaluation pools of \S+'s own dataset folder$"):
        small.pick_val([0])  # its pools are rows of the run's train split, not of this library
    tiny = Demonstrations(
        demos.selector, Library(ds.items["train"][:3], {"fused": ds.emb["train"][:3]}, "sim"), "random", 24
    )
    with pytest.raises(
        ValueError,
        match=r"^the library holds 3 demonstrations not on the picture of query 0, fewer than the 4 asked for$",
    ):
        tiny.pick_embedded({"fused": ds.emb["val"][:1]})


def test_refusals_on_the_simulator(random_run, small_data, tmp_path):
    run, _ = random_run
    demos = Demonstrations.from_run(run)
    ds = load_dataset(small_data)
    with pytest.raises(
        ValueError, match=r"^\S+ is a simulator run: its questions have no pictures to embed; .*pick_embedded$"
    ):
        demos.pick(tmp_path / "x.jpg", "What is it?")
    with pytest.raises(ValueError, match=r"^k=5: \S+ makes 1 to 4 picks \(model.json field 'picks'\)$"):
        demos.pick_val([0], 5)
    # a Hub download: the selector and its config.json, no dataset folder
    hub = tmp_path / "sel"
    hub.mkdir()
    for name in ("model.json", "model.safetensors", "config.json"):
        shutil.copy(run / name, hub / name)
    config = json.loads((hub / "config.json").read_text())
    config["data"]["folder"] = str(tmp_path / "elsewhere")
    (hub / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError,
        match=r"^\S+sel: its dataset folder \S+elsewhere \(config.json field 'data.folder'\) is not here; "
        r"name the library to pick from \(Demonstrations.from_run\(\.\.\., library=\.\.\.\)\)$",
    ):
        Demonstrations.from_run(hub)
    # the library may be the run's dataset folder: recognised by its digest, it brings the run's settings
    found = Demonstrations.from_run(hub, library=small_data)
    assert found.data == small_data and rows(found.pick_val(range(20))) == rows(demos.pick_val(range(20)))
    # another encoder's embeddings, and another width (named encoder, no dataset folder to check against)
    other = Library(ds.items["train"], {"fused": ds.emb["train"]}, "clip-x", where="other")
    with pytest.raises(
        ValueError,
        match=r"^other was embedded by clip-x \(revision None\), but \S+ was trained on embeddings of sim "
        r"\(revision None\); embed the library with that encoder .*\)$",
    ):
        Demonstrations.from_run(run, library=other)
    narrow = Library(ds.items["train"], {"fused": ds.emb["train"][:, :16]}, "sim", where="narrow")
    with pytest.raises(
        ValueError, match=r"^\S+sel/model.json: field 'dim' is 512, but the embeddings of narrow are 16-d; .*$"
    ):
        Demonstrations.from_run(hub, library=narrow, encoder="sim", sampler="random", pool_size=24)
    # its config.json says how the run embedded and pooled: a library of the same items picks as the run does
    same = Demonstrations.from_run(hub, library=Library(ds.items["train"], {"fused": ds.emb["train"]}, "sim"))
    view = {"fused": ds.emb["val"][:20]}
    assert (same.sampler, same.pool_size) == ("random", 24) and rows(same.pick_embedded(view)) == rows(
        demos.pick_embedded(view)
    )
    for field in ("task", "encoder", "sampler"):  # a run that does not say what it was trained for is not guessed at
        dataset = {k: v for k, v in config["dataset"].items() if k != field}
        (hub / "config.json").write_text(json.dumps(config | {"dataset": dataset}))
        with pytest.raises(ValueError, match=r"^\S+sel: its config.json does not record the task, encoder and pools "):
            Demonstrations.from_run(hub, library=Library(ds.items["train"], {"fused": ds.emb["train"]}, "sim"))
    # the task of the run against that of the library
    caption = Library(ds.items["train"], {"fused": ds.emb["train"]}, "sim", task="caption", where="captions")
    other_task = r"^\S+/model\.json was made from other inputs: the task vqa there, caption now"
    with pytest.raises(ValueError, match=other_task):
        Demonstrations(demos.selector, caption, "random", 24, source=str(run))
    # the dataset folder changed since training
    changed = tmp_path / "changed"
    shutil.copytree(small_data, changed)
    items = json.loads((changed / "items.json").read_text())
    items["train"][0]["question"] += "?"
    (changed / "items.json").write_text(json.dumps(items))
    config["data"]["folder"] = str(changed)
    (hub / "config.json").write_text(json.dumps(config))
    digest = config["data"]["digest"]
    with pytest.raises(
        ValueError,
        match=rf"^\S+sel: its dataset folder \S+changed changed since training \(digest {digest} in config.json, "
        rf"{data_digest(changed)} now\); name .*\)\)$",
    ):
        Demonstrations.from_run(hub)
    with pytest.raises(ValueError, match=r"^\S+ is a simulator run: the simulated LVLM answers no real question$"):
        demos.lvlm()
    with pytest.raises(ValueError, match=r"^\S+: a simulated dataset has no pictures for clip-x to embed$"):
        Library.from_dataset(small_data, encoder="clip-x")


# ----------------------------------------------------------------------------------------------------------------------
# The real backend: tiny CLIP and LVLMs, OK-VQA-format files


@pytest.fixture(scope="module")
def real_run(assets, tmp_path_factory):
    """An RCE run on tiny Qwen2.5-VL's scores of the OK-VQA-format fixture, pools by image similarity."""
    root = tmp_path_factory.mktemp("lib-real")
    generate(gen_args(assets, root / "data", sampler="image"))
    small = dict(hidden=32, num_heads=2, quality="all", epochs=1, batch_size=4, val_frac=0.25)
    rce.main(rce.Args(data=root / "data", out=root / "rce", **small))
    return root / "data", root / "rce"


@torch.no_grad()
def clip_of(folder, image: Image.Image, question: str) -> dict[str, torch.Tensor]:
    """CLIP's image, text and fused embeddings of one query with plain transformers, (1, d) each."""
    from transformers import CLIPModel, CLIPProcessor

    model, processor = CLIPModel.from_pretrained(folder).eval(), CLIPProcessor.from_pretrained(folder)
    pixels = processor(images=[image.convert("RGB")], return_tensors="pt")["pixel_values"]
    image_emb = F.normalize(model.get_image_features(pixel_values=pixels).pooler_output, dim=-1)
    text_emb = F.normalize(
        model.get_text_features(**processor(text=[question], return_tensors="pt")).pooler_output, dim=-1
    )
    return {"image": image_emb, "text": text_emb, "fused": F.normalize(image_emb + text_emb, dim=-1)}


def test_a_picture_and_question_get_what_the_kit_would_pick(real_run, assets, monkeypatch):
    """A validation picture (as a file or in memory) and its question: the picks of the query embedded by plain CLIP,
    its pool ranked by image similarity and decoded by the selector in the test, and pick_val's for that question."""
    data, run = real_run
    ds, demos = load_dataset(data), Demonstrations.from_run(run)
    assert (demos.sampler, demos.pool_size, demos.library.encoder) == ("image", 6, str(assets["clip"]))
    for r, item in enumerate(ds.items["val"]):
        query = clip_of(assets["clip"], Image.open(item["image"]), item["question"])
        pool = (ds.emb["train_image"] @ query["image"][0]).argsort(descending=True)[:6]  # no val picture is a train one
        picks, _ = demos.selector.greedy(query["fused"], ds.emb["train"][pool][None], torch.ones(1, 6) > 0, 2)
        want = pool[in_prompt_order(demos, picks)].tolist()
        assert rows([demos.pick(item["image"], item["question"])]) == want
        assert rows([demos.pick(Image.open(item["image"]), item["question"])]) == want
        assert rows(demos.pick_val([r])) == want
    batch = demos.pick_batch([(it["image"], it["question"]) for it in ds.items["val"]], k=1)
    assert rows(batch) == [w[-1:] for w in rows(demos.pick_val(range(len(ds.items["val"]))))]
    picked = batch[0][0]
    assert picked.item == ds.items["train"][picked.row] and picked.image.endswith(".jpg")
    with pytest.raises(ValueError, match=r"^query 1 has no picture: \S+ picks demonstrations for a picture$"):
        demos.pick_batch([(ds.items["val"][0]["image"], "What?"), (None, "What color is the shape?")])
    with pytest.raises(ValueError, match=r"^query 0: expected a \(picture, question\) pair, got '\S+'$"):
        demos.pick_batch([ds.items["val"][0]["image"]])


def test_the_library_is_embedded_once_and_again_when_it_changes(assets, real_run, tmp_path, monkeypatch):
    """OK-VQA files as a library: embedded by CLIP as plain transformers embeds them, cached beside them, reused while
    nothing changes (a moved copy included), embedded again when a picture's bytes or a question change."""
    root = tmp_path / "okvqa"
    shutil.copytree(assets["okvqa"], root)
    calls = []
    embed = clip_module.clip_embed
    monkeypatch.setattr(
        clip_module, "clip_embed", lambda items, *a, **k: calls.append(len(items)) or embed(items, *a, **k)
    )
    clip = str(assets["clip"])
    first = Library.from_vqa("okvqa", root, clip)
    assert calls == [32] and first.encoder == clip and first.where == f"okvqa train of {root}"
    [cached] = (root / CACHE).glob("okvqa-train-clip-*.safetensors")
    assert re.fullmatch(r"okvqa-train-clip-[0-9a-f]{8}-[0-9a-f]{16}\.safetensors", cached.name)
    item = first.items[5]
    plain = clip_of(clip, Image.open(item["image"]), item["question"])
    for view in ("image", "text", "fused"):
        torch.testing.assert_close(first.emb[view][5], plain[view][0], atol=1e-5, rtol=0)
    again = Library.from_vqa("okvqa", root, clip)
    assert calls == [32] and all(torch.equal(again.emb[v], first.emb[v]) for v in first.emb)

    picture = first.items[0]["image"]  # redrawn: its rows' picture embeddings change, no other
    Image.new("RGB", (56, 56), (10, 200, 10)).save(picture, quality=95)
    redrawn = Library.from_vqa("okvqa", root, clip)
    on_it = torch.tensor([it["image"] == picture for it in first.items])
    assert calls == [32, 32] and on_it.sum() == 2 and len(list((root / CACHE).glob("*.safetensors"))) == 1
    assert not torch.equal(redrawn.emb["image"][on_it], first.emb["image"][on_it])
    assert torch.equal(redrawn.emb["image"][~on_it], first.emb["image"][~on_it])

    questions = root / "OpenEnded_mscoco_train2014_questions.json"
    doc = json.loads(questions.read_text())
    doc["questions"][3]["question"] = "What is the shape?"
    questions.write_text(json.dumps(doc))
    asked = Library.from_vqa("okvqa", root, clip)
    assert calls == [32, 32, 32] and asked.items[3]["question"] == "What is the shape?"
    assert not torch.equal(asked.emb["text"][3], redrawn.emb["text"][3])

    moved = tmp_path / "moved"
    shutil.copytree(root, moved)
    assert all(torch.equal(Library.from_vqa("okvqa", moved, clip).emb[v], asked.emb[v]) for v in asked.emb)
    assert calls == [32, 32, 32]

    # a library embedded by another CLIP: the run refuses it in one line
    from icl_select.tiny import build_tiny_clip

    other = str(build_tiny_clip(tmp_path / "clip2", seed=1))
    _, run = real_run
    with pytest.raises(
        ValueError,
        match=rf"^okvqa train of \S+ was embedded by {re.escape(other)} \(revision sha256:\w{{16}}\), but \S+ was "
        rf"trained on embeddings of {re.escape(clip)} \(revision sha256:\w{{16}}\); .*\)$",
    ):
        Demonstrations.from_run(run, library=Library.from_vqa("okvqa", moved, other))
    demos = Demonstrations.from_run(run, library=Library.from_vqa("okvqa", moved, clip))
    assert demos.library.where == f"okvqa train of {moved}" and len(demos.pick(picture, "What color is it?")) == 2


def test_an_encoder_folder_is_who_its_weights_are(assets, tmp_path, monkeypatch):
    """A CLIP given as a folder of your own is identified by a digest of its files, as a Hub model is by its commit:
    changed weights under the same path embed the library again and are refused for a run trained on the old ones,
    while a moved copy of the same weights is the same encoder."""
    from safetensors.torch import load_file, save_file

    clip = tmp_path / "clip"
    shutil.copytree(assets["clip"], clip)
    generate(gen_args(assets, tmp_path / "data", encoder=str(clip)))
    small = dict(hidden=32, num_heads=2, quality="all", epochs=1, batch_size=4, val_frac=0.25)
    rce.main(rce.Args(data=tmp_path / "data", out=tmp_path / "rce", **small))
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    assert re.fullmatch(r"sha256:[0-9a-f]{16}", meta["encoder_revision"])
    root = tmp_path / "okvqa"
    shutil.copytree(assets["okvqa"], root)
    calls = []
    embed = clip_module.clip_embed
    monkeypatch.setattr(
        clip_module, "clip_embed", lambda items, *a, **k: calls.append(len(items)) or embed(items, *a, **k)
    )
    before = Library.from_vqa("okvqa", root, str(clip))
    assert before.encoder_revision == meta["encoder_revision"] and calls == [32]
    Demonstrations.from_run(tmp_path / "rce", library=before)

    moved = tmp_path / "clip-moved"  # the same weights elsewhere: the same encoder, its embeddings reused
    shutil.copytree(clip, moved)
    assert hf.resolve_model(str(moved))[1] == meta["encoder_revision"]

    weights = clip / "model.safetensors"  # new weights in the same folder
    tensors = load_file(weights)
    name = next(k for k in tensors if k.endswith("visual_projection.weight"))
    noise = torch.randn(tensors[name].shape, generator=torch.Generator().manual_seed(0))
    save_file(tensors | {name: tensors[name] + noise}, weights)
    after = Library.from_vqa("okvqa", root, str(clip))
    assert calls == [32, 32] and after.encoder_revision != before.encoder_revision
    assert not torch.equal(after.emb["image"], before.emb["image"])
    with pytest.raises(
        ValueError,
        match=rf"^{re.escape(str(clip))} is sha256:\w{{16}} here, but \S+rce was trained on embeddings of "
        rf"{meta['encoder_revision']}; restore the weights it was trained with$",
    ):
        Demonstrations.from_run(tmp_path / "rce")


def plain_answer(folder, style: str, meta: dict, query: dict, demos: list[dict]) -> str:
    """The greedy answer of plain transformers (test_families.Reference) to the kit's prompt layout for `style`, the
    chat written here from the template recorded in `meta`."""
    template, image = meta["prompt_template"], {"type": "image"}
    content, chat = [], []
    for d in demos:
        answer = Counter(d["answers"]).most_common(1)[0][0]
        if style == "turn-per-demo":
            asked = [image, {"type": "text", "text": template["query"].format(question=d["question"])}]
            chat += [
                {"role": "user", "content": asked},
                {"role": "assistant", "content": [{"type": "text", "text": answer}]},
            ]
        else:
            content += [image, {"type": "text", "text": template["icd"].format(question=d["question"], answer=answer)}]
    content += [image, {"type": "text", "text": template["query"].format(question=query["question"])}]
    reference = Reference(folder)
    reference.model.generation_config.max_new_tokens = meta["generation"]["max_new_tokens"]
    return reference.answer([*chat, {"role": "user", "content": content}], rgb_images(query, demos))


def test_the_lvlm_answers_with_the_picked_demonstrations(real_run, assets):
    """The run's LVLM with its recorded prompt layout answers a question with the picked demonstrations as plain
    transformers does on that prompt, and as the kit's own scoring of the same validation question and rows does."""
    data, run = real_run
    ds, demos = load_dataset(data), Demonstrations.from_run(run)
    model = demos.lvlm()
    assert model.template.icd == ds.meta["prompt_template"]["icd"] and model.check["answers_differ"] == 0
    kit = open_backend(ds.meta, ds.items, ds.emb, LVLMRun(device="cpu", skip_self_check=True))
    for r in (0, 5):
        query = ds.items["val"][r]
        picked = demos.pick(query["image"], query["question"])
        example = demos.example(query["image"], query["question"], picked)
        [answer] = model.generate([example])
        scored = kit.score("val", torch.tensor([r]), torch.tensor([[d.row for d in picked]]), gt_prob=False)
        assert postprocess(answer) == scored["prediction"][0]
        plain = plain_answer(assets["qwen"], "single-turn", ds.meta, query, example[1])
        assert answer == plain
        assert [d.answer for d in picked] == [Counter(d.answers).most_common(1)[0][0] for d in picked]


@pytest.mark.slow
def test_every_tiny_family_answers_as_the_kits_scoring(real_run, family_models):
    """Each tiny family, named to lvlm(), answers with the picked demonstrations as its own scoring of that validation
    question and those rows does, in the layout its template gets (turn-per-demo where images go first)."""
    data, run = real_run
    ds, demos = load_dataset(data), Demonstrations.from_run(run)
    query = ds.items["val"][2]
    picked = demos.pick(query["image"], query["question"])
    for family, folder in family_models.items():
        model = demos.lvlm(str(folder), LVLMRun(device="cpu"))
        [answer] = model.generate([demos.example(query["image"], query["question"], picked)])
        kit = open_backend(ds.meta, ds.items, ds.emb, LVLMRun(device="cpu", skip_self_check=True), str(folder))
        scored = kit.score("val", torch.tensor([2]), torch.tensor([[d.row for d in picked]]), gt_prob=False)
        assert postprocess(answer) == scored["prediction"][0], family
        assert answer == plain_answer(folder, model.template.style, ds.meta, query, [d.item for d in picked]), family
