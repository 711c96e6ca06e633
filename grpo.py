"""Stage 3: GRPO post-training of the selector, offline on the scored groups or online with the LVLM in the loop.

Each step takes a batch of queries, each with a group of G sequences and their rewards, and minimises the PPO clipped
surrogate of the group-relative advantages plus beta times the KL to a reference. How it departs from plain GRPO:

1. The reference is the starting selector (--init), frozen, and the KL to it is exact: a sum over the pool at every
   step taken (`model.exact_kl`), not a sampled estimate. Its weight --kl-beta stays fixed unless --kl-target asks
   for an adaptive one (Lever-Plus's adaptive rule ran unasked and overrode the beta given).
2. The old policy is the current one, refreshed every --num-iterations updates, and every log-prob is taken with
   dropout off, so a fresh group's ratio starts at exactly 1 (Lever-Plus compared against a stale, pre-RCE policy in
   another dropout mode).
3. Offline (the default), the groups are rl_data.jsonl's scored sequences, drawn by gen_rl_data.py and not by the
   policy, with no importance weight: a reward-weighted policy gradient on fixed groups, no LVLM call. Online
   (--online), each step samples G distinct sequences per query from the policy and scores them with the dataset's
   backend, for any train question (--queries).
4. Online, each step also learns from the groups of the last --replay-steps steps, each clipped against the policy
   that sampled it, and the selector learns a score per train item (--item-bias).
5. --lvlm-budget N spends at least 95% of N LVLM calls, never more (icl_select/budget.py): the epochs are planned and
   each spends its share of the calls left. A budget too short for the default run first trains offline GRPO from
   --init (the warm start, a run of its own in <out>/offline) and goes on online from it.
6. A selector that may stop (rce.py --can-stop) trains online only. Its picks learn as those of one that fills every
   slot; its stop learns from stop ladders, its greedy sequence scored at every length 0..S beside one query in
   --ladder-every, from which its stop at each step is set after every epoch (`icl_select.stops`).

Usage:
    python grpo.py --kl-beta 0.1 --no-rank-advantage         # offline, init runs/rce -> runs/grpo-kl0.1
    python grpo.py --online                                   # online -> runs/grpo-kl0.3-online
    python grpo.py --online --lvlm-budget 35000               # a budget: offline GRPO first, then online from it
    python grpo.py --quality medium --out runs/cur1 && python grpo.py --init runs/cur1 --out runs/cur2  # curriculum
"""

from __future__ import annotations

import copy
import functools
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Annotated, Literal

import torch
from torch import Tensor
from tyro.conf import DisallowNone

from icl_select import lineage, sharding
from icl_select.backends import ScoreCache
from icl_select.batches import Batch, Split, make_batch, split_queries, steps_per_epoch
from icl_select.budget import Passes, Plan, Spending, budget_plan, least_budget, step_calls
from icl_select.cli import Named, PerMode, alias, default_is, help_first, marked, modes, run_cli
from icl_select.data import Dataset, RewardArgs, RewardMode, compute_reward, load_dataset
from icl_select.epochs import EpochMeans, log_line, lr_factor, stop_if_diverged
from icl_select.pools import first_distinct, query_pools, random_sequences
from icl_select.runs import Loop, RunFolder, check_continues, check_selector, load_selector
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

# ----------------------------------------------------------------------------------------------------------------------
# Flags. A flag's declaration says all there is to it: its default in each mode (`modes`, docs/ablations.md measures
# them), how it names the default output folder (`Named`), and whether it acts online only (`ONLINE`).


@dataclass(frozen=True)
class OnlineOnly:
    """A flag that acts on online groups alone: set to other than its default offline, it is refused."""


ONLINE = OnlineOnly()


def from_init(init: Path) -> str:
    """How a starting selector names a run: from its run folder, plus the epoch for a checkpoint file."""
    init = Path(init)
    return "from-" + (f"{init.parent.parent.name}-{init.stem}" if init.suffix == ".safetensors" else init.name)


