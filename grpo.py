"""Stage 3: GRPO post-training of the selector, offline on the scored groups or online with the LVLM in the loop.

Per step, for a batch of queries and their groups of G sequences: advantages from the group's rewards
(`model.group_advantages`), the PPO clipped surrogate on sequence log-probs against the old policy, plus beta * exact
KL(pi || pi_ref) over the pool at every visited step, averaged over valid sequences. The reference is the starting
selector (--init, or the warm start below), frozen; the old policy is the current one, refreshed every --num-iterations
updates, so the ratio starts at exactly 1; every log-prob is taken with dropout off.

Offline (default), the groups are the scored sequences of rl_data.jsonl, drawn by gen_rl_data.py and not by the policy,
with no importance weight: a reward-weighted policy gradient on fixed groups, cheap (no LVLM calls) but blind to
sequences nobody scored; with --num-iterations 1 the clip never binds. Online (--online), each step samples G distinct
sequences per query from the current policy at --temperature and scores them with the dataset's backend: on-policy GRPO,
the mode that learns most wherever LVLM calls during training are affordable. Defaults differ by mode (MODE_DEFAULTS;
docs/ablations.md measures them); online, each step also learns from the groups of the last few steps (--replay-steps),
and the selector learns a score per train item (--item-bias). A --lvlm-budget that cuts the default online run short
first trains offline GRPO from --init, then the online run from it (--warm-start): no flag to add for a small budget. A
selector that may stop (rce.py --can-stop) learns its stop online only (a warm start trains, and is judged on, its picks
alone): its groups are those a selector that cannot stop would draw (every slot filled), PPO and the KL take its picks
given that it goes on, and beside the group of one query in --ladder-every a ladder is scored: its greedy sequence at
each length 0..S. After each epoch its stop at every step is set from the ladders so far, backward from the last step
(`icl_select.stops.set_stops`), and before the first pick fitted per question (`fit_first_stop`): a stop rce.py set for
its own picks would go stale as the picks improve. The ladders teach the stop alone, and the samples the picks alone.

Usage:
    python grpo.py --kl-beta 0.1 --no-rank-advantage         # offline, init runs/rce -> runs/grpo-kl0.1
    python grpo.py --online                                   # online -> runs/grpo-kl0.3-online
    python grpo.py --online --lvlm-budget 35000               # a budget: offline GRPO first, then online from it
    python grpo.py --quality medium --out runs/cur1 && python grpo.py --init runs/cur1 --out runs/cur2  # curriculum
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Annotated, Literal

import torch
from torch import Tensor
from tyro.conf import DisallowNone

from icl_select import lineage, sharding
from icl_select.backends import ScoreCache
from icl_select.batches import Batch, Split, make_batch, pass_batches, split_queries, steps_per_epoch
from icl_select.cli import alias, default_is, help_first, run_cli
from icl_select.data import Dataset, RewardArgs, RewardMode, compute_reward, load_dataset
from icl_select.epochs import EpochMeans, log_line, lr_factor, stop_if_diverged
from icl_select.pools import first_distinct, query_pools, random_sequences
from icl_select.runs import RunFolder, check_continues, check_selector, load_selector, new_loop
from icl_select.stops import fit_first_stop, set_stops
from icl_select.train_args import TrainArgs, check_train_args
from icl_select.validation import dataset_backend, greedy_icds, selection_metric, validate, validation_backend
from model import (
    PointerSelector,
    Steps,
    exact_kl,
    going_on_logp,
    group_advantages,
    k3_kl,
    picks_given_going_on,
    ppo_clip_loss,
    reward_spread,
    slices,
)

# What moves in GRPO, on the progress bar and the epoch line (the loss is ~beta * KL: the PPO term is ~0 at ratio 1).
SHOWN = ("grpo/reward_mean", "grpo/kl_ref", "grpo/entropy")


# Per-mode defaults of the flags left at None (docs/ablations.md measures them on the simulator).
MODE_DEFAULTS = {
    "offline": {
        "epochs": 10,
        "lr": 1e-4,
        "reward_mode": "hard_plus_soft",
        "kl_beta": 0.1,
        "replay_steps": 0,
        "item_bias": False,
    },
    "online": {
        "epochs": 30,
        "lr": 1e-3,
        "reward_mode": "hard_plus_gtprob",
        "kl_beta": 0.3,
        "replay_steps": 4,
        "item_bias": True,
    },
}


def per_mode(name: str):
    """--help's default of a flag left at None: its value in each mode."""
    return default_is(" offline, ".join(str(MODE_DEFAULTS[mode][name]) for mode in ("offline", "online")) + " online")


