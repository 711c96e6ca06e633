"""Every input of every stage changed after the stage ran, and every reader downstream asked (tests/lineage.py declares
them): each refuses in one line, leaving every file as it was, or does its work as if its own output had never
existed. Never a mix of two inputs: an evaluation resumed over a rebuilt dataset, a run continued on other data, a
cache reused for other weights."""

import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import die_after_first_chunk
from lineage import EVAL, INPUTS, RCE, REAL, REAL_INPUTS, SIM, TREE

import ablate
import compare
import evaluate
import gen_rl_data
import grpo
import rce
from icl_select import runs
from icl_select.data import data_digest
from icl_select.files import sha256
from icl_select.library import Demonstrations

# Every stage runs in the tree's folder on relative paths, as a user runs the kit from a project's folder: a copy of
# the tree is a project of its own (its runs record `data`, not the first tree's absolute path).
DATA, RCE_RUN = Path("data"), Path("runs/rce")


def gen(out: str, **flags) -> None:
    gen_rl_data.generate(gen_rl_data.Args(out=Path(out), **{**SIM, **flags}))


def train(out: str, **flags) -> None:
    rce.main(rce.Args(data=DATA, out=Path(out), **{**RCE, **flags}))


def post_train(**flags) -> None:
    args = dict(epochs=1, batch_size=8, val_frac=0.25) | flags
    grpo.main(grpo.Args(data=DATA, init=RCE_RUN, out=Path("runs/grpo"), **args))


def evaluate_run(**flags) -> None:
    evaluate.main(evaluate.Args(data=DATA, runs=[RCE_RUN], **{**EVAL, **flags}))


def random(out: str, **flags) -> None:
    evaluate.main(evaluate.Args(data=DATA, baseline="random", out=Path(out), **{**EVAL, **flags}))


def results(path: Path) -> list[dict]:
    return json.loads(path.read_text())["results"]


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """TREE: the small pipeline every change starts from, with a data build, a training and an evaluation killed."""
    root = tmp_path_factory.mktemp("lineage")
    with pytest.MonkeyPatch.context() as m:
        m.chdir(root)
        build_tree(m)
    made = {str(p.relative_to(root)) for p in [*root.iterdir(), *(root / "runs").iterdir()] if p.suffix != ".lock"}
    assert made - {"runs"} == set(TREE)
    return root


def build_tree(m: pytest.MonkeyPatch) -> None:
    gen("data")
    with m.context() as k, pytest.raises(KeyboardInterrupt):
        die_after_first_chunk(k, "gen_rl_data.py")
        gen("data-part", chunk=4)
    train("runs/rce")
    gen("data-init", init=RCE_RUN)
    real_save = runs.save_checkpoint

    def save_then_die(out, epoch, *a, **kw):
        real_save(out, epoch, *a, **kw)
        raise KeyboardInterrupt

    with m.context() as k, pytest.raises(KeyboardInterrupt):
        k.setattr(runs, "save_checkpoint", save_then_die)
        train("runs/rce-part")
    post_train()
    evaluate_run()
    random("runs/random")
    with m.context() as k, pytest.raises(KeyboardInterrupt):
        die_after_first_chunk(k, "evaluate.py", calls=len(EVAL["shots"]))
        random("runs/random-part")


@dataclass(frozen=True)
class Reader:
    """`run(flags)` reads the tree in the current folder (and writes its `own` paths); `made()` is what it made, to
    hold against a copy where its own paths never existed (`clean()`: another way to make it, where given)."""

    run: Callable[[dict], object]
    own: tuple[str, ...]
    made: Callable[[], object]
    clean: Callable[[], object] | None = None


def pick_val() -> list[list[int]]:
    demos = Demonstrations.from_run(RCE_RUN)
    return [[d.row for d in p] for p in demos.pick_val(range(8), exactly=True)]


def evaluated_picks() -> list[list[int]]:
    """What evaluate.py picks at the largest shot, on the first 8 questions: what Demonstrations must give."""
    evaluate_run()
    k = max(EVAL["shots"])
    return [r["icds"] for r in results(RCE_RUN / "eval" / "val.json") if r["shot"] == k][:8]


def ablate_cache(flags: dict) -> None:
    if not ablate.evaluated(RCE_RUN, DATA):
        evaluate_run()


def compared(flags: dict) -> str:
    return compare.report(compare.Args(runs=[RCE_RUN, Path("runs/random")], bootstrap=100))


def digest(folder: str) -> Callable[[], str]:
    return lambda: data_digest(Path(folder))


