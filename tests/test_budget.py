"""grpo.py --online --lvlm-budget: what the LVLM scores is counted independently here, around the backend itself, in
this process or, for `grpo.py --online --lvlm-budget N` with nothing else but the data and init, in each torchrun rank
(tests/test_sharding.py's counting wrapper)."""

import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import SMALL_NET
from hypothesis import example, given
from hypothesis import strategies as st
from test_sharding import COUNTING, ROOT, torchrun

import grpo
from icl_select import runs
from icl_select.backends import SimBackend
from icl_select.budget import budget_plan
from icl_select.cli import PerMode, marked
from icl_select.runs import load_selector, save_checkpoint

FAST = dict(batch_size=8, val_frac=0.25, group_size=6, online=True)


def records(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def save_then_die(out, e, *a):
    """A stage's save_checkpoint, then a kill right after epoch 2's checkpoint."""
    save_checkpoint(out, e, *a)
    if e == 2:
        raise KeyboardInterrupt


def die_in(name: str):
    """save_then_die in the run folder called `name` alone (a budgeted run or its warm start)."""
    return lambda out, e, *a: (save_then_die if out.name == name else save_checkpoint)(out, e, *a)


def count_calls(monkeypatch) -> list[int]:
    """Sequences the simulator is asked to score from now on, whoever asks (not grpo's own counter)."""
    asked = [0]
    real = SimBackend.score

    def score(self, split, queries, icds, gt_prob=True):
        asked[0] += len(queries)
        return real(self, split, queries, icds, gt_prob)

    monkeypatch.setattr(SimBackend, "score", score)
    return asked


@pytest.fixture
def counted(monkeypatch):
    return count_calls(monkeypatch)


@pytest.fixture(scope="module")
def init(small_data, tmp_path_factory):
    import rce

    out = tmp_path_factory.mktemp("runs") / "rce"
    rce.main(rce.Args(data=small_data, out=out, epochs=2, batch_size=8, val_frac=0.25, **SMALL_NET))
    return out


@pytest.fixture(scope="module")
def short(small_data, init, tmp_path_factory):
    """A 1500-call budget's arguments, the run they train, and the offline GRPO run grpo.py trains by default, each
    with the calls the simulator was asked for: the tests of the warm start share them."""
    root = tmp_path_factory.mktemp("short")
    args = dict(data=small_data, init=init, lvlm_budget=1500, **FAST)
    with pytest.MonkeyPatch.context() as m:
        asked = count_calls(m)
        train = {k: v for k, v in FAST.items() if k not in ("group_size", "online")}
        grpo.main(grpo.Args(data=small_data, init=init, out=root / "offline", **train))
        alone, asked[0] = asked[0], 0
        grpo.main(grpo.Args(out=root / "full", **args))
    return SimpleNamespace(args=args, offline=root / "offline", alone=alone, full=root / "full", spent=asked[0])


def test_budget_run_stops_within_budget_logs_calls_and_resumes_identically(
    small_data, init, tmp_path, counted, monkeypatch, capsys
):
    budget = 1500
    common = dict(data=small_data, init=init, lvlm_budget=budget, lr_schedule="linear", **FAST)
    full, part = tmp_path / "full", tmp_path / "part"
    grpo.main(grpo.Args(out=full, **common))
    spent = counted[0]
    assert f"\nLVLM calls: {spent:,} of the --lvlm-budget 1,500 " in capsys.readouterr().out  # what it was asked
    recs = records(full)
    config = json.loads((full / "config.json").read_text())
    plan = config["budget_plan"]
    assert config["args"]["replay_steps"] == marked(grpo.Args, PerMode)["replay_steps"].online > 0
    assert recs[-1]["lvlm/calls"] == spent  # grpo's count is what the backend was asked
    # spent, never overspent: what cache hits and repeated samples save buys more steps than the plan counted
    assert 0.95 * budget <= spent <= budget
    calls = [r["lvlm/calls"] for r in recs]
    assert calls == sorted(calls) and calls[0] > 0  # cumulative, from the start's validation on
    assert [r["epoch"] for r in recs] == list(range(plan["epochs"] + 1)) and recs[-1]["step"] >= plan["steps"]

    counted[0] = 0
    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        m.setattr(runs, "save_checkpoint", save_then_die)
        grpo.main(grpo.Args(out=part, **common))
    grpo.main(grpo.Args(out=part, **common))
    assert counted[0] == spent  # the resumed run neither scores nor counts again what the killed one scored
    for name in (
        "model.safetensors",
        "metrics.jsonl",
        "scores.safetensors",
        f"ckpt/epoch_{plan['epochs']:03d}.safetensors",
    ):
        assert (part / name).read_bytes() == (full / name).read_bytes(), name


def grpo_alone(data, init, out, budget: int, warm: bool, ranks: int) -> list[int]:
    """`grpo.py --online --lvlm-budget N` (and --no-warm-start where not `warm`) with nothing else but --data, --init
    and --out, in one process or over two torchrun ranks -> the prompts each rank asked the simulator to score, counted
    by test_sharding.py's wrapper around the backend."""
    counts = out.with_name(f"{out.name}-counts")
    counts.mkdir()
    (counts / "counting.py").write_text(COUNTING)
    flags = [f"--data={data}", f"--init={init}", f"--out={out}", "--online", f"--lvlm-budget={budget}"]
    argv = [str(counts / "counting.py"), str(counts), *flags, *([] if warm else ["--no-warm-start"])]
    if ranks == 2:
        torchrun(*argv)
    else:
        env = {**os.environ, "RANK": "0", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        done = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    return [sum(map(int, (counts / f"count.{rank}").read_text().split())) for rank in range(ranks)]


@pytest.mark.slow  # four grpo.py jobs, two of them over two torchrun ranks
@pytest.mark.parametrize(("warm", "budget"), [(True, 760), (False, 700)])
def test_the_budget_alone_stays_within_it_in_one_process_and_over_two_ranks(small_data, init, tmp_path, warm, budget):
    """Every other flag at its default (batches of 32 queries x 16 sequences, validation on a tenth of the anchors):
    the simulator is asked for at most N prompts in all, the run's own count agrees (no prompt scored twice, by one
    rank or two), and two ranks write the one-process run's bytes. Each budget is spent nearly whole, its last step
    cut to the calls left, so a run that overspends by a step's groups or a validation would pass N."""
    one, two = tmp_path / "one", tmp_path / "two"
    asked = {
        one: grpo_alone(small_data, init, one, budget, warm, 1),
        two: grpo_alone(small_data, init, two, budget, warm, 2),
    }
    for out, per_rank in asked.items():
        config, spent = json.loads((out / "config.json").read_text()), sum(per_rank)
        assert min(per_rank) > 0 and spent <= budget and records(out)[-1]["lvlm/calls"] == spent, (out.name, per_rank)
        assert ("warm_start" in config) == (out / "offline" / "model.safetensors").is_file() == warm
        assert config["args"]["batch_size"] == 32 and config["args"]["group_size"] == 16
        assert budget - spent < 2 * 16, (out.name, spent)  # under a group left, and validations the cache answered
    for name in ("metrics.jsonl", "model.safetensors", *(["offline/model.safetensors"] if warm else [])):
        assert (two / name).read_bytes() == (one / name).read_bytes(), name


@pytest.mark.parametrize("killed", ["offline", "part"])
def test_a_short_budget_trains_offline_grpo_first_counts_its_calls_and_resumes_identically(
    short, tmp_path, counted, monkeypatch, killed
):
    """The warm start is the offline GRPO run grpo.py trains by default; the online run starts from it and keeps it
    as its KL reference; its validation calls count in the budget, each paid for once, and a kill in either phase
    resumes to the same bytes."""
    full, part = short.full, tmp_path / "part"
    warm = records(full / "offline")
    config = json.loads((full / "config.json").read_text())
    assert (full / "offline" / "model.safetensors").read_bytes() == (short.offline / "model.safetensors").read_bytes()
    assert config["warm_start"]["lvlm_calls"] == warm[-1]["lvlm/calls"] == short.alone > 0
    recs = records(full)
    assert recs[-1]["lvlm/calls"] == short.spent <= short.args["lvlm_budget"]  # one count over both phases
    assert recs[0]["lvlm/calls"] == short.alone  # the start's validation asks what the warm start's best epoch paid for
    best = {r["epoch"]: r for r in warm}[warm[-1]["best_epoch"]]
    assert recs[0]["val/acc"] == best["val/acc"] and recs[0]["grpo/selection_change"] == 0  # it starts from the best
    assert load_selector(full).items is not None and load_selector(full / "offline").items is None  # item scores

    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        m.setattr(runs, "save_checkpoint", die_in(killed))
        grpo.main(grpo.Args(out=part, **short.args))
    grpo.main(grpo.Args(out=part, **short.args))
    assert counted[0] == short.spent
    for name in ("model.safetensors", "metrics.jsonl", "scores.safetensors", "offline/model.safetensors"):
        assert (part / name).read_bytes() == (full / name).read_bytes(), name


def test_a_killed_warm_start_continued_with_other_flags_is_refused_before_a_model_loads(short, tmp_path, monkeypatch):
    """Killed in its warm start, a budgeted run has no config.json of its own yet: the warm start's is checked, and a
    re-run with another seed refused before any LVLM loads (once it was refused only after)."""
    part = tmp_path / "part"
    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        m.setattr(runs, "save_checkpoint", die_in("offline"))
        grpo.main(grpo.Args(out=part, **short.args))
    monkeypatch.setattr(grpo, "validation_backend", lambda *a: pytest.fail("a model loaded before the refusal"))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(part / 'offline'))}.* was made from other inputs: .*seed"):
        grpo.main(grpo.Args(out=part, **short.args, seed=1))


