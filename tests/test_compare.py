"""compare.py on crafted run folders whose per-question scores give known accuracies."""

import json
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import ablate
from compare import Args, bootstrap_ci, gap_share, holm, report, sign_test


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


def test_accuracy_and_delta_tables_by_hand(tmp_path):
    base = write_run(tmp_path / "base", {1: [1, 0, 0, 1], 2: [0, 0, 1, 1]})
    new = write_run(
        tmp_path / "new",
        {1: [1, 1, 0.6, 1], 2: [0, 0, 1, 0.3]},
        icds_by_shot={1: [[0], [5], [0], [0]], 2: [[0, 1]] * 4},
    )
    text = report(Args(runs=[base, new], bootstrap=2000))
    # base: n=2 -> shot1 50, shot2 0; n=4 -> 50, 50.  new: n=2 -> 100, 0; n=4 -> 90, 32.5
    base_rows = cells(text.split("### base")[1], "| n |")
    assert base_rows == [["2", "50.00", "0.00", "25.00"], ["4", "50.00", "50.00", "50.00"]]
    new_rows = cells(text.split("### new\n")[1], "| n |")
    assert new_rows == [["2", "100.00", "0.00", "50.00"], ["4", "90.00", "32.50", "61.25"]]
    deltas = cells(text.split("### new vs base")[1], "| n |")
    assert deltas == [["2", "+50.00", "+0.00", "+25.00"], ["4", "+40.00", "-17.50", "+11.25"]]
    # 4 questions: no cell is distinguishable from noise, however large the delta looks
    assert "Cells better / worse / within noise: 0 / 0 / 4" in text
    sig = cells(text.split("Paired significance at n = 4")[1], "| shot |")
    assert sig[0][:2] == ["1", "+40.00"] and sig[0][4] == "2 / 0" and sig[0][3] == "0.5"
    assert sig[1][:2] == ["2", "-17.50"] and sig[1][4] == "0 / 1" and sig[1][5] == "n.s."
    ident = cells(text, "| runs |")
    assert ident == [["base / new", "75.0%", "100.0%"]]


def test_significant_cells_are_starred_and_other_questions_refused(tmp_path):
    base = write_run(tmp_path / "base", {1: [0] * 40, 2: [0.3] * 40}, ns=(20, 40))
    new = write_run(tmp_path / "new", {1: [1] * 20 + [0] * 20, 2: [0.3] * 40}, ns=(20, 40))
    text = report(Args(runs=[base, new], bootstrap=2000))
    deltas = cells(text.split("### new vs base")[1], "| n |")
    assert deltas == [["20", "+100.00*", "+0.00", "+50.00"], ["40", "+50.00*", "+0.00", "+25.00"]]
    assert "over the 4 cells compared for this pair. Cells better / worse / within noise: 2 / 0 / 2" in text
    # 2 questions, both better: the bootstrap CI excludes 0, but no test on 2 questions can be sure (p = 0.5)
    tiny = [write_run(tmp_path / f"t{i}", {1: [i, i]}, ns=(2,)) for i in (0, 1)]
    assert cells(report(Args(runs=tiny, bootstrap=500)).split("### t1 vs t0")[1], "| n |") == [
        ["2", "+100.00", "+100.00"]
    ]
    other = write_run(tmp_path / "other", {1: [1] * 40, 2: [1] * 40})
    doc = json.loads((other / "eval" / "val.json").read_text())
    for r in doc["results"]:
        r["question_id"] += 1
    (other / "eval" / "val.json").write_text(json.dumps(doc))
    assert "Not compared: different questions" in report(Args(runs=[base, other]))
    # the same question ids from dataset folders with other content (other pools): not paired either
    for run, digest in ((base, "aaaa"), (new, "bbbb")):
        doc = json.loads((run / "eval" / "val.json").read_text())
        (run / "eval" / "val.json").write_text(json.dumps(doc | {"data_digest": digest}))
    assert "Not compared: different dataset content (digest aaaa vs bbbb)" in report(Args(runs=[base, new]))


