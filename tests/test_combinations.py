"""Every feature with every other: each row of the pairwise design of tests/combinations.py runs through the command
lines (the simulator, or tiny random-weight Qwen2.5-VL and CLIP on OK-VQA- and COCO-format files), and on what it
writes the invariants that must always hold:

- every data folder written is read back, its sequences as long as --min-shots and --seq-len allow;
- every run that finishes loads, keeps the picks it was made with through every stage, and evaluates;
- every demonstration evaluate.py gives is a row of the question's pool, none twice, as many as asked (exactly k) or
  at most that (up to k);
- `Demonstrations` gives what evaluate.py's file holds, exactly k and up to k, from the run folder, from the files a
  Hub push uploads, and (similarity pools) over a `Library` of the run's items; every demonstration a library item;
- compare.py judges and crowns only runs it paired (a run of another dataset folder stands beside them, apart);
- a training stage killed after its first epoch and run again writes the bytes of one never killed.

Every refused combination stops in one line before any work. The design's first rows on one process (the first rows
cover the most pairs) run in `pytest -q`; the rest are slow.
"""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from unittest.mock import patch

import pytest
from combinations import AXES, REFUSED, every_pair, pairs_of, pairwise
from conftest import SMALL_NET

import compare
import evaluate
import gen_rl_data
import grpo
import rce
from icl_select.cli import run_cli
from icl_select.data import load_dataset
from icl_select.library import Demonstrations, Library
from model import PointerSelector

ROOT = Path(__file__).resolve().parent.parent
ROWS = pairwise()
# the plain suite's rows: the design's first on one process (the first rows cover the most pairs); the rest are slow
FAST = [i for i, r in enumerate(ROWS) if r["ranks"] == 1][:6]
SIM = dict(num_train=240, num_val=40, num_queries=16, group_size=6, pool_size=12, seq_len=3)
REAL = dict(num_queries=8, group_size=4, pool_size=6, seq_len=2, lvlm_batch_size=4)
TRAIN = dict(batch_size=8, val_frac=0.25, keep_every=1)


def flags(**kw) -> list[str]:
    """Keyword arguments as command-line flags (True: the flag alone; lists: its values)."""
    out = []
    for k, v in kw.items():
        name = "--" + k.replace("_", "-")
        if v is True:
            out.append(name)
        elif isinstance(v, list | tuple):
            out += [name, *map(str, v)]
        elif v is not None and v is not False:
            out += [name, str(v)]
    return out