def test_no_warm_start_plans_the_whole_budget_for_the_online_run(short, tmp_path, counted):
    grpo.main(grpo.Args(out=tmp_path / "cold", warm_start=False, **short.args))
    assert 0 < counted[0] <= short.args["lvlm_budget"] and records(tmp_path / "cold")[-1]["lvlm/calls"] == counted[0]
    warm, cold = (json.loads((d / "config.json").read_text()) for d in (short.full, tmp_path / "cold"))
    assert "warm_start" not in cold and not (tmp_path / "cold" / "offline").exists()
    assert cold["budget_plan"]["steps"] > warm["budget_plan"]["steps"]  # the warm start's calls were someone's steps
    assert "-budget1500-no-warm-" in grpo.default_out(grpo.Args(**short.args, warm_start=False)).name


def test_a_budget_below_what_can_be_spent_whole_is_refused(small_data, init, tmp_path, counted):
    """A budget is spent at least 95% or refused before any work: the last step may leave up to a query's group less
    one (6 - 1) unspent, and the last validation (12 anchors x 4 shots) none of the 48 calls kept for it, so 20 x 53
    = 1060 is the least; once 150 was accepted and 136 spent (91%)."""
    for budget, warm in ((50, True), (150, False), (1059, True)):
        out = tmp_path / f"b{budget}"
        with pytest.raises(ValueError, match=rf"^--lvlm-budget {budget} is below 1060, the smallest .* 95%"):
            grpo.main(grpo.Args(data=small_data, init=init, out=out, lvlm_budget=budget, warm_start=warm, **FAST))
        assert counted[0] == 0 and not out.exists()
    grpo.main(grpo.Args(data=small_data, init=init, out=tmp_path / "w", lvlm_budget=1060, warm_start=False, **FAST))
    assert 0.95 * 1060 <= counted[0] <= 1060
    with pytest.raises(ValueError, match=r"^--lvlm-budget 5000 acts on online groups: add --online"):
        grpo.main(grpo.Args(data=small_data, init=init, out=tmp_path / "c", lvlm_budget=5000))