@help_first("init", "data", "out", "online", "kl_beta")
@dataclass
class Args(TrainArgs):
    epochs: Annotated[int | None, alias("--num-train-epochs"), *modes(10, 30)] = None
    """Passes over the training queries; with --lvlm-budget, the epochs its calls spread over (planned if not given)."""
    lr: Annotated[float | None, alias("--learning-rate"), *modes(1e-4, 1e-3), Named("lr{:g}")] = None
    """AdamW learning rate."""
    reward_mode: Annotated[
        RewardMode | None, *modes("hard_plus_soft", "hard_plus_gtprob"), Named(lambda v: v.replace("_", "-"))
    ] = None
    """How a scored sequence becomes a reward (formulas: docs/flags.md)."""
    kl_beta: Annotated[float | None, alias("--beta"), *modes(0.1, 0.3)] = None
    """Weight of the exact KL to the reference policy, fixed for the run (see --kl-target); names the run folder."""
    online: bool = False
    """Sample fresh groups from the current policy each step and score them with the backend; names the run folder."""
    rank_advantage: Annotated[bool, Named("rank")] = False
    """Replace rewards by their within-group rank mapped onto [-1, 1] (Lever-Plus's default)."""
    freeze_backbone: Annotated[bool, Named("frozen")] = False
    """Train only the query/candidate projections and the gate."""
    scale_rewards: Annotated[Literal["group", "batch", "none"], Named("scale-{}")] = "group"
    """Divide centred rewards by the group std, the batch std, or nothing."""
    kl_target: Annotated[float | None, Named("target{}")] = None
    """Adaptive beta: after a step, x1.5 if its KL > 1.5 x target, /1.5 if below target / 1.5."""
    num_iterations: Annotated[int, Named("it{}")] = 1
    """Updates per batch before the old policy is refreshed (1: a fresh group's ratio is exactly 1; a replayed one's
    is to the policy that sampled it)."""
    epsilon: float = 0.2
    """PPO clip range below 1 (and above, unless --epsilon-high is given)."""
    epsilon_high: float | None = None
    """PPO clip range above 1 (DAPO-style asymmetric clipping)."""
    queries: Annotated[Literal["train", "anchors"], Named("queries-{}"), ONLINE] = "train"
    """Online: where each step's queries come from: any train question, or the anchors (docs/flags.md)."""
    temperature: Annotated[float, Named("t{:g}"), ONLINE] = 1.0
    """Online: sampling temperature."""
    group_size: Annotated[int, alias("--num-generations"), Named("g{}"), ONLINE] = 16
    """Online: distinct sequences sampled per query (TRL's num_generations defaults to 8)."""
    lvlm_budget: Annotated[int | None, Named("budget{}"), ONLINE] = None
    """Online: LVLM scores allowed in the whole run, validation included (docs/flags.md)."""
    warm_start: Annotated[bool, Named(lambda v: "warm" if v else "no-warm"), ONLINE] = True
    """Online, where --lvlm-budget cuts the default run short: offline GRPO from --init first (docs/flags.md)."""
    select_epoch: Annotated[
        Literal["best", "last"] | None, default_is("last with --lvlm-budget, else best"), Named("{}-epoch")
    ] = None
    """Which epoch the run returns: the best on the validation anchors, or the last (docs/flags.md)."""
    item_bias: Annotated[
        bool | None, DisallowNone, *modes(False, True), Named(lambda v: "items" if v else "no-items")
    ] = None
    """Also learn a score for each train item, added wherever it is a candidate: remembers which demonstrations
    helped beyond their embeddings (an --init that has them trains them either way; docs/flags.md)."""
    replay_steps: Annotated[int | None, *modes(0, 4), Named("replay{}"), ONLINE] = None
    """Online: also learn, each step, from the groups of the last N steps (0 = off; docs/flags.md)."""
    ladder_every: Annotated[int, ONLINE] = 4
    """Online, a selector that may stop: one query in N of each batch has its stop ladder scored (docs/flags.md)."""
    out: Annotated[Path | None, alias("--output-dir"), default_is("runs/grpo-<key flags>, e.g. runs/grpo-kl0.1")] = None
    """Run folder."""
    init: Annotated[Path, Named(from_init)] = Path("runs/rce")
    """Starting selector (run folder or epoch checkpoint); also the frozen KL reference, unless a warm start runs first
    (a short budget: then the warm start's selected epoch is both)."""

    def fixed_length_reason(self) -> str | None:
        if self.lvlm_budget is not None:
            return "--lvlm-budget plans the steps and the learning rate over the whole run"
        return super().fixed_length_reason()


def mode(args: Args) -> str:
    return "online" if args.online else "offline"


