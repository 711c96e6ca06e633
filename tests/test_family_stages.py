"""Every model family through every stage, its LVLM at one prompt per forward pass and at four.

For each family's tiny checkpoint (icl_select/tiny.py) on the OK-VQA-format folder with mixed picture shapes:
gen_rl_data.py (sampled groups, and InfoScore beams), evaluate.py with every baseline and an RCE selector and a
retriever trained on that data, and one online GRPO step.
Each LVLM-bound stage runs with --lvlm-batch-size 1 and 4 and must write the same answers and accuracies, and the same
gt_prob within float32 rounding: a left-padded batch is a different computation only in its rounding.

Gemma3's sliding window (tiny.GEMMA3_SLIDING_WINDOW) is shorter than every prompt the stages give it, so its
cache drops states and cannot be cut back after decoding. Every family runs under `-m slow`.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from conftest import FAMILIES
from safetensors.torch import load_file
from transformers import AutoConfig

import evaluate
import grpo
import rce
from gen_rl_data import Args, generate
from icl_select import lvlm
from icl_select.data import SEQ_FIELDS, load_dataset

pytestmark = pytest.mark.filterwarnings("ignore:invalid escape sequence:DeprecationWarning")  # llava-v1.6's template

BATCHES = (1, 4)
BASELINES = ("zero-shot", "random", "image-sim", "text-sim", "mmices", "mmr", "coreset")
RUNS = ("rce", "retriever", *BASELINES)
RTOL = 1e-4  # gt_prob, float32
TRAIN = dict(epochs=1, val_frac=0.25)
# 8 anchors, 6 of them for training: a batch of 8 is one GRPO step.
GEN = dict(num_queries=8, pool_size=6, group_size=4, seq_len=2, chunk=2)
EVAL = dict(shots=[1, 2], num_samples=[8])


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def assert_same_scores(a: list[dict], b: list[dict], where: str) -> None:
    """Two lists of scored records: every field equal, except gt_prob fields within RTOL."""
    assert len(a) == len(b), where
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.keys() == y.keys(), (where, i)
        for key in x:
            if "gt_prob" in key:
                assert math.isclose(x[key], y[key], rel_tol=RTOL), (where, i, key, x[key], y[key])
            elif isinstance(x[key], list) and x[key] and isinstance(x[key][0], dict):
                assert_same_scores(x[key], y[key], f"{where}[{i}].{key}")
            else:
                assert x[key] == y[key], (where, i, key, x[key], y[key])


def stages(model: Path, okvqa: Path, clip: Path, root: Path) -> None:
    """Every stage of `model`, its LVLM at each of BATCHES prompts per pass b, writing under `root`: data-b{b}/
    (gen_rl_data.py); rce/ (trained on data-b4); and on data-b4, from that selector, b{b}/<run>/eval/val.json
    (evaluate.py, <run> = rce or a baseline) and b{b}/online/ (one online GRPO step, validated with the LVLM)."""
    for b in BATCHES:
        gen = dict(lvlm=str(model), dataset="okvqa", data_root=okvqa, encoder=str(clip), skip_self_check=b == 1)
        generate(Args(out=root / f"data-b{b}", lvlm_batch_size=b, **gen, **GEN))
    infoscore = dict(groups="infoscore", num_queries=2, pool_size=4, group_size=2, seq_len=2)
    generate(Args(out=root / "data-infoscore", **gen | {"skip_self_check": True}, **infoscore))
    data = root / f"data-b{BATCHES[-1]}"
    # a random LVLM's rewards tie whole groups: quality "all" keeps them
    small = dict(hidden=32, num_heads=2, batch_size=4, quality="all", **TRAIN)
    rce.main(rce.Args(data=data, out=root / "rce", **small))
    rce.main(rce.Args(data=data, out=root / "retriever", retriever=True, **small))
    for b in BATCHES:
        lvlm_args = dict(data=data, lvlm_batch_size=b, skip_self_check=True)
        for run in ("rce", "retriever"):
            shutil.copytree(root / run, root / f"b{b}" / run)  # evaluate.py writes into the run folder
        evaluate.main(evaluate.Args(runs=[root / f"b{b}" / r for r in ("rce", "retriever")], **lvlm_args, **EVAL))
        for name in BASELINES:
            evaluate.main(evaluate.Args(baseline=name, out=root / f"b{b}" / name, **lvlm_args, **EVAL))
        online = dict(online=True, group_size=2, batch_size=8, val_lvlm=True, val_max_queries=2, **TRAIN)
        grpo.main(grpo.Args(init=root / "rce", out=root / f"b{b}" / "online", **lvlm_args, **online))


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_every_stage_batched_equals_one_prompt_at_a_time(
    name, family_models, mixed_okvqa, assets, tmp_path, monkeypatch
):
    model = Path(family_models[name])
    batches = []  # each processed batch's prompt lengths (tokens)
    process = lvlm.LVLMBackend._process  # what every batch's preparation calls

    def counted(self, examples):
        inputs, keys = process(self, examples)
        batches.append(inputs["attention_mask"].sum(1).tolist())
        return inputs, keys

    monkeypatch.setattr(lvlm.LVLMBackend, "_process", counted)
    stages(model, mixed_okvqa, assets["clip"], tmp_path)
    shortest = min(min(b) for b in batches)
    if name == "gemma3":  # the case at stake: a sliding-window cache that has dropped states before decoding starts
        window = AutoConfig.from_pretrained(model).get_text_config().sliding_window
        assert window is not None and window < shortest, (window, shortest)
    assert any(len(set(b)) > 1 for b in batches if len(b) == 4), "no batch of 4 was left-padded"
    one, four = (tmp_path / f"b{b}" for b in BATCHES)

    ds = load_dataset(tmp_path / "data-b4")
    assert ds.meta["self_check"]["answers_differ"] == 0 and len(ds.groups) == GEN["num_queries"]
    rl_data = [lines(tmp_path / f"data-b{b}" / "rl_data.jsonl") for b in BATCHES]
    assert len({s["prediction"] for line in rl_data[0] for s in line["seqs"]}) > 2  # the answers say something
    assert_same_scores(*rl_data, "rl_data.jsonl")

    lever = load_dataset(tmp_path / "data-infoscore")  # Lever-LM's beams, asked of this family
    assert lever.meta["lvlm_calls"] == 2 * (1 + 4 + 2 * 3 + 2 + 1) and {tuple(s) for s in lever.groups.sources} == {
        ("infoscore", "infoscore")
    }
    for run in RUNS:
        a, b = (json.loads((top / run / "eval" / "val.json").read_text()) for top in (one, four))
        assert a["results"] == b["results"] and a["summary"] == b["summary"], run
        assert len(a["results"]) == len(ds.items["val"]) * len(EVAL["shots"]), run

    a, b = (load_file(top / "online" / "scores.safetensors") for top in (one, four))
    assert len(a["query"]) > 0 and all(a[k].equal(b[k]) for k in ("split", "query", "icds")), "other prompts scored"
    fields = list(SEQ_FIELDS)
    exact = [fields.index(f) for f in fields if f != "gt_prob"]
    assert a["scores"][:, exact].equal(b["scores"][:, exact]), "online GRPO's answers differ"
    gt_a, gt_b = (s["scores"][:, fields.index("gt_prob")] for s in (a, b))  # (N,)
    assert ((gt_a - gt_b).abs() <= RTOL * gt_b.abs()).all(), (gt_a, gt_b)
    m1, m4 = (lines(top / "online" / "metrics.jsonl") for top in (one, four))
    assert [r["step"] for r in m4] == [0, 1] and [r["val/acc"] for r in m1] == [r["val/acc"] for r in m4]