def weights(run: str) -> Callable[[], str]:
    return lambda: sha256(Path(run) / "model.safetensors")


def evaluation(run: str) -> Callable[[], list[dict]]:
    return lambda: results(Path(run) / "eval" / "val.json")


READERS = {
    "gen_rl_data.py (killed, again)": Reader(
        lambda f: gen("data-part", chunk=4, **f), ("data-part",), digest("data-part")
    ),
    "gen_rl_data.py --init (again)": Reader(
        lambda f: gen("data-init", init=RCE_RUN, **f), ("data-init",), digest("data-init")
    ),
    "rce.py (again)": Reader(lambda f: train("runs/rce", **f), ("runs/rce",), weights("runs/rce")),
    "rce.py (killed, again)": Reader(
        lambda f: train("runs/rce-part", **f), ("runs/rce-part",), weights("runs/rce-part")
    ),
    "rce.py (a new run)": Reader(lambda f: train("runs/new", **f), ("runs/new",), weights("runs/new")),
    "grpo.py (again)": Reader(lambda f: post_train(**f), ("runs/grpo",), weights("runs/grpo")),
    "evaluate.py (a run)": Reader(lambda f: evaluate_run(**f), ("runs/rce/eval",), evaluation("runs/rce")),
    "evaluate.py (killed, again)": Reader(
        lambda f: random("runs/random-part", **f), ("runs/random-part",), evaluation("runs/random-part")
    ),
    "evaluate.py (a baseline, again)": Reader(
        lambda f: random("runs/random", **f), ("runs/random",), evaluation("runs/random")
    ),
    "Demonstrations": Reader(lambda f: pick_val(), ("runs/rce/eval",), pick_val, evaluated_picks),
    "ablate.py's cache": Reader(ablate_cache, ("runs/rce/eval",), evaluation("runs/rce")),
    "compare.py": Reader(compared, (), lambda: None),
}


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file of the tree but lock files (a refusal after taking a lock rewrites who holds it)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file() and p.suffix != ".lock"}


@pytest.mark.parametrize("case", INPUTS, ids=lambda i: i.name)
def test_a_changed_input_is_refused_or_its_readers_start_over(case, tree, tmp_path, monkeypatch):
    ask_every_reader(case, tree, READERS, tmp_path, monkeypatch)


def ask_every_reader(case, tree: Path, readers: dict, tmp_path: Path, monkeypatch) -> None:
    """Change `case`'s input in a copy of `tree` and run each of its readers on a copy of that: a refusal in one line
    that changed no file, or what the reader makes on a copy where its own output never existed."""
    changed = tmp_path / "changed"
    shutil.copytree(tree, changed, symlinks=True)
    monkeypatch.chdir(changed)
    flags = case.change(changed) or {}
    for name in case.readers:
        reader = readers[name]
        root, clean = tmp_path / name / "tree", tmp_path / name / "clean"
        shutil.copytree(changed, root, symlinks=True)
        shutil.copytree(changed, clean, symlinks=True)
        monkeypatch.chdir(root)
        before = snapshot(root)
        try:
            out = reader.run(flags.get(name, {}))
        except (ValueError, OSError) as e:  # a refusal: one line, before any file changed
            assert "\n" not in str(e) and snapshot(root) == before, (name, str(e))
            continue
        assert not case.refused, f"{name} read {case.name}"
        if name == "compare.py":  # it reads evaluations alone: it pairs none made from another dataset
            assert "**Not paired with" in out and "| made from other inputs: the dataset " in out, out
            continue
        made = reader.made()
        monkeypatch.chdir(clean)
        for path in reader.own:
            shutil.rmtree(path, ignore_errors=True)
        want = reader.clean() if reader.clean else (reader.run(flags.get(name, {})), reader.made())[1]
        assert made == want, f"{name} mixed {case.name} with what it had made before"


# ----------------------------------------------------------------------------------------------------------------------
# The real backend


def real_gen(out: str, data_root: Path, **flags) -> None:
    args = dict(lvlm="models/qwen", encoder="models/clip", dataset="okvqa", data_root=data_root) | REAL
    gen_rl_data.generate(gen_rl_data.Args(out=Path(out), **{**args, **flags}))


def real_random(out: str, **flags) -> None:
    args = dict(num_samples=[8], shots=[1, 2], batch_size=4, skip_self_check=True) | flags
    evaluate.main(evaluate.Args(data=DATA, baseline="random", out=Path(out), **args))