def resolve(args: Args) -> Args:
    """The flags left at None filled in, by mode (config.json records the resolved values); a budget plans the
    epochs, and returns its last epoch (its few epochs are still climbing, and their validation scores differ by less
    than the anchors' noise)."""
    filled = {name: getattr(m, mode(args)) for name, m in marked(Args, PerMode).items() if getattr(args, name) is None}
    if args.lvlm_budget is not None:
        filled.pop("epochs", None)
    if args.select_epoch is None:
        filled["select_epoch"] = "last" if args.lvlm_budget is not None else "best"
    return replace(args, **filled)


def default_of(args: Args, name: str):
    """The value the flag `name` takes when it is not given, beside the other flags of `args` (its mode's)."""
    return getattr(resolve(replace(args, **{name: Args.__dataclass_fields__[name].default})), name)


def default_out(args: Args) -> Path:
    """runs/grpo-kl<beta>[-online] plus the name of every flag that differs from its default (in its mode), in
    declaration order."""
    args = resolve(args)
    parts = [f"grpo-kl{args.kl_beta:g}"] + ["online"] * args.online
    for name, named in marked(Args, Named).items():
        if getattr(args, name) != default_of(args, name):
            parts.append(named.of(getattr(args, name)))
    return Path("runs") / "-".join(parts)


def check_args(args: Args) -> None:
    check_train_args(args)
    if not args.online:
        for name in marked(Args, OnlineOnly):
            if getattr(args, name) != default_of(args, name):
                flag = f"--{name.replace('_', '-')}"
                raise ValueError(f"{flag} {getattr(args, name)} acts on online groups: add --online, or leave it out")
    if args.lvlm_budget is not None and args.lvlm_budget < 1:
        raise ValueError(f"--lvlm-budget must be >= 1, got {args.lvlm_budget}")
    if args.replay_steps < 0 or args.ladder_every < 1:
        raise ValueError(
            f"--replay-steps must be >= 0 and --ladder-every >= 1, got {args.replay_steps}, {args.ladder_every}"
        )
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


def may_stop(init: Path) -> bool:
    """Whether the selector at `init` may stop. GRPO trains such a selector's stop online only, from its stop ladders,
    which offline groups lack: so it is refused offline (a short budget's warm start trains its picks alone)."""
    return load_selector(init).cfg.can_stop


# ----------------------------------------------------------------------------------------------------------------------
# The update: PPO clipped surrogate of the group advantages plus beta * exact KL to the reference


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


def make_learner(args: Args, ds: Dataset, split: Split, init: Path) -> Learner:
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


@dataclass
class Groups:
    """What one update trains on: the step's batch and, after it, any replayed groups."""

    batch: Batch  # (B', G, S) sequences
    adv: Tensor  # (B', G) advantages, a replayed group's as computed when it was scored
    ref_dist: Tensor  # (B', G, S, K) the reference's per-step log-distributions
    sampled: Tensor | None = None  # (B' - B, G) the replayed groups' sampling log-probs (None: none replayed)


def seq_logp(policy: PointerSelector, steps: Steps, seqs: Tensor) -> Tensor:
    """What PPO's ratio is taken on, (B, G): each sequence's log-prob; for a selector that may stop, of its picks
    given that it went on (`going_on_logp`), its stop set from its ladders alone (`end_epoch_stop`): in PPO's ratio,
    where stopping wins most groups, the stop goes to certainty (docs/ablations.md)."""
    return going_on_logp(steps, seqs) if policy.cfg.can_stop else steps.logp.sum(-1)


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