@given(
    budget=st.integers(1, 100_000),
    epochs=st.none() | st.integers(1, 40),
    batch=st.integers(1, 64),
    group=st.integers(2, 32),
    val=st.integers(0, 2000),
    natural=st.integers(1, 40),
)
@example(budget=2765, epochs=14, batch=1, group=21, val=1, natural=1)  # 130 steps fill 13 epochs of 10, not 14
@example(budget=198, epochs=2, batch=8, group=6, val=48, natural=5)  # 2 epochs fit: steps of 48 and 6, 3 validations
@example(budget=197, epochs=2, batch=8, group=6, val=48, natural=5)  # one call short of them
def test_budget_plan_fits_its_worst_case_in_the_budget(budget, epochs, batch, group, val, natural):
    try:
        plan = budget_plan(budget, epochs, batch * group, val, group, natural)
    except ValueError as e:
        assert "too small" in str(e)
        # Refused only where even the least run does not fit: `epochs` (or one) epochs of one step each, every step
        # but the last at its most calls, the last one group, and every validation at its most.
        least = ((epochs or 1) - 1) * batch * group + group + ((epochs or 1) + 1) * val
        assert budget < least, least
        return
    assert 1 <= plan.epochs <= (epochs or plan.epochs) and plan.steps >= plan.epochs
    assert (plan.epochs - 1) * plan.steps_per_epoch < plan.steps <= plan.epochs * plan.steps_per_epoch
    if epochs is None:  # the fewest epochs of at most `natural` steps: one epoch fewer could not hold its steps
        assert plan.steps_per_epoch <= natural
        fewer = budget - plan.epochs * val
        assert (
            plan.epochs == 1
            or fewer // (batch * group) + (fewer % (batch * group) >= group) > (plan.epochs - 1) * natural
        )
    # every step but the last at its most calls, the last at one group at least, every validation at its most
    train = budget - (plan.epochs + 1) * val
    assert (plan.steps - 1) * batch * group + group <= train
    assert train - plan.steps * batch * group < group or epochs is None  # no whole step left unused