@help_first("init", "data", "out", "online", "kl_beta")
@dataclass
class Args(TrainArgs):
    init: Path = Path("runs/rce")
    """Starting selector (run folder or epoch checkpoint); also the frozen KL reference, unless a warm start runs first
    (a short budget: then the warm start's selected epoch is both)."""
    out: Annotated[Path | None, alias("--output-dir"), default_is("runs/grpo-<key flags>, e.g. runs/grpo-kl0.1")] = None
    """Run folder."""
    epochs: Annotated[int | None, alias("--num-train-epochs"), per_mode("epochs")] = None
    """Passes over the training queries; with --lvlm-budget, the epochs its calls spread over (planned if not given)."""
    lr: Annotated[float | None, alias("--learning-rate"), per_mode("lr")] = None
    """AdamW learning rate."""
    reward_mode: Annotated[RewardMode | None, per_mode("reward_mode")] = None
    """How a scored sequence becomes a reward (formulas: docs/flags.md)."""
    kl_beta: Annotated[float | None, alias("--beta"), per_mode("kl_beta")] = None
    """Weight of the exact KL to the reference policy, fixed for the run (see --kl-target)."""
    kl_target: float | None = None
    """Adaptive beta: after a step, x1.5 if its KL > 1.5 x target, /1.5 if below target / 1.5."""
    num_iterations: int = 1
    """Updates per batch before the old policy is refreshed (1: a fresh group's ratio is exactly 1; a replayed one's
    is to the policy that sampled it)."""
    epsilon: float = 0.2
    """PPO clip range below 1 (and above, unless --epsilon-high is given)."""
    epsilon_high: float | None = None
    """PPO clip range above 1 (DAPO-style asymmetric clipping)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide centred rewards by the group std, the batch std, or nothing."""
    rank_advantage: bool = False
    """Replace rewards by their within-group rank mapped onto [-1, 1] (Lever-Plus's default)."""
    freeze_backbone: bool = False
    """Train only the query/candidate projections and the gate."""
    online: bool = False
    """Sample fresh groups from the current policy each step and score them with the backend."""
    group_size: Annotated[int, alias("--num-generations")] = 16
    """Online: distinct sequences sampled per query (TRL's num_generations defaults to 8)."""
    temperature: float = 1.0
    """Online: sampling temperature."""
    queries: Literal["train", "anchors"] = "train"
    """Online: where each step's queries come from: any train question, or the anchors (docs/flags.md)."""
    lvlm_budget: int | None = None
    """Online: LVLM scores allowed in the whole run, validation included (docs/flags.md)."""
    ladder_every: int = 4
    """Online, a selector that may stop: one query in N of each batch has its stop ladder scored (docs/flags.md)."""
    replay_steps: Annotated[int | None, per_mode("replay_steps")] = None
    """Online: also learn, each step, from the groups of the last N steps (0 = off; docs/flags.md)."""
    warm_start: bool = True
    """Online, where --lvlm-budget cuts the default run short or the selector may stop: offline GRPO from --init first
    (docs/flags.md)."""
    select_epoch: Annotated[Literal["best", "last"] | None, default_is("last with --lvlm-budget, else best")] = None
    """Which epoch the run returns: the best on the validation anchors, or the last (docs/flags.md)."""
    item_bias: Annotated[bool | None, DisallowNone, per_mode("item_bias")] = None
    """Also learn a score for each train item, added wherever it is a candidate: remembers which demonstrations
    helped beyond their embeddings (an --init that has them trains them either way; docs/flags.md)."""

    def fixed_length_reason(self) -> str | None:
        if self.lvlm_budget is not None:
            return "--lvlm-budget plans the steps and the learning rate over the whole run"
        return super().fixed_length_reason()


def default_select_epoch(args: Args) -> str:
    """A budget's few epochs are still climbing, and their validation scores differ by less than the anchors' noise."""
    return "last" if args.lvlm_budget is not None else "best"


def resolve(args: Args) -> Args:
    """Fill the per-mode defaults in (config.json records the resolved values)."""
    defaults = MODE_DEFAULTS["online" if args.online else "offline"]
    if args.lvlm_budget is not None:  # train plans the epochs from the budget
        defaults = {k: v for k, v in defaults.items() if k != "epochs"}
    defaults |= {"select_epoch": default_select_epoch(args)}
    return replace(args, **{k: v for k, v in defaults.items() if getattr(args, k) is None})


def default_out(args: Args) -> Path:
    """runs/grpo-kl<beta> plus every key flag that differs from its (per-mode) default."""
    args, defaults = resolve(args), MODE_DEFAULTS["online" if args.online else "offline"]
    parts = [f"grpo-kl{args.kl_beta:g}"]
    flags = {
        "online": args.online,
        "rank": args.rank_advantage,
        "frozen": args.freeze_backbone,
        f"scale-{args.scale_rewards}": args.scale_rewards != "group",
        args.reward_mode.replace("_", "-"): args.reward_mode != defaults["reward_mode"],
        f"q-{args.quality}": args.quality != "all",
        "pos": args.require_positive,
        f"target{args.kl_target}": args.kl_target is not None,
        f"it{args.num_iterations}": args.num_iterations != 1,
        f"lr{args.lr:g}": args.lr != defaults["lr"],
        f"lr-{args.lr_schedule}": args.lr_schedule != "constant",
        f"queries-{args.queries}": args.online and args.queries != "train",
        f"t{args.temperature:g}": args.online and args.temperature != 1.0,
        f"g{args.group_size}": args.online and args.group_size != 16,
        f"budget{args.lvlm_budget}": args.lvlm_budget is not None,
        "no-warm": args.online and not args.warm_start,
        f"{args.select_epoch}-epoch": args.select_epoch != default_select_epoch(args),
        f"{'' if args.item_bias else 'no-'}items": args.item_bias != defaults["item_bias"],
        f"replay{args.replay_steps}": args.replay_steps != defaults["replay_steps"],
        f"seed{args.seed}": args.seed != 0,
        f"from-{init_tag(args.init)}": Path(args.init) != Args.init,  # never the --init folder itself
    }
    return Path("runs") / "-".join(parts + [name for name, on in flags.items() if on])


def init_tag(init: Path) -> str:
    """A short name for a starting selector: its run folder, plus the epoch for a checkpoint file."""
    init = Path(init)
    return f"{init.parent.parent.name}-{init.stem}" if init.suffix == ".safetensors" else init.name