def update(learner: Learner, b: Batch, adv: Tensor, t: Groups, args: Args, loop: Loop, last: bool):
    """--num-iterations PPO-clipped updates with beta * exact KL to the reference, on the groups `t` (the batch `b`
    with advantages `adv`, then any replayed groups) against the policy as it was before them; then the adaptive beta,
    if asked for. Returns the step's metrics and the log-probs the batch was sampled with, (B, G)."""
    m, tm = b.seq_mask, t.batch.seq_mask  # (B, G), (B', G)
    temp = args.temperature if args.online else 1.0
    beta, policy = loop.beta, learner.policy
    old, extra = None, {}
    for _ in range(args.num_iterations):
        cur = policy(t.batch.query, t.batch.pool, t.batch.pool_mask, t.batch.seqs, tm, True, temp)
        logp = seq_logp(policy, cur, t.batch.seqs)  # (B', G)
        if old is None:  # a replayed group's ratio is to the policy that sampled it
            old = logp.detach() if t.sampled is None else replay_old(logp, t.sampled)
        ppo, st = ppo_clip_loss(logp, old, t.adv, tm, args.epsilon, args.epsilon_high)
        if policy.cfg.can_stop:  # over the picks given going on: the stop is set from its ladders alone
            taken = cur.taken & (t.batch.seqs >= 0)
            kl = exact_kl(picks_given_going_on(cur.log_dist), picks_given_going_on(t.ref_dist), taken)[tm].mean()
        else:
            kl = exact_kl(cur.log_dist, t.ref_dist, cur.taken)[tm].mean()  # over each step taken
        loss = ppo + beta * kl
        learner.opt.zero_grad(set_to_none=True)
        if last:  # once per epoch, where the policy has left the reference
            extra["grpo/kl_grad_share"] = kl_grad_share(learner.params, ppo, beta * kl)
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(learner.params, args.grad_clip or math.inf))
        if math.isfinite(norm):  # a NaN/inf gradient skips the step; the run stops just below
            learner.opt.step()
    if last:  # how far one batch's updates moved the policy, KL(old || new)
        with torch.no_grad():
            new = seq_logp(policy, policy(b.query, b.pool, b.pool_mask, b.seqs, m, True, temp), b.seqs)
        extra["grpo/approx_kl_old"] = k3_kl(old[: len(m)], new, m).item()
    if args.kl_target is not None:  # adaptive beta, only on request
        if kl.item() > 1.5 * args.kl_target:
            loop.beta = beta * 1.5
        elif kl.item() < args.kl_target / 1.5:
            loop.beta = beta / 1.5
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


def advantages(b: Batch, args: Args) -> Tensor:
    """Each sequence's advantage within its group, (B, G)."""
    return group_advantages(b.reward, b.seq_mask, args.scale_rewards, args.rank_advantage).float()


# ----------------------------------------------------------------------------------------------------------------------
# Offline: the scored groups of rl_data.jsonl


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


def offline_step(learner: Learner, idx: Tensor, loop: Loop, last: bool, ds: Dataset, split: Split, args: Args) -> dict:
    """One update on the scored groups of the anchors `idx` (B,), against the reference's cached distributions."""
    learner.policy.eval()  # every log-prob (new, old, reference) without dropout
    b = make_batch(ds, idx, split.reward, learner.policy.cfg)
    adv = advantages(b, args)  # (B, G)
    return update(learner, b, adv, Groups(b, adv, learner.ref_cache[idx]), args, loop, last)[0]


# ----------------------------------------------------------------------------------------------------------------------
# Online: groups sampled from the policy and scored by the LVLM, replayed groups, stop ladders


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
    scores = scorer.score("train", rows.repeat_interleave(scored.shape[1])[flat], icds[flat])
    scores = {k: v.new_zeros(len(flat)).masked_scatter(flat, v).view(known.shape) for k, v in scores.items()}
    reward = compute_reward(scores, args).where(known, 0.0)  # (B, G')
    ladders = StopLadders(rows[laddered], pool[laddered], reward[laddered, G:]) if policy.cfg.can_stop else None
    explored = (order >= sampled)[ok].double().mean().item()
    return Batch(query, pool_emb, pool_mask, seqs, ok, reward[:, :G]), explored, ladders


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


def online_step(learner: Learner, idx: Tensor, loop: Loop, last: bool, ds, scorer, queries, args, rngs) -> dict:
    """One update on fresh groups: a query for each anchor of `idx` (B,) (see online_queries), G distinct sequences
    each sampled from the policy and scored by the backend, plus the replay buffer's groups with --replay-steps."""
    learner.policy.eval()  # sampling and every log-prob (new, old, reference) without dropout
    rows, pool = queries(idx)  # (B,), (B, K)
    fill = args.lvlm_budget is not None
    gens = rngs["sampler"], rngs["explore"]
    b, explored, ladders = sample_and_score(learner.policy, scorer, ds, rows, pool, args, *gens, fill)
    if ladders is not None:
        learner.ladders.append(ladders)
    adv = advantages(b, args)  # (B, G)
    t, t_adv, sampled = with_replay(ds, b, adv, learner.buffer) if args.replay_steps else (b, adv, None)
    with torch.no_grad():  # the frozen reference's distributions: a replayed group's were kept when it was fresh
        ref = learner.ref(b.query, b.pool, b.pool_mask, b.seqs, b.seq_mask, True, args.temperature).log_dist
    ref_dist = torch.cat([ref, *(e["ref"] for e in learner.buffer)]) if args.replay_steps else ref
    metrics, logp = update(learner, b, adv, Groups(t, t_adv, ref_dist, sampled), args, loop, last)
    if args.replay_steps:  # the fresh groups with the log-probs they were sampled with
        fresh = {"rows": rows, "pool": pool, "seqs": b.seqs, "mask": b.seq_mask, "adv": adv, "logp": logp, "ref": ref}
        learner.buffer = [*learner.buffer, fresh][-args.replay_steps :]
    return metrics | {"grpo/explored": explored}


