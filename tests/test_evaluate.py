"""evaluate.py on the simulator: file format, nested prefixes, baselines, orders, resume, errors."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import die_after_first_chunk

import evaluate
import rce
from gen_rl_data import Args as GenArgs
from gen_rl_data import generate
from icl_select import data, pools
from icl_select.backends import open_backend
from icl_select.data import load_dataset
from icl_select.runs import load_selector
from model import PointerSelector, SelectorConfig

N = [50, 100, 150]


def run_eval(**kw):
    evaluate.main(evaluate.Args(num_samples=N, **kw))


@pytest.fixture(scope="module")
def baselines(small_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    out = {}
    for b in ("zero-shot", "random", "image-sim", "text-sim", "oracle"):
        run_eval(data=small_data, baseline=b, out=root / b)
        out[b] = json.loads((root / b / "eval" / "val.json").read_text())
    return out


def test_file_format_and_nested_summary(baselines, small_data):
    doc = baselines["random"]
    ds = load_dataset(small_data)
    assert doc["backend"] == "sim" and doc["simulation"] and doc["shots"] == [1, 2, 3, 4]
    res = doc["results"]
    assert len(res) == 150 * 4
    assert [r["question_id"] for r in res[::4]] == [it["question_id"] for it in ds.items["val"][:150]]
    for n in N:
        for s in doc["shots"]:
            scores = [r["score"] for r in res if r["shot"] == s][:n]
            assert doc["summary"][str(n)][str(s)] == pytest.approx(100 * sum(scores) / n, abs=1e-3)
    for r in res:  # ICDs come from the question's own pool, distinct, as many as the shot
        pool = set(ds.eval_pools[r["row"]].tolist())
        assert len(r["icds"]) == r["shot"] == len(set(r["icds"])) and set(r["icds"]) <= pool


def test_zero_shot_scores_each_question_once_for_every_shot_count(small_data, tmp_path, monkeypatch):
    """Zero-shot's prompt is the same at every shot count: each question is asked once, its score shared."""
    asked = []

    def counting(*args, **kwargs):
        backend = open_backend(*args, **kwargs)
        score = backend.score
        backend.score = lambda split, rows, icds, **kw: asked.append(len(rows)) or score(split, rows, icds, **kw)
        return backend

    monkeypatch.setattr(evaluate, "open_backend", counting)
    run_eval(data=small_data, baseline="zero-shot", out=tmp_path / "z")
    doc = json.loads((tmp_path / "z" / "eval" / "val.json").read_text())
    assert sum(asked) == max(N) and doc["shots"] == [1, 2, 3, 4]
    assert len({str(v) for v in doc["summary"][str(max(N))].values()}) == 1


def test_baselines_ordered_as_calibrated(baselines, tmp_path):
    """At realistic pool sizes (K=64 from 3000 items) and 1000 questions: oracle > similarity > random at 1 shot."""
    data = tmp_path / "mid"
    generate(GenArgs(out=data, num_train=3000, num_val=1000, num_queries=16, group_size=4))
    acc = {}
    for b in ("random", "image-sim", "text-sim", "oracle"):
        evaluate.main(evaluate.Args(data=data, baseline=b, out=tmp_path / b, shots=[1], num_samples=[1000]))
        acc[b] = json.loads((tmp_path / b / "eval" / "val.json").read_text())["summary"]["1000"]["1"]
    assert acc["oracle"] > acc["image-sim"] > acc["random"] + 1 and acc["oracle"] > acc["text-sim"] > acc["random"] + 1
    zs = baselines["zero-shot"]
    assert all(r["icds"] == [] for r in zs["results"]) and len(set(zs["summary"]["150"].values())) == 1


def test_similarity_baseline_puts_most_similar_last(baselines, small_data):
    ds = load_dataset(small_data)
    r = next(x for x in baselines["image-sim"]["results"] if x["shot"] == 4)
    q = ds.emb["val_image"][r["row"]]
    sims = [float(q @ ds.emb["train_image"][i]) for i in r["icds"]]
    assert sims == sorted(sims)  # ascending: the most similar is next to the query


