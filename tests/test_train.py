"""rce.py and grpo.py end to end on a small simulated dataset: run folders, exact resume, GRPO invariants, errors."""

import builtins
import copy
import errno
import io
import json
import math
import os
import re
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import patch

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import SMALL_NET
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import evaluate
import gen_rl_data
import grpo
import rce
from icl_select import batches, budget, epochs, runs, stops, validation
from icl_select.backends import ScoreCache
from icl_select.cli import run_cli
from icl_select.data import load_dataset
from icl_select.runs import checkpoint_meta, load_selector, save_checkpoint
from model import PointerSelector, SelectorConfig, stop_loss

FAST = dict(batch_size=8, val_frac=0.25, keep_every=1)
FIELDS = ("acc", "correct", "gt_prob", "rel")


def records(run, kind=None):
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if r.get("kind") == kind]


@pytest.fixture(scope="module")
def rce_run(small_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "rce"
    rce.main(rce.Args(data=small_data, out=out, epochs=3, **FAST, **SMALL_NET))
    return out


def test_rce_run_folder(rce_run):
    for name in ("config.json", "metrics.jsonl", "model.safetensors", "model.json", "ckpt/epoch_003.safetensors"):
        assert (rce_run / name).is_file(), name
    assert not list(rce_run.rglob("*.tmp"))
    epochs = records(rce_run)
    assert [r["epoch"] for r in epochs] == [0, 1, 2, 3]
    # simulator: the best epoch is the first with the highest true accuracy of its greedy picks, not val/reward
    assert all(r["select_metric"] == "val/acc" for r in epochs)
    best = max(epochs[1:], key=lambda r: (r["val/acc"], -r["epoch"]))
    assert epochs[-1]["best_epoch"] == best["epoch"]
    assert all(0 <= r["val/acc"] <= 100 for r in epochs)  # simulator: true accuracy of the greedy picks is logged
    taus = [r["train/tau"] for r in epochs[1:]]
    assert taus == sorted(taus, reverse=True) and 0.5 < taus[-1] < 2.0  # annealed 2.0 -> 0.5
    config = json.loads((rce_run / "config.json").read_text())
    assert config["args"]["epochs"] == 3 and config["data"]["simulation"] and config["versions"]["torch"]
    picks = json.loads((rce_run / "model.json").read_text())["picks"]
    assert picks == load_dataset(config["data"]["folder"]).seq_len == 4  # the selector makes the data's count


def killed_after_epoch(monkeypatch, epoch):
    """Make the next run die (as if killed) right after writing its checkpoint of `epoch`."""

    def save_then_die(out, e, *a):
        save_checkpoint(out, e, *a)
        if e == epoch:
            raise KeyboardInterrupt

    monkeypatch.setattr(runs, "save_checkpoint", save_then_die)


def test_rce_resume_is_bit_identical(small_data, rce_run, tmp_path, monkeypatch):
    out = tmp_path / "rce"
    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        killed_after_epoch(m, 2)
        rce.main(rce.Args(data=small_data, out=out, epochs=3, **FAST, **SMALL_NET))
    assert not (out / "ckpt/epoch_003.safetensors").exists()
    rce.main(rce.Args(data=small_data, out=out, epochs=3, **FAST, **SMALL_NET))
    assert (out / "model.safetensors").read_bytes() == (rce_run / "model.safetensors").read_bytes()
    assert (out / "ckpt/epoch_003.safetensors").read_bytes() == (rce_run / "ckpt/epoch_003.safetensors").read_bytes()
    assert (out / "metrics.jsonl").read_text() == (rce_run / "metrics.jsonl").read_text()


def test_rce_killed_mid_epoch_resumes_bit_identical(small_data, rce_run, tmp_path, monkeypatch):
    out = tmp_path / "mid"
    real = rce.make_batch
    calls = {"n": 0}
    args = rce.Args(data=small_data, out=out, epochs=3, **FAST, **SMALL_NET)
    steps = batches.steps_per_epoch(batches.split_queries(load_dataset(small_data), args).train, args.batch_size)
    assert steps >= 2

    def dies_in_epoch_3(*a):
        calls["n"] += 1
        if calls["n"] == 3 * steps:  # the last step of epoch 3: its other steps have updated the weights
            raise KeyboardInterrupt
        return real(*a)

    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        m.setattr(rce, "make_batch", dies_in_epoch_3)
        rce.main(rce.Args(data=small_data, out=out, epochs=3, **FAST, **SMALL_NET))
    assert (out / "ckpt/epoch_002.safetensors").exists() and not (out / "ckpt/epoch_003.safetensors").exists()
    rce.main(rce.Args(data=small_data, out=out, epochs=3, **FAST, **SMALL_NET))
    assert (out / "model.safetensors").read_bytes() == (rce_run / "model.safetensors").read_bytes()
    assert (out / "metrics.jsonl").read_text() == (rce_run / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match=r"mid.*--lr.*0\.0001.*0\.001"):
        rce.main(rce.Args(data=small_data, out=out, epochs=3, lr=1e-3, **FAST, **SMALL_NET))


def test_validation_split_is_by_image(small_data):
    from icl_select.batches import split_queries
    from icl_select.data import load_dataset

    ds = load_dataset(small_data)
    split = split_queries(ds, rce.Args(**FAST))
    image = [ds.items["train"][q]["image_id"] for q in ds.groups.queries.tolist()]
    assert not {image[i] for i in split.val.tolist()} & {image[i] for i in split.train.tolist()}
    assert abs(len(split.val) - 12) <= 2


def test_rerunning_a_finished_run_changes_nothing_and_top1(small_data, rce_run, tmp_path, capsys):
    """Every stage resumes when its command is re-run: a finished run is left as it is, and says so."""
    before = {p: p.read_bytes() for p in rce_run.rglob("*") if p.is_file()}
    rce.main(rce.Args(data=small_data, out=rce_run, epochs=3, **FAST, **SMALL_NET))
    assert {p: p.read_bytes() for p in rce_run.rglob("*") if p.is_file()} == before
    assert "finished" in capsys.readouterr().err
    rce.main(rce.Args(data=small_data, out=tmp_path / "sup", epochs=1, weights="top1", **FAST, **SMALL_NET))
    reward = torch.tensor([[0.0, 2.0, 2.0, 1.0], [1.0, 0.0, 5.0, 0.0]])
    mask = torch.tensor([[True, True, True, True], [True, True, False, True]])
    assert torch.equal(rce.top1_weights(reward, mask), torch.tensor([[0.0, 1, 0, 0], [1, 0, 0, 0]]))


def test_grpo_invariants_with_step_logs(small_data, rce_run, tmp_path):
    out = tmp_path / "g"
    grpo.main(grpo.Args(data=small_data, init=rce_run, out=out, epochs=2, kl_beta=0.1, kl_target=0.05, **FAST))
    steps = records(out, "step")
    first = steps[0]
    # the old policy and the reference are the init itself, with dropout off: ratio exactly 1, KL exactly 0
    assert first["grpo/ratio_mean"] == 1.0 and first["grpo/kl_ref"] == 0.0
    assert "grpo/approx_kl_old" not in first  # measured at each epoch's last step only (a forward more)
    assert all(s["grpo/approx_kl_old"] > 0 for s in steps if "grpo/approx_kl_old" in s)  # the update moved it
    assert first["grpo/clip_frac_low"] == first["grpo/clip_frac_high"] == 0.0 and first["grpo/beta"] == 0.1
    assert all(s["grpo/ratio_mean"] == 1.0 for s in steps)  # num_iterations=1: always on-policy
    assert len({s["grpo/beta"] for s in steps}) > 1  # adaptive beta moves and is logged per step
    fixed = tmp_path / "fixed"
    grpo.main(grpo.Args(data=small_data, init=rce_run, out=fixed, epochs=2, kl_beta=0.123, **FAST))
    epochs = records(fixed)
    assert all(r["grpo/beta"] == 0.123 for r in epochs[1:]) and not records(fixed, "step")
    assert epochs[0]["grpo/selection_change"] == 0.0 and epochs[-1]["grpo/kl_ref"] > 0
    # compare.py's training tables name the metrics the stages log: a renamed metric must not silently vanish there
    from compare import TRAIN_COLUMNS

    logged = set(epochs[1]) | set(records(rce_run)[1]) | set(records(out)[1])
    # online or stopping selectors alone: test_grpo_online_and_resume_bit_identical and the stopping tests see them
    elsewhere = {"grpo/explored", "val/demos"}
    assert set(TRAIN_COLUMNS) - elsewhere <= logged, set(TRAIN_COLUMNS) - elsewhere - logged
    for key in ("grpo/adv_abs_max", "train/grad_norm", "grpo/reward_mean", "grpo/reward_std"):
        assert key in epochs[1], key


def test_kl_grad_share_is_measured_where_the_kl_pulls_and_never_changes_training(
    small_data, rce_run, tmp_path, monkeypatch
):
    """At an epoch's first step of epoch 1 the policy is the reference, so the KL gradient is 0 whatever beta is:
    the share is measured at the last step instead, and measuring it leaves the trained bytes as they were."""
    kw = dict(data=small_data, init=rce_run, epochs=2, kl_beta=0.5, lr=3e-3, **FAST)
    grpo.main(grpo.Args(out=tmp_path / "measured", **kw))
    shares = [r["grpo/kl_grad_share"] for r in records(tmp_path / "measured")[1:]]
    assert all(0 < s < 1 for s in shares), shares
    monkeypatch.setattr(grpo, "kl_grad_share", lambda *a: 0.0)
    grpo.main(grpo.Args(out=tmp_path / "unmeasured", **kw))
    for name in ("model.safetensors", "ckpt/epoch_002.safetensors"):
        assert (tmp_path / "measured" / name).read_bytes() == (tmp_path / "unmeasured" / name).read_bytes()


def test_grpo_iterations_clip_and_frozen_backbone(small_data, rce_run, tmp_path):
    out = tmp_path / "it"
    grpo.main(
        grpo.Args(
            data=small_data, init=rce_run, out=out, epochs=1, num_iterations=4, lr=3e-3, freeze_backbone=True, **FAST
        )
    )
    last = records(out)[-1]
    assert last["grpo/ratio_mean"] != 1.0 and last["grpo/approx_kl_old"] > 0  # later inner updates move the ratio
    before, after = load_selector(rce_run), load_selector(out / "ckpt" / "epoch_001.safetensors")
    for (name, a), b in zip(before.state_dict().items(), after.state_dict().values()):
        frozen = name.startswith(("in_proj", "layers"))
        assert torch.equal(a, b) == frozen, name


def test_offline_ratio_is_one_and_iterations_make_the_clip_bind(small_data, rce_run, tmp_path):
    """Offline groups were not sampled by the policy: with one update per batch the ratio is exactly 1 and the clip
    never binds; more updates per batch move the ratio away from the refreshed old policy until the clip binds."""
    plain, iters = tmp_path / "plain", tmp_path / "iters"
    grpo.main(grpo.Args(data=small_data, init=rce_run, out=plain, epochs=1, lr=3e-3, **FAST))
    grpo.main(grpo.Args(data=small_data, init=rce_run, out=iters, epochs=1, lr=3e-3, num_iterations=4, **FAST))
    one, four = records(plain)[-1], records(iters)[-1]
    assert one["grpo/ratio_mean"] == 1.0 and one["grpo/clip_frac_low"] == one["grpo/clip_frac_high"] == 0.0
    assert four["grpo/clip_frac_low"] + four["grpo/clip_frac_high"] > 0


def test_a_selector_that_may_stop_learns_its_picks_as_one_that_cannot_and_its_stops_held_out(
    small_data, rce_run, tmp_path
):
    """RCE with --can-stop trains the very picks RCE trains without it (to rounding) and then sets its stop at each
    step, alike for every question, from cross-fitting: each half of the anchors outside validation is picked for by a
    selector trained on the other half, answered at 0..S shots, and every such prompt is counted in the run's last
    record, its own, which a re-run of the finished run neither repeats nor changes. RCE continuing it (--init) and the
    offline warm start of a budgeted online run judge its picks filling every slot (a stop sure to give none would leave
    their best epoch to chance); the warm start keeps the stop, the online part sets every step again from its ladders,
    the first per question."""
    out = tmp_path / "rce"
    rce.main(rce.Args(data=small_data, out=out, epochs=3, can_stop=True, **FAST, **SMALL_NET))
    may, cannot = PointerSelector.load(out), PointerSelector.load(rce_run)
    assert all(torch.allclose(v, may.state_dict()[k], atol=1e-5) for k, v in cannot.state_dict().items())
    assert not may.stop_weight.any()
    *epochs, last = records(out)
    ds = load_dataset(small_data)
    outside = len(ds.groups) - len(batches.split_queries(ds, rce.Args(data=small_data, **FAST)).val)
    assert last["epoch"] == epochs[-1]["epoch"] and last["best_epoch"] == epochs[-1]["best_epoch"]
    assert last["lvlm/calls"] - epochs[-1]["lvlm/calls"] == outside * (ds.seq_len + 1), (last, outside)
    go = last["stop/go_on"]  # p(going on) after 0..S - 1 picks
    stop = torch.sigmoid(may.stop_bias.detach() / may.cfg.temperature).tolist()  # p(stop) at each step
    assert len(go) == ds.seq_len and all(0.01 <= p <= 0.99 for p in go) and stop == pytest.approx([1 - p for p in go])
    weights, lines = (out / "model.safetensors").read_bytes(), (out / "metrics.jsonl").read_text()
    rce.main(rce.Args(data=small_data, out=out, epochs=3, can_stop=True, **FAST, **SMALL_NET))
    assert (out / "model.safetensors").read_bytes() == weights and (out / "metrics.jsonl").read_text() == lines
    with torch.no_grad():
        may.stop_bias.fill_(3.0)  # sure to stop at once
    may.save(out)
    rce.main(rce.Args(data=small_data, init=out, out=tmp_path / "rce-again", epochs=2, **FAST, **SMALL_NET))
    grpo_out = tmp_path / "grpo"
    grpo.main(grpo.resolve(grpo.Args(data=small_data, init=out, out=grpo_out, online=True, lvlm_budget=2500)))
    for trained in (tmp_path / "rce-again", grpo_out / "offline"):  # picks alone, judged filling every slot
        demos = [r["val/demos"] for r in records(trained) if "val/demos" in r]
        assert demos and all(d == ds.seq_len for d in demos), (trained, demos)
    warm, after = PointerSelector.load(grpo_out / "offline"), PointerSelector.load(grpo_out)
    assert all(torch.equal(a, b) for a, b in zip(warm.stop_parameters(), may.stop_parameters()))
    assert not torch.equal(warm.in_proj.weight, may.in_proj.weight)
    assert after.stop_weight.any() and after.stop_bias[0] != may.stop_bias[0]
    later = records(grpo_out)[-1]["stop/go_later"]  # p(going on) after 1..S - 1 picks, set on the run's ladders
    p_go = 1 - torch.sigmoid(after.stop_bias[1 : len(later) + 1].detach() / after.cfg.temperature)
    assert p_go.tolist() == pytest.approx(later) and later != pytest.approx(go[1:])


@settings(max_examples=30, deadline=None, database=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(2, 60), S=st.integers(1, 4), temperature=st.floats(0.3, 2))
def test_the_stop_at_each_step_goes_on_where_going_on_wins_held_out(seed, n, S, temperature):
    """Backward from the last step, after t picks p(going on) = the held-out wins' share of all won or lost by going on
    (what an anchor gets with the later steps as set, minus its accuracy at t shots), within [0.01, 0.99], for every
    question alike (w = 0): the constant the stop's own loss would reach on these anchors. Greedy decoding then gives a
    number of demonstrations that scored on them at least as well as any fewer (a stop that averaged what going on won
    over every later length gave none where one demonstration won)."""
    g = torch.Generator().manual_seed(seed)
    acc = torch.rand(n, S + 1, generator=g, dtype=torch.float64) + torch.rand(S + 1, generator=g) - 0.5  # (n, S + 1)
    model = PointerSelector(
        SelectorConfig(dim=8, hidden=16, num_heads=2, can_stop=True, temperature=temperature, picks=S + 1)
    )
    with torch.no_grad():
        model.stop_weight.normal_(generator=g)
        model.stop_bias.normal_(generator=g)
    go, first = stops.set_stops(model, acc)
    rows, value, means = acc.tolist(), [row[S] for row in acc.tolist()], [0.0] * S
    for t in reversed(range(S)):  # by hand, per anchor
        if t == 0:  # what each anchor gets once it takes a first pick, the later steps as set
            assert first.tolist() == pytest.approx(value, abs=1e-12)
        gain = [v - row[t] for v, row in zip(value, rows)]
        means[t] = sum(gain) / n
        wins = sum(x for x in gain if x > 0) / sum(abs(x) for x in gain)
        assert go[t] == pytest.approx(min(max(wins, 0.01), 0.99), abs=1e-12)
        if 0.01 < go[t] < 0.99:  # unclamped: the stop's own loss, for one p(stop) shared by all n, is least there
            at = [math.log(1 - go[t] + d) for d in (0, -1e-3, 1e-3)]
            loss = [stop_loss(torch.full((n,), x, dtype=torch.float64), -torch.tensor(gain)) for x in at]
            assert loss[0] <= min(loss[1:]) + 1e-12
        value = value if go[t] >= 0.5 else [row[t] for row in rows]
    assume(min(abs(m) for m in means) > 1e-9)
    assert not model.stop_weight.any() and torch.equal(model.stop_bias[S], model.stop_bias[S - 1])  # past S: S - 1's
    query, pool = torch.randn(5, 8, generator=g), torch.randn(5, 7, 8, generator=g)
    picks, _ = model.greedy(query, pool, torch.ones(5, 7, dtype=torch.bool), S)  # (5, S)
    given = next((t for t, m in enumerate(means) if m < 0), S)
    assert ((picks >= 0).sum(-1) == given).all(), (picks, means)
    mean = acc.mean(0)  # (S + 1,) that count scored at least as well as any fewer
    assert all(mean[given] >= mean[k] - 1e-12 for k in range(given + 1))


@pytest.mark.parametrize("fill", [False, True])
def test_a_stopping_selectors_groups_are_one_that_cannot_stops_with_its_stop_ladder_beside(small_data, fill):
    """For a selector that may stop, online groups are those a selector that cannot stop would draw: samples that fill
    every slot however likely the stop, never cut short, distinct sequences of distinct pool positions, scored by the
    backend for each prompt in prompt order. Beside the group of one query in --ladder-every its stop ladder: the
    query's greedy sequence filling every slot, however likely the stop, scored at each of its lengths 0..S (0: the
    zero-shot prompt); no other query's ladder is asked of the backend."""
    ds = load_dataset(small_data)
    torch.manual_seed(0)
    policy = PointerSelector(SelectorConfig(dim=512, hidden=32, num_heads=2, can_stop=True)).eval()
    with torch.no_grad():  # it stops after one to three picks, more or less sure of it by step
        policy.stop_bias.copy_(torch.tensor([-0.3, -0.05, 0.05, 0.3]))
        policy.stop_weight.copy_(0.1 * torch.randn(32, generator=torch.Generator().manual_seed(0)))

    def score(queries, icds):  # a score that tells prompts and questions apart
        return dict.fromkeys(FIELDS, (icds >= 0).sum(-1).double() / 4 + queries / 1000)

    class Scorer:
        asked = 0

        def score(self, split, queries, icds):
            self.asked += len(queries)
            return score(queries, icds)

    rows, pool = ds.groups.queries[:23], ds.groups.pools[:23]
    args = grpo.resolve(grpo.Args(online=True, group_size=6, lvlm_budget=1000 if fill else None, ladder_every=3))
    gens = [torch.Generator().manual_seed(s) for s in (0, 1)]
    scorer = Scorer()
    b, explored, ladder = grpo.sample_and_score(policy, scorer, ds, rows, pool, args, *gens, fill)
    S = ds.seq_len
    most = budget.step_calls(len(rows), args.group_size, args.ladder_every, S, True)
    assert scorer.asked == b.seq_mask.sum() + len(rows[::3]) * (S + 1) <= most
    assert torch.equal(ladder.rows, rows[::3]) and torch.equal(ladder.pool, pool[::3])
    going = torch.full((len(rows), S), -1)  # by hand: greedy decoding's choices from its state, never stopping
    stopping = torch.zeros(len(rows), S, dtype=torch.bool)  # and where it would have stopped
    with torch.no_grad():
        s, keys, _ = policy.encode(b.query, b.pool, b.pool_mask)
        avail = b.pool_mask.clone()
        for i in range(len(rows)):
            state, left = s[i : i + 1, None], avail[i : i + 1, None].clone()  # (1, 1, H), (1, 1, K)
            for t in range(S):
                a = torch.cat([left, torch.tensor([[[True]]])], -1)
                dist = policy.step_log_dist(state, keys[i : i + 1], None, a, t=t)[0, 0]  # (K + 1,)
                stopping[i, t] = bool(dist[-1].exp() > 0.5)
                going[i, t] = int(dist[:-1].argmax())
                left[0, 0, going[i, t]] = False
                state = policy.advance(state, keys[i : i + 1], going[i, t].view(1, 1))
    assert stopping[:, 1:].any(-1).all(), stopping  # greedy decoding would stop on each: the ladder does not
    for length in range(S + 1):  # its first `length` picks, in prompt order as the backend gets them
        x = going.where(torch.arange(S) < length, -1)
        want = grpo.compute_reward(score(rows, pool.gather(1, x.clamp_min(0)).where(x >= 0, -1)), args)
        assert torch.allclose(ladder.reward[:, length], want[::3])
    for group, mask in zip(b.seqs.tolist(), b.seq_mask.tolist()):
        kept = [tuple(x) for x, m in zip(group, mask) if m]
        assert len(set(kept)) == len(kept) and all(
            len({c for c in x if c >= 0}) == sum(c >= 0 for c in x) for x in kept
        )
    n = (b.seqs >= 0).sum(-1)[b.seq_mask]  # the samples' lengths: an unsure policy needs no random fill
    assert b.seqs.shape[1] == 6 and explored == 0 and (n == S).all(), n
    want = ((b.seqs >= 0).sum(-1).double() / 4 + rows[:, None].double() / 1000)[b.seq_mask]  # each prompt's score
    assert torch.allclose(b.reward[b.seq_mask], grpo.compute_reward(dict.fromkeys(FIELDS, want), args))


@given(st.integers(0, 2**31 - 1), st.floats(0.5, 2.0))
@settings(max_examples=10, deadline=None)
def test_a_stopping_selectors_picks_learn_as_one_that_cannot_stops_do_and_its_stop_from_no_step(seed, temperature):
    """Online, the picks of a selector that may stop take the update a selector that cannot stop, with the same picks,
    takes on the same groups (PPO and the KL over its picks given that it goes on), to rounding, even against a
    reference whose stop differs; no update moves its stop beyond rounding (and the optimizer never holds it), which is
    set from its ladders alone (PPO once drove the stop to certainty against them; the KL pulled it toward a reference
    whose stop no ladder had set)."""
    g = torch.Generator().manual_seed(seed)
    B, G, S, K, d = 5, 6, 4, 9, 16
    torch.manual_seed(seed)
    may = PointerSelector(SelectorConfig(dim=d, hidden=16, num_heads=2, can_stop=True)).eval()
    with torch.no_grad():
        may.stop_bias.copy_(torch.randn(S, generator=g))
        may.stop_weight.copy_(torch.randn(16, generator=g))
    cannot = PointerSelector(replace(may.cfg, can_stop=False)).eval()
    cannot.load_state_dict({k: v for k, v in may.state_dict().items() if k in cannot.state_dict()})
    query, pool = torch.randn(B, d, generator=g), torch.randn(B, K, d, generator=g)
    seqs = torch.rand(B, G, K, generator=g).argsort(-1)[..., :S]  # (B, G, S) full length
    ok = torch.rand(B, G, generator=g) < 0.9
    reward = torch.rand(B, G, generator=g, dtype=torch.float64)
    b = batches.Batch(query, pool, torch.ones(B, K, dtype=torch.bool), seqs, ok, reward)
    args = grpo.resolve(grpo.Args(online=True, temperature=temperature, kl_beta=0.1))
    adv = grpo.group_advantages(reward, ok).float()
    after = {}
    for policy in (may, cannot):
        ref = copy.deepcopy(policy)
        with torch.no_grad():
            if policy.cfg.can_stop:
                ref.stop_bias.add_(1.0)
            ref_dist = ref(query, b.pool, b.pool_mask, seqs, ok, True, temperature).log_dist
        params = list(policy.parameters())
        opt = torch.optim.SGD(params, lr=1.0)  # Adam's first step: noise's sign
        learner = grpo.Learner(policy, ref, opt, params, None, [])
        before = copy.deepcopy(policy.state_dict())
        grpo.update(learner, b, adv, grpo.Groups(b, adv, ref_dist), args, runs.Loop(beta=0.1), False)
        after[policy.cfg.can_stop] = {k: (before[k], v) for k, v in policy.state_dict().items()}
    for k, (_, end) in after[False].items():
        assert torch.allclose(after[True][k][1], end, atol=1e-6), k
    moved = [k for k, (start, end) in after[False].items() if not torch.equal(start, end)]
    assert moved and all(torch.allclose(*after[True][k], atol=1e-6) for k in ("stop_bias", "stop_weight"))


@settings(max_examples=20, deadline=None, database=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(100, 400), temperature=st.floats(0.05, 2))
def test_the_first_stop_is_fitted_to_go_on_where_going_on_wins(seed, n, temperature):
    """`fit_first_stop` sets w and b_0 alone, and its ridge is the one of RIDGE whose fits on one half of the pairs lose
    least on the other half (`stop_loss`, by hand). Where every state is the same, it is the constant the stop's own
    loss reaches: p(going on) = going on's wins' share (the weight can tell nothing apart). Where going on wins exactly
    on one side of a direction of the state, by far, greedy decoding gives demonstrations to that side and none to the
    other, on fresh states too."""
    g = torch.Generator().manual_seed(seed)
    H = 16
    model = PointerSelector(SelectorConfig(dim=8, hidden=H, num_heads=2, can_stop=True, temperature=temperature))
    with torch.no_grad():
        model.stop_bias.normal_(generator=g)
    later = model.stop_bias[1:].clone()
    states = F.normalize(torch.randn(n, H, generator=g), dim=-1)  # (n, H) unit, as the selector's are
    u = F.normalize(torch.randn(H, generator=g), dim=0)
    side = states @ u > 0  # (n,) where going on wins
    gain = torch.where(side, -1.0, 1.0) * (0.5 + torch.rand(n, generator=g))  # zero-shot minus going on
    assume(0 < side.sum() < n)
    fit = stops.fit_first_stop(model, states, gain)
    assert torch.equal(model.stop_bias[1:], later) and fit["stop/ridge"] in stops.RIDGE
    half = torch.arange(n) % 2
    held = []
    for ridge in stops.RIDGE:
        loss = 0.0
        for h in (0, 1):
            w, b = stops.ridge_fit(states[half == h], gain[half == h], temperature, ridge)
            z = (states[half != h].double() @ w + b) / temperature
            p = torch.sigmoid(z)  # p(stop), by hand: the gain-weighted cross-entropy
            ce = torch.where(gain[half != h] > 0, -p.log(), -(1 - p).log())
            loss += float((gain[half != h].abs() * ce).sum() / gain[half != h].abs().sum())
        held.append(loss)
    assert held[stops.RIDGE.index(fit["stop/ridge"])] == pytest.approx(min(held), rel=1e-9)
    fresh = F.normalize(torch.randn(200, H, generator=g), dim=-1)
    fresh = fresh[(fresh @ u).abs() > 0.3]  # (m, H) clear of the boundary
    z = fresh @ model.stop_weight + model.stop_bias[0]  # greedy decoding goes on where z <= 0
    assert ((z <= 0) == (fresh @ u > 0)).double().mean() > 0.9
    wins = float(gain.clamp_max(0).abs().sum() / gain.abs().sum())
    assume(abs(wins - 0.5) > 1e-3)
    same = stops.fit_first_stop(model, states[:1].expand(n, -1), gain)  # every state alike
    p_go = float(torch.sigmoid(-(states[0] @ model.stop_weight + model.stop_bias[0]).detach() / temperature))
    assert p_go == pytest.approx(wins, abs=1e-4) and same["stop/go_on"] == float(wins >= 0.5)


def test_online_queries_come_from_train_but_never_from_validation_images(small_data, rce_run, tmp_path, monkeypatch):
    asked = []
    real = ScoreCache.score

    def spy(self, split, queries, icds):
        asked.append(queries.clone())
        return real(self, split, queries, icds)

    monkeypatch.setattr(ScoreCache, "score", spy)
    args = grpo.resolve(grpo.Args(data=small_data, init=rce_run, out=tmp_path / "o", online=True, **FAST))
    assert (args.epochs, args.lr, args.reward_mode, args.kl_beta) == (30, 1e-3, "hard_plus_gtprob", 0.3)
    grpo.main(replace(args, epochs=1))
    ds = load_dataset(small_data)
    split = batches.split_queries(ds, args)
    image = torch.tensor([it["image_id"] for it in ds.items["train"]])
    val_images = set(image[ds.groups.queries[split.val]].tolist())
    trained = torch.cat([q for q in asked if len(q) > len(split.val)])  # the groups (validation asks 12 at a time)
    assert not set(image[trained].tolist()) & val_images
    assert not set(trained.tolist()) <= set(ds.groups.queries.tolist())  # not only the anchors


def test_offline_grpo_resumes_bit_identical_with_a_last_batch_of_one(small_data, rce_run, tmp_path, monkeypatch):
    """The reference's distributions are cached once per run: a resumed run must recompute the very bits the killed
    one used, even when an epoch ends with a one-query batch, whose own products round differently."""
    full, part = tmp_path / "full", tmp_path / "part"
    common = dict(data=small_data, init=rce_run, epochs=3, lr=3e-3, seed=3, **{**FAST, "batch_size": 5})
    assert len(batches.split_queries(load_dataset(small_data), grpo.resolve(grpo.Args(**common))).train) % 5 == 1
    grpo.main(grpo.Args(out=full, **common))
    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        killed_after_epoch(m, 1)
        grpo.main(grpo.Args(out=part, **common))
    grpo.main(grpo.Args(out=part, **common))
    for name in ("model.safetensors", "ckpt/epoch_003.safetensors", "metrics.jsonl"):
        assert (part / name).read_bytes() == (full / name).read_bytes(), name


def whole_and_resumed(monkeypatch, tmp_path, **flags) -> Path:
    """A GRPO run with `flags` made whole, and again killed after epoch 1 and resumed: the two are bit-identical.
    Returns the whole run."""
    full, part = tmp_path / "full", tmp_path / "part"
    grpo.main(grpo.Args(out=full, **flags))
    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        killed_after_epoch(m, 1)
        grpo.main(grpo.Args(out=part, **flags))
    grpo.main(grpo.Args(out=part, **flags))
    assert (part / "model.safetensors").read_bytes() == (full / "model.safetensors").read_bytes()
    assert (part / "metrics.jsonl").read_text() == (full / "metrics.jsonl").read_text()
    return full


def test_grpo_online_and_resume_bit_identical(small_data, rce_run, tmp_path, monkeypatch):
    flags = dict(online=True, group_size=6, temperature=1.5, epochs=2, lr_schedule="cosine", **FAST)
    full = whole_and_resumed(monkeypatch, tmp_path, data=small_data, init=rce_run, **flags)
    rec = records(full)[-1]
    assert 1 < rec["grpo/group_size"] <= 6 and 0 <= rec["grpo/explored"] <= 1


def test_a_selector_that_may_stop_trains_online_only_and_resumes_bit_identical(small_data, tmp_path, monkeypatch):
    """After each epoch its stop is set on the run's ladders so far (each later step's p(going on), the first step's
    ridge and share going on) from --init itself, with no warm start (that is a short budget's): a run killed after
    epoch 1 resumes to the same bytes, the ladders carried in its checkpoint. Offline GRPO of it is refused in one line
    before any work."""
    rce.main(rce.Args(data=small_data, out=tmp_path / "rce", can_stop=True, epochs=1, **FAST, **SMALL_NET))
    with pytest.raises(
        ValueError, match=r"^--init \S+ may stop, and GRPO learns when to stop online only: add --online"
    ):
        grpo.main(grpo.Args(data=small_data, init=tmp_path / "rce", out=tmp_path / "offline", epochs=1, **FAST))
    assert not (tmp_path / "offline").exists()
    flags = dict(online=True, group_size=6, epochs=2, **FAST)
    full = whole_and_resumed(monkeypatch, tmp_path, data=small_data, init=tmp_path / "rce", **flags)
    assert not (full / "offline").exists() and "warm_start" not in json.loads((full / "config.json").read_text())
    last = records(full)[-1]
    assert last["stop/ridge"] in stops.RIDGE and 0 <= last["stop/go_on"] <= 1, last
    assert len(last["stop/go_later"]) == 3 and all(0.01 <= p <= 0.99 for p in last["stop/go_later"]), last
    assert last["stop/ladders"] > records(full)[-2]["stop/ladders"] > 0  # each set on the run's ladders so far
    # no optimizer step moves its stop: it is not among the parameters the optimizer holds
    groups = checkpoint_meta(full / "ckpt" / "epoch_002.safetensors")["optimizer"]["param_groups"]
    model = load_selector(full)
    trained = len(list(model.parameters())) - len(model.stop_parameters())
    assert len(groups) == 1 and len(groups[0]["params"]) == trained, groups


def test_item_bias_learns_a_score_per_train_item_resumes_bit_identical_and_evaluates(
    small_data, rce_run, tmp_path, monkeypatch
):
    flags = dict(online=True, group_size=6, epochs=2, **FAST)  # the item scores are on in every online run
    full = whole_and_resumed(monkeypatch, tmp_path, data=small_data, init=rce_run, **flags)
    ds = load_dataset(small_data)
    model, init = load_selector(full), load_selector(rce_run)
    assert init.items is None and len(model.items.keys) == len(ds.emb["train"].unique(dim=0))
    assert (model.items.bias != 0).sum() > 10  # the items online groups were scored with moved
    assert grpo.default_out(grpo.Args(online=True, item_bias=False)).name == "grpo-kl0.3-online-no-items"
    evaluate.main(evaluate.Args(data=small_data, runs=[full], num_samples=[20], shots=[1, 2]))
    assert (full / "eval" / "val.json").is_file()


def test_curriculum_filters_shrink_the_training_set(small_data, rce_run, tmp_path):
    ds = load_dataset(small_data)
    kept = {
        q: batches.split_queries(ds, grpo.resolve(grpo.Args(quality=q, **FAST)))
        for q in ("high", "medium", "varied", "all")
    }
    sets = [set(kept[q].train.tolist()) for q in ("high", "medium", "varied", "all")]
    assert all(a <= b for a, b in zip(sets, sets[1:])) and len(sets[-1]) == 36 and 0 < len(sets[1]) < len(sets[2])
    assert all(torch.equal(k.val, kept["all"].val) for k in kept.values())  # filters never touch validation
    spread = kept["all"].reward.amax(-1) - kept["all"].reward.where(ds.groups.seq_mask, 9).amin(-1)
    assert sets[2] == {q for q in sets[-1] if spread[q] > 0}
    grpo.main(grpo.Args(data=small_data, init=rce_run, out=tmp_path / "c", epochs=1, quality="medium", **FAST))
    n = json.loads((tmp_path / "c" / "config.json").read_text())["queries"]
    assert n == {"train": len(sets[1]), "val": 12}


def test_warnings_name_dead_and_runaway_signals():
    healthy = {
        "grpo/zero_std_frac": 0.6,
        "grpo/adv_std": 0.6,
        "grpo/clip_frac_low": 0.1,
        "grpo/clip_frac_high": 0.1,
        "grpo/kl_ref": 0.5,
    }
    assert grpo.warnings_for(healthy, 4) == []
    dead = grpo.warnings_for({**healthy, "grpo/zero_std_frac": 1.0, "grpo/adv_std": 0.0}, 4)
    assert any("no learning signal" in w for w in dead) and any("advantage std" in w for w in dead)
    assert "PPO clip" in grpo.warnings_for({**healthy, "grpo/clip_frac_high": 0.45}, 4)[0]
    assert "running away" in grpo.warnings_for({**healthy, "grpo/kl_ref": 12.5}, 4)[0]
    assert grpo.warnings_for({**healthy, "grpo/kl_ref": 11.5}, 4) == []  # 3 nats per pick is the line


def test_default_out_names(small_data):
    assert grpo.default_out(grpo.Args(kl_beta=0.1)).as_posix() == "runs/grpo-kl0.1"
    assert grpo.default_out(grpo.Args(online=True)).name == "grpo-kl0.3-online"  # online defaults are no flags
    assert grpo.default_out(grpo.Args(online=True, lr=1e-4, lr_schedule="cosine", queries="anchors")).name == (
        "grpo-kl0.3-online-lr0.0001-lr-cosine-queries-anchors"
    )
    assert grpo.default_out(grpo.Args(kl_beta=0.05, online=True, rank_advantage=True)).name == "grpo-kl0.05-online-rank"
    assert grpo.default_out(grpo.Args(kl_target=0.05, lr=3e-5)).name == "grpo-kl0.1-lr3e-05-target0.05"
    # GRPO from a GRPO run: never the --init folder itself
    assert grpo.default_out(grpo.Args(init=Path("runs/grpo-kl0.1"), kl_beta=0.1)).name == "grpo-kl0.1-from-grpo-kl0.1"
    ckpt = Path("runs/rce/ckpt/epoch_003.safetensors")
    assert grpo.default_out(grpo.Args(init=ckpt)).name == "grpo-kl0.1-from-rce-epoch_003"


@pytest.mark.parametrize(
    "change, pattern",
    [
        (dict(kl_beta=-0.1), r"--kl-beta.*-0\.1"),
        (dict(epsilon=0.0), r"--epsilon.*0\.0"),
        (dict(val_frac=0.001), r"--val-frac 0\.001\b.*\b0\b"),
        (dict(init="missing-run"), "missing-run"),
        (dict(quality="high", require_positive=True, data="tiny"), r"--quality high --require-positive\b"),
    ],
)
def test_grpo_bad_input_fails_before_any_work(small_data, rce_run, tmp_path, change, pattern):
    args = dict(data=small_data, init=rce_run, out=tmp_path / "out", epochs=1, **FAST)
    args.update({k: (tmp_path / v if k in ("init", "data") else v) for k, v in change.items()})
    if "data" in change:  # a dataset folder where no query passes the filters: 8 queries, tiny groups
        shutil.copytree(small_data, args["data"])
        lines = (args["data"] / "rl_data.jsonl").read_text().splitlines()
        kept = [json.loads(x) for x in lines[:8]]
        for r in kept:
            r["seqs"] = [dict(s, correct=0, acc=0.0) for s in r["seqs"]]
        (args["data"] / "rl_data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    with pytest.raises((ValueError, FileNotFoundError), match=pattern):
        grpo.main(grpo.Args(**args))
    assert not (tmp_path / "out").exists()


def test_init_architecture_mismatch_names_tensor(small_data, tmp_path):
    PointerSelector(SelectorConfig(dim=512, hidden=32, num_heads=2)).save(tmp_path / "small")
    cfg = json.loads((tmp_path / "small" / "model.json").read_text())
    (tmp_path / "small" / "model.json").write_text(json.dumps(cfg | {"hidden": 64}))
    with pytest.raises(ValueError, match=r"\bin_proj\.weight\b.*\(32, 512\).*\(64, 512\)"):
        grpo.main(grpo.Args(data=small_data, init=tmp_path / "small", out=tmp_path / "o", epochs=1, **FAST))
    # rce.py and grpo.py --init: the selector's settings file and field
    d16 = PointerSelector(SelectorConfig(dim=16, hidden=32, num_heads=2))
    d16.made_from = {"task": "vqa", "encoder": "sim"}
    d16.save(tmp_path / "d16")
    for stage in (rce, grpo):
        with pytest.raises(
            ValueError, match=rf"d16/model\.json\b.*'dim'.*\b16\b.*{re.escape(str(small_data))}.*\b512\b"
        ):
            stage.main(stage.Args(data=small_data, init=tmp_path / "d16", out=tmp_path / "r", epochs=1, **FAST))
        assert not (tmp_path / "r").exists()


@pytest.fixture(scope="module")
def short_data(tmp_path_factory):
    """2-shot data, groups of 0..2 demonstrations (for a selector that may stop, or Lever-LM's 2-shot sequences)."""
    out = tmp_path_factory.mktemp("short") / "data"
    sim = dict(num_train=300, num_val=60, num_queries=24, group_size=6, pool_size=12, seq_len=2, min_shots=0)
    gen_rl_data.generate(gen_rl_data.Args(out=out, **sim))
    return out


@pytest.mark.parametrize("can_stop", [False, True])
def test_a_selector_keeps_the_picks_it_was_made_with_through_every_stage(short_data, tmp_path, can_stop):
    """Lever-LM's recipe (2-shot sequences, asked for 4: rce.py --picks 4) and a selector that may stop, then GRPO and
    RCE from it: each keeps its 4 picks (GRPO once rebuilt it with its data's 2; with a stop bias of 4 entries the
    saved selector no longer loaded), loads, and evaluates at 1-4 shots. (GRPO of one that may stop: online.)"""
    rce.main(rce.Args(data=short_data, out=tmp_path / "rce", picks=4, can_stop=can_stop, epochs=1, **FAST, **SMALL_NET))
    online = dict(online=True, group_size=4, warm_start=False) if can_stop else {}
    grpo.main(grpo.Args(data=short_data, init=tmp_path / "rce", out=tmp_path / "grpo", epochs=1, **online, **FAST))
    rce.main(rce.Args(data=short_data, init=tmp_path / "grpo", out=tmp_path / "again", epochs=1, **FAST, **SMALL_NET))
    for run in ("rce", "grpo", "again"):
        model = PointerSelector.load(tmp_path / run)
        assert model.cfg.picks == 4 and (not can_stop or model.stop_bias.shape == (4,))
    evaluate.main(evaluate.Args(data=short_data, runs=[tmp_path / "grpo"], num_samples=[20]))
    assert set(json.loads((tmp_path / "grpo" / "eval" / "val.json").read_text())["summary"]["20"]) == set("1234")
    rce.main(
        rce.Args(data=short_data, init=tmp_path / "grpo", out=tmp_path / "six", picks=6, epochs=1, **FAST, **SMALL_NET)
    )
    assert PointerSelector.load(tmp_path / "six").cfg.picks == 6


def test_flags_that_would_be_ignored_or_cannot_work_together_are_refused_before_any_work(short_data, rce_run, tmp_path):
    """A retriever learns from no sequence, so it cannot learn to stop (once a tensor-shape traceback); a selector's
    shape comes from --init, so a flag that shapes a fresh one is refused beside it rather than ignored."""
    for flags, pattern in (
        (dict(retriever=True, can_stop=True), r"^--retriever scores each demonstration alone .*\(--can-stop\)"),
        (dict(init=rce_run, can_stop=True), r"^--can-stop shapes a fresh selector; --init \S+ brings its own "),
        (dict(init=rce_run, hidden=64), r"^--hidden shapes a fresh selector; "),
        (dict(init=rce_run, retriever=True), r"^--retriever trains a bi-encoder; --init \S+ is a pointer selector"),
    ):
        with pytest.raises(ValueError, match=pattern):
            rce.main(rce.Args(data=short_data, out=tmp_path / "r", epochs=1, **flags, **FAST))
        assert not (tmp_path / "r").exists()


def test_data_of_another_version_is_refused(small_data, tmp_path):
    data = tmp_path / "d"
    shutil.copytree(small_data, data)
    meta = json.loads((data / "meta.json").read_text())
    (data / "meta.json").write_text(json.dumps({**meta, "format_version": 0}))
    with pytest.raises(ValueError, match="format_version"):
        rce.main(rce.Args(data=data, out=tmp_path / "r", epochs=1))
    assert not (tmp_path / "r").exists()


def test_nan_loss_stops_with_clear_message(small_data, rce_run, tmp_path, monkeypatch):
    real = grpo.exact_kl
    calls = {"n": 0}

    def poisoned(*a):
        calls["n"] += 1
        kl = real(*a)
        return kl * float("nan") if calls["n"] > 5 else kl  # the 6th step blows up (epoch 2 of 5-step epochs)

    monkeypatch.setattr(grpo, "exact_kl", poisoned)
    out = tmp_path / "nan"
    with pytest.raises(ValueError, match=r"loss.*nan.*epoch 2.*epoch_001"):
        grpo.main(grpo.Args(data=small_data, init=rce_run, out=out, epochs=3, **FAST))
    assert (out / "ckpt" / "epoch_001.safetensors").is_file() and not (out / "ckpt" / "epoch_002.safetensors").exists()


@given(st.sampled_from(["constant", "linear", "cosine"]), st.integers(1, 500), st.data())
def test_lr_schedule_starts_at_the_base_rate_and_never_rises(schedule, total, data):
    step = data.draw(st.integers(0, total - 1))
    f = [epochs.lr_factor(schedule, s, total) for s in (0, step, step + 1)]
    assert f[0] == 1.0 and 0.0 <= f[2] <= f[1] <= 1.0
    if schedule != "constant":  # decays to 0 at the end of the run: the step after the last one has rate 0
        assert epochs.lr_factor(schedule, total, total) == pytest.approx(0.0, abs=1e-12)
        assert step == 0 or f[1] < 1.0


def test_resume_identifies_the_data_by_content_and_survives_moved_folders(small_data, rce_run, tmp_path, monkeypatch):
    data, first = tmp_path / "data", tmp_path / "first"
    shutil.copytree(small_data, data)
    args = dict(epochs=3, **FAST, **SMALL_NET)
    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        killed_after_epoch(m, 1)
        rce.main(rce.Args(data=data, out=first, **args))
    # regenerated data that differs only in when it was written, in a moved data folder, for a moved run folder
    meta = json.loads((data / "meta.json").read_text())
    (data / "meta.json").write_text(json.dumps(meta | {"created_at": "2031-01-01T00:00:00+00:00"}))
    moved_data, moved_run = tmp_path / "data-moved", tmp_path / "run-moved"
    data.rename(moved_data)
    shutil.copytree(first, moved_run)
    rce.main(rce.Args(data=moved_data, out=moved_run, **args))
    assert (moved_run / "model.safetensors").read_bytes() == (rce_run / "model.safetensors").read_bytes()
    # rewards edited mid-run: what training reads changed, so the run is refused
    lines = (moved_data / "rl_data.jsonl").read_text().splitlines()
    record = json.loads(lines[0])
    record["seqs"][0]["correct"] = 1 - record["seqs"][0]["correct"]
    (moved_data / "rl_data.jsonl").write_text("\n".join([json.dumps(record), *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match=r"first.*dataset"):
        rce.main(rce.Args(data=moved_data, out=first, **args))


@pytest.mark.parametrize(
    "edit, pattern",
    [
        (lambda cfg: cfg | {"hidden": "256"}, r"model\.json.*'hidden'.*'256'"),
        (lambda cfg: cfg | {"temperature": None}, r"model\.json.*'temperature'.*None"),
        (lambda cfg: cfg | {"num_heads": 3}, r"model\.json.*hidden=32.*num_heads=3"),
        (lambda cfg: cfg | {"width": 3}, r"model\.json.*unknown \['width'\]"),
        (lambda cfg: "{not json", r"model\.json.*JSON"),
    ],
)
def test_bad_model_json_is_one_line_naming_file_and_field(rce_run, tmp_path, edit, pattern):
    run = tmp_path / "run"
    shutil.copytree(rce_run, run)
    cfg = json.loads((run / "model.json").read_text())
    new = edit(cfg)
    (run / "model.json").write_text(new if isinstance(new, str) else json.dumps(new))
    with pytest.raises(ValueError, match=pattern):
        load_selector(run)


def test_bad_run_files_and_unwritable_folders_are_one_line(small_data, rce_run, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    shutil.copytree(rce_run, run)
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "args"}))
    with pytest.raises(ValueError, match=r"config\.json\b.*'args'"):
        rce.main(rce.Args(data=small_data, out=run, epochs=3, **FAST, **SMALL_NET))
    (run / "config.json").write_text("{")
    with pytest.raises(ValueError, match=r"config\.json\b.*\bJSON\b"):
        rce.main(rce.Args(data=small_data, out=run, epochs=3, **FAST, **SMALL_NET))
    # an output folder that cannot be written (here: its parent is a file) is one line on the command line
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setattr("sys.argv", ["rce.py", "--data", str(small_data), "--out", str(blocker / "run")])
    with pytest.raises(SystemExit) as stop:
        run_cli(rce.main, rce.Args)
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and err.startswith("error: ") and str(blocker) in err and "\n" not in err


def test_a_run_that_fails_before_its_first_checkpoint_leaves_nothing(small_data, tmp_path, monkeypatch):
    out = tmp_path / "rce"

    def broken(*a):
        raise ValueError("rl_data.jsonl: line 3: field 'seqs' is broken")

    monkeypatch.setattr(rce, "make_batch", broken)
    with pytest.raises(ValueError, match="is broken"):
        rce.main(rce.Args(data=small_data, out=out, epochs=2, **FAST, **SMALL_NET))
    assert not out.exists()


class FullDisk:
    """An open file on a full disk: every write of data fails as write(2) does there."""

    def __init__(self, f):
        self.f = f

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def __getattr__(self, name):
        return getattr(self.f, name)

    def write(self, data):
        if data:
            raise OSError(errno.ENOSPC, "No space left on device")
        return 0


def disk_full_for(monkeypatch, name):
    """From now on, writing to a file called `name` (or to its temporary file) finds the disk full."""
    real = builtins.open

    def opener(file, mode="r", *a, **kw):
        f = real(file, mode, *a, **kw)
        named = isinstance(file, (str, os.PathLike)) and Path(file).name in (name, f"{name}.tmp")
        return FullDisk(f) if named and any(c in mode for c in "wax+") else f

    monkeypatch.setattr(builtins, "open", opener)
    monkeypatch.setattr(io, "open", opener)  # what Path.open calls


def rce_cli(monkeypatch, capsys, data, out, epochs):
    """rce.py on the command line: its exit code and the last line it printed on stderr."""
    flags = ["--data", str(data), "--out", str(out), "--epochs", str(epochs), "--batch-size", "8", "--val-frac", "0.25"]
    monkeypatch.setattr("sys.argv", ["rce.py", *flags])
    try:
        run_cli(rce.main, rce.Args)
    except SystemExit as stop:
        return stop.code, capsys.readouterr().err.rstrip("\n").split("\n")[-1].split("\r")[-1]
    return 0, ""


@pytest.mark.parametrize(
    "name", ["config.json", "metrics.jsonl", "model.safetensors", "model.json", "ckpt/epoch_001.safetensors"]
)
def test_a_full_disk_while_a_run_is_set_up_is_one_line_naming_the_file_and_leaves_no_folder(
    small_data, tmp_path, monkeypatch, capsys, name
):
    out = tmp_path / "rce"
    disk_full_for(monkeypatch, Path(name).name)
    code, last = rce_cli(monkeypatch, capsys, small_data, out, 1)
    assert code == 2 and last.startswith(f"error: {out / name}: ")
    assert not out.exists()


def test_a_full_disk_after_the_first_checkpoint_leaves_a_run_that_resumes(small_data, tmp_path, monkeypatch, capsys):
    out = tmp_path / "rce"
    with monkeypatch.context() as m:
        disk_full_for(m, "epoch_002.safetensors")
        code, last = rce_cli(m, capsys, small_data, out, 2)
    assert code == 2 and last.startswith(f"error: {out / 'ckpt' / 'epoch_002.safetensors'}: ")
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == ["epoch_001.safetensors"]
    assert rce_cli(monkeypatch, capsys, small_data, out, 2) == (0, "")  # space freed: the same command finishes it
    assert [r["epoch"] for r in records(out)] == [0, 1, 2] and (out / "ckpt" / "epoch_002.safetensors").is_file()


def test_keep_every_prunes_checkpoints_and_evaluate_names_the_epochs_kept(small_data, rce_run, tmp_path):
    import evaluate

    out = tmp_path / "g"
    grpo.main(grpo.Args(data=small_data, init=rce_run, out=out, epochs=5, **{**FAST, "keep_every": 3}))
    best = records(out)[-1]["best_epoch"]
    kept = sorted(int(p.stem[6:]) for p in (out / "ckpt").glob("epoch_*.safetensors"))
    assert kept == sorted({3, 4, 5, best})  # every 3rd, the last two (a damaged last falls back), the best
    missing = next(e for e in (1, 2) if e not in kept)
    with pytest.raises(ValueError, match=rf"epoch {missing}.*\[{', '.join(map(str, kept))}\]"):
        evaluate.main(evaluate.Args(runs=[out], data=small_data, epochs=[missing], num_samples=[8]))


def test_resume_may_change_epochs_only_where_the_schedule_continues(small_data, rce_run, tmp_path, monkeypatch):
    common = dict(data=small_data, init=rce_run, **FAST)
    full, part = tmp_path / "full", tmp_path / "part"
    grpo.main(grpo.Args(out=full, epochs=3, **common))
    grpo.main(grpo.Args(out=part, epochs=2, **common))
    grpo.main(grpo.Args(out=part, epochs=3, **{**common, "keep_every": 0}))  # constant lr: continues exactly
    assert (part / "model.safetensors").read_bytes() == (full / "model.safetensors").read_bytes()
    config = json.loads((part / "config.json").read_text())
    assert config["args"]["epochs"] == 3 and config["epochs_changed"] == [{"from": 2, "to": 3, "after_epoch": 2}]
    with pytest.raises(ValueError, match=r"--epochs 3\b.*\b3\b.*--epochs 2\b"):
        grpo.main(grpo.Args(out=part, epochs=2, **common))
    cosine = tmp_path / "cos"
    grpo.main(grpo.Args(out=cosine, epochs=1, lr_schedule="cosine", **common))
    with pytest.raises(ValueError, match=r"--lr-schedule cosine.*--epochs 2"):
        grpo.main(grpo.Args(out=cosine, epochs=2, lr_schedule="cosine", **common))
    with pytest.raises(ValueError, match=r"--epochs 3.*tau.*--epochs 4"):
        rce.main(rce.Args(data=small_data, out=rce_run, epochs=4, **FAST, **SMALL_NET))


def test_trl_flag_names_are_aliases_with_the_same_meaning():
    import tyro

    trl = ["--beta", "0.2", "--num-generations", "8", "--learning-rate", "0.01", "--max-grad-norm", "0.5"]
    trl += ["--num-train-epochs", "3", "--output-dir", "runs/x", "--per-device-train-batch-size", "16"]
    ours = ["--kl-beta", "0.2", "--group-size", "8", "--lr", "0.01", "--grad-clip", "0.5"]
    ours += ["--epochs", "3", "--out", "runs/x", "--batch-size", "16"]
    assert tyro.cli(grpo.Args, args=trl) == tyro.cli(grpo.Args, args=ours)
    assert tyro.cli(rce.Args, args=["--output-dir", "r", "--learning-rate", "0.1"]) == rce.Args(out=Path("r"), lr=0.1)


def test_progress_bar_names_the_run_and_redraws_on_time_not_per_step(
    small_data, rce_run, tmp_path, capsys, monkeypatch
):
    """A bar that redrew at every step filled logs with a line per step: each postfix update forced a redraw."""
    import tqdm

    forced, real = [], tqdm.tqdm.set_postfix_str

    def spy(self, s="", refresh=True):
        forced.append(refresh)
        return real(self, s, refresh=refresh)

    monkeypatch.setattr(tqdm.tqdm, "set_postfix_str", spy)
    out = tmp_path / "my-run"
    grpo.main(grpo.Args(data=small_data, init=rce_run, out=out, epochs=1, **FAST))
    assert len(forced) == records(out)[-1]["step"] and not any(forced)  # postfix set every step, drawn on time
    draws = [d for d in capsys.readouterr().err.replace("\r", "\n").split("\n") if "epoch 1/1" in d]
    assert draws and all(d.startswith("my-run epoch 1/1") for d in draws)
    assert "reward_mean=" in draws[-1] or len(draws) == 1  # what moves in GRPO, not ~beta * KL


def test_report_to_tensorboard_holds_the_metrics_once_even_after_a_resume(small_data, tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "tb"

    for killed_at in (1, 3):  # epoch 1 dies before any checkpoint exists; epoch 3 after two

        def dies_saving(out, epoch, *a, killed_at=killed_at):
            if epoch == killed_at:  # the epoch is logged (metrics.jsonl and TensorBoard) but never checkpointed
                raise KeyboardInterrupt
            save_checkpoint(out, epoch, *a)

        with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
            m.setattr(runs, "save_checkpoint", dies_saving)
            rce.main(rce.Args(data=small_data, out=out, epochs=3, report_to="tensorboard", **FAST, **SMALL_NET))
    rce.main(rce.Args(data=small_data, out=out, epochs=3, report_to="tensorboard", **FAST, **SMALL_NET))
    files = sorted((out / "tensorboard").iterdir())
    rce.main(
        rce.Args(data=small_data, out=out, epochs=3, report_to="tensorboard", **FAST, **SMALL_NET)
    )  # finished: logs nothing
    assert sorted((out / "tensorboard").iterdir()) == files
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    epochs = records(out)
    for name in ("val/acc", "train/loss", "train/tau"):
        got = [(e.step, e.value) for e in events.Scalars(name)]
        want = [(r["step"], r[name]) for r in epochs if name in r]
        assert [s for s, _ in got] == [s for s, _ in want], name  # every epoch once, in order
        assert np.allclose([v for _, v in got], [v for _, v in want], rtol=1e-6), name


def test_report_to_a_missing_package_stops_before_any_work(small_data, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match=r"--report-to wandb.*pip install wandb"):
        rce.main(rce.Args(data=small_data, out=tmp_path / "w", report_to="wandb", **FAST, **SMALL_NET))
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize(
    "stage, flags, pattern",
    [
        ("rce", {"temp_start": float("nan")}, r"--temp-start\b.*--temp-end\b.*\bnan\b"),
        ("rce", {"lr": float("nan")}, r"--lr\b.*\bnan$"),
        ("grpo", {"online": True, "temperature": float("inf")}, r"--temperature\b.*\binf$"),
        ("grpo", {"kl_beta": float("inf")}, r"--kl-beta\b.*\binf$"),
        ("grpo", {"online": True, "reward_mode": "info_score"}, r"--reward-mode info_score\b.*\bhard_plus_gtprob\b"),
    ],
)
def test_non_finite_or_unusable_flags_are_refused_before_any_work(small_data, rce_run, tmp_path, stage, flags, pattern):
    out = tmp_path / "run"
    main, args = (rce.main, rce.Args) if stage == "rce" else (grpo.main, grpo.Args)
    extra = {} if stage == "rce" else {"init": rce_run}
    with pytest.raises(ValueError, match=pattern):
        main(args(data=small_data, out=out, epochs=1, **extra, **flags))
    assert not out.exists()


def test_a_stray_file_among_the_checkpoints_is_named_and_epochs_sort_by_number(tmp_path):
    from icl_select.runs import checkpoints

    (tmp_path / "ckpt").mkdir()
    for epoch in (999, 1000, 7):
        (tmp_path / "ckpt" / f"epoch_{epoch:03d}.safetensors").touch()
    assert list(checkpoints(tmp_path)) == [7, 999, 1000]
    (tmp_path / "ckpt" / "epoch_abc.safetensors").touch()
    with pytest.raises(ValueError, match=r"ckpt/epoch_abc\.safetensors\b"):
        checkpoints(tmp_path)


@pytest.mark.parametrize("damage", [b"", b"truncated", "half"])
def test_a_damaged_last_checkpoint_falls_back_to_the_one_before(small_data, rce_run, tmp_path, capsys, damage):
    """A last checkpoint cut by a kill or a full disk outside the atomic writes (empty, foreign, truncated): the re-run
    notes it, resumes from the checkpoint before and ends bit-identical to an uninterrupted run."""
    out = tmp_path / "rce"
    shutil.copytree(rce_run, out)
    last = out / "ckpt/epoch_003.safetensors"
    last.write_bytes(last.read_bytes()[: len(last.read_bytes()) // 2] if damage == "half" else damage)
    rce.main(rce.Args(data=small_data, out=out, epochs=3, **FAST, **SMALL_NET))
    assert re.search(r"\bepoch_003\.safetensors\b.*\bdamaged\b", capsys.readouterr().err)
    for name in ("model.safetensors", "ckpt/epoch_003.safetensors", "metrics.jsonl"):
        assert (out / name).read_bytes() == (rce_run / name).read_bytes(), name
    for path in (out / "ckpt").glob("*.safetensors"):
        path.write_bytes(b"")
    with pytest.raises(
        ValueError, match=rf"{re.escape(str(out))}\b.*\bepoch_001\.safetensors\b.*\bepoch_003\.safetensors\b"
    ):
        rce.main(rce.Args(data=small_data, out=out, epochs=3, **FAST, **SMALL_NET))


@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 300), budget=st.integers(1, 2**16))
@settings(max_examples=15)
def test_greedy_icds_in_parts_equal_one_whole_call(seed, n, budget):
    """However few pool embeddings a part may hold, each question is decoded in the slice of one whole call."""
    g = torch.Generator().manual_seed(seed)
    model = PointerSelector(SelectorConfig(dim=8, hidden=16, num_heads=2))
    ds = SimpleNamespace(emb={"train": torch.randn(40, 8, generator=g), "val": torch.randn(n, 8, generator=g)})
    pool = torch.randint(-1, 40, (n, 6), generator=g)
    pool[:, :3] = torch.randint(0, 40, (n, 3), generator=g)  # at least as many candidates as picks
    rows = torch.randperm(n, generator=g)
    sizes, decode = [], model._decode
    model._decode = lambda query, *a, **k: sizes.append(len(query)) or decode(query, *a, **k)  # the slice sizes
    with torch.no_grad():
        whole, _ = model.eval().greedy(ds.emb["val"][rows], ds.emb["train"][pool.clamp_min(0)], pool >= 0, 3)
    whole_sizes, sizes[:] = sizes[:], []
    with patch.object(validation, "CHUNK_ELEMENTS", budget):
        assert torch.equal(validation.greedy_icds(model, ds, "val", rows, pool, 3), pool.gather(1, whole))
    assert sizes == whole_sizes  # BLAS may round a slice of other rows otherwise: same slices, same bits


def test_a_budget_returns_its_last_epoch_and_online_runs_learn_item_scores_where_offline_ones_do_not():
    budget = grpo.resolve(grpo.Args(online=True, lvlm_budget=35000))
    assert (budget.select_epoch, budget.item_bias) == ("last", True)
    assert [(a.select_epoch, a.item_bias) for a in map(grpo.resolve, [grpo.Args(online=True), grpo.Args()])] == [
        ("best", True),
        ("best", False),
    ]
    warm = grpo.warm_start_args(budget, Path("w"))
    assert (warm.select_epoch, warm.item_bias) == ("best", False)  # the warm start keeps its best, learns no items
    off = grpo.Args(online=True, lvlm_budget=35000, item_bias=False)
    assert not grpo.resolve(off).item_bias and grpo.default_out(off).name == "grpo-kl0.3-online-budget35000-no-items"


def test_select_epoch_last_returns_the_last_epoch_and_trains_the_same(small_data, rce_run, tmp_path):
    runs_ = {}
    for select in ("best", "last"):
        out = tmp_path / select
        grpo.main(grpo.Args(data=small_data, init=rce_run, out=out, epochs=5, lr=1e-3, select_epoch=select, **FAST))
        runs_[select] = out
    best, last = records(runs_["best"]), records(runs_["last"])
    assert best[-1]["best_epoch"] < 5 and last[-1]["best_epoch"] == 5  # at this rate, validation peaks before the end
    assert [{k: v for k, v in r.items() if k != "best_epoch"} for r in best] == [
        {k: v for k, v in r.items() if k != "best_epoch"} for r in last
    ]
    for select, epoch in (("best", best[-1]["best_epoch"]), ("last", 5)):
        returned = PointerSelector.load(runs_[select]).state_dict()
        saved = load_selector(runs_[select] / "ckpt" / f"epoch_{epoch:03d}.safetensors").state_dict()
        assert all(torch.equal(returned[k], saved[k]) for k in saved)


def planted(small_data: Path, out: Path, good: int = 6) -> tuple[Path, torch.Tensor]:
    """A copy of the small dataset whose rewards say one thing: a sequence is worth the share of its demonstrations
    among the `good` candidates of its pool nearest a hidden direction. Returns the folder and the direction."""
    shutil.copytree(small_data, out)
    ds = load_dataset(out)
    hidden = torch.nn.functional.normalize(
        torch.randn(ds.emb["train"].shape[1], generator=torch.Generator().manual_seed(7)), dim=0
    )
    lines = []
    for line in (out / "rl_data.jsonl").read_text().splitlines():
        rec = json.loads(line)
        near = (ds.emb["train"][rec["pool"]] @ hidden).argsort(descending=True)[:good].tolist()
        for s in rec["seqs"]:
            share = sum(c in near for c in s["icds"]) / len(s["icds"])
            s.update(acc=share, correct=int(share > 0), gt_prob=share, rel=share)
        lines.append(json.dumps(rec))
    (out / "rl_data.jsonl").write_text("\n".join(lines) + "\n")
    return out, hidden


def test_retriever_learns_a_preference_planted_in_its_data(small_data, tmp_path):
    """Trained on rewards that favour the candidates nearest a hidden direction, the retriever's first pick is one of
    them far more often than chance on every anchor; it is a bi-encoder whose picks are its top k."""
    data, hidden = planted(small_data, tmp_path / "planted")
    out = tmp_path / "retriever"
    rce.main(rce.Args(data=data, out=out, retriever=True, epochs=20, lr=1e-2, quality="all", **FAST, **SMALL_NET))
    # the last epoch: the validation accuracy that picks the best one knows nothing of the planted rewards
    model = load_selector(out / "ckpt" / "epoch_020.safetensors").eval()
    assert model.cfg.num_layers == 0 and not model.cfg.state_update
    ds = load_dataset(data)
    g, emb = ds.groups, ds.emb["train"]
    first, _ = model.greedy(emb[g.queries], emb[g.pools], g.pool_mask, 1)  # (Q, 1)
    near = (emb[g.pools] @ hidden).argsort(-1, descending=True)[:, :6]  # (Q, 6)
    hits = (near == first).any(-1).double().mean().item()
    assert hits > 0.6  # chance: 6 of 24; this seed: 0.79


def test_uniform_weights_are_cross_entropy_on_every_sequence_alike(small_data):
    """ICD-LM's objective: the mean over groups of the mean -log pi(seq) of its valid sequences, each taken alone."""
    ds = load_dataset(small_data)
    model = PointerSelector(SelectorConfig(dim=ds.emb["train"].shape[1], picks=ds.seq_len)).eval()
    split = batches.split_queries(ds, rce.Args(data=small_data, **FAST))
    b = batches.make_batch(ds, split.train[:5], split.reward, model.cfg)
    b.seq_mask[1, 3:] = False
    loss = rce.sequence_loss(model, b, rce.Args(weights="uniform"), tau=1.0)
    per_group = []
    for i in range(5):
        valid = [j for j in range(b.seqs.shape[1]) if b.seq_mask[i, j]]
        one = torch.ones(1, 1, dtype=torch.bool)
        nll = [
            -model.log_probs(
                b.query[i : i + 1], b.pool[i : i + 1], b.pool_mask[i : i + 1], b.seqs[i : i + 1, j : j + 1], one
            ).sum()
            for j in valid
        ]
        per_group.append(torch.stack(nll).mean())
    assert loss.item() == pytest.approx(torch.stack(per_group).mean().item(), rel=1e-5)


def test_a_runs_lvlm_calls_add_up_along_its_init_chain(small_data, tmp_path, monkeypatch):
    """The calls an evaluation says built a selector are its data's, counted by gen_rl_data.py, plus every prompt its
    RCE warm-up and its online GRPO run sent to the simulator, counted here at the backend."""
    from icl_select.backends import SimBackend

    sent = {"n": 0}
    real = SimBackend.score

    def counted(self, split, queries, icds, *a, **kw):
        sent["n"] += len(queries)
        return real(self, split, queries, icds, *a, **kw)

    monkeypatch.setattr(SimBackend, "score", counted)
    rce.main(rce.Args(data=small_data, out=tmp_path / "rce", epochs=2, **FAST, **SMALL_NET))
    online = dict(online=True, lvlm_budget=3000, warm_start=False, epochs=1)
    grpo.main(grpo.Args(data=small_data, init=tmp_path / "rce", out=tmp_path / "online", **online, **FAST))
    trained = sent["n"]
    evaluate.main(evaluate.Args(data=small_data, runs=[tmp_path / "online", tmp_path / "rce"], num_samples=[20]))
    data_calls = load_dataset(small_data).meta["lvlm_calls"]
    doc = json.loads((tmp_path / "online" / "eval" / "val.json").read_text())
    assert doc["lvlm_calls"] == data_calls + trained
    rce_doc = json.loads((tmp_path / "rce" / "eval" / "val.json").read_text())
    assert data_calls < rce_doc["lvlm_calls"] < doc["lvlm_calls"]


@pytest.mark.slow
@pytest.mark.parametrize("help_base, stops", [(-2.0, True), (1.0, False)])
def test_a_selector_that_may_stop_learns_when_to(tmp_path, help_base, stops):
    """Planted worlds: where every demonstration hurts (help_base -2) the selector learns to stop at once; where every
    one helps (+1) it fills its k slots. RCE warms its picks up on the full-length sequences of groups that hold shorter
    ones too (--min-shots 0: those train nothing) and sets its stop before the first pick from held-out picks (it stops
    already where demonstrations hurt), online GRPO then sets its stop on its stop ladders."""
    data = tmp_path / "data"
    sim = dict(num_train=600, num_val=150, num_queries=96, group_size=8, pool_size=24)
    gen_rl_data.generate(gen_rl_data.Args(out=data, min_shots=0, sim_set=[f"help_base={help_base}"], **sim))
    rce.main(rce.Args(data=data, out=tmp_path / "rce", can_stop=True, epochs=5, quality="all", **FAST))
    assert (load_selector(tmp_path / "rce").stop_bias[0] > 0) == stops
    online = dict(online=True, epochs=6, lr=3e-3, kl_beta=0.05, replay_steps=0, item_bias=False, kl_target=None)
    grpo.main(grpo.Args(data=data, init=tmp_path / "rce", out=tmp_path / "online", **online, **FAST))
    first = json.loads((tmp_path / "online" / "metrics.jsonl").read_text().splitlines()[1])  # epoch 1's record
    assert first["grpo/kl_ref"] >= 0 and first["grpo/entropy"] > 0 and 0 <= first["val/demos"] <= 4
    evaluate.main(evaluate.Args(data=data, runs=[tmp_path / "online"], num_samples=[150]))
    upto = json.loads((tmp_path / "online" / "eval" / "val-upto.json").read_text())
    used = upto["demonstrations"]["150"]["4"]
    assert used < 0.5 if stops else used > 3.5, used
    exact = json.loads((tmp_path / "online" / "eval" / "val.json").read_text())
    assert exact["demonstrations"]["150"]["4"] == 4
    if stops:  # stopping is right here: up to k beats filling every slot
        assert upto["summary"]["150"]["4"] > exact["summary"]["150"]["4"] + 10