def online_queries(ds: Dataset, split: Split, args: Args, draws: torch.Generator) -> Callable:
    """The online step's queries for a batch of anchors idx (B,), as (rows (B,), pools (B, K)). anchors = those
    anchors and their pools; train = as many train questions, drawn with replacement among those whose picture is no
    validation anchor's (validation stays held out), each with a fresh pool from the dataset's sampler."""
    pictures = {"train": ds.picture_ids["train"]}
    eligible = (~torch.isin(pictures["train"], pictures["train"][ds.groups.queries[split.val]])).nonzero()[:, 0]
    K = ds.groups.pools.shape[1]

    def draw(idx: Tensor) -> tuple[Tensor, Tensor]:
        if args.queries == "anchors":
            return ds.groups.queries[idx], ds.groups.pools[idx]
        rows = eligible[torch.randint(len(eligible), (len(idx),), generator=draws)]  # (B,)
        return rows, query_pools(ds.meta["sampler"], K, ds.emb, pictures, "train", rows, rows, draws)

    return draw


def end_epoch_stop(learner: Learner, ds: Dataset, batch_size: int) -> dict[str, float | list[float]]:
    """A may-stop selector, online: its stop at each step set from the run's ladders so far (`set_stops`), then before
    the first pick fitted per question on zero-shot against what a first pick leads to, each question's state that of
    the policy as the epoch leaves it (`fit_first_stop`; an epoch's ladders alone, a few hundred, left its ridge to
    chance). The ladders are kept as one (`stop_ladder_tensors` carries them in the checkpoint).
    -> the record of the stop (empty where there is none)."""
    if not learner.ladders:
        return {}
    one = StopLadders(*(torch.cat([getattr(p, f.name) for p in learner.ladders]) for f in fields(StopLadders)))
    learner.ladders = [one]
    rows, pool, reward = one.rows, one.pool, one.reward  # (P,), (P, K), (P, S + 1)
    emb = ds.emb["train"]
    with torch.no_grad():  # (P, H) in slices, each pool's embeddings gathered only there
        states = torch.cat(
            [
                learner.policy.encode(emb[rows[i]], emb[pool[i].clamp_min(0)], pool[i] >= 0)[0]
                for i in slices(len(rows), batch_size)
            ]
        )
    go, going = set_stops(learner.policy, reward)  # going (P,): what a first pick leads to, the later steps as set
    record = {"stop/go_later": go[1:], "stop/ladders": len(rows)}
    return record | fit_first_stop(learner.policy, states, reward[:, 0] - going)


# What a checkpoint carries besides the model, optimizer and RNGs: the replay buffer and the stop ladders.


def carried(learner: Learner) -> dict[str, Tensor]:
    """The replay buffer and the stop ladders kept at an epoch's end (one, or none), as named tensors."""
    out = {f"replay.{i}.{k}": v.contiguous() for i, e in enumerate(learner.buffer) for k, v in e.items()}
    if learner.ladders:
        out |= {f"stop_ladders.{f.name}": getattr(learner.ladders[0], f.name).contiguous() for f in fields(StopLadders)}
    return out


def carry_back(learner: Learner, tensors: dict[str, Tensor]) -> None:
    """`carried`'s inverse, from a checkpoint's extra tensors."""
    buffer: dict[int, dict[str, Tensor]] = {}
    for name, v in tensors.items():
        if name.startswith("replay."):
            i, k = name.removeprefix("replay.").split(".")
            buffer.setdefault(int(i), {})[k] = v
    learner.buffer = [buffer[i] for i in sorted(buffer)]
    names = [f"stop_ladders.{f.name}" for f in fields(StopLadders)]
    learner.ladders = [StopLadders(*(tensors[n] for n in names))] if names[0] in tensors else []


