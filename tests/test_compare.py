"""compare.py on crafted run folders whose per-question scores give known accuracies, and on a tiny simulator run."""

import hashlib
import json
import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ablate
from compare import Args, report
from icl_select.runs import KERNELS
from icl_select.stats import Bootstrap, bootstrap_ci, holm, sign_test


def write_run(folder, scores_by_shot, icds_by_shot=None, metrics=None, epoch_evals=None, ns=(2, 4)):
    """A run folder with eval/val.json built from per-question scores {shot: [score per question]}."""
    shots = sorted(scores_by_shot)
    n_q = len(scores_by_shot[shots[0]])
    results = []
    for i in range(n_q):
        for s in shots:
            icds = (icds_by_shot or {}).get(s, [[j for j in range(s)]] * n_q)[i]
            results.append(
                {
                    "question_id": 1000 + i,
                    "row": i,
                    "shot": s,
                    "icds": icds,
                    "prediction": "x",
                    "score": scores_by_shot[s][i],
                }
            )
    ns = [n for n in ns if n <= n_q]
    summary = {str(n): {str(s): 100 * sum(scores_by_shot[s][:n]) / n for s in shots} for n in ns}
    doc = {"data": "d", "backend": "sim", "simulation": True, "shots": shots, "results": results, "summary": summary}
    made_from = {"data": "d0", "task": "vqa", "lvlm": "sim:0", "encoder": "sim"}
    doc |= {"task": "vqa", "split": "val", "made_from": made_from}
    (folder / "eval").mkdir(parents=True)
    (folder / "eval" / "val.json").write_text(json.dumps(doc))
    if metrics:
        (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    for e, sc in (epoch_evals or {}).items():
        sub = folder / f"tmp{e}"
        write_run(sub, sc)
        (sub / "eval" / "val.json").rename(folder / "eval" / f"val-epoch{e:03d}.json")
    return folder


def cells(text, header_start):
    """Rows (as lists of cells) of the first Markdown table after the line starting with header_start."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(header_start))
    rows = []
    for ln in lines[start + 2 :]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip("|").split("|")])
    return rows


def glance(text):
    """The glance table as {run name (marks stripped): [what, accuracy cells...]} (its LVLM-calls column left out)."""
    return {r[0].replace("**", "").split(" (")[0]: [r[1], *r[3:]] for r in cells(text, "| run | what")}


def apart(text):
    """The runs named apart from the reference: {run: why not paired}."""
    return {r[0]: r[3] for r in cells(text, "| run | what | avg | why not paired")}


def reference(text):
    [name] = [r[0] for r in cells(text, "| run | what") if r[0].endswith(" (reference)")]
    return name.removesuffix(" (reference)").replace("**", "").removesuffix(" (best)")


def test_glance_and_paired_deltas_by_hand(tmp_path):
    base = write_run(tmp_path / "base", {1: [1, 0, 0, 1], 2: [0, 0, 1, 1]})
    new = write_run(
        tmp_path / "new",
        {1: [1, 1, 0.6, 1], 2: [0, 0, 1, 0.3]},
        icds_by_shot={1: [[0], [5], [0], [0]], 2: [[0, 1]] * 4},
    )
    text = report(Args(runs=[base, new], bootstrap=2000))
    assert text.index("## At a glance") < text.index("## Paired deltas")
    # base at n=4: 50, 50 (avg 50); new: 90, 32.5 (avg 61.25), the best run
    rows = {r[0]: r[3:] for r in cells(text, "| run | what")}
    assert rows["base (reference)"] == ["50.00", "50.00", "50.00"]
    assert rows["**new** (best)"] == ["90.00 (+40.00)", "32.50 (-17.50)", "**61.25 (+11.25)**"]
    # 4 questions: no cell is distinguishable from noise, however large the delta looks
    [row] = cells(text, "| run | minus")
    assert row[:2] == ["new", "base"] and row[2].startswith("+40.00 [") and row[2].endswith("p=0.5")
    assert row[3].startswith("-17.50 [") and row[4].startswith("+11.25 [") and "*" not in "".join(row)
    assert cells(text, "| run | n = 2") == [["base", "25.00", "50.00"], ["new", "50.00", "61.25"]]
    # the rule is stated once, not per pair or per table
    assert text.count("Holm's correction") == 1


def test_significant_cells_are_starred_and_other_questions_refused(tmp_path):
    base = write_run(tmp_path / "base", {1: [0] * 40, 2: [0.3] * 40}, ns=(20, 40))
    new = write_run(tmp_path / "new", {1: [1] * 20 + [0] * 20, 2: [0.3] * 40}, ns=(20, 40))
    text = report(Args(runs=[base, new], bootstrap=2000))
    assert glance(text)["new"][1:] == ["50.00 (+50.00*)", "30.00 (+0.00)", "**40.00 (+25.00*)**"]
    [row] = cells(text, "| run | minus")
    assert row[2].startswith("+50.00* [") and row[3].startswith("+0.00 [") and row[4].startswith("+25.00* [")
    assert "over the pair's 3 cells (each shot and the average)" in text
    # 2 questions, both better: the bootstrap CI excludes 0, but no test on 2 questions can be sure (p = 0.5)
    tiny = [write_run(tmp_path / f"t{i}", {1: [i, i]}, ns=(2,)) for i in (0, 1)]
    assert glance(report(Args(runs=tiny, bootstrap=500)))["t1"][1:] == ["100.00 (+100.00)", "**100.00 (+100.00)**"]
    other = write_run(tmp_path / "other", {1: [1] * 40, 2: [1] * 40})
    doc = json.loads((other / "eval" / "val.json").read_text())
    for r in doc["results"]:
        r["question_id"] += 1
    (other / "eval" / "val.json").write_text(json.dumps(doc))
    assert apart(report(Args(runs=[base, other])))["other"].startswith("different questions")
    # the same question ids from dataset folders with other content (other pools): not paired either
    retag(base, data="aaaa")
    retag(new, data="bbbb")
    assert apart(report(Args(runs=[base, new])))["new"] == "made from other inputs: the dataset aaaa there, bbbb now"


def retag(run, **fields):
    """Set fields of a run's evaluation; data, task and lvlm set what it is made from (task: the file's too)."""
    doc = json.loads((run / "eval" / "val.json").read_text())
    made = {k: fields.pop(k) for k in ("data", "task", "lvlm") if k in fields}
    doc["made_from"] |= made
    doc |= {"task": made["task"]} if "task" in made else {}
    (run / "eval" / "val.json").write_text(json.dumps(doc | fields))
    return run


def test_runs_it_cannot_pair_are_never_judged_nor_crowned(tmp_path):
    """Runs of two dataset folders (or of two tasks, or another LVLM's weights) in one report: only those paired with
    the reference are in the glance table, the verdict and the tables below; the best of the others is named apart,
    never crowned (a run of another folder was once 'best' and 'beat no baseline and not' baselines it never met)."""
    metrics = [{"phase": "rce", "epoch": 1, "val/acc": 50.0, "best_epoch": 1}]
    n = 40
    v0 = retag(write_run(tmp_path / "v0-rce", {1: [0.3] * n, 2: [0.3] * n}, metrics=metrics), data="aaaa")
    zero = retag(write_run(tmp_path / "v0-zero", {1: [0.2] * n, 2: [0.2] * n}), data="aaaa")
    retag(zero, baseline="zero-shot")
    grpo_metrics = [{"phase": "grpo", "epoch": 1, "val/acc": 50.0, "best_epoch": 1}]
    h0 = retag(write_run(tmp_path / "h0-on", {1: [1.0] * n, 2: [1.0] * n}, metrics=grpo_metrics), data="bbbb")
    cap = retag(write_run(tmp_path / "c0-on", {1: [1.0] * n, 2: [1.0] * n}), data="aaaa", task="caption")
    lvlm = write_run(tmp_path / "l0-on", {1: [1.0] * n, 2: [1.0] * n}, metrics=grpo_metrics)
    retag(lvlm, data="aaaa", lvlm="tiny@sha256:0123456789abcdef")
    text = report(Args(runs=[v0, zero, h0, cap, lvlm], bootstrap=200))
    assert set(glance(text)) == {"v0-rce", "v0-zero"}
    judged = text[: text.index("## Trained runs")]  # the verdict and the glance table
    for name in ("h0-on", "c0-on", "l0-on"):  # named once there, with why, and nowhere judged
        assert judged.count(name) == 1
    assert apart(text) == {
        "h0-on": "made from other inputs: the dataset aaaa there, bbbb now",
        "c0-on": "made from other inputs: the task vqa there, caption now",
        "l0-on": "made from other inputs: the LVLM sim:0 there, tiny@sha256:0123456789abcdef now",
    }
    assert "**v0-rce** (best)" in text and "(best)" not in text.replace("**v0-rce** (best)", "")
    judged_below = text.split("## Paired deltas")[1].split("## Made from")[0]  # the last section lists every file
    assert not any(a in judged_below for a in ("h0-on", "c0-on"))
    # the reference comes from the runs most of them pair with, not from an RCE run of another folder standing alone
    h_zero = retag(write_run(tmp_path / "h0-zero", {1: [0.5] * n, 2: [0.5] * n}), data="bbbb", baseline="zero-shot")
    h_random = retag(write_run(tmp_path / "h0-random", {1: [0.4] * n, 2: [0.4] * n}), data="bbbb")
    retag(h_random, baseline="random")
    text = report(Args(runs=[v0, h0, h_zero, h_random], bootstrap=200))
    assert reference(text) == "h0-random" and set(glance(text)) == {"h0-on", "h0-zero", "h0-random"}


def test_glance_deltas_are_the_paired_deltas_of_unrounded_accuracies(tmp_path):
    """42.5 -> 40.625: the difference of the two accuracies rounds to -1.88, the mean of the per-question differences
    (the number the CI is about) to -1.87; every table shows the one delta, from unrounded scores."""
    a = [0.6, 0.6, 0, 0.3, 1, 0, 0.6, 0.3, 0, 0.3, 0.6, 0.6, 1, 0.3, 0.6, 0]
    b = [0.3, 0.6, 0, 0.3, 0, 0.3, 0.3, 0.6, 0.6, 0.3, 0.3, 0.3, 0, 0.6, 1, 1]
    runs = [write_run(tmp_path / name, {1: sc}, ns=(16,)) for name, sc in (("a", a), ("b", b))]
    text = report(Args(runs=runs, bootstrap=200))
    [row] = cells(text, "| run | minus")
    assert glance(text)["b"][1] == "40.62 (-1.87)" and row[2].startswith("-1.87 [")


def test_trained_runs_are_compared_with_each_other_and_the_best_is_no_ceiling(tmp_path):
    rce = write_run(tmp_path / "rce", {1: [0] * 30}, metrics=[{"phase": "rce", "epoch": 0}], ns=(30,))
    offline = write_run(tmp_path / "off", {1: [1] * 10 + [0] * 20}, metrics=[{"phase": "grpo", "epoch": 0}], ns=(30,))
    online = write_run(tmp_path / "on", {1: [1] * 25 + [0] * 5}, metrics=[{"phase": "grpo", "epoch": 0}], ns=(30,))
    oracle = write_run(tmp_path / "oracle", {1: [1] * 30}, ns=(30,))
    doc = json.loads((oracle / "eval" / "val.json").read_text())
    (oracle / "eval" / "val.json").write_text(json.dumps(doc | {"baseline": "oracle"}))
    (online / "config.json").write_text(json.dumps({"args": {"online": True}}))
    (offline / "config.json").write_text(json.dumps({"args": {"online": False}}))
    text = report(Args(runs=[oracle, rce, offline, online], bootstrap=500))
    pairs = {(r[0], r[1]): r[2] for r in cells(text, "| run | minus")}
    assert set(pairs) == {("oracle", "rce"), ("off", "rce"), ("on", "rce"), ("on", "off")}
    assert pairs["on", "off"].startswith("+50.00* [")  # online against offline directly
    rows = {r[0]: r[1] for r in cells(text, "| run | what")}
    assert rows["**on** (best)"] == "GRPO online, 0 epochs" and rows["off"] == "GRPO offline, 0 epochs"
    assert rows["oracle"] == "simulator ceiling"
    (online / "config.json").unlink()  # without its flags, a run is not said to be offline (or online)
    rows = {r[0]: r[1] for r in cells(report(Args(runs=[rce, offline, online], bootstrap=50)), "| run | what")}
    assert rows["**on** (best)"] == "GRPO (flags unknown: no config.json), 0 epochs"


@given(st.lists(st.sampled_from([-1.0, -0.3, 0.0, 0.3, 0.6, 1.0]), min_size=1, max_size=60), st.integers(0, 2**31))
def test_statistics_properties(diffs, seed):
    d = np.array(diffs)
    lo, hi = bootstrap_ci(d, 500, np.random.default_rng(seed))
    assert d.min() - 1e-12 <= lo <= hi <= d.max() + 1e-12
    p = sign_test(d)
    assert 0 < p <= 1
    assert math.isclose(p, sign_test(-d))  # symmetric
    pos, neg = int((d > 0).sum()), int((d < 0).sum())
    if pos + neg and pos == neg:
        assert p == 1.0


def test_sign_test_by_hand():
    assert math.isclose(sign_test(np.array([1.0] * 5)), 2 / 32)
    assert math.isclose(sign_test(np.array([1.0] * 9 + [-1.0])), 2 * 11 / 1024)


def test_share_of_the_gap_to_the_simulator_ceilings_by_hand(tmp_path):
    """RCE 25%, a run 50%, oracle 75%, observable 50% (mean over shots): the run takes 50% of the gap to the
    oracle and all of it to the observable ceiling; a baseline below RCE gets no row (a share of a gap it is
    under says nothing)."""
    rce = write_run(tmp_path / "rce", {1: [1, 0, 0, 0], 2: [1, 0, 0, 0]}, metrics=[{"phase": "rce", "epoch": 0}])
    run = write_run(tmp_path / "grpo", {1: [1, 1, 0, 0], 2: [1, 1, 0, 0]}, metrics=[{"phase": "grpo", "epoch": 0}])
    zero = write_run(tmp_path / "zero", {1: [0, 0, 0, 0], 2: [0, 0, 0, 0]})
    paths = [zero, rce, run]
    for name, row in (("oracle", [1, 1, 1, 0]), ("observable", [1, 1, 0, 0])):
        write_run(tmp_path / name, {1: row, 2: row})
        doc = json.loads((tmp_path / name / "eval" / "val.json").read_text())
        (tmp_path / name / "eval" / "val.json").write_text(json.dumps({**doc, "baseline": name}))
        paths.append(tmp_path / name)
    text = report(Args(runs=paths, bootstrap=200))
    [row] = cells(text, "| run | share of the gap rce -> oracle (75.00)")
    assert row[0] == "grpo" and row[1].startswith("50% [") and row[2].startswith("100% [")
    assert "Share of the gap" not in report(Args(runs=paths[2:], bootstrap=200))  # no RCE run: no gap to measure


@given(st.integers(0, 2**32 - 1), st.integers(2, 40))
def test_gap_share_is_the_ratio_of_mean_gaps_and_bounded_by_its_ends(seed, n):
    rng = np.random.default_rng(seed)
    a, b, top = rng.random((3, 1, n))
    top = top + 2.0  # the ceiling is above both runs on every question: gap > 0
    share, lo, hi = Bootstrap(300, rng).share([(a, b, top)])
    assert share == pytest.approx((b.mean() - a.mean()) / (top.mean() - a.mean()))
    assert lo <= share + 1e-12 and share <= hi + 1e-12
    assert Bootstrap(50, rng).share([(a, a, top)])[0] == 0.0
    assert Bootstrap(50, rng).share([(a, top, top)])[0] == pytest.approx(1.0)


@given(st.integers(0, 2**32 - 1))
def test_a_gap_share_over_trainings_that_differ_is_wider_than_over_their_mean(seed):
    """Two trainings of b, one a tenth of the gap above their mean and one below: the same share, and a CI that holds
    their spread (once the share's CI resampled questions alone, from one training a run)."""
    rng = np.random.default_rng(seed)
    a, top = rng.random((1, 200)), rng.random((1, 200)) + 2.0
    mean = a + 0.5 * (top - a)  # (1, Q) half the gap
    b = np.concatenate([mean + 0.1 * (top - a), mean - 0.1 * (top - a)])  # (2, Q)
    one, two = (Bootstrap(400, np.random.default_rng(seed)).share([(a, x, top)]) for x in (mean, b))
    assert one[0] == pytest.approx(two[0]) == pytest.approx(0.5)
    assert two[2] - two[1] > one[2] - one[1] + 0.1


def test_ablate_orders_references_first_and_tables_pool_seeds_by_hand(tmp_path):
    assert ablate.order(["online, picks in prompt order"]) == [
        "rce",
        "rce, picks in prompt order",
        "online, no replay",
        "online, picks in prompt order",
    ]
    # per seed (4 questions, shots 1-2): rce 25%, online 50%, the variant without items 25% or 50%, oracle 75%, ...
    rows = {"rce": [1, 0, 0, 0], "online": [1, 1, 0, 0], "image-sim": [0, 0, 0, 0], "oracle": [1, 1, 1, 0]}
    rows |= {"observable": [1, 1, 0, 0]}
    for seed, variant in ((0, [1, 0, 0, 0]), (1, [1, 1, 0, 0])):
        for name, row in {**rows, "online, no item bias": variant}.items():
            calls = [{"epoch": 1, "lvlm/calls": 35_000}]
            write_run(tmp_path / "copy" / f"seed{seed}" / ablate.slug(name), {1: row, 2: row}, metrics=calls)
    args = ablate.Args(seeds=[0, 1], worlds=["copy"], out=tmp_path, bootstrap=200, trainings=1)
    text = ablate.tables(args, "copy")
    acc = {r[0]: r[1:] for r in cells(text, "| run |")}
    assert acc["online"] == ["50.00", "50.00"] and acc["online, no item bias"] == ["25.00", "50.00"]
    [row] = cells(text, "| variant |")
    assert row[:2] == ["online, no item bias", "online"]
    assert row[2].startswith("-25.00 [") and row[3] == "+0.00 [+0.00, +0.00]" and row[4].startswith("-12.50 [")
    targets = cells(text, "| seed |")
    assert [r[0] for r in targets] == ["0", "1"]
    assert all(r[1].startswith("+25.00 [") and r[2].startswith("50% [") and r[3].startswith("100% [") for r in targets)
    [world] = cells(ablate.worlds_table(args), "| world |")
    got = dict(zip(["world", *ablate.WORLD_RUNS, "observable", "oracle", "gap rce->oracle", "share: online"], world))
    assert got["world"] == "copy" and got["zero-shot"] == "-" and got["rce"] == "25.00" and got["oracle"] == "75.00"
    assert got["gap rce->oracle"] == "50.00" and got["share: online"].startswith("50% [")


def test_ablate_budget_table_pools_shares_over_seeds_and_averages_the_calls(tmp_path):
    # 4 questions, one shot: rce 1 right, oracle 3; offline 2 on both seeds; the 5k run 2 on seed 0 and 3 on seed 1
    rows = {"rce": [1, 0, 0, 0], "oracle": [1, 1, 1, 0], "offline": [1, 1, 0, 0]}
    spent = {"rce": 0, "oracle": 0, "offline": 1_000, "online, budget 5k": 5_000}
    args = ablate.Args(seeds=[0, 1], worlds=["order"], out=tmp_path, bootstrap=200, trainings=1)
    for seed, five in ((0, [1, 1, 0, 0]), (1, [1, 1, 1, 0])):
        for name, row in {**rows, "online, budget 5k": five}.items():
            if name == "online, budget 5k" and seed == 0:  # the worlds table has every budget so far: no table
                assert ablate.budget_table(args) == ""
            calls = [{"epoch": 1, "lvlm/calls": spent[name] - 200 * seed}]
            write_run(tmp_path / "order" / f"seed{seed}" / ablate.slug(name), {1: row}, metrics=calls)
    [row] = cells(ablate.budget_table(args), "| world |")
    assert row[0] == "order" and len(row) == 3  # offline and 5k ran; no other budget
    assert row[1].startswith("50% [") and row[1].endswith("(0.9k)")  # (1 - 0.5) / 2 extra right of 4; (1000 + 800) / 2
    assert row[2].startswith("75% [") and row[2].endswith("(4.9k)")  # (2 + 1) / 4 pooled


def test_ablate_figures_are_the_same_whichever_other_runs_are_in_the_table(tmp_path):
    """Each CI draws from a generator seeded by what it measures: a figure reproduces by any command that prints it."""
    g = np.random.default_rng(0)
    p = {"image-sim": 0.2, "rce": 0.3, "online": 0.6, "online, no item bias": 0.5, "oracle": 1.0}
    rows = {n: (g.random(40) < q).astype(float).tolist() for n, q in p.items()}
    calls = [{"epoch": 1, "lvlm/calls": 1}]
    for name, row in rows.items():
        write_run(tmp_path / "additive" / "seed0" / ablate.slug(name), {1: row}, metrics=calls, ns=(40,))
    args = ablate.Args(seeds=[0], worlds=["additive"], out=tmp_path, bootstrap=200, trainings=1)
    before = ablate.tables(args, "additive")
    # a variant listed before "online, no item bias" now has a run too: its own CI is drawn first
    lever_plus = tmp_path / "additive" / "seed0" / ablate.slug("rce, all groups (Lever-Plus)")
    write_run(lever_plus, {1: rows["online"]}, ns=(40,))
    after = ablate.tables(args, "additive")
    items = [r for r in cells(after, "| variant |") if r[0] == "online, no item bias"]
    assert items == [r for r in cells(before, "| variant |") if r[0] == "online, no item bias"] and "[" in items[0][2]
    assert len(cells(after, "| variant |")) == 2


def test_ablate_trainings_average_each_question_and_show_how_far_apart_they_are(tmp_path, monkeypatch):
    """--trainings 2: a trained run's score on a question is the mean of its two trainings (a run with one of them
    evaluated is not finished), a table gives the second minus the first, and build trains each variant twice, the
    second with training seed + 1000 from the first training of its init."""
    args = ablate.Args(seeds=[0], worlds=["copy"], out=tmp_path, bootstrap=200, trainings=2)
    root = tmp_path / "copy" / "seed0"
    first, second = [1, 1, 0, 0], [1, 1, 1, 1]  # 50%, then 100%
    write_run(root / "zero-shot", {1: [1, 0, 0, 0], 2: [1, 0, 0, 0]})
    write_run(root / "online", {1: first, 2: first})
    assert ablate.scores(args, "copy", 0, "online") is None and ablate.scores(args, "copy", 0, "zero-shot")
    write_run(root / "online--training-2", {1: second, 2: second})
    assert list(ablate.scores(args, "copy", 0, "online").values()) == [1, 1, 0.5, 0.5]
    text = ablate.tables(args, "copy")
    assert {r[0]: r[1] for r in cells(text, "| run |")} == {"zero-shot": "25.00", "online": "75.00"}
    [row] = cells(text, "| run | seed 0 | pooled over seeds | pooled, at 4 shots |")
    assert row[0] == "online: training 2 - 1" and row[1].startswith("+50.00 [") and row[3] == "-"

    (root / "data").mkdir()
    (root / "data" / "meta.json").write_text(json.dumps({"complete": True}))
    monkeypatch.setattr(ablate, "evaluated", lambda run, data: True)  # every baseline evaluated on this data
    trained = []
    monkeypatch.setattr(ablate, "train", lambda root, w, s, name, run, seed: trained.append((name, run.name, seed)))
    ablate.build(args, "copy", 0, ["rce", "online"])
    assert trained == [
        ("rce", "rce", 0),
        ("rce", "rce--training-2", 1000),
        ("online", "online", 0),
        ("online", "online--training-2", 1000),
    ]
    with pytest.raises(ValueError, match="--trainings must be at least 1"):
        ablate.main(ablate.Args(out=tmp_path, trainings=0))


def test_a_ci_that_excludes_zero_is_not_enough_when_the_sign_test_disagrees(tmp_path):
    """The failure Lever-Plus's reports hit: a few large gains and more small losses give a bootstrap CI above 0,
    while more questions got worse than better (sign test p ~ 0.1): the verdict must be n.s."""
    base = [0.0] * 30 + [0.6] * 45 + [0.0] * 725
    new = [1.0] * 30 + [0.3] * 45 + [0.0] * 725
    a, b = (write_run(tmp_path / name, {1: sc}, ns=(800,)) for name, sc in (("a", base), ("b", new)))
    text = report(Args(runs=[a, b], bootstrap=4000))
    [row] = cells(text, "| run | minus")
    m = re.fullmatch(r"\+\d+\.\d+ \[(\+\d+\.\d+), \+\d+\.\d+\] p=(\S+)", row[2])  # no star
    assert float(m.group(1)) > 0 and float(m.group(2)) > 0.05
    assert "over the pair's 2 cells" in text


@given(st.lists(st.floats(0, 1), min_size=1, max_size=30))
def test_holm_rejects_a_prefix_of_the_sorted_p_values_and_never_more_than_bonferroni_allows(ps):
    rejected = holm(ps)
    order = sorted(range(len(ps)), key=ps.__getitem__)
    k = sum(rejected)
    assert all(rejected[i] for i in order[:k]) and not any(rejected[i] for i in order[k:])
    assert all(rejected[i] for i, p in enumerate(ps) if p <= 0.05 / len(ps))  # Holm is never weaker than Bonferroni
    assert all(ps[i] <= 0.05 / (len(ps) - r) for r, i in enumerate(order[:k]))


def test_runs_glob_picks_the_rce_run_as_baseline_ignores_files_and_accepts_any_path_spelling(
    tmp_path, capsys, monkeypatch
):
    sc = {1: [1, 0, 0, 0], 2: [1, 1, 0, 0]}
    write_run(tmp_path / "baseline-image-sim", sc)  # first in glob order: must not become the baseline
    write_run(tmp_path / "rce", sc, metrics=[{"phase": "rce", "epoch": 0}])
    write_run(tmp_path / "grpo", sc, metrics=[{"phase": "grpo", "epoch": 0}])
    (tmp_path / "report.md").write_text("# an earlier report\n")
    runs = sorted(tmp_path.iterdir())
    text = report(Args(runs=runs, bootstrap=100))
    assert reference(text) == "rce" and ["grpo", "rce"] in [r[:2] for r in cells(text, "| run | minus")]
    assert "report.md" not in capsys.readouterr().err  # a file in runs/ is not a run folder to warn about
    assert report(Args(runs=[*runs, tmp_path / "rce"], bootstrap=100)) == text  # a folder named twice is read once
    (tmp_path / "seed1").mkdir()
    write_run(tmp_path / "seed1" / "rce", sc)
    with pytest.raises(ValueError, match=r"/rce\b.*/seed1/rce\b.*'rce'"):
        report(Args(runs=[*runs, tmp_path / "seed1" / "rce"]))
    monkeypatch.chdir(tmp_path)
    for spelling in ("./baseline-image-sim/", str(tmp_path / "grpo" / ".." / "baseline-image-sim")):
        assert reference(report(Args(runs=runs, baseline=spelling, bootstrap=100))) == "baseline-image-sim"


def test_unknown_split_is_rejected_on_the_command_line(monkeypatch, capsys):
    import sys

    import compare
    from icl_select.cli import run_cli

    monkeypatch.setattr(sys, "argv", ["compare.py", "--split", "test", "runs/rce"])
    with pytest.raises(SystemExit) as stop:
        run_cli(compare.main, compare.Args)
    assert stop.value.code == 2 and "test" in capsys.readouterr().err


def test_trained_runs_show_flags_that_differ_and_an_unfinished_run_is_marked_wherever_it_appears(tmp_path):
    """A GRPO run killed after epoch 8 of 30 beside a finished 10-epoch RCE run: the glance table, the trained-runs
    table and the training curves all say that it is unfinished, and which epoch its model is."""
    rce_metrics = [{"phase": "rce", "epoch": e, "val/acc": 50.0 + e, "best_epoch": e or None} for e in range(11)]
    grpo_metrics = [{"phase": "grpo", "epoch": e, "val/acc": 60.0 + e % 3, "best_epoch": 2} for e in range(9)]
    base = write_run(tmp_path / "rce", {1: [0] * 40, 2: [0.3] * 40}, metrics=rce_metrics, ns=(40,))
    new = write_run(tmp_path / "grpo", {1: [1] * 20 + [0] * 20, 2: [0.3] * 40}, metrics=grpo_metrics, ns=(40,))
    for run, args in (
        (base, {"epochs": 10, "lr": 1e-4, "temp_end": 0.5}),
        (new, {"epochs": 30, "lr": 1e-3, "epsilon": 0.2, "keep_every": 5}),
    ):
        (run / "config.json").write_text(json.dumps({"args": {**args, "out": str(run)}}))
    text = report(Args(runs=[base, new], bootstrap=500))
    assert text.index("## At a glance") < text.index("## Trained runs") < text.index("## Paired deltas")
    rows = {r[0]: r[1] for r in cells(text, "| run | what")}
    assert rows["rce (reference)"] == "RCE, 10 epochs"
    assert rows["**grpo** (best)"] == "GRPO offline, UNFINISHED: 8 of 30 epochs"
    assert "**Unfinished:** grpo trained 8 of 30 epochs; its model is epoch 2" in text
    # lr differs; each stage's own flags (temp_end, epsilon) and what is kept (keep_every) are not differences
    assert cells(text, "| run | stage") == [
        ["rce", "RCE", "10", "10", "0.0001"],
        ["grpo", "GRPO offline", "UNFINISHED: 8 of 30 epochs", "2", "0.001"],
    ]
    assert "| run | stage | epochs trained | selected epoch | lr |" in text
    curve = {r[1]: r[2:] for r in cells(text, "| metric | run")}
    # the selected epoch, not the worst one; the last epoch says the run stopped early
    assert curve["grpo"] == ["60", "62 (epoch 2)", "62 (epoch 8, UNFINISHED)", "+2"]
    assert curve["rce"] == ["50", "60 (epoch 10)", "60", "+10"]
    assert "held-out train anchors" in text and "different question set from the test questions" in text


def test_unknown_baseline_is_an_error(tmp_path):
    a = write_run(tmp_path / "a", {1: [1, 0]})
    with pytest.raises(ValueError, match="--baseline nope"):
        report(Args(runs=[a], baseline="nope"))


def test_same_icds_table_compares_trained_runs_only(tmp_path):
    """A GRPO run that kept RCE's picks on 3 of 4 questions is listed; pairs with baselines (a zero-shot run with no
    picks, a multi-seed random baseline with no single selection, retrieval baselines) are not."""
    sc, grpo_metrics = {1: [1, 0, 0, 1], 2: [0, 0, 1, 1]}, [{"phase": "grpo", "epoch": 0}]
    rce = write_run(tmp_path / "rce", sc, {1: [[0], [1], [2], [3]], 2: [[0, 1]] * 4}, [{"phase": "rce", "epoch": 0}])
    grpo = write_run(tmp_path / "grpo", sc, {1: [[0], [1], [2], [9]], 2: [[0, 1]] * 4}, grpo_metrics)
    near = write_run(tmp_path / "near", sc, {1: [[0], [1], [2], [3]], 2: [[0, 1]] * 4})
    zero = write_run(tmp_path / "zero", sc, {1: [[]] * 4, 2: [[]] * 4})
    rnd = write_run(tmp_path / "random", sc)
    doc = json.loads((rnd / "eval" / "val.json").read_text())
    for r in doc["results"]:
        r["per_seed"] = [{"seed": 0, "icds": r.pop("icds"), "prediction": r.pop("prediction"), "score": r["score"]}]
    (rnd / "eval" / "val.json").write_text(json.dumps(doc))
    text = report(Args(runs=[rce, grpo, near, zero, rnd], bootstrap=100))
    assert cells(text, "| runs | 1-shot") == [["grpo / rce", "75.0%", "100.0%"]]
    assert "## Same ICDs" not in report(Args(runs=[rce, near, zero, rnd], bootstrap=100))


def test_training_curves_leave_out_what_never_moves_and_name_the_selected_epoch(tmp_path, capsys):
    metrics = [
        {"phase": "grpo", "epoch": 0, "val/reward": 1.0, "grpo/beta": 0.1},
        {
            "phase": "grpo",
            "epoch": 1,
            "train/loss": 2.0,
            "val/reward": 1.2,
            "grpo/kl_ref": 0.1,
            "grpo/beta": 0.1,
            "grpo/adv_std": 1.0,
        },
        {"phase": "grpo", "kind": "step", "epoch": 2, "train/loss": 99.0, "grpo/beta": 5.0},
        {"phase": "grpo", "epoch": 2, "train/loss": 1.0, "val/reward": 1.1, "grpo/kl_ref": 0.3, "grpo/beta": 0.1},
        {"phase": "grpo", "epoch": 3, "train/loss": 1.0, "val/reward": 1.1, "grpo/kl_ref": 0.3, "grpo/adv_std": 0.995},
    ]
    metrics[-1]["best_epoch"] = 1
    run = write_run(tmp_path / "r", {1: [1, 0, 1, 1]}, metrics=metrics, epoch_evals={1: {1: [0, 0, 1, 1]}})
    only_train = tmp_path / "t"
    only_train.mkdir()
    (only_train / "metrics.jsonl").write_text(json.dumps({"epoch": 1, "train/loss": 3.0}) + "\n")
    junk = tmp_path / "junk"
    junk.mkdir()
    text = report(Args(runs=[run, only_train, junk]))
    assert f"{junk} " in capsys.readouterr().err  # warned about, by path
    curve = {(r[0], r[1]): r[2:] for r in cells(text, "| metric | run")}
    # beta never moves (the step record is not an epoch), the advantage std barely: both left out
    assert set(curve) == {("validation reward", "r"), ("training loss", "r"), ("KL to the reference (nats)", "r")}
    assert curve["validation reward", "r"] == ["1", "1.2 (epoch 1)", "1.1", "+0.1"]  # the selected, not the worst
    assert curve["training loss", "r"] == ["2 (epoch 1)", "2 (epoch 1)", "1", "-1"]  # no epoch-0 loss
    per_epoch = cells(text.split("## Test accuracy per epoch: r")[1], "| epoch |")
    assert per_epoch == [["epoch 1", "50.00", "50.00"], ["selected (epoch 1)", "75.00", "75.00"]]
    assert "(training only): t" in text


def test_plots_are_the_three_figures_and_leave_out_constant_series(tmp_path):
    from compare import main

    metrics = [
        {"phase": "grpo", "epoch": e, "val/acc": 50.0 + e, "grpo/kl_ref": 0.0, "best_epoch": 1} for e in range(3)
    ]
    run = write_run(tmp_path / "r", {1: [1, 0], 2: [1, 1]}, metrics=metrics)
    other = write_run(tmp_path / "s", {1: [0, 0], 2: [1, 0]})
    main(Args(runs=[other, run], plot=tmp_path / "plots", bootstrap=100))
    written = sorted(p.name for p in (tmp_path / "plots").iterdir())
    # the KL is 0 at every epoch (constant): no KL/selection figure
    assert written == ["accuracy_vs_shots.png", "val_acc_per_epoch.png"]
    assert all((tmp_path / "plots" / name).stat().st_size > 5000 for name in written)
    for e in metrics:
        e["grpo/kl_ref"] = 0.1 * e["epoch"]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    main(Args(runs=[other, run], plot=tmp_path / "plots", bootstrap=100))
    assert (tmp_path / "plots" / "kl_and_selection_per_epoch.png").is_file()


def test_a_caption_run_s_validation_is_cider_wherever_it_is_named(tmp_path, monkeypatch):
    """A captioning run validates by CIDEr-D: its curve and its figure's axis say so (they once said accuracy)."""
    import matplotlib.axes

    from compare import main

    metrics = [{"phase": "rce", "epoch": e, "val/acc": 80.0 + 10 * e, "best_epoch": 2} for e in range(3)]
    run = retag(write_run(tmp_path / "cap", {1: [1.5, 0.2], 2: [3.0, 0.4]}, metrics=metrics), task="caption")
    labels = []
    real = matplotlib.axes.Axes.set
    monkeypatch.setattr(matplotlib.axes.Axes, "set", lambda ax, **kw: (labels.append(kw.get("ylabel")), real(ax, **kw)))
    main(Args(runs=[run], plot=tmp_path / "plots", out=tmp_path / "report.md", bootstrap=100))
    curve = {r[0] for r in cells((tmp_path / "report.md").read_text(), "| metric | run")}
    assert curve == {"validation CIDEr-D x100"} and "validation CIDEr-D x100" in labels
    assert not any("accuracy" in (label or "") for label in labels)


def test_out_prints_the_glance_table_and_the_path_and_a_folder_is_refused_before_work(tmp_path, capsys):
    from compare import main

    runs = [write_run(tmp_path / name, {1: [i, 0]}) for i, name in enumerate(("a", "b"))]
    main(Args(runs=runs, out=tmp_path / "report.md", bootstrap=100))
    printed = capsys.readouterr().out
    written = (tmp_path / "report.md").read_text()
    assert printed.startswith("# Comparison") and "## At a glance" in printed and "## Paired deltas" not in printed
    assert printed.rstrip().endswith(f"Full report: {tmp_path / 'report.md'}") and "## Paired deltas" in written
    folder = tmp_path / "reports"
    folder.mkdir()
    with pytest.raises(ValueError, match=rf"--out {re.escape(str(folder))}\b"):
        main(Args(runs=[tmp_path / "missing"], out=folder))  # refused before any run is read
    with pytest.raises(ValueError, match=r"--plot .*report\.md\b"):
        main(Args(runs=runs, plot=tmp_path / "report.md"))
    with pytest.raises(ValueError, match=r"--bootstrap\b.*\b0$"):
        main(Args(runs=runs, bootstrap=0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "report.md", "reports"]  # no reports.tmp
    assert not any(folder.iterdir())


# A damaged or foreign file is one line naming the file and what it lacks; files the kit wrote are not re-validated.
MALFORMED = [
    ("metrics.jsonl", '{"epoch": 0}\n{"epoch": 1,\n{"epoch": 2}\n', "line 2"),
    ("metrics.jsonl", "[1, 2]\n", "line 1.*'epoch'"),
    ("metrics.jsonl", '{"step": 3}\n', "line 1.*'epoch'"),
    ("config.json", "{not json", "JSON"),
    ("config.json", '{"flags": {}}', "'args'"),
    ("eval/val.json", "{", "JSON"),
    ("eval/val.json", "[]", "'shots'"),
    ("eval/val.json", lambda d: d.pop("results"), "'results'"),
]


@pytest.mark.parametrize(("name", "corrupt", "message"), MALFORMED)
def test_a_malformed_run_file_is_one_line_naming_file_line_and_field(tmp_path, name, corrupt, message):
    run = write_run(tmp_path / "run", {1: [1, 0], 2: [0, 1]}, metrics=[{"epoch": 0}])
    path = run / name
    if callable(corrupt):
        doc = json.loads(path.read_text())
        corrupt(doc)
        path.write_text(json.dumps(doc))
    else:
        path.write_text(corrupt)
    with pytest.raises(ValueError, match=message) as error:
        report(Args(runs=[run], bootstrap=10))
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_a_malformed_file_ends_the_command_in_one_line(tmp_path, monkeypatch, capsys):
    import sys

    import compare
    from icl_select.cli import run_cli

    run = write_run(tmp_path / "run", {1: [1, 0]})
    (run / "eval" / "val.json").write_text(json.dumps({"shots": [1]}))  # results cut away
    monkeypatch.setattr(sys, "argv", ["compare.py", str(run), "--out", str(tmp_path / "r.md")])
    with pytest.raises(SystemExit) as stop:
        run_cli(compare.main, compare.Args)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and "val.json" in err and "'results'" in err
    assert not (tmp_path / "r.md").exists()


def test_trained_runs_table_shows_the_lvlm_calls_each_run_spent(tmp_path):
    def epochs(calls):
        return [{"phase": "grpo", "epoch": e, "step": 10 * e, "lvlm/calls": c, "best_epoch": 1} for e, c in calls]

    a = write_run(tmp_path / "budget", {1: [1, 0, 1, 0]}, metrics=epochs([(0, 320), (1, 12_000), (2, 34_836)]))
    b = write_run(
        tmp_path / "offline", {1: [1, 0, 0, 0]}, metrics=[{"phase": "grpo", "epoch": 1, "step": 5, "best_epoch": 1}]
    )
    rows = {r[0]: r for r in cells(report(Args(runs=[a, b])), "| run | stage |")}
    assert rows["budget"][4] == "34,836" and rows["offline"][4] == "-"


def test_an_evaluation_of_weights_the_run_no_longer_holds_is_stale_and_says_how_to_refresh_it(small_data, tmp_path):
    import evaluate
    import grpo
    import rce

    fast = dict(batch_size=8, val_frac=0.25)
    rce.main(rce.Args(data=small_data, out=tmp_path / "rce", epochs=1, **fast))
    run = tmp_path / "grpo"
    grpo.main(grpo.Args(data=small_data, init=tmp_path / "rce", out=run, epochs=1, **fast))
    evaluate.main(evaluate.Args(data=small_data, runs=[run], num_samples=[50], epochs=[1]))
    doc = json.loads((run / "eval" / "val.json").read_text())
    files = "".join(hashlib.sha256((run / n).read_bytes()).hexdigest() for n in ("model.safetensors", "model.json"))
    assert doc["selector_epoch"] == 1 and doc["selector_digest"] == hashlib.sha256(files.encode()).hexdigest()
    assert "STALE" not in report(Args(runs=[run], bootstrap=100))

    grpo.main(grpo.Args(data=small_data, init=tmp_path / "rce", out=run, epochs=2, **fast))  # training goes on
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["best_epoch"] == 2  # a better epoch
    text = report(Args(runs=[run], bootstrap=100))
    assert glance(text)["grpo"][0] == "GRPO offline, 2 epochs, STALE evaluation"
    assert cells(text, "| run | stage")[0][3] == "2 (evaluated: epoch 1, STALE)"
    refresh = f"python evaluate.py {run} --data {small_data} --shots 1 2 3 4 --num-samples 50"
    assert re.search(rf"\*\*Stale:\*\* grpo's evaluation is of epoch 1, .*now epoch 2.*`{re.escape(refresh)}`", text)
    assert [r[0] for r in cells(text, "| epoch |")] == ["epoch 1", "evaluated (epoch 1, STALE)"]

    evaluate.main(evaluate.Args(data=small_data, runs=[run], num_samples=[50]))  # the refresh it names
    assert json.loads((run / "eval" / "val.json").read_text())["selector_epoch"] == 2
    assert "STALE" not in report(Args(runs=[run], bootstrap=100))


def test_training_table_numbers_read_as_numbers():
    """Counts in full (LVLM calls: 349,369, not 3.494e+05); everything else to four significant digits."""
    from compare import fmt

    assert [fmt(349369.0), fmt(349369.0, "+"), fmt(1009.0), fmt(992.0), fmt(0.01234567), fmt(-1.1714, "+")] == [
        "349,369",
        "+349,369",
        "1,009",
        "992",
        "0.01235",
        "-1.171",
    ]


def baseline_run(folder, name, scores):
    run = write_run(folder, {1: scores, 2: scores}, ns=(len(scores),))
    doc = json.loads((run / "eval" / "val.json").read_text())
    (run / "eval" / "val.json").write_text(json.dumps({**doc, "baseline": name}))
    return run


def test_the_verdict_comes_first_and_says_when_zero_shot_wins(tmp_path):
    """A world where demonstrations hurt: zero-shot answers 60 of 80 questions, the selector 40, random 20. The
    report's first section says zero-shot wins; with the orders swapped it says the selector beats every baseline."""
    rce = [{"phase": "rce", "epoch": 1, "step": 1, "best_epoch": 1}]

    def world(root, zero, sel, rand):
        runs = [
            baseline_run(root / "zero-shot", "zero-shot", zero),
            baseline_run(root / "random", "random", rand),
            write_run(root / "rce", {1: sel, 2: sel}, metrics=rce, ns=(len(sel),)),
        ]
        return report(Args(runs=runs, bootstrap=1000))

    high, mid, low = ([1.0] * k + [0.0] * (80 - k) for k in (60, 40, 20))
    text = world(tmp_path / "hurt", high, mid, low)
    first = text.split("## At a glance")[0]
    assert first.index("## Verdict") < first.index("**Zero-shot wins.**") < first.index("- rce (50.00)")
    assert "zero-shot (no demonstrations): worse, -25.00" in first and "random demonstrations: better, +25.00" in first
    text = world(tmp_path / "helps", low, high, mid)
    first = text.split("## At a glance")[0]
    assert "Zero-shot" not in first and "**rce beats every baseline** (zero-shot, random)" in first


def test_rivals_calls_and_a_selector_that_chose_how_many(tmp_path):
    """The verdict names the strongest rival (a trained retriever here, above every training-free one) and the best
    selector's paired delta against it; an up-to-k evaluation is a row of its own with the demonstrations it used, and
    the verdict says what choosing bought against its own picks filling every slot (here also the best selector that
    does, named once), or, where it never stopped, that it could and filled every slot; the glance table shows the
    LVLM calls each run cost; the reference is the RCE run, never the retriever rce.py trained."""
    n = 16
    rows = {
        "zero-shot": [1] * 8 + [0] * 8,
        "mmr": [1] * 6 + [0] * 10,
        "retriever": [1] * 9 + [0] * 7,
        "rce": [1] * 7 + [0] * 9,
        "online": [1] * 8 + [0] * 8,
    }
    epochs = [{"phase": "rce", "epoch": 0}, {"phase": "rce", "epoch": 1, "best_epoch": 1}]
    grpo_epochs = [{**e, "phase": "grpo"} for e in epochs]
    runs = {}
    for name, row in rows.items():
        metrics = {"rce": epochs, "retriever": epochs, "online": grpo_epochs}.get(name)
        runs[name] = write_run(tmp_path / name, {4: row}, metrics=metrics, ns=(n,))
    calls = {"zero-shot": 0, "mmr": 0, "retriever": 15_000, "rce": 14_600, "online": 364_000}
    for name, path in runs.items():
        doc = json.loads((path / "eval" / "val.json").read_text())
        doc |= {"lvlm_calls": calls[name], "baseline": name if name in ("zero-shot", "mmr") else None}
        (path / "eval" / "val.json").write_text(json.dumps(doc))
    for name, args in (("retriever", {"retriever": True}), ("rce", {}), ("online", {"online": True})):
        (runs[name] / "config.json").write_text(json.dumps({"args": args}))
    upto = json.loads((runs["online"] / "eval" / "val.json").read_text())  # it chose: all right, 1.5 demonstrations
    upto["results"] = [r | {"score": 1.0, "icds": r["icds"][: 1 + r["row"] % 2]} for r in upto["results"]]
    upto |= {"summary": {str(n): {"4": 100.0}}, "demonstrations": {str(n): {"4": 1.5}}}
    (runs["online"] / "eval" / "val-upto.json").write_text(json.dumps(upto))
    text = report(Args(runs=list(runs.values()), bootstrap=500))
    glance = {
        r[0].replace("**", "").split(" (")[0] + (" (up to k)" if "up to k" in r[0] else ""): r
        for r in cells(text, "| run | what")
    }
    assert glance["rce"][0] == "rce (reference)" and glance["retriever"][1].startswith("retriever")
    assert glance["online (up to k)"][1] == "GRPO online, up to k, 1 epoch, 1.50 demonstrations at 4"
    assert [glance[r][2] for r in ("zero-shot", "rce", "retriever", "online")] == ["0", "14.6k", "15k", "364k"]
    verdict = text.split("## At a glance")[0]
    assert "**Strongest rival: retriever** (56.25, built with 15k LVLM calls); online (up to k) (100.00" in verdict
    chose = "online (up to k) chose how many: 1.50 demonstrations per question at up to 4; against its own picks "
    assert chose + "filling every slot: better, +50.00" in verdict and "the best selector that fills" not in verdict
    # its own picks below rce's: the verdict names both, its own first
    exact = json.loads((runs["online"] / "eval" / "val.json").read_text())
    exact["results"] = [r | {"score": float(r["row"] % 16 < 6)} for r in exact["results"]]
    (runs["online"] / "eval" / "val.json").write_text(json.dumps(exact))
    verdict = report(Args(runs=list(runs.values()), bootstrap=500)).split("## At a glance")[0]
    assert chose + "filling every slot: better, +62.50" in verdict
    assert "; against the best selector that fills every slot, rce: better, +56.25" in verdict
    # an up-to-k evaluation with the picks of its exactly-k one: no row of its own, and the verdict says it filled them
    exact["results"] = [r | {"score": float(r["row"] % 16 < 8)} for r in exact["results"]]
    for name in ("val.json", "val-upto.json"):
        (runs["online"] / "eval" / name).write_text(json.dumps(exact))
    text = report(Args(runs=list(runs.values()), bootstrap=500))
    assert "online could stop, and gave every question 4 demonstrations at up to 4." in text and "(up to k)" not in text


def coverage(seeds: int, trainings: int, two_level: bool, rng: np.random.Generator, n: int = 60) -> float:
    """How often a 95% CI of b - a holds the recipes' true difference (1 point) over n simulated experiments, each of
    `seeds` seeds of `trainings` trainings a side on 200 questions, where a training comes out up to a few points off
    (offset ~ N(0, 1)) beside each question's noise (N(0, 3))."""
    held = 0
    for _ in range(n):
        pairs = []
        for _ in range(seeds):

            def side(mean):
                return mean + rng.normal(0, 1, (trainings, 1)) + rng.normal(0, 3, (trainings, 200))

            pairs.append((side(0.0), side(1.0)))
        if two_level:
            _, lo, hi = Bootstrap(400, rng).ci(pairs)
        else:  # the trainings averaged per question, the questions of every seed pooled and resampled
            d = np.concatenate([b.mean(0) - a.mean(0) for a, b in pairs])
            lo, hi = bootstrap_ci(d, 400, rng)
        held += lo <= 1.0 <= hi
    return held / n


@settings(max_examples=2, deadline=None)
@given(st.integers(0, 2**31))
def test_a_ci_over_trainings_then_questions_holds_a_recipe_s_difference_where_one_over_questions_does_not(seed):
    """Trainings of one recipe differ by more than its questions' noise can tell: resampling trainings (and seeds)
    before questions gives a 95% CI that holds the recipes' difference about 95% of the time; the bootstrap over
    questions alone, however many seeds it pools, holds it far less often."""
    rng = np.random.default_rng(seed)
    assert coverage(4, 2, True, rng) >= 0.85 and coverage(1, 8, True, rng) >= 0.8
    assert coverage(4, 2, False, rng) <= 0.6


def test_trainings_of_one_recipe_are_judged_together(tmp_path):
    """Two trainings of a recipe (the same inputs and flags, another --seed) are one row, judged on both: the CI
    resamples trainings, then questions, and the verdict says so; a selector of one training says its CI covers the
    questions alone."""
    n, rng = 200, np.random.default_rng(0)
    base = write_run(tmp_path / "zero", {1: [0.5] * n}, ns=(n,))
    retag(base, baseline="zero-shot")
    made = {"data": "d0", "task": "vqa", "lvlm": "sim:0", "encoder": "sim", "init": "i", "flags": {"lr": 0.001}}
    for name, shift, seed in (("a", 0.2, 0), ("a-seed1", -0.1, 1)):
        scores = list(np.clip(0.5 + shift + rng.normal(0, 0.3, n), 0, 1))
        run = write_run(tmp_path / name, {1: scores}, metrics=[{"phase": "grpo", "epoch": 0}], ns=(n,))
        made_from = made | {"flags": made["flags"] | {"seed": seed}}
        (run / "config.json").write_text(json.dumps({"args": {"seed": seed, "online": True}, "made_from": made_from}))
    text = report(Args(runs=[base, tmp_path / "a", tmp_path / "a-seed1"], bootstrap=2000))
    rows = {r[0] for r in cells(text, "| run | what")}
    assert not any("a-seed1" in r for r in rows), rows  # one row for the recipe
    assert "Judged on the trainings of one recipe" in text and "a on 2" in text
    [pair] = [r for r in cells(text, "| run | minus") if r[0] == "a"]
    one = report(Args(runs=[base, tmp_path / "a"], bootstrap=2000))
    [alone] = [r for r in cells(one, "| run | minus") if r[0] == "a"]
    width = [
        float(h) - float(lo) for lo, h in (re.findall(r"\[([-+0-9.]+), ([-+0-9.]+)\]", c[2])[0] for c in (pair, alone))
    ]
    assert width[0] > width[1]  # the trainings' spread widens it
    assert "Judged on one training: a;" in one


def test_the_judgement_writes_every_figure_from_the_runs_and_records_its_seeds(tmp_path, monkeypatch):
    """`ablate.py --judge`'s figures come from the judged runs' evaluations (both trainings of a recipe), the page it
    writes from the figures alone, and the seeds it used join the ledger; seeds outside the reserved block, or that
    tuned or judged anything before, are refused."""
    rng = np.random.default_rng(0)
    args = ablate.Args(seeds=[100, 101], worlds=["additive", "caption"], out=tmp_path, bootstrap=200)
    for world in args.worlds:
        free = ablate.CAPTION_TRAINING_FREE if world in ablate.CAPTIONING else ablate.TRAINING_FREE
        for seed in args.seeds:
            root = tmp_path / world / f"seed{seed}"
            runs = [*(ablate.slug(n) for n in ("zero-shot", *free, "oracle"))]
            runs += [f for n in ablate.JUDGED for f in ablate.folders(args, n)]
            for name in runs:
                row = list((rng.random(40) < 0.5).astype(float))
                write_run(root / name, {1: row, 2: row, 3: row, 4: row}, ns=(40,))
                doc = json.loads((root / name / "eval" / "val.json").read_text())
                (root / name / "eval" / "val.json").write_text(json.dumps(doc | {"lvlm_calls": 1000 + seed}))
                if "can-stop" in name:
                    doc = json.loads((root / name / "eval" / "val.json").read_text())
                    doc["demonstrations"] = {"800": {"4": 1.25}}
                    (root / name / "eval" / "val-upto.json").write_text(json.dumps(doc))
            for name in [f for n in ablate.JUDGED for f in ablate.folders(args, n)]:
                config = {"args": {}, "git_sha": "a" * 40, "kernels": {"env": KERNELS}}
                (root / name / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(ablate, "build", lambda *a: None)  # the runs are there
    ledger = {"reserved": [100, 199], "uses": [{"seeds": [0, 4], "did": "tuned", "what": "defaults"}]}
    ledger["uses"].append({"seeds": [95, 95], "did": "judged", "what": "one seed"})
    (tmp_path / "seeds.json").write_text(json.dumps(ledger))
    monkeypatch.setattr(ablate, "LEDGER", tmp_path / "seeds.json")
    monkeypatch.setattr(ablate, "JUDGEMENT", tmp_path / "judged.json")
    monkeypatch.setattr(ablate, "RESULTS", tmp_path / "results.md")
    ablate.judge(args)
    doc = json.loads((tmp_path / "judged.json").read_text())
    assert doc["commit"] == "a" * 40 and doc["seeds"] == [100, 101]
    figures = doc["figures"]
    mean = np.mean([per_question_mean(tmp_path / "additive" / f"seed{s}" / f) for s in (100, 101)
                    for f in ablate.folders(args, "rce")])  # fmt: skip
    assert figures["accuracy"]["additive"]["rce"] == f"{100 * mean:.2f}"  # both trainings of both seeds
    assert figures["how many"]["caption"]["35k run: demonstrations at 4"] == "1.25"
    assert figures["calls"]["additive"]["online, can stop"] == "1,100"  # seeds 100 and 101: 1,100 and 1,101 calls
    page = (tmp_path / "results.md").read_text()
    assert "seeds 100–101" in page and all(v in page for v in figures["35k run"]["additive"].values())
    assert "| 0–4 | tuned |" in page and "| 95 | judged |" in page  # the ledger's blocks, one seed as itself
    ledger_text = (tmp_path / "seeds.json").read_text()
    uses = json.loads(ledger_text)["uses"]
    assert sum(line.startswith('    {"seeds"') for line in ledger_text.splitlines()) == len(uses)  # one use a line
    assert uses[-1]["seeds"] == [100, 101] and uses[-1]["did"] == "judged" and uses[-1]["commit"] == "a" * 40
    ablate.judge(args)  # the same judgement again: allowed, written the same
    assert json.loads((tmp_path / "judged.json").read_text()) == doc
    for seeds, says in (([3], "outside the reserved block"), ([101, 102], "judged before")):
        with pytest.raises(ValueError, match=says):
            ablate.ledger_check(seeds, "b" * 40)
    unpinned = tmp_path / "additive" / "seed101" / ablate.folders(args, "lever-lm")[1] / "config.json"
    unpinned.write_text(json.dumps({"args": {}, "git_sha": "a" * 40, "kernels": {"env": {}}}))  # AVX-512, say
    with pytest.raises(ValueError, match="off run.sh's kernels"):
        ablate.judge(args)


def per_question_mean(run) -> float:
    doc = json.loads((run / "eval" / "val.json").read_text())
    return float(np.mean([r["score"] for r in doc["results"]]))