# A wrapper that runs a stage and kills its process right after the epoch-1 checkpoint is written (rank 0 writes it;
# torchrun then stops the other rank): a run killed as a machine would kill it.
DIES = """
import os, runpy, signal, sys
sys.path.insert(0, os.getcwd())
from icl_select import runs
real = runs.save_checkpoint
def save_then_die(out, epoch, *a, **k):
    real(out, epoch, *a, **k)
    if epoch == 1:
        os.kill(os.getpid(), signal.SIGKILL)
runs.save_checkpoint = save_then_die
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


class Kit:
    """Runs the stages as a user would: in this process through the command-line parser, or under torchrun."""

    def __init__(self, root: Path, ranks: int):
        self.root, self.ranks = root, ranks

    def __call__(self, module, *argv, ranks: int = 1, dies: bool = False) -> int:
        """`python module.py argv` (torchrun with `ranks` > 1); `dies`: killed after its first checkpoint. Returns
        the exit code; a run that must succeed is checked by the caller."""
        argv = [str(a) for a in argv]
        script = f"{module.__name__}.py"
        if ranks > 1 or dies:
            env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
            head = [sys.executable]
            if ranks > 1:
                head += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
            if dies:
                (self.root / "dies.py").write_text(DIES)
                head.append(str(self.root / "dies.py"))
            done = subprocess.run([*head, script, *argv], cwd=ROOT, env=env, capture_output=True, text=True)
            assert dies or done.returncode == 0, f"{script} {argv}: {done.stderr[-3000:]}"
            return done.returncode
        with patch.object(sys, "argv", [script, *argv]):
            try:
                run_cli(module.main, module.Args)
            except SystemExit as stop:
                assert stop.code == 0, f"{script} {argv} exited {stop.code}"
        return 0


def data_flags(row: dict, assets: dict, coco: Path) -> list[str]:
    S = SIM["seq_len"] if row["world"] != "real" else REAL["seq_len"]
    least = {"all": None, "some": 1, "none": 0}[row["min_shots"]]
    common = dict(task=row["task"], groups=row["groups"], min_shots=least, sampler=row["sampler"])
    if row["world"] != "real":
        return flags(world=row["world"], **common, **SIM)
    where = dict(dataset="okvqa", data_root=assets["okvqa"])
    if row["task"] == "caption":
        where = dict(dataset="coco2014", data_root=coco)
    return flags(lvlm=assets["qwen"], encoder=assets["clip"], **where, **common, **REAL) + ["--seq-len", str(S)]


def selector_flags(row: dict, seq_len: int) -> list[str]:
    kind = {"pointer": {}, "lever-lm": {"weights": "uniform"}, "retriever": {"retriever": True}}[row["selector"]]
    picks = seq_len + 2 if row["picks"] == "more" else None
    return flags(can_stop=row["can_stop"], picks=picks, quality="all", **kind, **SMALL_NET, **TRAIN)


def grpo_flags(row: dict) -> list[str]:
    mode = {
        "offline": {},
        "online": dict(online=True, group_size=4),
        "budget": dict(online=True, group_size=4, lvlm_budget=600),
    }[row["training"]]
    return flags(epochs=2, **mode, **TRAIN)


def same_bytes(a: Path, b: Path) -> None:
    """Two run folders (a budget's warm start inside included) hold the same weights, checkpoints and scores, and the
    same metrics but for the real LVLM's speed (`lvlm/seq_per_s`, a timing)."""

    def kept(folder: Path) -> list[Path]:
        return sorted(p.relative_to(folder) for p in folder.rglob("*") if p.suffix == ".safetensors")

    assert kept(a) == kept(b)
    for name in kept(a):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    for log in a.rglob("metrics.jsonl"):
        records = [
            [
                {k: v for k, v in json.loads(line).items() if k != "lvlm/seq_per_s"}
                for line in f.read_text().splitlines()
            ]
            for f in (log, b / log.relative_to(a))
        ]
        assert records[0] == records[1], log


def check_eval(doc: dict, ds, exactly: bool) -> None:
    """Each result's demonstrations: rows of the question's pool, distinct, k of them or at most k."""
    for r in doc["results"]:
        for picked in [p["icds"] for p in r.get("per_seed", [r])]:
            pool = set(ds.eval_pools[r["row"]].tolist()) - {-1}
            assert set(picked) <= pool and len(set(picked)) == len(picked), r
            assert len(picked) == r["shot"] if exactly else len(picked) <= r["shot"], r


@pytest.fixture(scope="module")
def coco(tmp_path_factory):
    from icl_select.tiny import build_coco_captions_fixture

    return build_coco_captions_fixture(tmp_path_factory.mktemp("combos-coco") / "coco")


@pytest.fixture(scope="module")
def foreign(small_data, tmp_path_factory):
    """A run of another dataset folder, evaluated: it must stand apart in every row's report."""
    out = tmp_path_factory.mktemp("combos-foreign") / "foreign"
    rce.main(rce.Args(data=small_data, out=out, epochs=1, **SMALL_NET, **TRAIN))
    evaluate.main(evaluate.Args(runs=[out], data=small_data, num_samples=[8], shots=[1]))
    return out


def test_the_design_covers_every_pair_of_values_the_kit_allows():
    covered = set().union(*(pairs_of(r) for r in ROWS))
    assert covered == every_pair()
    assert all(set(r) == set(AXES) for r in ROWS) and len({tuple(r.values()) for r in ROWS}) == len(ROWS)
    fast = set().union(*(pairs_of(ROWS[i]) for i in FAST))
    assert len(fast) > len(covered) / 3  # the plain suite's share


@pytest.mark.parametrize(
    "row",
    [pytest.param(r, marks=[pytest.mark.slow] * (i not in FAST), id=f"row{i:02d}") for i, r in enumerate(ROWS)],
)
def test_a_row_of_the_design(row, assets, coco, foreign, tmp_path):
    root, real = tmp_path, row["world"] == "real"
    kit = Kit(root, row["ranks"])
    S = REAL["seq_len"] if real else SIM["seq_len"]
    n_val = 8 if real else SIM["num_val"]
    data = root / "data"

    # data, and what a selector trained first brings to it (gen_rl_data.py --init, rce.py --init)
    base = data_flags(row, assets, coco)
    first = root / "first"
    if row["init"] == "data":
        kit(gen_rl_data, "--out", root / "data0", *base, ranks=row["ranks"])
        kit(rce, "--data", root / "data0", "--out", first, "--epochs", 1, *selector_flags(row, S))
        kit(gen_rl_data, "--out", data, *base, "--init", first, ranks=row["ranks"])
    else:
        kit(gen_rl_data, "--out", data, *base, ranks=row["ranks"])
    ds = load_dataset(data)
    least = ds.meta["min_shots"]
    n = (ds.groups.seqs >= 0).sum(-1)[ds.groups.seq_mask]
    assert ((least <= n) & (n <= S)).all()

    # the selector, and its last training stage (killed once and run again, where asked)
    rce_run = root / "rce"
    rce_argv = ["--data", data, "--epochs", 2, *selector_flags(row, S)]
    if row["init"] == "rce":  # the same flags: a selector's shape may be restated beside --init, not changed
        kit(rce, "--data", data, "--out", first, "--epochs", 1, *selector_flags(row, S))
        rce_argv += ["--init", first]
    if row["training"] == "rce":
        last, stage, argv, ranks = rce_run, rce, rce_argv, 1
    else:
        kit(rce, "--out", rce_run, *rce_argv)
        last, stage, argv, ranks = (
            root / "grpo",
            grpo,
            ["--data", data, "--init", rce_run, *grpo_flags(row)],
            row["ranks"],
        )
    if row["interrupted"]:
        straight = root / "straight"
        kit(stage, "--out", straight, *argv, ranks=ranks)
        assert kit(stage, "--out", last, *argv, ranks=ranks, dies=True) == -signal.SIGKILL or ranks > 1
    kit(stage, "--out", last, *argv, ranks=ranks)
    if row["interrupted"]:
        same_bytes(last, straight)
    picks = S + 2 if row["picks"] == "more" else S
    for run in {rce_run, last}:
        model = PointerSelector.load(run)
        assert model.cfg.picks == picks and model.cfg.can_stop == row["can_stop"]

    # evaluation, the baselines the report judges it by, and what each gives
    shots = list(range(1, picks + 1))
    every = ["--data", data, "--num-samples", n_val, "--shots", *shots, "--batch-size", 16]
    kit(evaluate, last, *every, ranks=row["ranks"])
    for name in ("zero-shot", "random"):  # on one process: two ranks are the selector's to show
        kit(evaluate, "--baseline", name, "--out", root / name, *every)
    exact = json.loads((last / "eval" / "val.json").read_text())
    check_eval(exact, ds, exactly=True)
    upto = exact
    if row["can_stop"]:
        upto = json.loads((last / "eval" / "val-upto.json").read_text())
        check_eval(upto, ds, exactly=False)
    assert not (last / "eval" / "val-upto.json").exists() or row["can_stop"]

    # Demonstrations: what evaluate.py gave, exactly k or up to k, every demonstration a library item
    exactly = row["evaluation"] == "exactly"
    want = {(r["row"], r["shot"]): r["icds"] for r in (exact if exactly else upto)["results"]}
    if row["use"] == "hub":
        from test_hub import push

        with pytest.MonkeyPatch.context() as m:
            uploaded = push(PointerSelector.from_pretrained(last), "me/selector", m)
        (root / "hub").mkdir()
        for name, body in uploaded.items():
            (root / "hub" / name).write_bytes(body)
        demos = Demonstrations.from_run(root / "hub", library=data)
    else:
        demos = Demonstrations.from_run(last)
    assert demos.task == row["task"] and demos.data == data
    if row["use"] == "library":  # the run's items as a library of their own: pools built afresh, as for new questions
        views = {"fused": ds.emb["train"]} | {v: ds.emb[f"train_{v}"] for v in ("image", "text")}
        library = Library(ds.items["train"], views, ds.meta["encoder"], ds.meta.get("encoder_revision"), row["task"])
        demos = Demonstrations(demos.selector, library, demos.sampler, demos.pool_size, demos.seed)
        query = {"fused": ds.emb["val"][:n_val]} | {v: ds.emb[f"val_{v}"][:n_val] for v in ("image", "text")}
        for k in shots:
            picked = demos.pick_embedded(query, k, exactly=exactly)
            rows_ = [[d.row for d in p] for p in picked]
            assert all(len(set(r)) == len(r) and (len(r) == k if exactly else len(r) <= k) for r in rows_)
            if row["sampler"] != "random":  # similarity pools are the evaluation's pools
                assert rows_ == [want[r, k] for r in range(n_val)]
        if real:  # new pictures (and questions) embedded by the run's encoder: the same as their stored embeddings
            own = Demonstrations.from_run(last)
            items = ds.items["val"][:n_val]
            queries = [it["image"] if row["task"] == "caption" else (it["image"], it["question"]) for it in items]
            got = own.pick_batch(queries, exactly=exactly)
            if row["sampler"] != "random":
                assert [[d.row for d in p] for p in got] == [want[r, picks] for r in range(n_val)]
    else:
        for k in shots:
            picked = demos.pick_val(range(n_val), k, exactly=exactly)
            assert [[d.row for d in p] for p in picked] == [want[r, k] for r in range(n_val)]
            assert all(d.item == ds.items["train"][d.row] and 0 < d.prob <= 1 for p in picked for d in p)

    # the report: only runs paired with the reference are judged or crowned
    report = root / "report.md"
    kit(compare, last, root / "zero-shot", root / "random", foreign, "--out", report, "--bootstrap", 200)
    text = report.read_text()
    judged = text[: text.index("## ", text.index("## At a glance") + 3)]
    assert judged.count(foreign.name) == 1 and "**Not paired with" in judged
    best = [line for line in judged.splitlines() if "(best)" in line]
    assert best and all(foreign.name not in line for line in best)


@pytest.mark.parametrize("rule", REFUSED, ids=[f"{r.axes[0]}-{r.axes[1]}" for r in REFUSED])
def test_a_refused_combination_stops_in_one_line_before_any_work(rule, small_data, tmp_path, capsys):
    row = {a: values[0] for a, (values, _) in AXES.items()} | rule.example
    out = tmp_path / "out"
    if rule.stage == "gen_rl_data.py":
        module, argv = gen_rl_data, ["--out", out, *data_flags(row, {}, tmp_path)]
        argv += ["--init", tmp_path / "selector"] * (row["init"] == "data")
    elif rule.stage == "rce.py":
        module, argv = rce, ["--data", small_data, "--out", out, *selector_flags(row, 4)]
    else:  # grpo.py, from the selector the row's rce.py makes
        Kit(tmp_path, 1)(rce, "--data", small_data, "--out", tmp_path / "rce", *selector_flags(row, 4))
        capsys.readouterr()  # its progress bars
        module, argv = grpo, ["--data", small_data, "--init", tmp_path / "rce", "--out", out, *grpo_flags(row)]
    with patch.object(sys, "argv", [rule.stage, *map(str, argv)]), pytest.raises(SystemExit) as stop:
        run_cli(module.main, module.Args)
    err = capsys.readouterr().err.strip().split("\n")[-1]
    assert stop.value.code == 2 and err.startswith("error: "), err
    assert re.search(rule.says, err.removeprefix("error: ")), err
    assert not out.exists() and not Path(f"{out}.building").exists()