# ----------------------------------------------------------------------------------------------------------------------
# Validation: each epoch's record


@dataclass
class Validation:
    """What an epoch's record is measured on: the validation anchors, answered by `backend` where something can (the
    first `cap` of them), a may-stop selector's picks at least `min_picks`, and the reference's greedy picks (V, S)
    that the selection change is measured against."""

    ds: Dataset
    split: Split
    backend: ScoreCache | None
    cap: int | None
    min_picks: int
    ref_greedy: Tensor

    def record(self, epoch: int, loop: Loop, means: dict, policy: PointerSelector, lvlm: ScoreCache | None) -> dict:
        """An epoch's line of metrics.jsonl: its step means, validation (eval mode), the selection change against the
        reference and the LVLM calls of the run so far (kept in the loop state for a resume)."""
        record = {"phase": "grpo", "epoch": epoch, "step": loop.step, **means}
        record.update(validate(policy, self.ds, self.split, self.backend, self.cap, self.min_picks))
        record["grpo/selection_change"] = selection_change(policy, self.ds, self.split, self.ref_greedy)
        if lvlm is not None:  # cumulative, training and validation
            record["lvlm/calls"] = loop.lvlm_calls = lvlm.calls
        return record


def val_greedy(model: PointerSelector, ds: Dataset, split: Split) -> Tensor:
    """The greedy demonstrations of the validation anchors, (V, S) train rows."""
    g = ds.groups
    return greedy_icds(model, ds, "train", g.queries[split.val], g.pools[split.val], ds.seq_len)


def selection_change(policy: PointerSelector, ds: Dataset, split: Split, ref_greedy: Tensor) -> float:
    """Share of validation anchors whose greedy demonstrations differ from the reference's, ref_greedy (V, S)."""
    return (val_greedy(policy, ds, split) != ref_greedy).any(-1).double().mean().item()


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


# ----------------------------------------------------------------------------------------------------------------------
# A budget's terms, from flags and files alone (the arithmetic: icl_select/budget.py)


@dataclass
class Budget:
    """What --lvlm-budget's plan rests on: the most calls a step of n queries asks, the most one validation asks
    (validate() asks 1..S shots of each validation anchor, where something answers them), the steps of a pass."""

    total: int
    calls: Callable[[int], int]
    val_calls: int
    batch_size: int
    epochs: int | None
    natural: int

    def plan(self, spent: int = 0) -> Plan:
        """The plan for what is left once `spent` calls are (a warm start's)."""
        most, group = self.calls(self.batch_size), self.calls(1)
        return budget_plan(self.total - spent, self.epochs, most, self.val_calls, group, self.natural)


def budget_of(args: Args, ds: Dataset, split: Split) -> Budget:
    S = ds.seq_len
    answered = split.val if ds.is_sim else split.val[: args.val_max_queries] if args.val_lvlm else split.val[:0]
    calls = functools.partial(
        step_calls, group=args.group_size, ladder_every=args.ladder_every, seq_len=S, can_stop=may_stop(args.init)
    )
    natural = steps_per_epoch(split.train, args.batch_size)
    return Budget(args.lvlm_budget, calls, len(answered) * S, args.batch_size, args.epochs, natural)


def check_budget(budget: Budget) -> None:
    """Refuse, before any LVLM loads, a budget this run cannot spend at least 95% of (`budget.least_budget`), or one
    with no room for a step. (Above that least budget, a warm start's validations always leave room for the online
    run.)"""
    least = least_budget(budget.calls(1), budget.val_calls)
    if budget.total < least:
        raise ValueError(
            f"--lvlm-budget {budget.total} is below {least}, the smallest this run spends at least 95% of: its last "
            f"step may leave up to {budget.calls(1) - 1} calls unspent (a query asks up to {budget.calls(1)}) and its "
            f"last validation up to {budget.val_calls}"
        )
    budget.plan()


# ----------------------------------------------------------------------------------------------------------------------
# The run


