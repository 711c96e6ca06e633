"""Property tests for the RL math in model.py: advantages, PPO clip, the stop loss, exact/k3 KL, RCE weights."""

import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from strategies import group_batches, rng, seeds

from model import (
    demo_credits,
    exact_kl,
    group_advantages,
    k3_kl,
    ppo_clip_loss,
    rce_weights,
    reward_spread,
    stop_loss,
)

SCALES = st.sampled_from(["group", "batch", "none"])


def spread(r, mask):
    """Population std of each group's valid rewards (B,)."""
    n = mask.sum(-1)
    mean = r.where(mask, 0).sum(-1) / n
    return (((r - mean[:, None]) ** 2).where(mask, 0).sum(-1) / n).sqrt()


# ---------------------------------------------------------------------------------------------- group_advantages
@given(group_batches(), SCALES, st.booleans())
def test_advantages_centred_finite_and_zero_where_masked(batch, scale, rank):
    r, mask = batch
    a = group_advantages(r, mask, scale=scale, rank=rank)
    assert torch.isfinite(a).all()
    assert (a[~mask] == 0).all()
    assert torch.allclose(a.where(mask, 0).sum(-1), torch.zeros(len(r), dtype=a.dtype), atol=1e-9)


@given(group_batches(distinct=True))
def test_group_scale_gives_unit_std(batch):
    r, mask = batch
    a = group_advantages(r, mask, scale="group", eps=1e-4)
    ok = (mask.sum(-1) >= 2) & (spread(r, mask) > 0.1)
    # std/(std+eps) is within 1e-3 of 1 when std > 0.1
    assert torch.allclose(spread(a, mask)[ok], torch.ones(int(ok.sum()), dtype=a.dtype), atol=1e-3)


@given(group_batches(), SCALES, seeds)
def test_shift_invariance(batch, scale, seed):
    r, mask = batch
    shift = torch.randn(len(r), 1, generator=rng(seed), dtype=r.dtype) * 10
    a, b = group_advantages(r, mask, scale=scale), group_advantages(r + shift, mask, scale=scale)
    assert torch.allclose(a, b, atol=1e-6)


@given(group_batches(distinct=True), seeds)
def test_group_scale_invariance(batch, seed):
    r, mask = batch
    factor = torch.rand(len(r), 1, generator=rng(seed), dtype=r.dtype) * 9.5 + 0.5
    a, b = group_advantages(r, mask, eps=0.0), group_advantages(r * factor, mask, eps=0.0)
    assert torch.allclose(a, b, atol=1e-9)


@given(group_batches(), SCALES, st.booleans(), seeds)
def test_masked_entries_never_influence_valid_ones(batch, scale, rank, seed):
    r, mask = batch
    noisy = torch.where(mask, r, torch.randn(r.shape, generator=rng(seed), dtype=r.dtype) * 1e6)
    assert torch.equal(group_advantages(r, mask, scale, rank), group_advantages(noisy, mask, scale, rank))


@given(group_batches(), SCALES, st.booleans(), st.floats(-1e6, 1e6))
def test_all_equal_group_gets_exactly_zero(batch, scale, rank, value):
    r, mask = batch
    r = r.clone()
    r[0] = value
    a = group_advantages(r, mask, scale=scale, rank=rank)
    assert (a[0] == 0).all()


@given(group_batches())
def test_rank_bounded_order_preserving_ties_shared(batch):
    r, mask = batch
    a = group_advantages(r, mask, rank=True)
    assert (a.abs() <= 1).all()
    for b in range(len(r)):
        rv, av = r[b][mask[b]], a[b][mask[b]]
        gt = rv[:, None] > rv[None, :]
        assert (av[:, None] > av[None, :])[gt].all()
        assert (av[:, None] == av[None, :])[rv[:, None] == rv[None, :]].all()
        if (rv == rv.max()).sum() == 1 < len(rv):  # a unique best gets +1, a unique worst -1
            assert av[rv.argmax()] == 1
        if (rv == rv.min()).sum() == 1 < len(rv):
            assert av[rv.argmin()] == -1


def test_rank_by_hand():
    r = torch.tensor([[3.0, 1.0, 1.0, 0.0, 9.0]])
    mask = torch.tensor([[True, True, True, True, False]])
    # valid ranks ascending: 0.0 -> 0, the two 1.0s share (1+2)/2 = 1.5, 3.0 -> 3; n-1 = 3
    expected = torch.tensor([[1.0, 0.0, 0.0, -1.0, 0.0]])
    assert torch.allclose(group_advantages(r, mask, rank=True), expected)


