"""The stop of a selector that may stop (--can-stop): each step's set from the reward of its picks' first 0..S on a
set of questions (rce.py: anchors they never trained on, by cross-fitting; grpo.py: the run's stop ladders), and online
its first step fitted per question on the same ladders. Both are fits of `model.stop_loss`, whose least
value for one p(stop) shared by all pairs is p = (sum of stopping's wins) / (sum of |gain|)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from model import PointerSelector, stop_loss

# The ridge strengths on the first step's stop weight that `fit_first_stop` chooses among, by cross-validation.
RIDGE = (1e-3, 1e-2, 1e-1, 1.0, 10.0)


@torch.no_grad()
def set_stops(model: PointerSelector, acc: Tensor) -> tuple[list[float], Tensor]:
    """Set a may-stop selector's stop at each step, alike for every question, from `acc` (n, S + 1): the reward of
    its picks' first 0..S on n questions. Backward from the last step: after t picks, going on
    wins gain_t = v_{t+1} - acc_t, where v is what a question gets from step t + 1 on with the later steps as set
    (acc_S at the end); p(going on) = (sum of the wins) / (sum of |gain_t|), the constant `stop_loss` would reach on
    these questions (1/2 where nothing was won or lost), within [0.01, 0.99]. Greedy decoding thus gives a number of
    demonstrations that scored on them at least as well as any fewer. The stop weight w = 0; steps past S take step
    S - 1's. -> p(going on) after 0..S - 1 picks, and v_1 (n,): what each question gets once it takes a first pick."""
    S = acc.shape[1] - 1
    go, value = [0.5] * S, acc[:, S]  # value (n,): from step t + 1 on, the later steps deciding as set
    for t in reversed(range(S)):
        if t == 0:
            first = value
        gain = value - acc[:, t]  # (n,)
        size = float(gain.abs().sum())
        go[t] = min(max(float(gain.clamp_min(0).sum()) / size if size > 0 else 0.5, 0.01), 0.99)
        value = value if go[t] >= 0.5 else acc[:, t]  # a tie goes on, as greedy decoding does
    model.stop_weight.zero_()
    for t in range(len(model.stop_bias)):
        p = go[min(t, S - 1)]
        model.stop_bias[t] = model.cfg.temperature * math.log((1 - p) / p)
    return go, first


def stop_logp(states: Tensor, w: Tensor, b: Tensor, temperature: float) -> Tensor:
    """log p(stop) before the first pick, sigmoid((states . w + b) / temperature), in float64: states (P, H) -> (P,)."""
    return F.logsigmoid((states.double() @ w + b) / temperature)


def ridge_fit(states: Tensor, gain: Tensor, temperature: float, ridge: float) -> tuple[Tensor, Tensor]:
    """(w, b) minimising `stop_loss` of p(stop) = sigmoid((states . w + b) / temperature) on P pairs, states (P, H),
    gain (P,) stopping's reward minus going on's, plus ridge * |w|^2: convex, solved by L-BFGS in float64 from 0."""
    states, gain = states.double(), gain.double()  # once, not at every L-BFGS evaluation
    w = torch.zeros(states.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=200, tolerance_grad=1e-9, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        opt.zero_grad()
        loss = stop_loss(stop_logp(states, w, b, temperature), gain) + ridge * w.square().sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return w.detach(), b.detach()


@torch.no_grad()
def fit_first_stop(model: PointerSelector, states: Tensor, gain: Tensor) -> dict[str, float]:
    """Fit a may-stop selector's stop before its first pick, per question, on P questions: states (P, H) each
    question's state before its first pick, gain (P,) its zero-shot reward minus going on's (`ridge_fit`, the ridge
    chosen among RIDGE by the loss on the other half of two halves). One full-batch fit of the pairs, whatever order
    they came in: trained by Adam a few pairs a step, the stop's bias swung from seed to seed, giving none where going
    on won. The later steps are kept. -> the chosen ridge and the share of the pairs' questions that now go on."""
    if not gain.abs().sum() > 0:  # nothing won or lost: the stop stays as it was
        return {}
    states, T, half = states.double(), model.cfg.temperature, torch.arange(len(gain)) % 2
    held_out = []
    for ridge in RIDGE:
        loss = 0.0
        for h in (0, 1):
            fit, other = half == h, half != h
            w, b = ridge_fit(states[fit], gain[fit], T, ridge)
            loss += float(stop_loss(stop_logp(states[other], w, b, T), gain[other].double()))
        held_out.append(loss)
    ridge = RIDGE[min(range(len(RIDGE)), key=held_out.__getitem__)]
    w, b = ridge_fit(states, gain, T, ridge)
    model.stop_weight.copy_(w)
    model.stop_bias[0] = b
    go = (states @ w + b <= 0).double().mean()  # greedy decoding goes on where p(stop) <= 1/2
    return {"stop/ridge": ridge, "stop/go_on": float(go)}