def test_rivals_reduce_to_rices_and_text_similarity_at_their_limits(baselines, small_data, tmp_path):
    """MMR at lambda 1 picks (and orders) what RICES picks; MMICES with a prefilter as large as the pool picks what
    text similarity picks; each records its setting, and a file made with another setting is kept, not overwritten."""
    ds = load_dataset(small_data)
    run_eval(data=small_data, baseline="mmr", mmr_lambda=1.0, out=tmp_path / "mmr")
    run_eval(data=small_data, baseline="mmices", prefilter=ds.eval_pools.shape[1], out=tmp_path / "mmices")
    mmr, mmices = (json.loads((tmp_path / b / "eval" / "val.json").read_text()) for b in ("mmr", "mmices"))
    assert [r["icds"] for r in mmr["results"]] == [r["icds"] for r in baselines["image-sim"]["results"]]
    assert [r["icds"] for r in mmices["results"]] == [r["icds"] for r in baselines["text-sim"]["results"]]
    assert mmr["baseline_settings"] == {"lambda": 1.0} and mmices["order"] == "reversed"
    other = r"^\S+val\.json was made from other inputs: --baseline-settings \{'lambda': 1\.0\} there, [^\n]*$"
    with pytest.raises(ValueError, match=other):
        run_eval(data=small_data, baseline="mmr", mmr_lambda=0.5, out=tmp_path / "mmr")


def test_coreset_and_mmr_diversify_within_the_pool(small_data, tmp_path):
    """The diversity baselines pick distinct demonstrations of the question's own pool, the most relevant next to the
    question, and at a lambda below 1 MMR departs from RICES somewhere."""
    ds = load_dataset(small_data)
    for b in ("coreset", "mmr"):
        run_eval(data=small_data, baseline=b, out=tmp_path / b)
    coreset, mmr = (json.loads((tmp_path / b / "eval" / "val.json").read_text()) for b in ("coreset", "mmr"))
    for r in coreset["results"]:
        assert len(set(r["icds"])) == r["shot"] and set(r["icds"]) <= set(ds.eval_pools[r["row"]].tolist())
        q = ds.emb["val"][r["row"]]
        sims = [float(q @ ds.emb["train"][i]) for i in r["icds"]]
        assert sims == sorted(sims)  # ascending: the most similar is next to the query
    rices = pools.pool_ranking(ds.emb["val_image"], ds.emb["train_image"], ds.eval_pools)
    four = [r["icds"][::-1] for r in mmr["results"] if r["shot"] == 4]
    assert any(f != ds.eval_pools[i].gather(0, rices[i, :4]).tolist() for i, f in enumerate(four))


def test_selector_run_orders_epochs_and_train_split(small_data, tmp_path):
    run = tmp_path / "rce"
    rce.main(rce.Args(data=small_data, out=run, epochs=2, batch_size=8, val_frac=0.25))
    run_eval(data=small_data, runs=[run], epochs=[1, 2])
    best = json.loads((run / "eval" / "val.json").read_text())
    for e in (1, 2):
        assert (run / "eval" / f"val-epoch{e:03d}.json").is_file()
    # a fresh selector's first pick sits next to the query: the k-shot prompt is its first k picks reversed
    assert json.loads((run / "model.json").read_text())["pick_order"] == "nearest_first"
    assert best["order"] == "reversed"
    picks = {s: [r["icds"][::-1] for r in best["results"] if r["shot"] == s] for s in (1, 2, 3, 4)}
    assert all(b[: len(a)] == a for a, b in zip(picks[2], picks[4]))  # k-shot = first k of the greedy picks
    rev = tmp_path / "rev"
    rev.mkdir()
    for f in ("model.safetensors", "model.json"):
        (rev / f).write_bytes((run / f).read_bytes())
    run_eval(data=small_data, runs=[rev], order="selected")
    flipped = json.loads((rev / "eval" / "val.json").read_text())
    assert [r["icds"] for r in flipped["results"]] == [r["icds"][::-1] for r in best["results"]]
    evaluate.main(evaluate.Args(data=small_data, runs=[run], split="train", num_samples=[20]))
    train = json.loads((run / "eval" / "train.json").read_text())
    ds = load_dataset(small_data)
    queries = ds.groups.queries[:20].tolist()
    assert [r["row"] for r in train["results"][::4]] == queries
    assert all(r["row"] not in r["icds"] for r in train["results"])


def interrupted_eval(monkeypatch, data, out, batch_size, run=False):
    """A random-baseline evaluation into `out` (with `run`: an evaluation of the run folder `out`) killed while
    scoring its second chunk; returns its progress file."""
    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        die_after_first_chunk(m, "evaluate.py", calls=4)  # 4 shots a chunk: the second chunk dies
        run_eval(data=data, batch_size=batch_size, **(dict(runs=[out]) if run else dict(baseline="random", out=out)))
    [partial] = (out / "eval").glob("*.partial.jsonl")
    return partial


