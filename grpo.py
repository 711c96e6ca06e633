"""Stage 3: GRPO post-training of the selector, offline on the scored groups or online with the LVLM in the loop.

Per step, for a batch of queries and their groups of G sequences: advantages from the group's rewards
(`model.group_advantages`), the PPO clipped surrogate on sequence log-probs against the old policy, plus
beta * exact KL(pi || pi_ref) over the pool at every visited step, averaged over valid sequences.

Correctness choices (each one a bug of Lever-Plus):
- the reference policy is the --init (RCE) weights, frozen; the KL weight is exactly --kl-beta for the whole run,
  unless an adaptive target is asked for with --kl-target (then the beta used is logged every epoch);
- the old policy is the current one, refreshed every --num-iterations updates on a batch, so the PPO ratio starts
  at exactly 1; every log-prob (new, old, reference) is computed with dropout off;
- every scored sequence of every group is used (no top-k), variable group sizes are masked;
- the best epoch is chosen on held-out anchor queries by the true accuracy of the greedy picks when the backend can
  answer them (always on the simulator; --val-lvlm on real data), else by validation reward; never by loss or
  test questions.

Two modes, and what each one is:
- offline (default): the groups are the scored sequences of rl_data.jsonl, drawn by gen_rl_data.py (random and
  retrieval sequences, or an earlier selector's), not by the policy being trained. Their probabilities under the
  sampler are not stored and no importance weight is applied, so this is a reward-weighted policy gradient on fixed
  groups (advantage-weighted log-likelihood), not on-policy GRPO: with --num-iterations 1 the PPO ratio is exactly 1
  at every step and the clip never binds; with more iterations it binds against the policy's own previous step.
  Cheap (no LVLM calls) and a fair warm-up, but it cannot learn about sequences nobody scored.
- online (--online): each step samples G distinct sequences per query from the current policy at --temperature,
  scores them with the dataset's backend (the simulator, or the LVLM that scored the data; each distinct prompt
  once per process) and updates: real on-policy GRPO. The ratio, the KL and the entropy are those of the sampling
  policy at that temperature (as in TRL). Queries come from all train questions held out from validation
  (--queries train), not only the anchors. Use it whenever LVLM calls during training are affordable: on the
  simulator it is the mode that learns most (README, "What moves the learning").

Defaults differ by mode where the README's ablation says they should: offline 10 epochs at lr 1e-4, reward
hard_plus_soft, beta 0.1; online 30 epochs at lr 1e-3, reward hard_plus_gtprob (gt_prob grades every group: with
0/1 correctness most groups tie), beta 0.3.

Usage:
    python grpo.py --kl-beta 0.1 --no-rank-advantage         # offline, init runs/rce -> runs/grpo-kl0.1
    python grpo.py --online                                   # online -> runs/grpo-kl0.3-online
    python grpo.py --quality medium --out runs/cur1 && python grpo.py --init runs/cur1 --out runs/cur2  # curriculum
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Literal

import torch
from torch import Tensor

from backends import ScoreCache, open_backend
from checkpoints import load_selector
from cli import alias, default_is, help_first, run_cli
from data import Dataset, RewardMode, compute_reward
from model import PointerSelector, exact_kl, group_advantages, k3_kl, ppo_clip_loss, reward_spread, slices
from pools import first_distinct, query_pools
from training import (
    Batch,
    Loop,
    Split,
    TrainArgs,
    adamw,
    check_train_args,
    clipped_step,
    greedy_picks,
    make_batch,
    open_run,
    run_training,
    steps_per_epoch,
)


@help_first("init", "data", "out", "online", "kl_beta")
@dataclass
class Args(TrainArgs):
    init: Path = Path("runs/rce")
    """Starting selector (run folder or epoch checkpoint); also the frozen KL reference."""
    out: Annotated[Path | None, alias("--output-dir"), default_is("runs/grpo-<key flags>, e.g. runs/grpo-kl0.1")] = None
    """Run folder."""
    epochs: Annotated[int | None, alias("--num-train-epochs"), default_is("10 offline, 30 online")] = None
    """Passes over the training queries (an online epoch takes as many steps)."""
    lr: Annotated[float | None, alias("--learning-rate"), default_is("1e-4 offline, 1e-3 online")] = None
    """AdamW learning rate."""
    reward_mode: Annotated[RewardMode | None, default_is("hard_plus_soft offline, hard_plus_gtprob online")] = None
    """How a scored sequence becomes a reward (hard_plus_soft, hard_plus_gtprob, ...: see the README)."""
    kl_beta: Annotated[float | None, alias("--beta"), default_is("0.1 offline, 0.3 online")] = None
    """Weight of the exact KL to the reference policy, used as given for the whole run (TRL's GRPOConfig defaults
    to 0.0: here the KL is what keeps the selector near its warm-up)."""
    kl_target: float | None = None
    """Adaptive beta: after each step, x1.5 when its KL is above 1.5x this target, /1.5 below target/1.5."""
    num_iterations: int = 1
    """Updates per batch before the old policy is refreshed (1 = purely on-policy, ratio exactly 1)."""
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
    """Online: distinct sequences sampled per query (TRL's num_generations defaults to 8; 8 cost 1.4 points here)."""
    temperature: float = 1.0
    """Online: sampling temperature."""
    queries: Literal["train", "anchors"] = "train"
    """Online: where each step's queries come from. train = any train question whose image is not a validation
    anchor's, each with a fresh pool from the dataset's sampler (the groups are scored anew anyway, so online GRPO
    need not be confined to the scored anchors); anchors = the scored anchor queries and their pools."""


# Per-mode defaults of the flags left at None (measured on the simulator: README, "What moves the learning").
MODE_DEFAULTS = {
    "offline": {"epochs": 10, "lr": 1e-4, "reward_mode": "hard_plus_soft", "kl_beta": 0.1},
    "online": {"epochs": 30, "lr": 1e-3, "reward_mode": "hard_plus_gtprob", "kl_beta": 0.3},
}


def resolve(args: Args) -> Args:
    """Fill the per-mode defaults in (config.json records the resolved values)."""
    defaults = MODE_DEFAULTS["online" if args.online else "offline"]
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
        f"seed{args.seed}": args.seed != 0,
    }
    return Path("runs") / "-".join(parts + [name for name, on in flags.items() if on])


