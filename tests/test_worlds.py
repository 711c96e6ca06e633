"""Tests for the simulator's worlds: additive pinned to its bytes, each world deterministic and calibrated (seed 0 to
its table, seeds 1-4 to their ranges, the oracle above every other row on each), each world's mechanism, and the
one-line refusals of a bad parameter, in code and on the command line.

The calibration tables are those of docs/worlds.md (default sizes); the mechanism tests run on small simulators with
hypothesis-drawn seeds.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import seeds
from test_pinned import cpu_model
from torch.overrides import TorchFunctionMode

from icl_select import pools, sim
from icl_select.data import DataError, read_meta
from icl_select.runs import KERNELS
from icl_select.vqa import answer_rel, vqa_score

ROOT = Path(__file__).resolve().parent.parent
OTHER_WORLDS = [w for w in sim.WORLDS if w != "additive"]

# docs/worlds.md: python gen_rl_data.py --calibrate --world NAME (VQA accuracy %, shots 1-4).
TABLES = {
    "additive": {
        "zero_shot": 49.24,
        "random": [49.46, 48.71, 47.61, 47.49],
        "similar": [54.46, 56.20, 56.61, 56.97],
        "oracle": [68.58, 73.72, 76.66, 78.00],
        "observable": [62.98, 68.15, 70.55, 71.71],
    },
    "copy": {
        "zero_shot": 49.24,
        "random": [50.14, 49.37, 49.57, 50.02],
        "similar": [52.36, 54.88, 55.40, 55.80],
        "oracle": [89.09, 90.06, 90.82, 91.30],
        "observable": [60.72, 63.53, 65.36, 66.97],
    },
    "saturating": {
        "zero_shot": 49.24,
        "random": [48.76, 47.04, 45.82, 45.17],
        "similar": [50.42, 54.66, 54.39, 54.45],
        "oracle": [65.41, 71.93, 72.79, 72.89],
        "observable": [59.46, 66.67, 67.65, 67.77],
    },
    "strong": {
        "zero_shot": 69.68,
        "random": [66.15, 62.99, 60.65, 58.64],
        "similar": [64.90, 62.73, 60.37, 59.70],
        "oracle": [81.45, 84.89, 86.55, 87.69],
        "observable": [76.95, 79.92, 81.42, 82.01],
    },
    "order": {
        "zero_shot": 49.24,
        "random": [49.46, 48.25, 46.93, 45.42],
        "similar": [54.46, 56.01, 54.87, 55.12],
        "oracle": [68.58, 79.48, 81.96, 83.39],
        "observable": [62.98, 71.30, 74.20, 75.08],
    },
    "harmful": {
        "zero_shot": 69.68,
        "random": [67.46, 64.13, 62.48, 61.15],
        "similar": [67.97, 67.34, 66.71, 65.14],
        "oracle": [92.43, 92.13, 91.72, 91.09],
        "observable": [70.13, 66.63, 63.62, 61.43],
        "observable_upto": [73.32, 73.07, 73.15, 73.15],
    },
}
# docs/worlds.md, seeds 1-4 (python gen_rl_data.py --calibrate --world NAME --seed S): each value's range over them.
SEEDS = (1, 2, 3, 4)
RANGES = {
    "additive": {
        "zero_shot": (50.0, 50.6),
        "random_2": (48.0, 49.3),
        "similar_2": (54.0, 55.1),
        "observable_2": (65.4, 69.5),
        "oracle_2": (73.6, 75.0),
        "oracle_4": (78.3, 79.0),
    },
    "copy": {
        "zero_shot": (50.0, 50.6),
        "random_2": (48.6, 50.4),
        "similar_2": (53.0, 55.4),
        "observable_2": (61.9, 65.5),
        "oracle_2": (90.6, 92.2),
        "oracle_4": (91.7, 92.8),
    },
    "saturating": {
        "zero_shot": (50.0, 50.6),
        "random_2": (46.3, 47.7),
        "similar_2": (52.3, 54.1),
        "observable_2": (64.8, 68.5),
        "oracle_2": (72.1, 73.5),
        "oracle_4": (72.8, 73.7),
    },
    "strong": {
        "zero_shot": (68.4, 70.1),
        "random_2": (62.5, 63.8),
        "similar_2": (60.5, 60.9),
        "observable_2": (78.8, 79.9),
        "oracle_2": (85.3, 86.1),
        "oracle_4": (88.1, 89.0),
    },
    "order": {
        "zero_shot": (50.0, 50.6),
        "random_2": (47.2, 48.6),
        "similar_2": (53.0, 55.2),
        "observable_2": (69.5, 72.6),
        "oracle_2": (80.3, 80.6),
        "oracle_4": (83.3, 84.5),
    },
    "harmful": {
        "zero_shot": (68.4, 70.1),
        "random_2": (63.7, 64.2),
        "similar_2": (65.8, 67.2),
        "observable_2": (63.7, 66.0),
        "oracle_2": (91.3, 93.0),
        "oracle_4": (90.6, 92.3),
        "observable_upto_4": (70.4, 71.9),
    },
}
TOLERANCE = 0.5  # points: a few of 1200 queries crossing their threshold under other CPU kernels
# additive_digest() of commit eb46077, the parent of f55d107 that added the worlds (its sim.py and pools.py at the root)
ADDITIVE_DIGEST = "7722f3855a8a15b7"


@functools.cache
def calibration(world: str, seed: int = 0) -> dict:
    """gen_rl_data.py --calibrate --world WORLD --seed SEED (the anchors, which only the reward spread uses, fewer)."""
    return sim.calibrate(sim.Simulator(sim.world_config(world, seed=seed)), num_anchors=64, seed=seed)


@functools.lru_cache(maxsize=16)
def small_sim(world: str, seed: int = 0, **overrides) -> sim.Simulator:
    return sim.Simulator(sim.world_config(world, seed=seed, num_train=300, num_val=80, dim=64, **overrides))


def random_pools(s: sim.Simulator, split: str, n: int, size: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """n random queries of `split` and a random pool of `size` train items each (never the query's image)."""
    queries = torch.randperm(len(s.items[split]), generator=g)[:n]  # (B,)
    rows = queries if split == "train" else torch.full_like(queries, -1)
    exclude = pools.exclusion_mask(s.latents[split]["image_id"][queries], s.latents["train"]["image_id"], rows)
    return queries, pools.build_pools("random", size, exclude, g)  # (B,), (B, K)


def additive_digest() -> str:
    """sha256 of the additive world's embeddings, scores at 0-4 shots, oracle and observable picks, calibration."""
    import hashlib

    s = sim.Simulator(sim.SimConfig(seed=3, num_train=600, num_val=150, dim=64))
    h = hashlib.sha256()
    for key in sorted(s.emb):
        h.update(s.emb[key].numpy().tobytes())
    g = torch.Generator().manual_seed(0)
    for split in sim.SPLITS:
        queries = torch.randint(len(s.items[split]), (256,), generator=g)
        icds = torch.rand(256, 600, generator=g).argsort(dim=1)[:, :4]
        for k in range(5):
            res = s.score(split, queries, icds[:, :k])
            for field in ("acc", "correct", "gt_prob", "rel"):
                h.update(res[field].numpy().tobytes())
            h.update("\n".join(res["prediction"]).encode())
        rows = queries if split == "train" else torch.full_like(queries, -1)
        exclude = pools.exclusion_mask(s.latents[split]["image_id"][queries], s.latents["train"]["image_id"], rows)
        pool = pools.build_pools("random", 24, exclude, g)
        for k in range(1, 5):
            for observable in (False, True):
                h.update(s.oracle(split, queries, pool, k, observable=observable).numpy().tobytes())
    cal = sim.calibrate(s, pool_size=24, num_anchors=64)
    # the keys calibrate had at that commit (the best of 0..k and its shots came with the harmful world)
    old = [
        (k, v) for k, v in cal.items() if not k.startswith("observable") and "_upto_" not in k and "_shots_" not in k
    ]
    h.update(repr(sorted(old)).encode())
    return h.hexdigest()[:16]


def test_additive_world_keeps_its_bytes():
    """The default world scores, searches and calibrates bit for bit as before the worlds existed (the same pinned
    child process as tests/test_pinned.py, on the CPUs pinned there)."""
    if os.uname().machine != "x86_64" or not cpu_model().startswith("AMD EPYC"):
        pytest.skip(f"pins are for AVX2 kernels on AMD EPYC CPUs, this is {cpu_model()}")
    env = {**os.environ, **KERNELS, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    code = "import test_worlds; print(test_worlds.additive_digest())"
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert child.stdout.strip() == ADDITIVE_DIGEST
    assert sim.world_config("additive") == sim.SimConfig() and sim.SimConfig().additive


# the default world's table in the plain suite; the others' (about 4 s each) with the slow evidence
SLOW_UNLESS_DEFAULT = [w if w == "additive" else pytest.param(w, marks=pytest.mark.slow) for w in sim.WORLDS]


@pytest.mark.parametrize("world", SLOW_UNLESS_DEFAULT)
def test_calibration_table_within_tolerance(world):
    got, want = calibration(world), TABLES[world]
    assert got["zero_shot"] == pytest.approx(want["zero_shot"], abs=TOLERANCE)
    for row in ("random", "similar", "oracle", "observable", "observable_upto"):
        if row in want:
            assert [got[f"{row}_{k}"] for k in range(1, 5)] == pytest.approx(want[row], abs=TOLERANCE), row


def test_the_default_world_meets_its_calibration_targets():
    """The targets the default world was calibrated to (its table above pins its values; these say why they matter)."""
    r = calibration("additive")
    assert 45 <= r["random_1"] <= 52
    assert r["random_4"] < r["random_1"]
    for k in (1, 2):
        assert r[f"similar_{k}"] >= r[f"random_{k}"] + 1
    for k in (1, 2, 3, 4):
        assert r[f"oracle_{k}"] >= r[f"random_{k}"] + 8
    assert 0.25 <= r["varying_reward_frac"] <= 0.60


@pytest.mark.slow  # twenty calibrations at the default sizes (shared with the next test): about 90 s on one core
@pytest.mark.parametrize("world", list(sim.WORLDS))
def test_seeds_1_to_4_span_the_documented_ranges_and_the_oracle_leads_on_each(world):
    """docs/worlds.md's claims beyond seed 0's table: each value's range over seeds 1-4, the oracle above every other
    row at every shot count on every seed, and in the strong world random 2-shot costing 5.2-6.8 points."""
    cals = [calibration(world, s) for s in SEEDS]
    for key, (lo, hi) in RANGES[world].items():
        values = [c[key] for c in cals]
        assert (min(values), max(values)) == pytest.approx((lo, hi), abs=TOLERANCE), key
    for seed, c in zip(SEEDS, cals):
        for k in range(1, 5):
            others = {row: c[f"{row}_{k}"] for row in ("random", "similar", "observable")} | {"zero": c["zero_shot"]}
            assert c[f"oracle_{k}"] > max(others.values()), (seed, k, c[f"oracle_{k}"], others)
    if world == "strong":
        cost = [c["zero_shot"] - c["random_2"] for c in cals]
        assert (min(cost), max(cost)) == pytest.approx((5.2, 6.8), abs=2 * TOLERANCE)


@pytest.mark.slow  # the calibrations of the test above
@pytest.mark.parametrize("seed", SEEDS)
def test_each_world_shows_what_it_mirrors_on_seeds_1_to_4(seed):
    """The phenomena docs/worlds.md reads off seed 0's tables, on seeds whose tables no test pins: a phenomenon, not one
    draw's accident."""
    add, copy, sat, strong, order, harm = (
        calibration(w, seed) for w in ("additive", "copy", "saturating", "strong", "order", "harmful")
    )
    # strong: zero-shot about 70; random 2-shot costs 5-8 points; similarity is no better than random plus a point;
    # the oracle still finds a narrow kind of ICD that helps.
    assert 68 <= strong["zero_shot"] <= 72
    assert 5 <= strong["zero_shot"] - strong["random_2"] <= 8
    assert strong["similar_2"] <= strong["random_2"] + 1
    assert strong["oracle_1"] > strong["zero_shot"] + 5
    # copy: an ICD whose answer is the query's lifts the oracle far above the additive one, while nothing in the
    # embeddings tells which ICD that is (the observable ceiling stays below the additive world's).
    assert copy["oracle_1"] > add["oracle_1"] + 10 and copy["observable_1"] < add["observable_1"]
    # saturating: most of the oracle's gain by 2 shots; 3 and 4 add little.
    assert sat["oracle_4"] - sat["oracle_2"] < 0.2 * (sat["oracle_2"] - sat["zero_shot"])
    # order: one ICD alone answers as in the additive world; with several, primacy and neighbours change the rest.
    assert order["oracle_1"] == add["oracle_1"] and order["random_1"] == add["random_1"]
    assert order["oracle_4"] > add["oracle_4"] and order["similar_4"] < add["similar_4"]
    # harmful: zero-shot about 70; random and the most similar demonstrations below it at every shot count; the best
    # of 0..4 that the embeddings reveal lifts a minority above zero-shot with under half a demonstration on average;
    # where demonstrations help (additive), that best uses all four.
    assert 68 <= harm["zero_shot"] <= 72
    assert all(harm[f"{row}_{k}"] < harm["zero_shot"] for row in ("random", "similar") for k in range(1, 5))
    assert harm["observable_upto_4"] > harm["zero_shot"] + 1 and harm["observable_shots_4"] < 0.5
    assert add["observable_shots_4"] == 4 and add["oracle_shots_4"] == 4


@given(world=st.sampled_from(OTHER_WORLDS), seed=st.integers(0, 2**31 - 2))
@settings(max_examples=8)
def test_each_world_is_deterministic_per_seed(world, seed):
    cfg = sim.world_config(world, seed=seed, num_train=200, num_val=50, dim=32)
    a, b = sim.Simulator(cfg), sim.Simulator(cfg)
    c = sim.Simulator(sim.world_config(world, seed=seed + 1, num_train=200, num_val=50, dim=32))
    g = torch.Generator().manual_seed(seed)
    queries, pool = random_pools(a, "val", 32, 12, g)
    icds = pool[:, :4]
    ra, rb, rc = (s.score("val", queries, icds) for s in (a, b, c))
    assert ra["prediction"] == rb["prediction"]
    for field in ("acc", "gt_prob", "rel"):
        assert torch.equal(ra[field], rb[field]), field
    assert not torch.equal(ra["gt_prob"], rc["gt_prob"])
    for observable in (False, True):
        assert torch.equal(
            a.oracle("val", queries, pool, 3, observable=observable),
            b.oracle("val", queries, pool, 3, observable=observable),
        )


@given(world=st.sampled_from(list(sim.WORLDS)), sim_seed=st.integers(0, 2), seed=seeds, k=st.integers(1, 3))
@settings(max_examples=25)
def test_search_is_exact_when_the_beam_holds_every_partial_sequence(world, sim_seed, seed, k):
    """With a beam as large as the number of ordered partial sequences (so also of partial sets, which the additive
    equations' set search keeps), the search values every full sequence: it finds the best VQA accuracy (then
    gt_prob) over all of them, in every world."""
    s = small_sim(world, sim_seed)
    queries, pool = random_pools(s, "val", 16, 6, torch.Generator().manual_seed(seed))
    perms = torch.tensor(list(itertools.permutations(range(6), k)))  # (P, k)
    res = s.score("val", queries.repeat_interleave(len(perms)), pool[:, perms].flatten(0, 1))
    value = (10 * res["acc"].double() + res["gt_prob"].double()).view(16, -1)  # acc, then gt_prob
    best = s.oracle("val", queries, pool, k, beam=math.perm(6, k - 1) if k > 1 else 1)
    got = s.score("val", queries, best)
    assert torch.allclose(10 * got["acc"].double() + got["gt_prob"].double(), value.amax(1), atol=1e-6)
    assert all(len(set(row)) == k and set(row) <= set(p) for row, p in zip(best.tolist(), pool.tolist()))


@given(world=st.sampled_from(OTHER_WORLDS), seed=seeds, k=st.integers(1, 4))
@settings(max_examples=12)
def test_search_never_picks_padding_and_beats_random_sequences_on_average(world, seed, k):
    s = small_sim(world, 1)
    g = torch.Generator().manual_seed(seed)
    queries, pool = random_pools(s, "val", 40, 20, g)
    pool = pool.masked_fill(torch.rand(40, 20, generator=g) < 0.2 * (torch.arange(20) < 4), -1)  # some padding
    for observable in (False, True):
        best = s.oracle("val", queries, pool, k, observable=observable)
        assert all(set(row) <= set(p) - {-1} and len(set(row)) == k for row, p in zip(best.tolist(), pool.tolist()))
    best = s.oracle("val", queries, pool, k)
    seqs = pool.gather(1, pools.random_sequences(pool >= 0, 8, k, g).flatten(1)).view(-1, k)  # (B*8, k)
    rand = s.score("val", queries.repeat_interleave(8), seqs)["acc"].view(40, 8)
    assert (s.score("val", queries, best)["acc"] >= rand.amax(1)).float().mean() >= 0.95


@given(sim_seed=st.integers(0, 3), seed=seeds, k=st.integers(1, 4))
def test_copy_repeats_the_answer_of_the_resembling_icd(sim_seed, seed, k):
    """A copying reply is the shown answer of the ICD with the strongest pull, scored by the query's annotators: the
    query's own answer earns its full credit, another answer what it earns (mostly 0); gt_prob mixes the two."""
    s = small_sim("copy", sim_seed)
    g = torch.Generator().manual_seed(seed)
    queries = torch.randint(80, (128,), generator=g)
    icds = torch.rand(128, 300, generator=g).argsort(1)[:, :k]
    res, logit = s.score("val", queries, icds), s.logit("val", queries, icds)
    margin = logit - s.latents["val"]["threshold"][queries]
    q, c = s.latents["val"], s.latents["train"]
    same_type = q["answer_type"][queries][:, None] == c["answer_type"][icds]
    same_topic = q["topic"][queries][:, None] == c["topic"][icds]
    same_super = q["supertopic"][queries][:, None] == c["supertopic"][icds]
    affinity = torch.where(same_topic, 1.0, torch.where(same_super, s.cfg.help_supertopic, 0.0))
    resemblance = same_type * (s.cfg.copy_question + (1 - s.cfg.copy_question) * affinity)
    pull, source = (resemblance * s.position_weights(k)).max(1)
    copies = s.cfg.copy_weight * pull > margin.exp()
    assert copies.any() and (~copies).any()
    for i in range(128):
        answers = s.items["val"][int(queries[i])]["answers"]
        pred = res["prediction"][i]
        if copies[i]:
            shown = s.items["train"][int(icds[i, source[i]])]["answers"]
            assert pred == max(shown, key=shown.count)  # the ICD's majority answer, as the prompt shows it
            assert float(res["acc"][i]) == pytest.approx(vqa_score(pred, answers))
            p = float(torch.sigmoid(torch.tensor(float(s.cfg.copy_weight * pull[i])).log() - margin[i].double()))
            want = (1 - p) * float(torch.sigmoid(logit[i].double())) + p * float(res["acc"][i])
            assert float(res["gt_prob"][i]) == pytest.approx(want, abs=1e-6)
        else:  # the model's own answer: right above its threshold, wrong below
            assert (float(res["acc"][i]) > 0) == bool(margin[i] > 0)
            assert pred == max(answers, key=answers.count) or margin[i] <= s.cfg.band
        assert bool(res["correct"][i]) == (float(res["acc"][i]) > 0)
        assert float(res["rel"][i]) == pytest.approx(answer_rel(pred, answers))
    # Without any resembling ICD nothing is copied: the reply is the additive world's.
    unrelated = resemblance.sum(1) == 0
    additive = small_sim("additive", sim_seed).score("val", queries, icds)
    assert [p for p, u in zip(res["prediction"], unrelated) if u] == [
        p for p, u in zip(additive["prediction"], unrelated) if u
    ]


@given(sim_seed=st.integers(0, 3), seed=seeds)
def test_saturating_gains_diminish_and_format_and_topic_complement(sim_seed, seed):
    s = small_sim("saturating", sim_seed)
    g = torch.Generator().manual_seed(seed)
    queries = torch.randint(80, (256,), generator=g)
    icds = torch.rand(256, 300, generator=g).argsort(1)[:, :2]
    l0 = s.logit("val", queries, icds[:, :0])
    sens = s.latents["val"]["sensitivity"][queries]
    h = s.helpfulness("val", queries, icds)
    w = s.position_weights(2)
    pair = s.logit("val", queries, icds) - l0 + 2 * s.cfg.shot_cost  # sensitivity * effect
    gains = (h * w).clamp(min=0).sort(1, descending=True).values
    q, c = s.latents["val"], s.latents["train"]
    fmt = q["answer_type"][queries][:, None] == c["answer_type"][icds]
    top = (q["topic"][queries][:, None] == c["topic"][icds]) & ~c["misleading"][icds]
    both = (fmt[:, 0] & top[:, 1]) | (fmt[:, 1] & top[:, 0])
    want = gains[:, 0] + s.cfg.gain_decay * gains[:, 1] + (h * w).clamp(max=0).sum(1) + s.cfg.help_pair * both
    assert torch.allclose(pair, sens * (want - s.redundancy(icds)), atol=1e-5)
    # Two helpful ICDs add less than their sum, unless they complement each other: pairs drawn among each query's
    # helpful train items (random pairs are rarely both helpful; help below 1e-3 would hide the loss in rounding).
    every = s.helpfulness("val", queries, torch.arange(300).expand(256, -1))  # (B, N_train)
    icds = torch.multinomial((every > 1e-3).double() + 1e-12, 2, generator=g)  # (B, 2) distinct, helpful if possible
    h = s.helpfulness("val", queries, icds)
    pair = s.logit("val", queries, icds) - l0 + 2 * s.cfg.shot_cost
    fmt = q["answer_type"][queries][:, None] == c["answer_type"][icds]
    top = (q["topic"][queries][:, None] == c["topic"][icds]) & ~c["misleading"][icds]
    both = (fmt[:, 0] & top[:, 1]) | (fmt[:, 1] & top[:, 0])
    helpful = (h > 1e-3).all(1) & ~both & (s.redundancy(icds) == 0)
    assert helpful.sum() >= 32, int(helpful.sum())
    assert (pair[helpful] < (sens * (h * w).sum(1))[helpful] - 1e-6).all()


@given(sim_seed=st.integers(0, 3), seed=seeds, k=st.integers(2, 4))
def test_order_weighs_first_and_last_and_neighbours_lean_on_each_other(sim_seed, seed, k):
    s = small_sim("order", sim_seed)
    w = s.position_weights(k)
    assert w[0] > w[1] and w[-1] == 1 and w[0] == pytest.approx(s.cfg.position_decay ** (k - 1) + s.cfg.primacy)
    assert torch.equal(s.position_weights(1), torch.ones(1))
    g = torch.Generator().manual_seed(seed)
    queries = torch.randint(80, (128,), generator=g)
    icds = torch.rand(128, 300, generator=g).argsort(1)[:, :k]
    h = s.helpfulness("val", queries, icds)
    effect = h @ w + s.cfg.neighbour * torch.minimum(h[:, 1:], h[:, :-1]).sum(1) - s.redundancy(icds)
    want = s.latents["val"]["difficulty"][queries] + s.latents["val"]["sensitivity"][queries] * effect
    assert torch.allclose(s.logit("val", queries, icds), want - s.cfg.shot_cost * k, atol=1e-5)


@given(sim_seed=st.integers(0, 3), seed=seeds)
@settings(max_examples=10)
def test_order_with_one_icd_answers_as_the_additive_world(sim_seed, seed):
    """docs/worlds.md: one demonstration alone answers exactly as in the additive world (the 1-shot rows are equal),
    and so the 1-shot oracle reaches the same scores; with more, the order world answers otherwise."""
    order, add = small_sim("order", sim_seed), small_sim("additive", sim_seed)
    queries, pool = random_pools(order, "val", 64, 20, torch.Generator().manual_seed(seed))
    for icds in (pool[:, :1], pool[:, 5:6], order.oracle("val", queries, pool, 1), add.oracle("val", queries, pool, 1)):
        a, b = order.score("val", queries, icds), add.score("val", queries, icds)
        assert a["prediction"] == b["prediction"]
        assert all(torch.equal(a[f], b[f]) for f in ("acc", "correct", "gt_prob", "rel"))
    found = [s.score("val", queries, s.oracle("val", queries, pool, 1)) for s in (order, add)]
    assert torch.equal(found[0]["acc"], found[1]["acc"]) and torch.equal(found[0]["gt_prob"], found[1]["gt_prob"])
    assert not torch.equal(order.logit("val", queries, pool[:, :3]), add.logit("val", queries, pool[:, :3]))


class TorchCalls(TorchFunctionMode):
    """Counts every torch function and tensor method called under it (indexing and .tolist() included)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("world", sim.WORLDS)
def test_scoring_is_vectorised_in_every_world(world):
    """Scoring 500 groups of 16 makes no more Python calls, builtin calls or torch operations (tensor indexing and
    .tolist() included) than 10 groups: no loop over sequences, whatever it loops with (a wall-clock bound would fail
    on a busy machine and pass a slow loop on a fast one). Both sizes fit one chunk of `Simulator.redundancy`."""
    s = small_sim(world)

    def calls(n: int) -> dict[str, int]:
        g = torch.Generator().manual_seed(0)
        queries, icds = torch.randint(300, (n,), generator=g), torch.randint(300, (n, 4), generator=g)
        s.score("train", queries, icds)  # warm-up: caches
        count, torch_calls = {"call": 0, "c_call": 0}, TorchCalls()
        sys.setprofile(lambda frame, event, arg: count.__setitem__(event, count[event] + 1) if event in count else None)
        try:
            with torch_calls:
                s.score("train", queries, icds)
        finally:
            sys.setprofile(None)
        return count | {"torch": torch_calls.count}

    small, large = calls(10 * 16), calls(500 * 16)
    assert all(large[k] <= small[k] + 2 for k in small), (small, large)


@pytest.mark.slow  # timing: several seconds, and only meaningful on an otherwise quiet machine
def test_scoring_within_one_and_a_half_times_the_additive_time():
    """bench.py --only sim: every world's median per-call time at a GRPO-like batch, interleaved with additive's."""
    import statistics

    import bench

    times = bench.bench_sim(repeats=7)
    base = statistics.median(times["additive"])
    for world, t in times.items():
        assert statistics.median(t) <= 1.5 * base, world


def one_line(error: pytest.ExceptionInfo, pattern: str) -> None:
    """The error's message is one line, all of it matched by `pattern`."""
    message = str(error.value)
    assert "\n" not in message and re.fullmatch(pattern, message), message


@pytest.mark.parametrize(
    ("pairs", "match"),
    [
        (["gain_decay=2"], r"SimConfig\.gain_decay must be in \[0, 1\], got 2\.0"),
        (["copy_weight=-1"], r"SimConfig\.copy_weight must be in \[0, inf\), got -1\.0"),
        (["help_base=nan"], r"SimConfig\.help_base must be in \(-inf, inf\), got nan"),
        (["answer_type_probs=0.5,0.5"], r"SimConfig\.answer_type_probs needs 4 entries, got 2"),
        (["typo=1"], r"'typo=1': 'typo' is not a parameter of sim\.SimConfig"),
        (["band"], r"'band' is not FIELD=VALUE"),
        (["dim=6.5"], r"'dim=6\.5': dim takes an integer, got '6\.5'"),
        (["seed=1"], r"'seed=1': set seed with --seed, not as a parameter"),
        (["world=copy"], r"'world=copy': set world with --world, not as a parameter"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(pairs, match):
    with pytest.raises(ValueError) as e:
        sim.world_config("copy", **sim.parse_settings(pairs))
    one_line(e, match)


@pytest.mark.parametrize(
    ("pair", "match"),
    [
        ("typo=1", r"'typo=1': 'typo' is not a parameter of sim\.SimConfig"),  # an unknown field
        ("dim=0", r"SimConfig\.dim must be in \[1, inf\), got 0"),  # an integer out of range
        ("position_decay=0", r"SimConfig\.position_decay must be in \(0, inf\), got 0\.0"),  # an open lower bound
        ("redundancy_threshold=1", r"SimConfig\.redundancy_threshold must be in \[0, 1\), got 1\.0"),  # open upper
    ],
)
def test_bad_sim_set_flags_are_refused_on_the_command_line_in_one_line(pair, match, monkeypatch, capsys):
    """gen_rl_data.py's command line, parsed and run as its __main__ does (in this process, not a child: the child
    route is test_gen_rl_data.py's): one line on stderr, exit code 2, before any simulator is built."""
    import gen_rl_data
    from icl_select.cli import run_cli

    built = []
    monkeypatch.setattr(gen_rl_data, "Simulator", lambda cfg: built.append(cfg))
    monkeypatch.setattr(sys, "argv", ["gen_rl_data.py", "--calibrate", "--sim-set", pair])
    with pytest.raises(SystemExit) as e:
        run_cli(gen_rl_data.main, gen_rl_data.Args)
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "" and not built
    assert re.fullmatch(f"error: --sim-set: {match}\n", err), err


def test_settings_take_their_fields_types_and_override_the_world():
    got = sim.parse_settings(["primacy=0.9", "dim=64", "image_group_probs=0.5,0.5", "help_pair=1"])
    assert got == {"primacy": 0.9, "dim": 64, "image_group_probs": (0.5, 0.5), "help_pair": 1.0}
    cfg = sim.world_config("order", **got)
    assert (cfg.world, cfg.primacy, cfg.neighbour, cfg.dim, cfg.help_pair) == ("order", 0.9, 0.3, 64, 1.0)
    assert not cfg.additive and sim.world_config("order", primacy=0, neighbour=0).additive
    with pytest.raises(ValueError) as e:
        sim.world_config("nope")
    one_line(e, r"unknown world 'nope'; the worlds are " + ", ".join(sim.WORLDS))


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda c: c.__setitem__("world", 3), r".*/meta\.json: field 'sim_config\.world': expected a string, got 3"),
        (
            lambda c: c.__setitem__("world", "nope"),
            r".*/meta\.json: field 'sim_config': SimConfig\.world must be one of .*, got 'nope'",
        ),
        (
            lambda c: c.__setitem__("gain_decay", 1.5),
            r".*/meta\.json: field 'sim_config': SimConfig\.gain_decay must be in \[0, 1\], got 1\.5",
        ),
    ],
)
def test_meta_json_world_is_validated(small_data, tmp_path, edit, match):
    meta = json.loads((small_data / "meta.json").read_text())
    edit(meta["sim_config"])
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError) as e:
        read_meta(tmp_path)
    one_line(e, match)