@pytest.fixture(scope="module")
def real_tree(assets, tmp_path_factory) -> Path:
    """REAL_TREE: the small pipeline on tiny real models that every real change starts from."""
    from icl_select import tiny

    root = tmp_path_factory.mktemp("lineage-real")
    tiny.build_tiny_qwen(root / "models" / "qwen")
    tiny.build_tiny_clip(root / "models" / "clip")
    with pytest.MonkeyPatch.context() as m:
        m.chdir(root)
        real_gen("data", assets["okvqa"])
        with m.context() as k, pytest.raises(KeyboardInterrupt):
            die_after_first_chunk(k, "gen_rl_data.py")
            real_gen("data-part", assets["okvqa"], chunk=4)
        rce.main(rce.Args(data=DATA, out=RCE_RUN, **{**RCE, "batch_size": 4}))
        real_random("runs/random")
        with m.context() as k, pytest.raises(KeyboardInterrupt):
            die_after_first_chunk(k, "evaluate.py", calls=2)  # two shots
            real_random("runs/random-part")
    return root


def new_pictures() -> list[list[int]]:
    """The run's picks for the first validation pictures and questions, given as new pictures (embedded now)."""
    items = json.loads((DATA / "items.json").read_text())["val"][:4]
    demos = Demonstrations.from_run(RCE_RUN)
    return [[d.row for d in p] for p in demos.pick_batch([(it["image"], it["question"]) for it in items])]


@pytest.mark.slow  # tiny real models load at every reader
@pytest.mark.parametrize("case", REAL_INPUTS, ids=lambda i: i.name)
def test_a_changed_model_is_refused_or_its_readers_start_over(case, real_tree, assets, tmp_path, monkeypatch):
    readers = {
        "gen_rl_data.py (killed, again)": Reader(
            lambda f: real_gen("data-part", assets["okvqa"], chunk=4, **f), ("data-part",), digest("data-part")
        ),
        "evaluate.py (killed, again)": Reader(
            lambda f: real_random("runs/random-part", **f), ("runs/random-part",), evaluation("runs/random-part")
        ),
        "evaluate.py (a baseline, again)": Reader(
            lambda f: real_random("runs/random", **f), ("runs/random",), evaluation("runs/random")
        ),
        "Demonstrations of new pictures": Reader(lambda f: new_pictures(), (), new_pictures),
    }
    ask_every_reader(case, real_tree, readers, tmp_path, monkeypatch)


@pytest.mark.slow  # a real data build and the tiny models
def test_a_picture_changed_after_the_build_is_refused_by_every_reader_before_a_model_loads(
    real_tree, assets, tmp_path, monkeypatch
):
    """A dataset's pictures are those it embedded and scored, or its readers refuse: a file touched but with the same
    pixels goes on; a file with other pixels is refused by name before any model loads, by a resumed build, an
    evaluation and a training alike (once the LVLM was shown the new pixels beside the old ones' pools and scores)."""
    from PIL import Image

    from icl_select import lvlm

    shutil.copytree(assets["okvqa"], tmp_path / "okvqa")
    (tmp_path / "models").symlink_to(real_tree / "models")
    monkeypatch.chdir(tmp_path)
    real_gen("data", tmp_path / "okvqa")
    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        die_after_first_chunk(m, "gen_rl_data.py")
        real_gen("data-part", tmp_path / "okvqa", chunk=4)
    picture = Path(json.loads((DATA / "items.json").read_text())["val"][0]["image"])
    os.utime(picture, ns=(picture.stat().st_atime_ns, picture.stat().st_mtime_ns + 10**9))
    real_random("runs/random")  # touched, the same pixels: stamped anew, to be decoded once
    assert json.loads(Path("data/picture_stamps.json").read_text())[str(picture)][1] == picture.stat().st_mtime_ns
    Image.new("RGB", (24, 24), (200, 30, 30)).save(picture, format="JPEG")
    monkeypatch.setattr(lvlm.LVLMBackend, "__init__", lambda *a, **k: pytest.fail("a model loaded"))
    readers = [
        lambda: real_random("runs/random-2"),
        lambda: real_gen("data-part", tmp_path / "okvqa", chunk=4),  # the killed build, resumed
        lambda: rce.main(rce.Args(data=DATA, out=Path("runs/rce-2"), **{**RCE, "batch_size": 4})),
    ]
    for read in readers:
        with pytest.raises(ValueError, match=rf"^{re.escape(str(picture))}: the picture changed since "):
            read()
    assert not Path("runs/random-2").exists() and not Path("runs/rce-2").exists(), "a refusal left files behind"