def test_random_seeds_average_and_resume(small_data, tmp_path, monkeypatch):
    run_eval(data=small_data, baseline="random", out=tmp_path / "r", seeds=2)
    doc = json.loads((tmp_path / "r" / "eval" / "val.json").read_text())
    assert doc["made_from"]["data"] == data.data_digest(small_data)  # what compare.py pairs runs on
    singles = []
    for seed in (0, 1):
        run_eval(data=small_data, baseline="random", out=tmp_path / f"s{seed}", seed=seed)
        singles.append(json.loads((tmp_path / f"s{seed}" / "eval" / "val.json").read_text())["results"])
    for r, a, b in zip(doc["results"], *singles):
        assert r["score"] == pytest.approx((a["score"] + b["score"]) / 2, abs=1e-6)
        # every seed's own picks, answer and score; no single prediction beside the mean score
        assert "icds" not in r and "prediction" not in r
        assert r["per_seed"] == [
            {"seed": sd, **{k: x[k] for k in ("icds", "prediction", "score")}} for sd, x in ((0, a), (1, b))
        ]
    # an interrupted evaluation: killed while scoring its second chunk, with half a line written; the re-run
    # scores only what is missing and writes the same file
    target = tmp_path / "s0" / "eval" / "val.json"
    before = target.read_bytes()
    target.unlink()
    partial = interrupted_eval(monkeypatch, small_data, tmp_path / "s0", 60)
    assert len(partial.read_text().splitlines()) == 61  # header + the first chunk's 60 questions
    partial.write_text(partial.read_text() + '{"i": 60, "sh')
    run_eval(data=small_data, baseline="random", out=tmp_path / "s0", batch_size=60)
    assert target.read_bytes() == before and not partial.exists()


@pytest.mark.parametrize(
    "kw, pattern",
    [
        (dict(), r"--baseline\b"),
        (dict(baseline="random", runs=["x"]), r"--baseline\b"),
        (dict(runs=["nowhere"]), r"^nowhere\b.*\bmodel\.safetensors\b"),
        (dict(baseline="random", num_samples=[100000]), r"--num-samples 100000\b.*\b150\b"),
    ],
)
def test_bad_input(small_data, kw, pattern):
    kw = {**kw, "runs": [Path(r) for r in kw.get("runs", [])]}
    with pytest.raises(ValueError, match=pattern):
        evaluate.main(evaluate.Args(data=small_data, **kw))


def test_says_which_epoch_it_evaluates_and_never_overwrites_other_settings(small_data, tmp_path, capsys):
    run = tmp_path / "rce"
    rce.main(rce.Args(data=small_data, out=run, epochs=2, batch_size=8, val_frac=0.25))
    capsys.readouterr()
    run_eval(data=small_data, runs=[run])
    best = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["best_epoch"]
    said = rf"^{re.escape(str(run))}: .*\bmodel\.safetensors\b.*\bepoch {best}\b"  # the run and the epoch it holds
    assert re.search(said + r".*\bfinished$", capsys.readouterr().out, re.M)
    before = (run / "eval" / "val.json").read_bytes()
    with pytest.raises(ValueError, match=r"eval/val\.json\b.*\bshots\b.*\[1, 2, 3, 4\].*\[1, 2\]"):
        run_eval(data=small_data, runs=[run], shots=[1, 2])
    assert (run / "eval" / "val.json").read_bytes() == before
    run_eval(data=small_data, runs=[run])  # the same settings again: allowed, same file
    assert (run / "eval" / "val.json").read_bytes() == before
    # an interrupted run (its metrics end before the planned epochs) is evaluated, and said to be unfinished
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join(lines[:2]))
    (run / "eval" / "val.json").unlink()
    run_eval(data=small_data, runs=[run])
    assert re.search(rf"^{re.escape(str(run))}: .*\bUNFINISHED\b.*\b1 of 2 epochs$", capsys.readouterr().out, re.M)


