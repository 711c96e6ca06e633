"""Every input of every stage, how it changes after the stage ran, and which readers must notice: declared once, here.

tests/test_lineage.py builds a small pipeline on the simulator (TREE: a dataset folder, runs, evaluations, and the same
stages killed part way), then for each input below, on a copy of that tree, changes the input (`change`: a file, or
the flags a reader is run again with) and runs each of its `readers`. A reader must either refuse in one line, leaving
every file of the tree as it was, or do its work as if its own output had never existed (the same result as on a copy
without it): never a mix of the two inputs. A new input of a stage joins INPUTS with its change and every reader
downstream; a new reader joins test_lineage.READERS and the inputs it reads.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from conftest import SMALL_NET

SIM = dict(num_train=240, num_val=40, num_queries=16, group_size=6, pool_size=12, seq_len=3)  # gen_rl_data.py's
RCE = dict(epochs=2, batch_size=8, val_frac=0.25, quality="all", **SMALL_NET)
EVAL = dict(shots=[1, 2, 3], num_samples=[40], batch_size=8)

# The tree every change starts from, path -> what made it (test_lineage.build_tree makes it).
TREE = {
    "data": "gen_rl_data.py with SIM",
    "data-part": "gen_rl_data.py with SIM --chunk 4, killed after its first chunk",
    "data-init": "gen_rl_data.py with SIM --init runs/rce",
    "runs/rce": "rce.py with RCE, evaluated (eval/val.json)",
    "runs/rce-part": "rce.py with RCE killed after its first epoch",
    "runs/grpo": "grpo.py --init runs/rce, offline, one epoch",
    "runs/random": "evaluate.py --baseline random",
    "runs/random-part": "evaluate.py --baseline random killed after its first chunk",
}


@dataclass(frozen=True)
class Input:
    """One input: how it changes after the stages that read it ran, and the readers that must notice
    (test_lineage.READERS)."""

    of: str  # the stages it is an input of
    name: str
    change: Callable[[Path], dict | None]  # changes the tree; returns the flags its readers are run with, if others
    readers: tuple[str, ...]
    refused: bool = False  # nothing may be made from it: every reader refuses


def regenerate(root: Path, **flags) -> None:
    """The dataset folder built again in place, from other flags."""
    import gen_rl_data

    shutil.rmtree(root / "data")
    gen_rl_data.generate(gen_rl_data.Args(out=root / "data", **{**SIM, **flags}))


def edit_score(root: Path) -> None:
    """One scored sequence's accuracy and correctness changed by hand (what rl_data.jsonl holds, not how)."""
    path = root / "data" / "rl_data.jsonl"
    lines = path.read_text().splitlines()
    first = json.loads(lines[0])
    seq = first["seqs"][0]
    seq["acc"], seq["correct"] = (0.0, 0) if seq["correct"] else (1.0, 1)
    path.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")


def unfinish(root: Path) -> None:
    """The dataset folder rebuilt from another seed, and that build killed part way (meta.json "complete": false)."""
    regenerate(root, seed=1)
    meta = json.loads((root / "data" / "meta.json").read_text())
    (root / "data" / "meta.json").write_text(json.dumps(meta | {"complete": False}))
    lines = (root / "data" / "rl_data.jsonl").read_text().splitlines(keepends=True)
    (root / "data" / "rl_data.jsonl").write_text("".join(lines[:4]))


def retrain(root: Path) -> None:
    """runs/rce's selector replaced by one trained from another seed (its training went on, say)."""
    import rce

    rce.main(rce.Args(data=root / "data", out=root / "other", seed=1, **RCE))
    for name in ("model.safetensors", "model.json"):
        shutil.copyfile(root / "other" / name, root / "runs" / "rce" / name)


def for_captions(root: Path) -> None:
    """runs/rce's selector one trained for captions (as wide: the simulators' embeddings are 512-d alike)."""
    path = root / "runs" / "rce" / "model.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps(config | {"made_from": config["made_from"] | {"task": "caption"}}))


def evaluate_again(root: Path) -> None:
    """The dataset built again from another seed, and the random baseline evaluated on it (runs/rce's evaluation is of
    the first dataset)."""
    import evaluate

    regenerate(root, seed=1)
    shutil.rmtree(root / "runs" / "random")
    evaluate.main(evaluate.Args(data=root / "data", baseline="random", out=root / "runs" / "random", **EVAL))