def test_identical_runs_zero_delta_not_significant(tmp_path):
    sc = {1: [1, 0, 0.3, 1, 0.6], 2: [1, 1, 0, 0, 0.9]}
    a, b = write_run(tmp_path / "a", sc), write_run(tmp_path / "b", sc)
    text = report(Args(runs=[a, b]))
    deltas = cells(text.split("### b vs a")[1], "| n |")
    assert all(c == "+0.00" for row in deltas for c in row[1:])
    sig = cells(text.split("Paired significance")[1], "| shot |")
    assert all(r[5] == "n.s." and r[3] == "1" for r in sig)
    assert cells(text, "| runs |") == [["a / b", "100.0%", "100.0%"]]
    # a multi-seed random baseline stores per-seed picks only: it has no single selection to compare
    doc = json.loads((b / "eval" / "val.json").read_text())
    for r in doc["results"]:
        r["per_seed"] = [{"seed": 0, "icds": r.pop("icds"), "prediction": r.pop("prediction"), "score": r["score"]}]
    (b / "eval" / "val.json").write_text(json.dumps(doc))
    assert cells(report(Args(runs=[a, b])), "| runs |") == [["a / b", "-", "-"]]


def test_training_tables_curves_epochs_and_skips(tmp_path, capsys):
    metrics = [
        {"phase": "grpo", "epoch": 0, "val/reward": 1.0},
        {"phase": "grpo", "epoch": 1, "train/loss": 2.0, "val/reward": 1.2, "grpo/kl_ref": 0.1},
        {"phase": "grpo", "kind": "step", "epoch": 2, "train/loss": 99.0},
        {"phase": "grpo", "epoch": 2, "train/loss": 1.0, "val/reward": 1.1, "grpo/kl_ref": 0.3},
    ]
    run = write_run(tmp_path / "r", {1: [1, 0, 1, 1]}, metrics=metrics, epoch_evals={1: {1: [0, 0, 1, 1]}})
    only_train = tmp_path / "t"
    only_train.mkdir()
    (only_train / "metrics.jsonl").write_text(json.dumps({"epoch": 1, "train/loss": 3.0}) + "\n")
    junk = tmp_path / "junk"
    junk.mkdir()
    text = report(Args(runs=[run, only_train, junk]))
    assert "junk is not a run folder" in capsys.readouterr().err
    train = cells(text.split("## Training")[1], "| epoch |")
    assert train[1][:4] == ["1", "2", "1.2", "0.1"] and len(train) == 3  # the step record is not an epoch row
    curve = {(r[0], r[1]): r for r in cells(text, "| metric |")}
    assert curve[("train/loss", "r")][2:] == ["2", "1", "1.5", "-50.0%", "1 (epoch 2)"]
    assert curve[("grpo/kl_ref", "r")][5] == "+200.0%"
    per_epoch = cells(text.split("## Accuracy per epoch: r")[1], "| epoch |")
    assert per_epoch == [["1", "50.00", "50.00"], ["selected", "75.00", "75.00"]]
    assert "training tables only): t" in text


def test_plots_are_the_three_figures_and_leave_out_constant_series(tmp_path):
    from compare import main

    metrics = [{"phase": "grpo", "epoch": e, "val/acc": 50.0 + e, "grpo/kl_ref": 0.0} for e in range(3)]
    run = write_run(tmp_path / "r", {1: [1, 0], 2: [1, 1]}, metrics=metrics)
    other = write_run(tmp_path / "s", {1: [0, 0], 2: [1, 0]})
    main(Args(runs=[run, other], plot=tmp_path / "plots", out=tmp_path / "report.md", bootstrap=100))
    written = sorted(p.name for p in (tmp_path / "plots").iterdir())
    # the KL is 0 at every epoch (constant): no KL/selection figure; accuracy vs shots for both runs
    assert written == ["accuracy_vs_shots.png", "val_acc_per_epoch.png"]
    assert all((tmp_path / "plots" / name).stat().st_size > 5000 for name in written)
    assert (tmp_path / "report.md").read_text().startswith("# Comparison")