@pytest.fixture(scope="module")
def run(small_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "rce"
    rce.main(rce.Args(data=small_data, out=out, epochs=1, batch_size=8, val_frac=0.25))
    return out


def copy_run(run, to):
    shutil.copytree(run, to, ignore=shutil.ignore_patterns("eval"))
    return to


def test_shots_beyond_the_selector_or_the_pools_are_refused_up_front(small_data, run, tmp_path):
    for shots in ([9], [1, 5]):
        with pytest.raises(ValueError, match=rf"--shots {max(shots)}\b.*\b4\b.*model\.json\b.*'picks'"):
            run_eval(data=small_data, runs=[run], shots=shots)
    run_eval(data=small_data, runs=[copy_run(run, tmp_path / "r")], shots=[1, 2])  # a file with other settings
    with pytest.raises(ValueError, match=r"--shots 5\b.*\b4\b.*model\.json\b.*'picks'"):
        run_eval(data=small_data, runs=[tmp_path / "r"], shots=[1, 5])
    # the count is the selector's own (model.json), not the dataset's
    two = copy_run(run, tmp_path / "two")
    config = json.loads((two / "model.json").read_text())
    (two / "model.json").write_text(json.dumps(config | {"picks": 2}))
    with pytest.raises(ValueError, match=rf"--shots 3\b.*\b2\b.*{re.escape(str(two / 'model.json'))}\b.*'picks'"):
        run_eval(data=small_data, runs=[two], shots=[1, 3])
    (two / "model.json").write_text(json.dumps({k: v for k, v in config.items() if k != "picks"}))
    with pytest.raises(ValueError, match=r"two/model\.json\b.*\['picks'\]"):
        run_eval(data=small_data, runs=[two], shots=[1, 2])
    small = tmp_path / "small-pools"
    shutil.copytree(small_data, small)
    doc = json.loads((small / "eval_pools.json").read_text())
    (small / "eval_pools.json").write_text(json.dumps({**doc, "pools": [p[:3] for p in doc["pools"]]}))
    for b in ("random", "image-sim", "oracle"):
        with pytest.raises(ValueError, match=rf"--shots 4\b.*\bval\b.*{re.escape(str(small))}\b.*\b3\b"):
            run_eval(data=small, baseline=b, out=tmp_path / b)
        assert not (tmp_path / b).exists()
    run_eval(data=small, baseline="zero-shot", out=tmp_path / "zero-shot")  # needs no pool


def test_progress_left_by_other_weights_is_scored_again(small_data, run, tmp_path, monkeypatch):
    r = copy_run(run, tmp_path / "r")
    interrupted_eval(monkeypatch, small_data, r, 20, run=True)
    torch.manual_seed(1)
    other = PointerSelector(load_selector(r).cfg)  # other weights in the run (its training went on, say)
    other.made_from = load_selector(r).made_from
    other.save(r)
    run_eval(data=small_data, runs=[r], batch_size=20)
    fresh = copy_run(r, tmp_path / "fresh")
    run_eval(data=small_data, runs=[fresh], batch_size=20)
    resumed, anew = (json.loads((f / "eval" / "val.json").read_text()) for f in (r, fresh))
    assert resumed["results"] == anew["results"] and resumed["selector_digest"] == anew["selector_digest"]


def test_a_selector_of_other_embeddings_is_one_line_naming_its_model_json(small_data, tmp_path):
    d16 = PointerSelector(SelectorConfig(dim=16, hidden=32, num_heads=2))
    d16.made_from = {"task": "vqa", "encoder": "sim"}
    d16.save(tmp_path / "d16")
    with pytest.raises(ValueError, match=rf"d16/model\.json\b.*'dim'.*\b16\b.*{re.escape(str(small_data))}.*\b512\b"):
        run_eval(data=small_data, runs=[tmp_path / "d16"])
    assert not (tmp_path / "d16" / "eval").exists()
    d16.made_from = None  # a selector that does not say what it reads: refused before any work
    d16.save(tmp_path / "d16")
    with pytest.raises(ValueError, match=r"d16/model\.json does not record what it was made from"):
        run_eval(data=small_data, runs=[tmp_path / "d16"])


def test_every_run_is_checked_before_any_evaluation_is_written(small_data, run, tmp_path):
    a, b = copy_run(run, tmp_path / "a"), copy_run(run, tmp_path / "b")
    (b / "eval").mkdir()
    (b / "eval" / "val.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"/b/eval/val\.json\b.*\bJSON\b"):
        run_eval(data=small_data, runs=[a, b])
    assert not (a / "eval" / "val.json").exists() and (b / "eval" / "val.json").read_text() == "{not json"
    (b / "eval" / "val.json").write_text("[1, 2]")  # JSON, but no evaluation: kept as well
    with pytest.raises(ValueError, match=r"/b/eval/val\.json\b.*'results'"):
        run_eval(data=small_data, runs=[a, b])
    (b / "eval" / "val.json").unlink()
    (b / "model.safetensors").write_bytes(b"\0" * 10)  # a damaged selector
    with pytest.raises(ValueError, match=r"/b/model\.safetensors\b"):
        run_eval(data=small_data, runs=[a, b])
    assert not (a / "eval" / "val.json").exists()


def test_damaged_progress_and_run_files_are_one_line(small_data, run, tmp_path, monkeypatch):
    partial = interrupted_eval(monkeypatch, small_data, tmp_path / "r", 20)
    lines = partial.read_text().splitlines()
    record = json.loads(lines[3])
    record["shots"][1]["score"] = float("nan")
    partial.write_text("\n".join([*lines[:3], json.dumps(record), *lines[4:]]) + "\n")
    with pytest.raises(ValueError, match=r"val\.json\.seed0\.rank\*\.partial\.jsonl\b.*\bquestion 2\b"):
        run_eval(data=small_data, baseline="random", out=tmp_path / "r", batch_size=20)
    partial.write_text("\n".join([*lines[:3], "[]", *lines[4:]]) + "\n")
    with pytest.raises(ValueError, match=rf"{re.escape(partial.name)} line 4\b.*'i'"):
        run_eval(data=small_data, baseline="random", out=tmp_path / "r", batch_size=20)
    r = copy_run(run, tmp_path / "run")
    (r / "metrics.jsonl").write_text((r / "metrics.jsonl").read_text() + "[1]\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl line \d+\b.*'epoch'"):
        run_eval(data=small_data, runs=[r])
    (r / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text())
    config = json.loads((r / "config.json").read_text())
    (r / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "args"}))
    with pytest.raises(ValueError, match=r"config\.json\b.*'args'"):
        run_eval(data=small_data, runs=[r])