def test_budget_plan_takes_one_epoch_where_a_second_cannot_pay_for_its_validation():
    """Every training anchor in one batch (natural 1): 2 steps do not fit one epoch, and 2 epochs cannot pay for their
    3 validations; one epoch of one step and its 2 validations take 2 + 2 * 5 = 12 of the 14 calls."""
    plan = budget_plan(14, None, 2, 5, 2, 1)
    assert (plan.epochs, plan.steps) == (1, 1)


@pytest.mark.parametrize("stop_bias", [0.0, 3.0])
def test_a_budget_is_spent_whatever_the_selector_does(tmp_path, counted, stop_bias):
    """At least 95% of the budget and never more, counted at the backend, by a selector that may stop (one that fills
    its slots: the test above), from untrained (a coin flip, where greedy decoding goes on) to nearly always at once
    (whose stop ladders repeat the query's zero-shot prompt, scored once: once such a run spent a third of its budget).
    What the cache saves buys more steps."""
    import gen_rl_data
    import rce
    from model import PointerSelector

    data = tmp_path / "data"
    sim = dict(num_train=300, num_val=60, num_queries=32, group_size=6, pool_size=12, min_shots=0)
    gen_rl_data.generate(gen_rl_data.Args(out=data, world="harmful", **sim))
    rce.main(rce.Args(data=data, out=tmp_path / "rce", can_stop=True, epochs=1, batch_size=8, **SMALL_NET))
    model = PointerSelector.load(tmp_path / "rce")
    with torch.no_grad():
        model.stop_bias.fill_(stop_bias)
    model.save(tmp_path / "rce")
    budget = 1000
    counted[0] = 0
    grpo.main(grpo.Args(data=data, init=tmp_path / "rce", out=tmp_path / "b", lvlm_budget=budget, **FAST))
    assert 0.95 * budget <= counted[0] <= budget, counted[0]
    assert records(tmp_path / "b")[-1]["lvlm/calls"] == counted[0]


class Stub:
    """Scores that depend on the prompt alone; counts what it is asked."""

    def __init__(self):
        self.asked = 0

    def score(self, split, queries, icds):
        self.asked += len(queries)
        base = queries.double() + icds.double().sum(-1) / 7 + (split == "val")
        return {f: base + i for i, f in enumerate(("acc", "correct", "gt_prob", "rel"))}


prompt = st.tuples(
    st.sampled_from(["train", "val"]), st.integers(0, 4), st.lists(st.integers(0, 5), min_size=1, max_size=4)
)


@given(st.lists(st.lists(prompt, min_size=1, max_size=6), max_size=8), st.data())
def test_score_cache_restores_any_earlier_state_from_a_later_one(requests, data):
    import torch

    from icl_select.backends import ScoreCache

    cache, memos = ScoreCache(Stub()), [{}]
    for req in requests:
        for k in sorted({len(p[2]) for p in req}):  # one call per split and shot count, as validation asks
            for split in ("train", "val"):
                ps = [p for p in req if len(p[2]) == k and p[0] == split]
                if ps:
                    cache.score(split, torch.tensor([p[1] for p in ps]), torch.tensor([p[2] for p in ps]))
        memos.append(dict(cache.memo))
    assert cache.calls == cache.backend.asked == len(cache.memo)  # every miss is asked once and counted once
    then = data.draw(st.sampled_from(memos))
    again = ScoreCache(Stub())
    again.restore(cache.state(), len(then))
    assert again.memo == then and again.calls == len(then)
    state, saved = again.state(), cache.state()
    assert all(torch.equal(state[k], saved[k][: len(then)]) for k in state)  # a prefix of what was saved
    for key in then:  # a restored score is never asked again
        again.score(key[0], torch.tensor([key[1]]), torch.tensor([key[2]]))
    assert again.backend.asked == 0