def check_args(args: Args) -> None:
    if args.lvlm_budget is not None and (not args.online or args.lvlm_budget < 1):
        raise ValueError(f"--lvlm-budget needs --online and must be >= 1, got {args.lvlm_budget}")
    if args.replay_steps < 0 or (args.replay_steps and not args.online):
        raise ValueError(f"--replay-steps needs --online and must be >= 0, got {args.replay_steps}")
    if args.ladder_every < 1:
        raise ValueError(f"--ladder-every must be at least 1, got {args.ladder_every}")
    check_train_args(args)
    numbers = {"--kl-beta": args.kl_beta, "--kl-target": args.kl_target, "--epsilon": args.epsilon}
    numbers |= {"--epsilon-high": args.epsilon_high, "--temperature": args.temperature}
    for flag, value in numbers.items():
        if value is not None and not math.isfinite(value):
            raise ValueError(f"{flag} must be a finite number, got {value}")
    if args.online and args.reward_mode == "info_score":
        raise ValueError(
            "--reward-mode info_score needs each query's zero-shot probability, which online queries are not scored "
            "for; within a group it ranks sequences as log gt_prob does: use hard_plus_gtprob online"
        )
    if args.kl_beta < 0:
        raise ValueError(f"--kl-beta must be >= 0, got {args.kl_beta}")
    if args.kl_target is not None and args.kl_target <= 0:
        raise ValueError(f"--kl-target must be > 0, got {args.kl_target}")
    if args.kl_target is not None and args.kl_beta == 0:
        raise ValueError(
            "--kl-target moves beta by factors of 1.5 from --kl-beta, and from --kl-beta 0 it would stay 0: give a "
            "starting --kl-beta > 0"
        )
    if args.epsilon <= 0 or (args.epsilon_high is not None and args.epsilon_high <= 0):
        raise ValueError(f"--epsilon and --epsilon-high must be > 0, got {args.epsilon}, {args.epsilon_high}")
    if args.num_iterations < 1 or args.group_size < 2 or args.temperature <= 0:
        raise ValueError("--num-iterations must be >= 1, --group-size >= 2 and --temperature > 0")


@dataclass
class Plan:
    """How a run spends --lvlm-budget, fixed at the start."""

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


def warnings_for(record: dict, steps: int) -> list[str]:
    """Plain-words alarms for dead or runaway training signals (`steps` = picks per sequence)."""
    out = []
    if record.get("grpo/zero_std_frac", 0) >= 1:
        out.append("every group has equal rewards: there is no learning signal at all")
    if record.get("grpo/adv_std", 1) < 1e-3:
        out.append(f"advantage std is {record['grpo/adv_std']:.2g} (< 1e-3): rewards give the policy no gradient")
    if record.get("grpo/clip_frac_low", 0) + record.get("grpo/clip_frac_high", 0) > 0.5:
        out.append("more than half of the sequences hit the PPO clip: lower --lr or --num-iterations")
    # Against a near-uniform reference over K candidates the KL per pick is at most about log K (a deterministic
    # policy); 3 nats per pick is a policy that has left the reference almost entirely.
    if record.get("grpo/kl_ref", 0) > 3 * steps:
        out.append(
            f"KL to the reference is {record['grpo/kl_ref']:.3g} nats per sequence (> 3 per pick): the policy is "
            f"running away from it; raise --kl-beta or lower --lr"
        )
    return out


def kl_grad_share(params: list[torch.nn.Parameter], ppo: Tensor, kl_term: Tensor) -> float:
    """The KL term's share of the gradient norm, |g_kl| / (|g_ppo| + |g_kl|); the graph is kept for the update.

    The PPO term's *value* is ~0 at ratio 1 (advantages are centred), so the KL's share of the loss value says
    little; its share of the gradient says whether the KL penalty drowns the reward signal. The update itself still
    comes from one backward of the summed loss, so measuring never changes what is trained.
    """
    norms = []
    for part in (ppo, kl_term):
        grads = torch.autograd.grad(part, params, retain_graph=True, allow_unused=True)
        norms.append(sum(g.square().sum().item() for g in grads if g is not None) ** 0.5)
    return norms[1] / (norms[0] + norms[1] + 1e-12)


@torch.no_grad()
def reference_dists(ref: PointerSelector, ds: Dataset, split: Split, batch_size: int) -> Tensor:
    """The frozen reference's per-step distributions over every training query's scored group, (Q, G, S, K) (zeros
    for the validation queries), computed once per run: offline groups never change, so neither do these.

    They are computed in fixed `slices` of the training queries, so a resumed run recomputes the very same bits."""
    g = ds.groups
    out = torch.zeros(len(g), g.seqs.shape[1], ds.seq_len, g.pools.shape[1] + ref.cfg.can_stop)  # (Q, G, S, K [+ 1])
    for part in slices(len(split.train), batch_size):
        idx = split.train[part]
        b = make_batch(ds, idx, split.reward, ref.cfg)
        out[idx] = ref(b.query, b.pool, b.pool_mask, b.seqs, b.seq_mask, True).log_dist
    return out


@dataclass
class StopLadders:
    """A selector that may stop, online: beside each group, the query's greedy sequence filling every slot, scored at
    each of its lengths 0..S (0: the zero-shot prompt), what its stop at every step is set from (`end_epoch_stop`).
    rows (B,) the questions, pool (B, K) their candidates, reward (B, S + 1) each length's."""

    rows: Tensor
    pool: Tensor
    reward: Tensor