def test_shots_as_captioning_papers_report_them(small_data, tmp_path):
    """1, 2, 3, 4, 6 and 8 shots (Lever-LM's counts): a selector trained on 4-shot sequences asked for up to 8
    (rce.py --picks 8) decodes 8 and k-shot is its first k; a baseline ranks 8 as it ranks 4."""
    shots = [1, 2, 3, 4, 6, 8]
    rce.main(rce.Args(data=small_data, out=tmp_path / "rce8", epochs=1, picks=8, batch_size=8, val_frac=0.25))
    run_eval(data=small_data, runs=[tmp_path / "rce8"], shots=shots)
    run_eval(data=small_data, baseline="image-sim", out=tmp_path / "rices", shots=shots)
    for doc in (json.loads((p / "eval" / "val.json").read_text()) for p in (tmp_path / "rce8", tmp_path / "rices")):
        assert doc["shots"] == shots and set(doc["summary"]["150"]) == {str(s) for s in shots}
        by_q = {}
        for r in doc["results"]:
            by_q.setdefault(r["row"], {})[r["shot"]] = r["icds"]
        for picks in by_q.values():
            assert all(len(picks[s]) == s and picks[s] == picks[8][8 - s :] for s in shots)  # the 8 nearest last


def test_up_to_k_asks_only_the_prompts_its_exactly_k_evaluation_did_not(small_data, tmp_path, monkeypatch):
    """A selector that may stop is evaluated twice, exactly k then up to k: the second asks the LVLM only for prompts
    the first did not (where it stopped early), and every answer in it is the simulator's to that prompt."""
    rce.main(rce.Args(data=small_data, out=tmp_path / "may", epochs=1, batch_size=8, val_frac=0.25, can_stop=True))
    model = load_selector(tmp_path / "may")
    with torch.no_grad():  # a stop that fires on some questions at some steps: by the sign of its state's projection
        model.stop_weight.copy_(torch.randn(model.cfg.hidden, generator=torch.Generator().manual_seed(0)))
    model.save(tmp_path / "may")
    asked, made = [], []

    def counting(*args, **kwargs):
        backend = open_backend(*args, **kwargs)
        score, backend.score = (
            backend.score,
            lambda split, rows, icds, **kw: asked.append(len(rows)) or score(split, rows, icds, **kw),
        )
        made.append(score)
        return backend

    monkeypatch.setattr(evaluate, "open_backend", counting)
    run_eval(data=small_data, runs=[tmp_path / "may"])
    exact, upto = (
        json.loads((tmp_path / "may" / "eval" / f).read_text())["results"] for f in ("val.json", "val-upto.json")
    )
    differ = sum(a["icds"] != b["icds"] for a, b in zip(exact, upto))
    assert 0 < differ < len(upto) and all(len(r["icds"]) == r["shot"] for r in exact)
    # every exactly-k prompt once (no shot count repeats another's), then those that differ
    assert sum(asked) == len(exact) + differ
    for shot in (1, 2, 3, 4):
        rows = [r for r in upto if r["shot"] == shot]
        icds = torch.tensor([r["icds"] + [-1] * (shot - len(r["icds"])) for r in rows])
        said = made[0]("val", torch.tensor([r["row"] for r in rows]), icds, gt_prob=False)
        assert [r["prediction"] for r in rows] == said["prediction"]
        assert [r["score"] for r in rows] == [round(float(a), 6) for a in said["acc"]]
