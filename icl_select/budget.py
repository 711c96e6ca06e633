"""How a training run's epochs are cut into steps: one shuffled pass over the training anchors each, or, under
`grpo.py --lvlm-budget N`, each epoch its share of the LVLM calls left. Plain numbers in, no stage's flags.

    plan = budget_plan(N, epochs, step_calls, val_calls, group, natural)   # the epochs and steps N affords
    least_budget(query_calls, val_calls)                                     # the smallest N spent 95% or more
    epochs = Passes(...) or Spending(...)                                    # one interface for the training loop

A budget's calls are the prompts the score cache sends to the LVLM: each step's groups (and a selector's stop
ladders) and every validation. The plan keeps every validation at its most calls and affords the most steps with the
rest; an epoch then takes as many steps as its share of what is left allows, so prompts the cache answers for free buy
more steps instead of leaving the budget unspent.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from icl_select.batches import pass_batches

# A budget's epoch takes at most this many times its planned steps: where a policy's groups stop costing calls (every
# prompt in them scored before), more steps no longer spend the budget.
MAX_STEPS = 10


@dataclass
class Plan:
    """How a run spends a budget, fixed at its start."""

    epochs: int
    steps: int  # optimisation steps in the whole run
    steps_per_epoch: int  # the last epoch may be shorter
    val_calls: int  # the most calls one validation makes (the start's and every epoch's)


def budget_plan(budget: int, epochs: int | None, step_calls: int, val_calls: int, group: int, natural: int) -> Plan:
    """The most steps `budget` affords once every validation is reserved, each step counted at its most calls
    (`step_calls`) and the last cut to the whole groups (`group` calls each) left. Without `epochs`, as many epochs of
    at most `natural` steps as the steps need: the fewest that fit, since every epoch reserves a validation; where one
    more epoch's validation would cost more than the steps it frees, the epochs so far, each of `natural` steps."""

    def affords(e: int) -> int:  # steps of training left once e epochs and the start (+ 1) are validated
        train = max(budget - (e + 1) * val_calls, 0)
        return train // step_calls + (train % step_calls >= group)

    e = epochs or 1
    while True:
        steps = affords(e)
        if epochs is not None or -(-steps // natural) <= e:
            break
        if affords(e + 1) < e + 1:  # one more epoch would not pay for its own validation
            steps = e * natural
            break
        e += 1
    if steps < e:
        raise ValueError(
            f"--lvlm-budget {budget} is too small: {e} epoch(s) need at least {e} step(s) of {group} to {step_calls} "
            f"calls and {e + 1} validations of up to {val_calls} calls, {e * group + (e + 1) * val_calls} in all"
        )
    per_epoch = -(-steps // e)
    while epochs is not None and (used := -(-steps // per_epoch)) < e:  # the last epochs came out empty: their
        e, steps = used, affords(used)  # validations are not needed, so they fund more steps
        per_epoch = -(-steps // e)
    return Plan(-(-steps // per_epoch), steps, per_epoch, val_calls)


def least_budget(query_calls: int, val_calls: int) -> int:
    """The smallest budget a run spends at least 95% of: its last step may leave up to a query's calls less one
    unspent (`query_calls`: the most one query asks), and its last validation ask none of the `val_calls` it kept."""
    return 20 * (query_calls - 1 + val_calls)


def step_calls(n: int, group: int, ladder_every: int, seq_len: int, can_stop: bool) -> int:
    """The most LVLM calls a step of n queries asks: their groups of `group` sequences, and a may-stop selector's
    ladders, seq_len + 1 calls beside each of the batch's queries 0, N, 2N, ... (N = `ladder_every`)."""
    return n * group + can_stop * -(-n // ladder_every) * (seq_len + 1)


def budget_batches(
    train: Tensor,
    batch: int,
    shuffle: torch.Generator,
    calls: Callable[[], int],
    until: int,
    most: Callable[[int], int],
    planned: int,
) -> Iterator[tuple[Tensor, bool]]:
    """An epoch of a budgeted run: batches of anchors from one shuffled pass after another, each as large as the calls
    left before `until` (`calls()`, read before each step) allow, `most(n)` the most n queries ask, so that cached
    prompts buy more steps rather than leave the budget unspent; it ends where no query fits, or after MAX_STEPS x
    `planned` steps. Each batch comes with whether no full step would fit after it (the epoch's last, where it spends
    all)."""
    anchors = (row for _ in itertools.count() for row in train[torch.randperm(len(train), generator=shuffle)].tolist())
    for _ in range(MAX_STEPS * planned):
        left = until - calls()
        if (n := next((m for m in range(batch, 0, -1) if most(m) <= left), 0)) == 0:
            return
        yield torch.tensor(list(itertools.islice(anchors, n))), left - most(n) < most(1)


@dataclass
class Passes:
    """Epochs without a budget: each a shuffled pass over the training anchors `train`, `steps` batches of `batch`."""

    train: Tensor
    batch: int
    shuffle: torch.Generator
    epochs: int
    steps: int
    unit: str = "step"

    def batches(self, epoch: int) -> Iterator[tuple[Tensor, bool]]:
        """The epoch's batches of anchors, each with whether it is the epoch's last."""
        return iter(pass_batches(self.train, self.batch, self.shuffle))

    def size(self) -> int:
        """What the epoch's progress bar counts to (set by `batches`)."""
        return self.steps

    def clock(self, step: int, calls: int) -> tuple[int, int]:
        """Where the run stands for its learning-rate schedule: (done, total) in steps."""
        return step, self.epochs * self.steps

    def moved(self, calls_before: int, calls: int) -> int:
        """What one step advances the progress bar by."""
        return 1


@dataclass
class Spending:
    """Epochs of a budget: each its share of the calls left once every validation is kept, however many steps that
    takes (`budget_batches`); `first`: the calls spent before the run (its warm start's), where its clock starts."""

    train: Tensor
    batch: int
    shuffle: torch.Generator
    calls: Callable[[], int]  # the LVLM calls so far (the score cache's count)
    most: Callable[[int], int]  # the most calls a step of n queries asks
    budget: int
    first: int
    plan: Plan
    unit: str = "call"
    until: int = 0  # the calls the current epoch may reach
    start: int = 0  # the calls when it began

    def batches(self, epoch: int) -> Iterator[tuple[Tensor, bool]]:
        later = self.plan.epochs - epoch + 1  # this epoch and those after it
        self.start = self.calls()
        self.until = self.start + (self.budget - self.start - later * self.plan.val_calls) // later
        return budget_batches(
            self.train, self.batch, self.shuffle, self.calls, self.until, self.most, self.plan.steps_per_epoch
        )

    def size(self) -> int:
        return self.until - self.start

    def clock(self, step: int, calls: int) -> tuple[int, int]:
        """(done, total) in calls: a budget's schedule follows what it spent, not its steps."""
        return calls - self.first, self.budget - self.first

    def moved(self, calls_before: int, calls: int) -> int:
        return calls - calls_before