def test_unknown_baseline_is_an_error(tmp_path):
    a = write_run(tmp_path / "a", {1: [1, 0]})
    with pytest.raises(ValueError, match="--baseline nope"):
        report(Args(runs=[a], baseline="nope"))


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


def test_room_taken_against_the_simulator_ceilings_by_hand(tmp_path):
    """RCE 25%, a run 50%, oracle 75%, observable 50% (mean over shots): the run takes 50% of the room to the
    oracle and all of it to the observable ceiling."""
    rce = write_run(tmp_path / "rce", {1: [1, 0, 0, 0], 2: [1, 0, 0, 0]}, metrics=[{"phase": "rce", "epoch": 0}])
    run = write_run(tmp_path / "grpo", {1: [1, 1, 0, 0], 2: [1, 1, 0, 0]}, metrics=[{"phase": "grpo", "epoch": 0}])
    paths = [rce, run]
    for name, row in (("oracle", [1, 1, 1, 0]), ("observable", [1, 1, 0, 0])):
        write_run(tmp_path / name, {1: row, 2: row})
        doc = json.loads((tmp_path / name / "eval" / "val.json").read_text())
        (tmp_path / name / "eval" / "val.json").write_text(json.dumps({**doc, "baseline": name}))
        paths.append(tmp_path / name)
    text = report(Args(runs=paths, bootstrap=200))
    [row] = cells(text, "| run | avg acc")
    assert row[0] == "grpo" and row[1] == "50.00" and row[2].startswith("50% [") and row[3].startswith("100% [")
    assert "Room taken" not in report(Args(runs=paths[1:], bootstrap=200))  # no RCE run: no room to measure


@given(st.integers(0, 2**32 - 1), st.integers(2, 40))
def test_gap_share_is_the_ratio_of_mean_gaps_and_bounded_by_its_ends(seed, n):
    rng = np.random.default_rng(seed)
    a, b, top = ({q: float(v) for q, v in enumerate(rng.random(n))} for _ in range(3))
    top = {q: v + 2.0 for q, v in top.items()}  # the ceiling is above both runs on every question: gap > 0
    share, lo, hi = gap_share(a, b, top, 300, rng)
    mean = [np.mean(list(d.values())) for d in (a, b, top)]
    assert share == pytest.approx((mean[1] - mean[0]) / (mean[2] - mean[0]))
    assert lo <= share + 1e-12 and share <= hi + 1e-12
    assert gap_share(a, a, top, 50, rng)[0] == 0.0 and gap_share(a, top, top, 50, rng)[0] == pytest.approx(1.0)


def test_ablate_orders_references_first_and_tables_pool_seeds_by_hand(tmp_path):
    assert ablate.order(["online, picks in prompt order"]) == [
        "rce",
        "rce, picks in prompt order",
        "online",
        "online, picks in prompt order",
    ]
    # per seed (4 questions, shots 1-2): rce 25%, online 50%, beta-0.1 variant 25% or 50%, oracle 75%, ...
    rows = {"rce": [1, 0, 0, 0], "online": [1, 1, 0, 0], "image-sim": [0, 0, 0, 0], "oracle": [1, 1, 1, 0]}
    rows |= {"observable": [1, 1, 0, 0]}
    for seed, variant in ((0, [1, 0, 0, 0]), (1, [1, 1, 0, 0])):
        for name, row in {**rows, "online, beta 0.1": variant}.items():
            write_run(tmp_path / f"seed{seed}" / ablate.slug(name), {1: row, 2: row})
    text = ablate.tables(ablate.Args(seeds=[0, 1], out=tmp_path, bootstrap=200))
    acc = {r[0]: r[1:] for r in cells(text, "| run |")}
    assert acc["online"] == ["50.00", "50.00"] and acc["online, beta 0.1"] == ["25.00", "50.00"]
    [row] = cells(text, "| variant |")
    assert row[:2] == ["online, beta 0.1", "online"]
    assert row[2].startswith("-25.00 [") and row[3] == "+0.00 [+0.00, +0.00]" and row[4].startswith("-12.50 [")
    targets = cells(text, "| seed |")
    assert [r[0] for r in targets] == ["0", "1"]
    assert all(r[1].startswith("+25.00 [") and r[2].startswith("50% [") and r[3].startswith("100% [") for r in targets)