def sample_and_score(
    policy: PointerSelector,
    scorer: ScoreCache,
    ds: Dataset,
    rows: Tensor,
    pool: Tensor,
    args: Args,
    gen,
    explore,
    fill: bool,
) -> tuple[Batch, float, StopLadders | None]:
    """Online groups: up to G distinct sequences per query, scored by the backend. From 2G samples of the current
    policy, the distinct ones, every slot filled, never cut short: the groups a selector that cannot stop would draw, so
    its picks learn as that selector's do (a cut sequence's reward is lower, or higher, for its stop, and PPO would
    credit its picks with it). With `fill` (a budgeted run) and fewer than G distinct (a policy sure of its choice),
    uniformly random sequences too: a group never collapses to the one sequence whose score is known, so it keeps a
    signal and spends its calls. A selector that may stop has its ladder scored beside the group of one query in
    --ladder-every (StopLadders): its stop is a few numbers, its picks need the calls. The cache answers a prompt
    scored before (a query's zero-shot prompt, a sample that is the greedy sequence) for free.
    rows (B,) train questions, pool (B, K) their candidates (train rows, -1 = padding) -> the batch, the share of its
    sequences that are random fills, and the ladders of a selector that may stop."""
    S, G = ds.seq_len, args.group_size
    emb = ds.emb["train"]
    query, pool_emb, pool_mask = emb[rows], emb[pool.clamp_min(0)], pool >= 0  # (B, d), (B, K, d), (B, K)
    cand, _ = policy.sample(query, pool_emb, pool_mask, S, 2 * G, gen, args.temperature, S)  # (B, 2G, S) all filled
    sampled = cand.shape[1]
    if fill:
        cand = torch.cat([cand, random_sequences(pool_mask, G, S, explore)], 1)  # the samples' distinct ones first
    order, ok = first_distinct(cand, G)  # (B, G)
    seqs = cand.gather(1, order[..., None].expand(-1, -1, S)).masked_fill(~ok[..., None], -1)  # (B, G, S)
    scored, known = seqs, ok
    if policy.cfg.can_stop:  # the greedy sequence's first 0..S picks: (B, S + 1, S), -1 past each length
        going = policy.greedy(query, pool_emb, pool_mask, S, S)[0]  # (B, S)
        ladder = going[:, None].where(torch.arange(S) < torch.arange(S + 1)[:, None], -1)
        scored = torch.cat([seqs, ladder], 1)  # (B, G + S + 1, S)
        laddered = torch.arange(len(rows)) % args.ladder_every == 0  # (B,) the rest leave their ladder unscored
        known = torch.cat([ok, laddered[:, None].expand(-1, S + 1)], 1)
    prompt = policy.cfg.to_prompt(scored).flatten(1)  # (B, G'*S) -1 after a stop and in padded sequences
    icds = pool.gather(1, prompt.clamp_min(0)).where(prompt >= 0, -1).view(-1, S)  # (B*G', S) train rows, prompt order
    flat = known.flatten()  # (B*G',) a padded sequence is never scored: its reward is 0 anyway
    fields = scorer.score("train", rows.repeat_interleave(scored.shape[1])[flat], icds[flat])
    fields = {k: v.new_zeros(len(flat)).masked_scatter(flat, v).view(known.shape) for k, v in fields.items()}
    reward = compute_reward(fields, args).where(known, 0.0)  # (B, G')
    ladders = StopLadders(rows[laddered], pool[laddered], reward[laddered, G:]) if policy.cfg.can_stop else None
    explored = (order >= sampled)[ok].double().mean().item()
    return Batch(query, pool_emb, pool_mask, seqs, ok, reward[:, :G]), explored, ladders


# An online budget's epoch takes at most this many times its planned steps: where a policy's groups stop costing calls
# (every prompt in them scored before), more steps no longer spend the budget.
MAX_STEPS = 10


