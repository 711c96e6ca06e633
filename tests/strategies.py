"""Shared hypothesis strategies: every random tensor comes from a hypothesis-drawn seed, so failures replay."""

import torch
from hypothesis import strategies as st

seeds = st.integers(0, 2**32 - 1)


def rng(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@st.composite
def group_batches(draw, max_b=5, max_g=8, distinct=False):
    """(rewards (B, G) float64, mask (B, G) bool) with at least one valid entry per group."""
    B, G = draw(st.integers(1, max_b)), draw(st.integers(1, max_g))
    g = rng(draw(seeds))
    # Rewards on a coarse grid so ties happen often (as with correct+acc rewards), unless distinct ones are asked for.
    if distinct:
        rewards = torch.rand(B, G, generator=g, dtype=torch.float64) * 4
    else:
        rewards = torch.randint(0, 5, (B, G), generator=g).double() * 0.5
    mask = torch.rand(B, G, generator=g) < 0.8
    mask[:, 0] = True
    return rewards, mask