def test_a_ci_that_excludes_zero_is_not_enough_when_the_sign_test_disagrees(tmp_path):
    """The failure Lever-Plus's reports hit: a few large gains and more small losses give a bootstrap CI above 0,
    while more questions got worse than better (sign test p ~ 0.1): the verdict must be n.s."""
    base = [0.0] * 30 + [0.6] * 45 + [0.0] * 725
    new = [1.0] * 30 + [0.3] * 45 + [0.0] * 725
    a, b = (write_run(tmp_path / name, {1: sc}, ns=(800,)) for name, sc in (("a", base), ("b", new)))
    text = report(Args(runs=[a, b], bootstrap=4000))
    [row] = cells(text.split("Paired significance at n = 800")[1], "| shot |")
    lo = float(row[2].strip("[]").split(",")[0])
    assert lo > 0 and float(row[3]) > 0.05 and row[4] == "30 / 45" and row[5] == "n.s."
    assert "Holm's correction at 5% over the 1 cells" in text


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
    assert "## Deltas against rce (points)" in text and "### grpo vs rce" in text
    assert "report.md" not in capsys.readouterr().err  # a file in runs/ is not a run folder to warn about
    monkeypatch.chdir(tmp_path)
    for spelling in ("./baseline-image-sim/", str(tmp_path / "grpo" / ".." / "baseline-image-sim")):
        assert "## Deltas against baseline-image-sim" in report(Args(runs=runs, baseline=spelling, bootstrap=100))


def test_unknown_split_is_rejected_on_the_command_line(monkeypatch, capsys):
    import sys

    import compare
    from cli import run_cli

    monkeypatch.setattr(sys, "argv", ["compare.py", "--split", "test", "runs/rce"])
    with pytest.raises(SystemExit) as stop:
        run_cli(compare.main, compare.Args)
    assert stop.value.code == 2 and "test" in capsys.readouterr().err


def test_the_glance_table_comes_first_and_flags_that_differ_are_shown(tmp_path):
    base = write_run(tmp_path / "rce", {1: [0] * 40, 2: [0.3] * 40}, metrics=[{"phase": "rce", "epoch": 0}], ns=(40,))
    new = write_run(
        tmp_path / "grpo", {1: [1] * 20 + [0] * 20, 2: [0.3] * 40}, metrics=[{"phase": "grpo", "epoch": 0}], ns=(40,)
    )
    for run, args in (
        (base, {"epochs": 10, "lr": 1e-4, "temp_end": 0.5}),
        (new, {"epochs": 2, "lr": 1e-4, "epsilon": 0.2}),
    ):
        (run / "config.json").write_text(json.dumps({"args": {**args, "out": str(run)}}))
    text = report(Args(runs=[base, new], bootstrap=500))
    assert text.index("## At a glance") < text.index("## Flags") < text.index("## Accuracy")
    glance = {r[0]: r[1:] for r in cells(text, "| run | shot 1")}
    assert glance["rce (baseline)"] == ["0.00", "30.00", "15.00"]
    assert glance["grpo"] == ["50.00 (+50.00*)", "30.00 (+0.00)", "40.00"]
    # epochs differ (2 vs 10); lr is the same; each stage's own flags (temp_end, epsilon) are not differences
    assert cells(text, "| run | stage") == [["rce", "rce", "10"], ["grpo", "grpo", "2"]]
    assert "| run | stage | epochs |" in text