def test_scale_variants_by_hand():
    # groups with different means, so the batch std of group-centred rewards differs from the std of raw rewards
    r = torch.tensor([[1.0, 3.0], [10.0, 14.0]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    assert torch.allclose(group_advantages(r, mask, "none"), torch.tensor([[-1.0, 1.0], [-2.0, 2.0]]))
    assert torch.allclose(group_advantages(r, mask, "group", eps=0.0), torch.tensor([[-1.0, 1.0], [-1.0, 1.0]]))
    # batch std of centred values (-1, 1, -2, 2) is sqrt(2.5)
    expected = torch.tensor([[-1.0, 1.0], [-2.0, 2.0]]) / math.sqrt(2.5)
    assert torch.allclose(group_advantages(r, mask, "batch", eps=0.0), expected)


@given(group_batches())
def test_reward_spread(batch):
    r, mask = batch
    spread = reward_spread(r, mask)
    for b in range(len(r)):
        valid = r[b][mask[b]]
        assert spread[b] == valid.max() - valid.min()
    assert reward_spread(r, torch.zeros_like(mask)).eq(0).all()


def test_ppo_finite_for_huge_log_ratios():
    logp = torch.tensor([[1000.0, -1000.0, 0.0]], requires_grad=True)
    loss, stats = ppo_clip_loss(logp, torch.zeros(1, 3), torch.tensor([[0.0, 0.0, 1.0]]), torch.ones(1, 3).bool())
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all() and torch.isfinite(stats["ratio_mean"])


def test_advantages_reject_bad_input():
    with pytest.raises(ValueError, match="scale"):
        group_advantages(torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), scale="std")
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(torch.tensor([[0.0, float("nan")]]), torch.ones(1, 2, dtype=torch.bool))


# ---------------------------------------------------------------------------------------------- ppo_clip_loss
@st.composite
def ppo_batches(draw, spread_=0.1):
    B, G = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    g = rng(draw(seeds))
    old = torch.randn(B, G, generator=g, dtype=torch.float64) * 3 - 5
    logp = old + (torch.rand(B, G, generator=g, dtype=torch.float64) * 2 - 1) * spread_
    adv = torch.randn(B, G, generator=g, dtype=torch.float64)
    mask = torch.rand(B, G, generator=g) < 0.8
    mask[0, 0] = True
    return logp, old, adv, mask


@given(ppo_batches(spread_=0.15))
def test_ppo_inside_clip_range_equals_unclipped(batch):
    logp, old, adv, mask = batch  # |log ratio| <= 0.15 keeps rho inside [0.86, 1.17] within (0.8, 1.2)
    loss, stats = ppo_clip_loss(logp, old, adv, mask, 0.2)
    ratio = (logp - old).exp()
    assert torch.allclose(loss, -(ratio * adv)[mask].mean())
    assert stats["clip_frac_low"] == 0 and stats["clip_frac_high"] == 0


@given(ppo_batches())
def test_ppo_ratio_one(batch):
    _, old, adv, mask = batch
    loss, stats = ppo_clip_loss(old.clone(), old, adv, mask)
    assert torch.allclose(loss, -adv[mask].mean())
    assert stats["clip_frac_low"] == 0 and stats["clip_frac_high"] == 0 and stats["ratio_mean"] == 1


@given(ppo_batches(spread_=1.0), st.floats(0.05, 0.5), st.floats(0.05, 0.5))
def test_ppo_gradient_zero_where_clipped_against_advantage(batch, eps_low, eps_high):
    logp, old, adv, mask = batch
    logp = logp.clone().requires_grad_(True)
    loss, stats = ppo_clip_loss(logp, old, adv, mask, eps_low, eps_high)
    loss.backward()
    ratio = (logp - old).exp().detach()
    low = (ratio < 1 - eps_low) & (adv < 0) & mask
    high = (ratio > 1 + eps_high) & (adv > 0) & mask
    assert (logp.grad[low | high] == 0).all()
    assert (logp.grad[~mask] == 0).all()
    live = mask & ~low & ~high & (adv != 0)
    assert (logp.grad[live] != 0).all()
    n = mask.sum()
    assert math.isclose(float(stats["clip_frac_low"]), float(low.sum() / n), abs_tol=1e-12)
    assert math.isclose(float(stats["clip_frac_high"]), float(high.sum() / n), abs_tol=1e-12)


def test_ppo_by_hand_and_bad_eps():
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.0]]))
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    loss, stats = ppo_clip_loss(logp, old, adv, torch.ones(1, 3, dtype=torch.bool), 0.2, 0.3)
    # min(1.5, 1.3) = 1.3; min(-0.5, -0.8) = -0.8; 2.0 -> mean = (1.3 - 0.8 + 2.0) / 3
    assert torch.allclose(loss, torch.tensor(-(1.3 - 0.8 + 2.0) / 3))
    assert math.isclose(float(stats["clip_frac_low"]), 1 / 3, rel_tol=1e-6)
    assert math.isclose(float(stats["clip_frac_high"]), 1 / 3, rel_tol=1e-6)
    with pytest.raises(ValueError, match="eps"):
        ppo_clip_loss(logp, old, adv, torch.ones(1, 3, dtype=torch.bool), 0.0)