def most_calls(n: int, args: Args, S: int, can_stop: bool) -> int:
    """The most LVLM calls a step of n queries asks (`sample_and_score`): their groups, and a may-stop selector's
    ladders, S + 1 calls beside each of the batch's queries 0, N, 2N, ... (N = --ladder-every)."""
    return n * args.group_size + can_stop * -(-n // args.ladder_every) * (S + 1)


def budget_batches(
    train: Tensor,
    batch: int,
    shuffle: torch.Generator,
    cache: ScoreCache,
    until: int,
    calls: Callable[[int], int],
    planned: int,
) -> Iterator[tuple[Tensor, bool]]:
    """An epoch of a budgeted run: batches of anchors from one shuffled pass after another, each as large as the calls
    left before `until` (the cache's count, read before each step) allow, `calls(n)` the most n queries ask, so that
    cached prompts buy more steps rather than leave the budget unspent; it ends where no query fits, or after MAX_STEPS
    x `planned` steps. Each batch comes with whether no full step would fit after it (the epoch's last, where it spends
    all)."""
    anchors = (row for _ in itertools.count() for row in train[torch.randperm(len(train), generator=shuffle)].tolist())
    for _ in range(MAX_STEPS * planned):
        left = until - cache.calls
        if (n := next((m for m in range(batch, 0, -1) if calls(m) <= left), 0)) == 0:
            return
        yield torch.tensor(list(itertools.islice(anchors, n))), left - calls(n) < calls(1)


def with_replay(ds: Dataset, b: Batch, adv: Tensor, buffer: list[dict[str, Tensor]]) -> tuple[Batch, Tensor, Tensor]:
    """The fresh batch followed by the buffer's groups, for one update: the batch (B', G, S), the advantages (B', G),
    each replayed group's as computed when it was scored, and the replayed groups' sampling log-probs (B' - B, G).
    The batch's rewards stay the fresh ones: replayed groups enter the loss only through their advantages."""
    emb = ds.emb["train"]
    parts = [(b.query, b.pool, b.pool_mask, b.seqs, b.seq_mask, adv)]
    for e in buffer:
        parts.append((emb[e["rows"]], emb[e["pool"].clamp_min(0)], e["pool"] >= 0, e["seqs"], e["mask"], e["adv"]))
    query, pool, pool_mask, seqs, mask, advs = (torch.cat(x) for x in zip(*parts))
    sampled = torch.cat([e["logp"] for e in buffer]) if buffer else adv.new_zeros(0, adv.shape[1])
    return Batch(query, pool, pool_mask, seqs, mask, b.reward), advs, sampled


def replay_old(logp: Tensor, sampled: Tensor) -> Tensor:
    """What the PPO ratio of each sequence is taken against, (B', G), for a batch whose last len(sampled) groups are
    replayed: logp (B', G) the current policy's, sampled (R, G) the replayed groups' sampling log-probs. A fresh group
    was sampled by the current policy: its ratio starts at exactly 1. A replayed one is the importance ratio to the
    policy that sampled it, clipped as PPO clips it: once the policy has moved past the clip, an old group stops
    pushing it further."""
    now = logp.detach()
    return torch.cat([now[: len(now) - len(sampled)], sampled])


def replay_tensors(buffer: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """The replay buffer as named tensors, for the epoch checkpoint."""
    return {f"replay.{i}.{k}": v.contiguous() for i, e in enumerate(buffer) for k, v in e.items()}


def replay_buffer(tensors: dict[str, Tensor]) -> list[dict[str, Tensor]]:
    """replay_tensors' inverse, from a checkpoint's extra tensors (none: an empty buffer)."""
    buffer: dict[int, dict[str, Tensor]] = {}
    for name, v in tensors.items():
        if name.startswith("replay."):
            i, k = name.removeprefix("replay.").split(".")
            buffer.setdefault(int(i), {})[k] = v
    return [buffer[i] for i in sorted(buffer)]


def val_greedy(model: PointerSelector, ds: Dataset, split: Split) -> Tensor:
    """The greedy demonstrations of the validation anchors, (V, S) train rows."""
    g = ds.groups
    return greedy_icds(model, ds, "train", g.queries[split.val], g.pools[split.val], ds.seq_len)


def selection_change(policy: PointerSelector, ds: Dataset, split: Split, ref_greedy: Tensor) -> float:
    """Share of validation anchors whose greedy demonstrations differ from the reference's, ref_greedy (V, S)."""
    return (val_greedy(policy, ds, split) != ref_greedy).any(-1).double().mean().item()


@dataclass
class Learner:
    """What GRPO updates and carries from step to step: the policy and its optimizer, the frozen reference, the
    reference's distributions over the offline groups (computed once), and the replay buffer of online groups."""

    policy: PointerSelector
    ref: PointerSelector
    opt: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    ref_cache: Tensor | None  # (Q, G, S, K) offline
    buffer: list[dict[str, Tensor]]  # --replay-steps: the last steps' groups, oldest first
    ladders: list[StopLadders] = field(default_factory=list)  # a selector that may stop: the run's, for its stop


def seq_logp(policy: PointerSelector, steps: Steps, seqs: Tensor) -> Tensor:
    """What PPO's ratio is taken on, (B, G): each sequence's log-prob; for a selector that may stop, of its picks
    given that it went on (`going_on_logp`), its stop set from its ladders alone (`end_epoch_stop`): in PPO's ratio,
    where stopping wins most groups, the stop goes to certainty (docs/ablations.md)."""
    return going_on_logp(steps, seqs) if policy.cfg.can_stop else steps.logp.sum(-1)


def update(lr: Learner, b: Batch, adv: Tensor, t: Batch, t_adv: Tensor, sampled, ref_dist: Tensor, args, loop, last):
    """--num-iterations PPO-clipped updates with beta * exact KL to the reference, on the groups `t` (the batch `b`,
    then any replayed groups, `sampled` their sampling log-probs) against the policy as it was before them; then the
    adaptive beta, if asked for. Returns the step's metrics and the log-probs the batch was sampled with, (B, G)."""
    m, tm = b.seq_mask, t.seq_mask  # (B, G), (B', G)
    temp = args.temperature if args.online else 1.0
    beta = loop["state"]["beta"]
    old, extra = None, {}
    for _ in range(args.num_iterations):
        cur = lr.policy(t.query, t.pool, t.pool_mask, t.seqs, tm, True, temp)
        logp = seq_logp(lr.policy, cur, t.seqs)  # (B', G)
        if old is None:  # a replayed group's ratio is to the policy that sampled it
            old = logp.detach() if sampled is None else replay_old(logp, sampled)
        ppo, st = ppo_clip_loss(logp, old, t_adv, tm, args.epsilon, args.epsilon_high)
        if lr.policy.cfg.can_stop:  # over the picks given going on: the stop is set from its ladders alone
            kl = exact_kl(picks_given_going_on(cur.log_dist), picks_given_going_on(ref_dist), cur.taken & (t.seqs >= 0))
            kl = kl[tm].mean()
        else:
            kl = exact_kl(cur.log_dist, ref_dist, cur.taken)[tm].mean()  # over each step taken
        loss = ppo + beta * kl
        lr.opt.zero_grad(set_to_none=True)
        if last:  # once per epoch, where the policy has left the reference
            extra["grpo/kl_grad_share"] = kl_grad_share(lr.params, ppo, beta * kl)
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(lr.params, args.grad_clip or math.inf))
        if math.isfinite(norm):  # a NaN/inf gradient skips the step; the run stops just below
            lr.opt.step()
    if last:  # how far one batch's updates moved the policy, KL(old || new)
        with torch.no_grad():
            new = seq_logp(lr.policy, lr.policy(b.query, b.pool, b.pool_mask, b.seqs, m, True, temp), b.seqs)
        extra["grpo/approx_kl_old"] = k3_kl(old[: len(m)], new, m).item()
    if args.kl_target is not None:  # adaptive beta, only on request
        if kl.item() > 1.5 * args.kl_target:
            loop["state"]["beta"] = beta * 1.5
        elif kl.item() < args.kl_target / 1.5:
            loop["state"]["beta"] = beta / 1.5
    r = b.reward[m]
    metrics = {
        "train/loss": loss.item(),
        "grpo/ppo_loss": ppo.item(),
        "grpo/kl_ref": kl.item(),
        "grpo/clip_frac_low": float(st["clip_frac_low"]),
        "grpo/clip_frac_high": float(st["clip_frac_high"]),
        "grpo/ratio_mean": float(st["ratio_mean"]),
        "grpo/entropy": cur.entropy[cur.taken].mean().item(),
        "train/grad_norm": norm,
        "grpo/beta": beta,
        "grpo/reward_mean": r.mean().item(),
        "grpo/reward_std": r.std(correction=0).item(),
        "grpo/zero_std_frac": (reward_spread(b.reward, m) == 0)[m.any(-1)].double().mean().item(),
        "grpo/adv_std": adv[m].std(correction=0).item(),
        "grpo/adv_abs_max": adv[m].abs().max().item(),
        "grpo/group_size": m.sum(-1).double().mean().item(),
        "grpo/demos": (b.seqs >= 0).sum(-1)[m].double().mean().item(),
        **extra,
    }
    return metrics, old[: len(m)]


def offline_step(lr: Learner, ds: Dataset, split: Split, idx: Tensor, args: Args, loop: dict, last: bool) -> dict:
    """One update on the scored groups of the anchors `idx` (B,), against the reference's cached distributions."""
    lr.policy.eval()  # every log-prob (new, old, reference) without dropout
    b = make_batch(ds, idx, split.reward, lr.policy.cfg)
    adv = group_advantages(b.reward, b.seq_mask, args.scale_rewards, args.rank_advantage).float()  # (B, G)
    return update(lr, b, adv, b, adv, None, lr.ref_cache[idx], args, loop, last)[0]


def online_step(lr: Learner, ds: Dataset, scorer: ScoreCache, queries, idx: Tensor, args: Args, loop, rngs, last):
    """One update on fresh groups: a query for each anchor of `idx` (B,) (see online_queries), G distinct sequences
    each sampled from the policy and scored by the backend, plus the replay buffer's groups with --replay-steps."""
    lr.policy.eval()  # sampling and every log-prob (new, old, reference) without dropout
    rows, pool = queries(idx)  # (B,), (B, K)
    fill = args.lvlm_budget is not None
    gens = rngs["sampler"], rngs["explore"]
    b, explored, ladders = sample_and_score(lr.policy, scorer, ds, rows, pool, args, *gens, fill)
    if ladders is not None:
        lr.ladders.append(ladders)
    adv = group_advantages(b.reward, b.seq_mask, args.scale_rewards, args.rank_advantage).float()  # (B, G)
    t, t_adv, sampled = with_replay(ds, b, adv, lr.buffer) if args.replay_steps else (b, adv, None)
    with torch.no_grad():
        ref_dist = lr.ref(t.query, t.pool, t.pool_mask, t.seqs, t.seq_mask, True, args.temperature).log_dist
    metrics, logp = update(lr, b, adv, t, t_adv, sampled, ref_dist, args, loop, last)
    if args.replay_steps:  # the fresh groups with the log-probs they were sampled with
        fresh = {"rows": rows, "pool": pool, "seqs": b.seqs, "mask": b.seq_mask, "adv": adv, "logp": logp}
        lr.buffer = [*lr.buffer, fresh][-args.replay_steps :]
    return metrics | {"grpo/explored": explored}


def online_queries(ds: Dataset, split: Split, args: Args, draws: torch.Generator):
    """The online step's queries for a batch of anchors idx (B,), as (rows (B,), pools (B, K)). anchors = those
    anchors and their pools; train = as many train questions, drawn with replacement among those whose image is no
    validation anchor's (validation stays held out), each with a fresh pool from the dataset's sampler."""
    image_ids = {"train": ds.picture_ids["train"]}
    eligible = (~torch.isin(image_ids["train"], image_ids["train"][ds.groups.queries[split.val]])).nonzero()[:, 0]
    K = ds.groups.pools.shape[1]

    def draw(idx: Tensor) -> tuple[Tensor, Tensor]:
        if args.queries == "anchors":
            return ds.groups.queries[idx], ds.groups.pools[idx]
        rows = eligible[torch.randint(len(eligible), (len(idx),), generator=draws)]  # (B,)
        return rows, query_pools(ds.meta["sampler"], K, ds.emb, image_ids, "train", rows, rows, draws)

    return draw


def learner(args: Args, ds: Dataset, split: Split, init: Path) -> Learner:
    """The `init` selector as the policy (its picks kept, grown to the data's sequence length where fewer) and as the
    frozen reference, its AdamW optimizer, and for offline GRPO the reference's distributions over the
    scored groups."""
    policy = load_selector(init)
    policy.set_picks(max(policy.cfg.picks, ds.seq_len))  # Lever-LM's 2-shot data: still asked for its 4
    if args.item_bias and policy.items is None:  # every score 0: the reference is the init's policy all the same
        policy.remember_items(ds.emb["train"])
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    if args.freeze_backbone:
        for p in policy.backbone_parameters():
            p.requires_grad_(False)
    for p in policy.stop_parameters():  # set at the end of an online epoch (`end_epoch_stop`), not by its steps
        p.requires_grad_(False)
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    ref_cache = None if args.online else reference_dists(ref, ds, split, args.batch_size)  # (Q, G, S, K)
    return Learner(policy, ref, opt, params, ref_cache, [])


def end_epoch_stop(lr: Learner, ds: Dataset, batch_size: int) -> dict[str, float | list[float]]:
    """A may-stop selector, online: its stop at each step set from the run's ladders so far (`set_stops`), then before
    the first pick fitted per question on zero-shot against what a first pick leads to, each question's state that of
    the policy as the epoch leaves it (`fit_first_stop`; an epoch's ladders alone, a few hundred, left its ridge to
    chance). The ladders are kept as one (`stop_ladder_tensors` carries them in the checkpoint).
    -> the record of the stop (empty where there is none)."""
    if not lr.ladders:
        return {}
    lr.ladders = [StopLadders(*(torch.cat([getattr(p, f.name) for p in lr.ladders]) for f in fields(StopLadders)))]
    rows, pool, reward = lr.ladders[0].rows, lr.ladders[0].pool, lr.ladders[0].reward  # (P,), (P, K), (P, S + 1)
    emb = ds.emb["train"]
    with torch.no_grad():  # (P, H) in slices, each pool's embeddings gathered only there
        states = torch.cat(
            [
                lr.policy.encode(emb[rows[i]], emb[pool[i].clamp_min(0)], pool[i] >= 0)[0]
                for i in slices(len(rows), batch_size)
            ]
        )
    go, going = set_stops(lr.policy, reward)  # going (P,): what a first pick leads to, the later steps as set
    record = {"stop/go_later": go[1:], "stop/ladders": len(rows)}
    return record | fit_first_stop(lr.policy, states, reward[:, 0] - going)


def stop_ladder_tensors(ladders: list[StopLadders]) -> dict[str, Tensor]:
    """The stop ladders kept at an epoch's end (one, or none), as named tensors for the epoch checkpoint."""
    if not ladders:
        return {}
    return {f"stop_ladders.{f.name}": getattr(ladders[0], f.name).contiguous() for f in fields(StopLadders)}


def stop_ladders(tensors: dict[str, Tensor]) -> list[StopLadders]:
    """stop_ladder_tensors' inverse, from a checkpoint's extra tensors (none: no ladders)."""
    names = [f"stop_ladders.{f.name}" for f in fields(StopLadders)]
    return [StopLadders(*(tensors[n] for n in names))] if names[0] in tensors else []


def epoch_record(epoch: int, loop: dict, means: dict, policy, ds, split, backend, cap, min_picks, lvlm, ref_greedy):
    """An epoch's line of metrics.jsonl: its step means, validation (eval mode; a selector that may stop makes at least
    `min_picks` picks), the selection change against the reference's greedy picks and the LVLM calls of the run so far
    (kept in the loop state for a resume)."""
    record = {"phase": "grpo", "epoch": epoch, "step": loop["step"], **means}
    record.update(validate(policy, ds, split, backend, cap, min_picks))
    record["grpo/selection_change"] = selection_change(policy, ds, split, ref_greedy)
    if lvlm is not None:  # cumulative, training and validation
        record["lvlm/calls"] = loop["state"]["lvlm_calls"] = lvlm.calls
    return record


def budget_terms(args: Args, ds: Dataset, split: Split) -> tuple[Callable[[int], Plan], Callable[[int], int], int]:
    """What --lvlm-budget's plan rests on, from flags and files alone: the plan a budget affords, the most calls a
    step of n queries asks (`most_calls`) and the most one validation asks (validate() asks 1..S shots of each
    validation anchor, where something answers them)."""
    S, steps = ds.seq_len, steps_per_epoch(split.train, args.batch_size)
    answered = split.val if ds.is_sim else split.val[: args.val_max_queries] if args.val_lvlm else split.val[:0]
    val_calls = len(answered) * S
    step_calls = functools.partial(most_calls, args=args, S=S, can_stop=stops(Path(args.init)))

    def plan_for(budget: int) -> Plan:
        return budget_plan(budget, args.epochs, step_calls(args.batch_size), val_calls, step_calls(1), steps)

    return plan_for, step_calls, val_calls


def check_budget(args: Args, ds: Dataset, split: Split) -> None:
    """Refuse, before any LVLM loads, a budget this run cannot spend at least 95% of: its last step may leave less than
    one query's calls unspent, and its last validation ask none of the calls kept for it. (Above that least budget,
    a warm start's validations always leave room for the online run.)"""
    plan_for, step_calls, val_calls = budget_terms(args, ds, split)
    least = 20 * (step_calls(1) - 1 + val_calls)
    if args.lvlm_budget < least:
        raise ValueError(
            f"--lvlm-budget {args.lvlm_budget} is below {least}, the smallest this run spends at least 95% of: its "
            f"last step may leave up to {step_calls(1) - 1} calls unspent (a query asks up to {step_calls(1)}) and "
            f"its last validation up to {val_calls}"
        )
    plan_for(args.lvlm_budget)  # one epoch's steps and validations fit


def stops(init: Path) -> bool:
    """Whether the selector at `init` may stop. GRPO trains such a selector's stop online only, from its stop ladders,
    which offline groups lack: so it is refused offline (a short budget's warm start trains its picks alone)."""
    return load_selector(init).cfg.can_stop


def warm_start_args(args: Args, out: Path) -> Args:
    """The offline GRPO run an online run starts from (a warm start): grpo.py's offline defaults from --init, sharing
    the online run's data, seed, validation split and other training flags, but not its schedule or rewards."""
    own = {"epochs", "lr", "lr_schedule", *(f.name for f in fields(RewardArgs))}
    shared = {f.name: getattr(args, f.name) for f in fields(TrainArgs) if f.name not in own}
    return resolve(Args(init=args.init, out=out, **shared))


def main(args: Args) -> None:
    args = resolve(args)
    check_args(args)
    if not args.online and stops(args.init):
        raise ValueError(
            f"--init {args.init} may stop, and GRPO learns when to stop online only: add --online (a budgeted online "
            "run's warm start trains its picks offline first)"
        )
    ds = load_dataset(args.data)
    check_selector(load_selector(args.init), args.init, lineage.reads(ds.meta), ds.folder, ds.emb["train"].shape[1])
    if args.lvlm_budget is not None:
        check_budget(args, ds, split_queries(ds, args))
    check_continues(args.out or default_out(args), args, ds)  # before a model loads
    rank, world = sharding.init()  # every rank trains the same policy on the same batches; RunFolder: rank 0 writes
    train(args, ds, validation_backend(ds, args), rank, world)
    sharding.finish(world)


def train(args: Args, ds: Dataset, backend: ScoreCache | None, rank: int, world: int) -> None:
    """One GRPO run; `backend` answers the validation anchors' greedy picks, where something can (validation_backend).
    A short budget's warm start runs first on the same cache, so its scores are counted, and paid for, once."""
    out = args.out or default_out(args)
    split = split_queries(ds, args)
    S, steps = ds.seq_len, steps_per_epoch(split.train, args.batch_size)
    metric, cap = selection_metric(backend), None if ds.is_sim else args.val_max_queries
    # Offline, a may-stop selector is a warm start, training its picks alone: they are judged, and its best epoch
    # chosen, filling every slot (by the stop it does not train, that epoch was chance's).
    min_picks = 0 if args.online else S
    plan, init, warm, short = None, Path(args.init), None, False
    if args.lvlm_budget is not None:
        plan_for, step_calls, _ = budget_terms(args, ds, split)
        plan = plan_for(args.lvlm_budget)
        short = plan.steps < (args.epochs or MODE_DEFAULTS["online"]["epochs"]) * steps  # fewer than the default run
    if args.online and args.warm_start and short:
        init = out / "offline"
        if rank == 0:
            print(f"warm start: offline GRPO from {args.init} -> {init} (--no-warm-start skips it)", flush=True)
        train(warm_start_args(args, init), ds, backend, rank, world)
        warm = {"run": str(init), "lvlm_calls": 0 if backend is None else backend.calls}
        if plan is not None:
            plan = plan_for(args.lvlm_budget - warm["lvlm_calls"])
    if plan is not None:
        args, steps = replace(args, epochs=plan.epochs), plan.steps_per_epoch
    total = args.epochs * steps
    first = warm["lvlm_calls"] if warm else 0  # a budget's calls before this run's own (its learning rate's clock)

    with RunFolder(out, rank, world) as run:
        resume_from = run.resume(args, ds)  # the last checkpoint of this run, if a re-run continues it
        scorer = (backend or dataset_backend(ds, args)) if args.online else None  # the same cache scores online
        lvlm = scorer or backend  # the one cache in front of the LVLM: its misses are the calls counted
        torch.manual_seed(args.seed)
        lr = learner(args, ds, split, init)
        rngs = {
            "shuffle": torch.Generator().manual_seed(args.seed + 1),
            "sampler": torch.Generator().manual_seed(args.seed + 2),
            "queries": torch.Generator().manual_seed(args.seed + 3),
            "explore": torch.Generator().manual_seed(args.seed + 4),
        }
        queries = online_queries(ds, split, args, rngs["queries"])
        ref_greedy = val_greedy(lr.ref, ds, split)  # (V, S): selection change is measured against these
        loop = new_loop({"beta": args.kl_beta})  # beta moves only with --kl-target
        if resume_from is not None:
            loop, extra = run.restore(resume_from, lr.policy, lr.opt, rngs, lvlm)
            lr.buffer, lr.ladders = replay_buffer(extra), stop_ladders(extra)
        planned = ({"budget_plan": asdict(plan)} if plan else {}) | ({"warm_start": warm} if warm else {})
        run.start(args, ds, split, loop, resume_from is not None, {"out": str(out), **planned})
        if resume_from is None:  # epoch 0 = the initial policy, the start of every curve
            run.log(epoch_record(0, loop, {}, lr.policy, ds, split, backend, cap, min_picks, lvlm, ref_greedy))

        for epoch in range(loop["epoch"] + 1, args.epochs + 1):
            start, calls = time.perf_counter(), lvlm.calls if lvlm else 0  # the bar's LVLM sequences a second
            if plan is None:  # a pass over the training anchors
                batches = pass_batches(split.train, args.batch_size, rngs["shuffle"])
                bar = run.progress(epoch, args.epochs, steps)
            else:  # an epoch is its share of the calls left once every validation is kept, however many steps it takes
                later = args.epochs - epoch + 1  # this epoch and those after it
                until = calls + (args.lvlm_budget - calls - later * plan.val_calls) // later
                batches = budget_batches(split.train, args.batch_size, rngs["shuffle"], lvlm, until, step_calls, steps)
                bar = run.progress(epoch, args.epochs, until - calls, unit="call")
            means = EpochMeans()
            for idx, last in batches:
                done = lvlm.calls if lvlm else 0
                progress = (loop["step"], total) if plan is None else (done - first, args.lvlm_budget - first)
                for group in lr.opt.param_groups:  # a function of the step (a budget's: of its calls) alone
                    group["lr"] = args.lr * lr_factor(args.lr_schedule, *progress)
                if args.online:
                    metrics = online_step(lr, ds, scorer, queries, idx, args, loop, rngs, last)
                else:
                    metrics = offline_step(lr, ds, split, idx, args, loop, last)
                loop["step"] += 1
                if args.kl_target is not None:  # beta moves every step: log every step
                    run.log({"phase": "grpo", "kind": "step", "epoch": epoch, "step": loop["step"], **metrics})
                stop_if_diverged(metrics, "grpo", epoch, loop["step"], out, "try a lower --lr or a larger --kl-beta")
                means.add(metrics)
                rate = f" seq_per_s={(lvlm.calls - calls) / (time.perf_counter() - start):.1f}" if args.online else ""
                bar.set_postfix_str(log_line(metrics, SHOWN) + rate, refresh=False)  # drawn at the bar's next redraw
                bar.update(1 if plan is None else lvlm.calls - done)
            bar.close()
            per_s = (lvlm.calls - calls) / (time.perf_counter() - start) if args.online else None  # before validation
            means = means.result() | end_epoch_stop(lr, ds, args.batch_size)

            record = epoch_record(epoch, loop, means, lr.policy, ds, split, backend, cap, min_picks, lvlm, ref_greedy)
            if per_s is not None and not ds.is_sim:  # the epoch's LVLM sequences a second, readable after the run
                record["lvlm/seq_per_s"] = round(per_s, 3)
            if warnings := warnings_for(record, S):
                record["warnings"] = warnings
            # epoch 0 is no candidate: see validation.selection_metric
            if args.select_epoch == "last" or record[metric] > loop["best"]:
                loop["best"], loop["best_epoch"] = record[metric], epoch
            record["best_epoch"] = loop["best_epoch"]
            loop["epoch"] = epoch
            kept = replay_tensors(lr.buffer) | stop_ladder_tensors(lr.ladders)
            run.end_epoch(record, lr.policy, lr.opt, rngs, loop, args.keep_every, lvlm, kept)
            warned = "".join(f"\n  warning: {w}" for w in warnings)
            run.say(f"{out.name} epoch {epoch}: {log_line(record, (*SHOWN, 'val/reward', 'val/acc'))}{warned}")
        chosen = f"{args.select_epoch} epoch {loop['best_epoch']} ({metric} {loop['best']:.4f})"
        run.say(f"{chosen} -> {out}/model.safetensors")
        if plan is not None:  # a bound, not a target: prompts scored before (a stop's zero-shot prompt) cost no call
            run.say(f"LVLM calls: {lvlm.calls:,} of the --lvlm-budget {args.lvlm_budget:,} (repeated prompts are free)")


if __name__ == "__main__":
    run_cli(main, Args)