def warm_start_args(args: Args, out: Path) -> Args:
    """The offline GRPO run an online run starts from (a warm start): grpo.py's offline defaults from --init, sharing
    the online run's data, seed, validation split and other training flags, but not its schedule or rewards."""
    own = {"epochs", "lr", "lr_schedule", *(f.name for f in fields(RewardArgs))}
    shared = {f.name: getattr(args, f.name) for f in fields(TrainArgs) if f.name not in own}
    return resolve(Args(init=args.init, out=out, **shared))


def main(args: Args) -> None:
    args = resolve(args)
    check_args(args)
    if not args.online and may_stop(args.init):
        raise ValueError(
            f"--init {args.init} may stop, and GRPO learns when to stop online only: add --online (a budgeted online "
            "run's warm start trains its picks offline first)"
        )
    ds = load_dataset(args.data)
    check_selector(load_selector(args.init), args.init, lineage.reads(ds.meta), ds.folder, ds.emb["train"].shape[1])
    split = split_queries(ds, args)
    budget = budget_of(args, ds, split) if args.lvlm_budget is not None else None
    if budget is not None:
        check_budget(budget)
    out = args.out or default_out(args)
    check_continues(out, args, ds)  # before a model loads, and a warm start's too (killed in it, out has no config)
    if budget is not None and args.warm_start:
        check_continues(out / "offline", warm_start_args(args, out / "offline"), ds)
    rank, world = sharding.init()  # every rank trains the same policy on the same batches; RunFolder: rank 0 writes
    backend = validation_backend(ds, args)  # answers the validation anchors, where something can

    # The warm start, where a budget affords fewer steps than the default run: offline GRPO from --init, on the same
    # score cache, so its validations are counted, and paid for, once
    plan, warm = budget.plan() if budget else None, None
    default_epochs = marked(Args, PerMode)["epochs"].online
    if plan is not None and args.warm_start and plan.steps < (args.epochs or default_epochs) * budget.natural:
        offline = out / "offline"
        if rank == 0:
            print(f"warm start: offline GRPO from {args.init} -> {offline} (--no-warm-start skips it)", flush=True)
        train(warm_start_args(args, offline), ds, backend, Path(args.init), None, None, rank, world)
        warm = {"run": str(offline), "lvlm_calls": 0 if backend is None else backend.calls}
        plan = budget.plan(warm["lvlm_calls"])

    train(args, ds, backend, Path(warm["run"]) if warm else Path(args.init), plan, warm, rank, world)
    sharding.finish(world)