# ---------------------------------------------------------------------------------------------- stop loss
@given(seeds, st.integers(1, 12), st.floats(-6, 6))
def test_stop_loss_puts_p_stop_at_one_half_exactly_where_stopping_gains_on_average(seed, P, logit):
    """For one stop probability p = sigmoid(x) shared by every pair, d loss / dx = p - wins / (wins + losses) (sums of
    the positive gains and of the negative ones' sizes): least at that share, so p >= 1/2 iff the mean gain >= 0,
    whatever the split into many small wins and few large losses."""
    g = rng(seed)
    gain = torch.randn(P, generator=g, dtype=torch.float64) * torch.rand(P, generator=g, dtype=torch.float64) * 3
    gain = gain.where(torch.rand(P, generator=g) < 0.8, 0.0)  # some pairs tie
    assume(gain.abs().sum() > 1e-6)
    x = torch.tensor(logit, dtype=torch.float64, requires_grad=True)
    loss = stop_loss(torch.nn.functional.logsigmoid(x).expand(P), gain)
    (grad,) = torch.autograd.grad(loss, x)
    share = gain.clamp_min(0).sum() / gain.abs().sum()
    assert grad.item() == pytest.approx(torch.sigmoid(x).item() - share.item(), abs=1e-9)
    half = torch.zeros((), dtype=torch.float64, requires_grad=True)  # p = 1/2: the loss pushes p up iff stopping gains
    (grad,) = torch.autograd.grad(stop_loss(torch.nn.functional.logsigmoid(half).expand(P), gain), half)
    assert (grad.item() < 0) == (gain.sum().item() > 1e-12) or abs(gain.sum().item()) <= 1e-12


def test_stop_loss_by_hand_and_zero_where_nothing_is_at_stake():
    logp = torch.log(torch.tensor([0.25, 0.25, 0.9], dtype=torch.float64))
    gain = torch.tensor([2.0, -1.0, 0.0])  # won by 2, lost by 1, a tie (no weight)
    want = (2 * -math.log(0.25) + 1 * -math.log(0.75)) / 3
    assert stop_loss(logp, gain).item() == pytest.approx(want, rel=1e-9)
    assert stop_loss(logp, torch.zeros(3)).item() == 0.0
    assert torch.isfinite(stop_loss(torch.zeros(2), torch.tensor([1.0, -1.0])))  # p = 1: finite, not inf


# ---------------------------------------------------------------------------------------------- KL
@st.composite
def dist_pairs(draw):
    """Two per-step log-distributions (B, G, S, K) sharing the same -inf (unavailable) pattern, plus a step mask."""
    B, G, S, K = (draw(st.integers(1, n)) for n in (3, 4, 4, 6))
    K = max(K, 2)
    g = rng(draw(seeds))
    avail = torch.rand(B, G, S, K, generator=g) < 0.7
    avail[..., 0] = True

    def dist():
        logits = torch.randn(B, G, S, K, generator=g, dtype=torch.float64) * 2
        return logits.masked_fill(~avail, float("-inf")).log_softmax(-1)

    step_mask = torch.rand(B, G, S, generator=g) < 0.8
    return dist(), dist(), step_mask


@given(dist_pairs())
def test_exact_kl_nonnegative_zero_iff_equal_and_by_hand(pair):
    p, q, step_mask = pair
    kl = exact_kl(p, q, step_mask)
    assert (kl >= -1e-12).all()
    assert (exact_kl(p, p.clone(), step_mask) == 0).all()
    # brute force with explicit loops over valid entries
    B, G, S, K = p.shape
    for b in range(B):
        for g_ in range(G):
            ref = sum(
                math.exp(p[b, g_, t, k]) * (p[b, g_, t, k] - q[b, g_, t, k])
                for t in range(S)
                if step_mask[b, g_, t]
                for k in range(K)
                if math.isfinite(p[b, g_, t, k])
            )
            assert math.isclose(float(kl[b, g_]), ref, abs_tol=1e-9)
    differs = ((p - q).abs().nan_to_num(0).amax(-1) > 1e-3) & step_mask  # (B, G, S) steps where p != q
    assert (kl[differs.any(-1)] > 0).all()