def check_args(args: Args) -> None:
    check_train_args(args)
    if args.kl_beta < 0:
        raise ValueError(f"--kl-beta must be >= 0, got {args.kl_beta}")
    if args.kl_target is not None and args.kl_target <= 0:
        raise ValueError(f"--kl-target must be > 0, got {args.kl_target}")
    if args.epsilon <= 0 or (args.epsilon_high is not None and args.epsilon_high <= 0):
        raise ValueError(f"--epsilon and --epsilon-high must be > 0, got {args.epsilon}, {args.epsilon_high}")
    if args.num_iterations < 1 or args.group_size < 2 or args.temperature <= 0:
        raise ValueError("--num-iterations must be >= 1, --group-size >= 2 and --temperature > 0")


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
    """The frozen reference policy's per-step distributions over every training query's scored group, (Q, G, S, K)
    (zeros for the validation queries), computed once per run: offline groups never change, and neither do these,
    so every step reads them instead of running the reference again (Lever-Plus caches its reference the same way).
    13 MB at 800 queries x 16 x 4 x 64.

    They are computed in fixed `slices` of the training queries, so a resumed run recomputes the very same bits; each
    row's bits are those of any training batch of at least MIN_SLICE queries (a smaller last batch of an epoch used
    to get other roundings from its own small products)."""
    g = ds.groups
    out = torch.zeros(len(g), g.seqs.shape[1], ds.seq_len, g.pools.shape[1])  # (Q, G, S, K)
    for part in slices(len(split.train), batch_size):
        idx = split.train[part]
        b = make_batch(ds, idx, split.reward, ref.cfg)
        out[idx] = ref(b.query, b.pool, b.pool_mask, b.seqs, b.seq_mask, True).log_dist
    return out