def train(args, ds, backend, init: Path, plan: Plan | None, warm: dict | None, rank: int, world: int) -> None:
    """One GRPO run from the selector `init`; `backend` answers the validation anchors' greedy picks, where something
    can (validation_backend), and online scores on the same cache; a budget's `plan`, and the `warm` start it
    follows."""
    out = args.out or default_out(args)
    split = split_queries(ds, args)
    S = ds.seq_len
    metric, cap = selection_metric(backend), None if ds.is_sim else args.val_max_queries
    # Offline, a may-stop selector is a warm start, training its picks alone: they are judged, and its best epoch
    # chosen, filling every slot (by the stop it does not train, that epoch was chance's).
    min_picks = 0 if args.online else S
    if plan is not None:
        args = replace(args, epochs=plan.epochs)

    with RunFolder(out, rank, world) as run:
        resume_from = run.resume(args, ds)  # the last checkpoint of this run, if a re-run continues it
        scorer = (backend or dataset_backend(ds, args)) if args.online else None  # the same cache scores online
        lvlm = scorer or backend  # the one cache in front of the LVLM: its misses are the calls counted
        calls = (lambda: lvlm.calls) if lvlm is not None else (lambda: 0)
        torch.manual_seed(args.seed)
        learner = make_learner(args, ds, split, init)
        rngs = {
            "shuffle": torch.Generator().manual_seed(args.seed + 1),
            "sampler": torch.Generator().manual_seed(args.seed + 2),
            "queries": torch.Generator().manual_seed(args.seed + 3),
            "explore": torch.Generator().manual_seed(args.seed + 4),
        }
        if args.online:
            queries = online_queries(ds, split, args, rngs["queries"])
            step = functools.partial(online_step, ds=ds, scorer=scorer, queries=queries, args=args, rngs=rngs)
        else:
            step = functools.partial(offline_step, ds=ds, split=split, args=args)
        if plan is None:  # an epoch is a pass over the training anchors
            natural = steps_per_epoch(split.train, args.batch_size)
            epochs = Passes(split.train, args.batch_size, rngs["shuffle"], args.epochs, natural)
        else:  # an epoch is its share of the calls left once every validation is kept, however many steps it takes
            can_stop = learner.policy.cfg.can_stop
            most = functools.partial(
                step_calls, group=args.group_size, ladder_every=args.ladder_every, seq_len=S, can_stop=can_stop
            )
            first = warm["lvlm_calls"] if warm else 0  # calls spent before this run: its learning rate's clock starts
            epochs = Spending(split.train, args.batch_size, rngs["shuffle"], calls, most, args.lvlm_budget, first, plan)
        validation = Validation(ds, split, backend, cap, min_picks, val_greedy(learner.ref, ds, split))
        loop = Loop(beta=args.kl_beta)  # beta moves only with --kl-target
        if resume_from is not None:
            loop, extra = run.restore(resume_from, learner.policy, learner.opt, rngs, lvlm)
            carry_back(learner, extra)
        planned = ({"budget_plan": asdict(plan)} if plan else {}) | ({"warm_start": warm} if warm else {})
        run.start(args, ds, split, loop, resume_from is not None, {"out": str(out), **planned})
        if resume_from is None:  # epoch 0 = the initial policy, the start of every curve
            run.log(validation.record(0, loop, {}, learner.policy, lvlm))

        for epoch in range(loop.epoch + 1, args.epochs + 1):
            # ---- the epoch's steps
            start, at_start = time.perf_counter(), calls()  # the bar's LVLM sequences a second
            batches = epochs.batches(epoch)
            bar = run.progress(epoch, args.epochs, epochs.size(), epochs.unit)
            means = EpochMeans()
            for idx, last in batches:
                before = calls()
                for group in learner.opt.param_groups:  # a function of the step (a budget's: of its calls) alone
                    group["lr"] = args.lr * lr_factor(args.lr_schedule, *epochs.clock(loop.step, before))
                metrics = step(learner, idx, loop, last)
                loop.step += 1
                if args.kl_target is not None:  # beta moves every step: log every step
                    run.log({"phase": "grpo", "kind": "step", "epoch": epoch, "step": loop.step, **metrics})
                stop_if_diverged(metrics, "grpo", epoch, loop.step, out, "try a lower --lr or a larger --kl-beta")
                means.add(metrics)
                rate = f" seq_per_s={(calls() - at_start) / (time.perf_counter() - start):.1f}" if args.online else ""
                bar.set_postfix_str(log_line(metrics, SHOWN) + rate, refresh=False)  # drawn at the bar's next redraw
                bar.update(epochs.moved(before, calls()))
            bar.close()
            per_s = (calls() - at_start) / (time.perf_counter() - start) if args.online else None  # before validation
            means = means.result() | end_epoch_stop(learner, ds, args.batch_size)

            # ---- validation, the best epoch and the checkpoint
            record = validation.record(epoch, loop, means, learner.policy, lvlm)
            if per_s is not None and not ds.is_sim:  # the epoch's LVLM sequences a second, readable after the run
                record["lvlm/seq_per_s"] = round(per_s, 3)
            if warnings := warnings_for(record, S):
                record["warnings"] = warnings
            # epoch 0 is no candidate: see validation.selection_metric
            if args.select_epoch == "last" or record[metric] > loop.best:
                loop.best, loop.best_epoch = record[metric], epoch
            record["best_epoch"] = loop.best_epoch
            loop.epoch = epoch
            run.end_epoch(record, learner.policy, learner.opt, rngs, loop, args.keep_every, lvlm, carried(learner))
            warned = "".join(f"\n  warning: {w}" for w in warnings)
            run.say(f"{out.name} epoch {epoch}: {log_line(record, (*SHOWN, 'val/reward', 'val/acc'))}{warned}")
        run.say(f"{args.select_epoch} epoch {loop.best_epoch} ({metric} {loop.best:.4f}) -> {out}/model.safetensors")
        if plan is not None:  # a bound, not a target: prompts scored before (a stop's zero-shot prompt) cost no call
            run.say(f"LVLM calls: {calls():,} of the --lvlm-budget {args.lvlm_budget:,} (repeated prompts are free)")


if __name__ == "__main__":
    run_cli(main, Args)