@given(dist_pairs())
def test_exact_kl_gradients_finite(pair):
    p, q, step_mask = pair
    logits = p.masked_fill(~torch.isfinite(p), 0).clone().requires_grad_(True)
    lp = logits.masked_fill(~torch.isfinite(p), float("-inf")).log_softmax(-1)
    exact_kl(lp, q, step_mask).sum().backward()
    assert torch.isfinite(logits.grad).all()


@given(ppo_batches(spread_=3.0))
def test_k3_nonnegative_and_formula(batch):
    logp, ref, _, mask = batch
    k3 = k3_kl(logp, ref, mask)
    r = (ref - logp)[mask]
    assert k3 >= 0
    assert math.isclose(float(k3), float((r.exp() - r - 1).mean()), rel_tol=1e-9, abs_tol=1e-12)
    assert k3_kl(logp, logp.clone(), mask) == 0


# ---------------------------------------------------------------------------------------------- rce_weights
@given(group_batches(), st.floats(0.05, 5.0))
def test_rce_weights_normalised_and_masked(batch, tau):
    r, mask = batch
    w = rce_weights(r, mask, tau)
    assert (w[~mask] == 0).all() and (w >= 0).all()
    assert torch.allclose(w.sum(-1), torch.ones(len(r), dtype=w.dtype))
    # higher reward -> at least as much weight
    for b in range(len(r)):
        rv, wv = r[b][mask[b]], w[b][mask[b]]
        assert (wv[:, None] >= wv[None, :] - 1e-12)[rv[:, None] >= rv[None, :]].all()


@given(group_batches(distinct=True))
def test_rce_weights_tend_to_one_hot(batch):
    r, mask = batch
    w = rce_weights(r, mask, 1e-4)
    best = r.masked_fill(~mask, float("-inf")).argmax(-1)
    gap = r.masked_fill(~mask, float("-inf")).topk(min(2, r.shape[1]), -1).values
    clear = (gap[:, 0] - gap[:, -1] > 1e-2) | (mask.sum(-1) == 1)
    assert torch.allclose(w[clear].gather(1, best[clear, None]), torch.ones(int(clear.sum()), 1, dtype=w.dtype))
    uniform = rce_weights(r, mask, 1e6)
    assert torch.allclose(uniform, (mask / mask.sum(-1, keepdim=True)).to(w.dtype), atol=1e-5)


def test_rce_weights_reject_nonpositive_temperature():
    with pytest.raises(ValueError, match="temperature"):
        rce_weights(torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), 0.0)


# ---------------------------------------------------------------------------------------------- demo_credits
@given(
    seeds, st.integers(1, 4), st.integers(1, 6), st.integers(1, 3), st.integers(0, 4), st.sampled_from(["mean", "best"])
)
def test_demo_credits_by_a_loop_over_candidates(seed, B, G, S, spare, how):
    """mean: a candidate's credit is the mean reward of the valid sequences holding it minus the group's mean; best:
    1 for the demonstrations of the first best valid sequence; 0 for candidates in no valid sequence."""
    g = rng(seed)
    K = S + spare
    seqs = torch.rand(B, G, K, generator=g).argsort(-1)[..., :S]  # distinct picks per sequence
    mask = torch.rand(B, G, generator=g) < 0.7
    mask[:, 0] = True
    rewards = torch.randint(0, 4, (B, G), generator=g).double()  # coarse: ties happen
    credit, seen = demo_credits(seqs.masked_fill(~mask[..., None], -1), mask, rewards, K, how)
    for b in range(B):
        valid = [j for j in range(G) if mask[b, j]]
        mean = sum(rewards[b, j].item() for j in valid) / len(valid)
        best = max(valid, key=lambda j: (rewards[b, j].item(), -j))
        for c in range(K):
            holding = [j for j in valid if c in seqs[b, j].tolist()]
            assert bool(seen[b, c]) == bool(holding)
            if how == "mean":
                want = sum(rewards[b, j].item() for j in holding) / len(holding) - mean if holding else 0.0
            else:
                want = float(c in seqs[b, best].tolist())
            assert credit[b, c].item() == pytest.approx(want, abs=1e-12)
