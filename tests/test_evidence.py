"""Evidence on the simulator, where the truth is known: RCE beats random ICDs, GRPO beats RCE, and the KL weight
changes what GRPO selects (the user's beta sweep selected 100% identical ICDs; this one must not)."""

import json

import pytest

import evaluate
import grpo
import rce
from gen_rl_data import Args as GenArgs
from gen_rl_data import generate

EPOCHS = 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("evidence")
    data = root / "data"
    generate(GenArgs(out=data, num_val=600))  # 800 anchors x 16 sequences, K=64, S=4 (the defaults)
    rce.main(rce.Args(data=data, out=root / "rce", epochs=EPOCHS))
    common = dict(data=data, init=root / "rce", epochs=EPOCHS)
    grpo.main(grpo.Args(out=root / "offline", kl_beta=0.1, **common))
    grpo.main(grpo.Args(out=root / "online", kl_beta=0.1, online=True, group_size=16, **common))
    for beta in (0.0, 1.0):
        grpo.main(grpo.Args(out=root / f"beta{beta}", kl_beta=beta, **common))
    evaluate.main(evaluate.Args(data=data, baseline="random", out=root / "random", num_samples=[600]))
    evaluate.main(evaluate.Args(data=data, runs=[root / "rce", root / "offline", root / "online"], num_samples=[600]))
    return root


def mean_accuracy(run):
    summary = json.loads((run / "eval" / "val.json").read_text())["summary"]["600"]
    return sum(summary.values()) / len(summary)


def test_rce_beats_random_and_grpo_beats_rce(runs):
    acc = {name: mean_accuracy(runs / name) for name in ("random", "rce", "offline", "online")}
    assert acc["rce"] >= acc["random"] + 2, acc
    assert acc["online"] >= acc["rce"] + 2, acc
    assert acc["offline"] >= acc["rce"] + 2, acc


def test_selection_change_decreases_with_kl_beta(runs):
    def change(run):
        records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return records[-1]["grpo/selection_change"]

    rates = [change(runs / "beta0.0"), change(runs / "offline"), change(runs / "beta1.0")]
    assert rates[0] >= rates[1] >= rates[2] and rates[0] > rates[2], rates