DATA_READERS = (
    "rce.py (again)",
    "rce.py (killed, again)",
    "rce.py (a new run)",
    "grpo.py (again)",
    "evaluate.py (a run)",
    "evaluate.py (killed, again)",
    "evaluate.py (a baseline, again)",
    "Demonstrations",
    "ablate.py's cache",
)
SELECTOR_READERS = (
    "gen_rl_data.py --init (again)",
    "grpo.py (again)",
    "evaluate.py (a run)",
    "Demonstrations",
    "ablate.py's cache",
)


def flags(readers: tuple[str, ...], **values) -> Callable[[Path], dict]:
    """A change of flags alone: `readers` run again with `values`."""
    return lambda root: dict.fromkeys(readers, values)


DATASET = "rce.py, grpo.py, evaluate.py, Demonstrations, ablate.py"  # whose input a dataset folder is
SELECTOR = "gen_rl_data.py, grpo.py, evaluate.py, Demonstrations, ablate.py"  # whose input a selector is
INPUTS = [
    Input(
        "gen_rl_data.py",
        "--seed",
        flags(("gen_rl_data.py (killed, again)",), seed=1),
        ("gen_rl_data.py (killed, again)",),
    ),
    Input(
        "gen_rl_data.py",
        "--world",
        flags(("gen_rl_data.py (killed, again)",), world="copy"),
        ("gen_rl_data.py (killed, again)",),
    ),
    Input(SELECTOR, "the selector's weights, trained again", retrain, SELECTOR_READERS),
    Input(SELECTOR, "the selector's task", for_captions, SELECTOR_READERS),
    Input(DATASET, "the dataset, built again from another seed", lambda r: regenerate(r, seed=1), DATA_READERS),
    Input(DATASET, "the dataset, one score edited", edit_score, DATA_READERS),
    Input(DATASET, "the dataset, built again and killed part way", unfinish, DATA_READERS, refused=True),
    Input(DATASET, "the dataset, of another simulated world", lambda r: regenerate(r, world="copy"), DATA_READERS),
    Input(
        "rce.py",
        "--lr",
        flags(("rce.py (again)", "rce.py (killed, again)"), lr=1e-2),
        ("rce.py (again)", "rce.py (killed, again)"),
    ),
    Input(
        "evaluate.py",
        "--order",
        flags(("evaluate.py (killed, again)",), order="selected"),
        ("evaluate.py (killed, again)",),
    ),
    Input("compare.py", "an evaluation's dataset", evaluate_again, ("compare.py",)),
]

# The same on the real backend (slow): tiny random-weight Qwen2.5-VL and CLIP in the tree's models/ folder, the
# OK-VQA-format fixture's files; test_lineage.build_real_tree makes it.
REAL = dict(num_queries=8, pool_size=6, group_size=3, seq_len=2, lvlm_batch_size=4, skip_self_check=True)
REAL_TREE = {
    "models/qwen": "build_tiny_qwen",
    "models/clip": "build_tiny_clip",
    "data": "gen_rl_data.py --lvlm models/qwen --encoder models/clip with REAL",
    "data-part": "the same killed after its first chunk of 4 anchors",
    "runs/rce": "rce.py",
    "runs/random": "evaluate.py --baseline random",
    "runs/random-part": "evaluate.py --baseline random killed after its first chunk",
}


def new_weights(name: str) -> Callable[[Path], None]:
    """The model folder models/<name> built again from another seed: the same files, other weights."""

    def change(root: Path) -> None:
        from icl_select import tiny

        shutil.rmtree(root / "models" / name)
        getattr(tiny, f"build_tiny_{name}")(root / "models" / name, seed=1)

    return change


REAL_INPUTS = [
    Input(
        "gen_rl_data.py, evaluate.py",
        "the LVLM's weights",
        new_weights("qwen"),
        ("gen_rl_data.py (killed, again)", "evaluate.py (killed, again)", "evaluate.py (a baseline, again)"),
    ),
    Input(
        "gen_rl_data.py, Demonstrations",
        "the encoder's weights",
        new_weights("clip"),
        ("gen_rl_data.py (killed, again)", "Demonstrations of new pictures"),
    ),
]