def test_replay_keeps_fresh_ratios_at_one_and_clips_replayed_groups_against_their_sampler():
    import torch

    logp = torch.tensor([[-1.0, -2.0], [-3.0, -4.0], [-5.0, -6.0]])  # (B', G): one fresh group, two replayed
    sampled = torch.tensor([[-3.5, -4.0], [-4.0, -8.0]])  # (R, G)
    old = grpo.replay_old(logp, sampled)
    assert torch.equal(old[0], logp[0]) and torch.equal(old[1:], sampled)


def test_replay_buffer_holds_the_last_steps_with_their_sampling_log_probs_and_resumes_identically(
    small_data, init, tmp_path, monkeypatch
):
    import torch

    from icl_select.files import read_tensors
    from icl_select.runs import load_selector

    def stored_buffer(ckpt):  # the checkpoint's extra tensors, as load_checkpoint hands them over
        learner = SimpleNamespace()
        grpo.carry_back(learner, {k.removeprefix("extra."): v for k, v in read_tensors(ckpt).items()})
        return learner.buffer

    common = dict(data=small_data, init=init, epochs=3, replay_steps=3, temperature=0.7, **FAST)
    full, part = tmp_path / "full", tmp_path / "part"
    grpo.main(grpo.Args(out=full, **common))
    # an epoch is 5 steps of 8 queries, the last of 4: its checkpoint holds the last 3 steps' groups of 6 sequences
    buffer = stored_buffer(full / "ckpt" / "epoch_001.safetensors")
    assert [e["logp"].shape for e in buffer] == [(8, 6), (8, 6), (4, 6)]
    assert all(e["seqs"].shape[:2] == e["mask"].shape == e["adv"].shape == e["logp"].shape for e in buffer)
    # with room for the whole first epoch, the oldest group is the first step's, sampled by the --init policy: its
    # stored log-prob is that policy's at --temperature
    one = tmp_path / "one"
    grpo.main(grpo.Args(out=one, **{**common, "epochs": 1, "replay_steps": 5}))
    first = stored_buffer(one / "ckpt" / "epoch_001.safetensors")[0]
    emb = grpo.load_dataset(small_data).emb["train"]
    seqs = (emb[first["rows"]], emb[first["pool"].clamp_min(0)], first["pool"] >= 0, first["seqs"], first["mask"])
    with torch.no_grad():
        policy = load_selector(init).eval()
        at_temp, plain = (policy(*seqs, temperature=t).logp.sum(-1) for t in (0.7, 1.0))
    assert torch.allclose(first["logp"], at_temp, atol=1e-6) and not torch.allclose(first["logp"], plain, atol=1e-3)

    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        m.setattr(runs, "save_checkpoint", save_then_die)
        grpo.main(grpo.Args(out=part, **common))
    grpo.main(grpo.Args(out=part, **common))
    for name in ("model.safetensors", "metrics.jsonl", "scores.safetensors", "ckpt/epoch_003.safetensors"):
        assert (part / name).read_bytes() == (full / name).read_bytes(), name


def test_replay_needs_online(small_data, init, tmp_path):
    with pytest.raises(ValueError, match=r"^--replay-steps 2 acts on online groups: add --online"):
        grpo.main(grpo.Args(data=small_data, init=init, out=tmp_path / "r", replay_steps=2))
    assert not (tmp_path / "r").exists()


def test_rce_logs_the_calls_its_validations_make_resume_included(small_data, tmp_path, counted, monkeypatch):
    import rce

    common = dict(data=small_data, out=tmp_path / "rce", epochs=3, batch_size=8, val_frac=0.25)

    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        m.setattr(runs, "save_checkpoint", save_then_die)
        rce.main(rce.Args(**common))
    killed = counted[0]
    assert [r["lvlm/calls"] for r in records(tmp_path / "rce")][-1] == killed
    rce.main(rce.Args(**common))
    calls = [r["lvlm/calls"] for r in records(tmp_path / "rce")]
    # cumulative over both processes: the resumed run restores the scores it saved and pays only for new prompts
    assert len(calls) == 4 and calls == sorted(calls) and calls[0] > 0 and calls[-1] == counted[0] > killed