def main(args: Args) -> None:
    args = resolve(args)
    check_args(args)
    run = open_run(args, args.out or default_out(args))
    ds, split, backend = run.ds, run.split, run.backend
    # online groups are scored by the dataset's backend (the simulator, or the LVLM that scored the data), through
    # the same score cache as validation
    scorer = (backend or ScoreCache(open_backend(ds.meta, ds.items, ds.emb))) if args.online else None
    policy = load_selector(args.init)
    if policy.cfg.dim != ds.emb["train"].shape[1]:
        raise ValueError(
            f"--init {args.init}: selector expects {policy.cfg.dim}-d embeddings, the data has "
            f"{ds.emb['train'].shape[1]}"
        )
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    if args.freeze_backbone:
        for p in policy.backbone_parameters():
            p.requires_grad_(False)
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = adamw(params, args.lr, args.weight_decay)
    ref_greedy = greedy_picks(ref, ds, split.val)
    ref_cache = None if args.online else reference_dists(ref, ds, split, args.batch_size)  # (Q, G, S, K)
    sampler = torch.Generator().manual_seed(args.seed + 2)
    S = ds.seq_len
    # Online groups are drawn at --temperature: the ratio, the KL and the entropy are those of that sampling policy
    # (as in TRL). Offline groups were not drawn from the policy at all, so the plain policy is used.
    temp = args.temperature if args.online else 1.0
    epoch_steps = steps_per_epoch(split, args.batch_size)

    image_ids = {"train": torch.tensor([it["image_id"] for it in ds.items["train"]])}
    # Online queries never share an image with a validation anchor, so validation stays held out.
    eligible = (~torch.isin(image_ids["train"], image_ids["train"][ds.groups.queries[split.val]])).nonzero()[:, 0]
    draws = torch.Generator().manual_seed(args.seed + 3)

    def online_batch(idx: Tensor) -> Batch:
        """Sample G distinct sequences per query from the current policy and score them (cached). With --queries
        train, the len(idx) queries are drawn from `eligible` (uniformly, with replacement) with fresh pools."""
        if args.queries == "anchors":
            rows, pool = ds.groups.queries[idx], ds.groups.pools[idx]  # (B,), (B, K)
        else:
            rows = eligible[torch.randint(len(eligible), (len(idx),), generator=draws)]  # (B,)
            pool = query_pools(
                ds.meta["sampler"], ds.groups.pools.shape[1], ds.emb, image_ids, "train", rows, rows, draws
            )
        emb = ds.emb["train"]
        query, pool_emb, pool_mask = emb[rows], emb[pool.clamp_min(0)], pool >= 0  # (B, d), (B, K, d), (B, K)
        cand, _ = policy.sample(query, pool_emb, pool_mask, S, 2 * args.group_size, sampler, args.temperature)
        order, ok = first_distinct(cand, args.group_size)  # (B, G) first G distinct of 2G samples
        seqs = cand.gather(1, order[..., None].expand(-1, -1, S)).masked_fill(~ok[..., None], -1)  # (B, G, S)
        prompt = policy.cfg.to_prompt(seqs.clamp_min(0))  # (B, G, S)
        icds = pool.gather(1, prompt.flatten(1)).view(-1, S)  # (B*G, S) train rows, prompt order
        fields = scorer.score("train", rows.repeat_interleave(args.group_size), icds)
        reward = compute_reward({k: v.view(len(idx), -1) for k, v in fields.items()}, args).where(ok, 0.0)
        return Batch(query, pool_emb, pool_mask, seqs, ok, reward)

    def step(idx: Tensor, step: int, state: dict) -> dict[str, float]:
        policy.eval()  # sampling and every log-prob (new, old, reference) without dropout: the ratio starts at 1
        b = online_batch(idx) if args.online else make_batch(ds, idx, split.reward, policy.cfg)
        m = b.seq_mask
        adv = group_advantages(b.reward, m, args.scale_rewards, args.rank_advantage).float()  # (B, G)
        step_mask = m[..., None].expand(-1, -1, S)  # (B, G, S)
        if ref_cache is not None:
            ref_dist = ref_cache[idx]  # (B, G, S, K)
        else:
            with torch.no_grad():
                ref_dist = ref(b.query, b.pool, b.pool_mask, b.seqs, m, True, temp).log_dist  # (B, G, S, K)
        beta = state["beta"]  # --kl-beta, or where --kl-target has moved it (saved in checkpoints)
        last_of_epoch = (step + 1) % epoch_steps == 0
        old = None
        for _ in range(args.num_iterations):
            cur = policy(b.query, b.pool, b.pool_mask, b.seqs, m, True, temp)
            logp = cur.logp.sum(-1)  # (B, G)
            old = logp.detach() if old is None else old  # the policy before this batch's updates: ratio starts at 1
            ppo, st = ppo_clip_loss(logp, old, adv, m, args.epsilon, args.epsilon_high)
            kl = exact_kl(cur.log_dist, ref_dist, step_mask)[m].mean()
            loss = ppo + beta * kl
            opt.zero_grad(set_to_none=True)
            # Two extra backward passes: measured once per epoch, at its last step, where the policy has left the
            # reference (at an epoch's first step the KL gradient is still 0 in epoch 1).
            extra = {"grpo/kl_grad_share": kl_grad_share(params, ppo, beta * kl)} if last_of_epoch else {}
            loss.backward()
            norm = clipped_step(opt, params, args.grad_clip)
        if last_of_epoch:  # how far one batch's updates move the policy, KL(old || new); a forward more
            with torch.no_grad():
                new = policy(b.query, b.pool, b.pool_mask, b.seqs, m, temperature=temp).logp.sum(-1)
            extra["grpo/approx_kl_old"] = k3_kl(old, new, m).item()
        r = b.reward[m]
        zero_std = (reward_spread(b.reward, m) == 0)[m.any(-1)]
        if args.kl_target is not None:  # adaptive beta only on explicit request; then every step is logged
            state["beta"] = (
                beta * 1.5
                if kl.item() > 1.5 * args.kl_target
                else (beta / 1.5 if kl.item() < args.kl_target / 1.5 else beta)
            )
        return {
            "train/loss": loss.item(),
            "grpo/ppo_loss": ppo.item(),
            "grpo/kl_ref": kl.item(),
            "grpo/kl_share": (beta * kl.abs() / (ppo.abs() + beta * kl.abs() + 1e-12)).item(),
            "grpo/clip_frac_low": float(st["clip_frac_low"]),
            "grpo/clip_frac_high": float(st["clip_frac_high"]),
            "grpo/ratio_mean": float(st["ratio_mean"]),
            "grpo/entropy": cur.entropy[step_mask].mean().item(),
            "train/grad_norm": norm,
            "grpo/beta": beta,
            "grpo/reward_mean": r.mean().item(),
            "grpo/reward_std": r.std(correction=0).item(),
            "grpo/zero_std_frac": zero_std.double().mean().item(),
            "grpo/adv_std": adv[m].std(correction=0).item(),
            "grpo/adv_abs_max": adv[m].abs().max().item(),
            "grpo/group_size": m.sum(-1).double().mean().item(),
            **extra,
        }

    def selection_change() -> dict[str, float]:
        changed = (greedy_picks(policy, ds, split.val) != ref_greedy).any(-1)
        return {"grpo/selection_change": changed.double().mean().item()}

    loop = Loop(
        args=args,
        start=run,
        model=policy,
        opt=opt,
        phase="grpo",
        step=step,
        state={"beta": args.kl_beta},
        rngs={"sampler": sampler, "queries": draws},
        epoch_extra=selection_change,
        check=lambda record: warnings_for(record, S),
        # The loss value is ~beta * KL (centred advantages give a PPO term near 0 at ratio 1): show what moves.
        postfix=("grpo/reward_mean", "grpo/kl_ref", "grpo/entropy"),
        log_steps=args.kl_target is not None,
        diverged_hint="try a lower --lr or a larger --kl-beta",
        config_extra={"out": str(run.out)},
    )
    run_training(loop)


if __name__ == "__main__":
    run_cli(main, Args)
