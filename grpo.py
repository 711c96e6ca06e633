"""Stage 3: GRPO post-training of the selector, offline on the scored groups or online with the LVLM in the loop.

Per step, for a batch of queries and their groups of G sequences: advantages from the group's rewards
(`model.group_advantages`), the PPO clipped surrogate on sequence log-probs against the old policy, plus
beta * exact KL(pi || pi_ref) over the pool at every visited step, averaged over valid sequences.

Correctness choices (each one a bug of the user's earlier code, DESIGN §7):
- the reference policy is the --init (RCE) weights, frozen; the KL weight is exactly --kl-beta for the whole run,
  unless an adaptive target is asked for with --kl-target (then the beta used is logged every epoch);
- the old policy is the current one, refreshed every --num-iterations updates on a batch, so the PPO ratio starts
  at exactly 1; every log-prob (new, old, reference) is computed with dropout off;
- every scored sequence of every group is used (no top-k), variable group sizes are masked;
- the best epoch is chosen by validation reward on held-out anchor queries, never by loss or test questions.

Online mode (--online): each step samples G distinct sequences per query from the current policy (temperature
--temperature), scores them with the dataset's backend (the simulator, or the LVLM), caches every score by
(query, sequence), and updates: real on-policy GRPO.

Usage:
    python grpo.py --kl-beta 0.1 --no-rank-advantage         # offline, init runs/rce -> runs/grpo-kl0.1
    python grpo.py --online --group-size 16 --temperature 1.0  # online -> runs/grpo-kl0.1-online
    python grpo.py --quality medium --out runs/cur1 && python grpo.py --init runs/cur1 --out runs/cur2  # curriculum
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

from backends import open_backend
from data import compute_reward, load_dataset, run_cli
from model import exact_kl, group_advantages, k3_kl, ppo_clip_loss, reward_spread
from pools import first_distinct
from training import (
    Batch,
    Loop,
    TrainArgs,
    check_train_args,
    clipped_step,
    fit,
    greedy_picks,
    load_selector,
    make_batch,
    prepare_out,
    sim_backend,
    split_queries,
    steps_per_epoch,
    write_config,
)


@dataclass
class Args(TrainArgs):
    init: Path = Path("runs/rce")
    """Starting selector (run folder or epoch checkpoint); also the frozen KL reference."""
    out: Path | None = None
    """Run folder; default runs/grpo-<key flags>, e.g. runs/grpo-kl0.1 or runs/grpo-kl0.1-online."""
    epochs: int = 10
    """Passes over the training queries."""
    lr: float = 1e-4
    """AdamW learning rate."""
    kl_beta: float = 0.1
    """Weight of the exact KL to the reference policy; used as given for the whole run."""
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
    """Replace rewards by their within-group rank mapped onto [-1, 1] (the user's old default)."""
    freeze_backbone: bool = False
    """Train only the query/candidate projections and the gate."""
    online: bool = False
    """Sample fresh groups from the current policy each step and score them with the backend."""
    group_size: int = 16
    """Online: distinct sequences sampled per query."""
    temperature: float = 1.0
    """Online: sampling temperature."""


def default_out(args: Args) -> Path:
    """runs/grpo-kl<beta> plus every key flag that differs from its default."""
    parts = [f"grpo-kl{args.kl_beta:g}"]
    flags = {
        "online": args.online,
        "rank": args.rank_advantage,
        "frozen": args.freeze_backbone,
        f"scale-{args.scale_rewards}": args.scale_rewards != "group",
        args.reward_mode.replace("_", "-"): args.reward_mode != "hard_plus_soft",
        f"q-{args.quality}": args.quality != "all",
        "pos": args.require_positive,
        f"target{args.kl_target}": args.kl_target is not None,
        f"it{args.num_iterations}": args.num_iterations != 1,
        f"lr{args.lr:g}": args.lr != Args.lr,
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


def warnings_for(record: dict) -> list[str]:
    """Plain-words alarms for dead or runaway training signals."""
    out = []
    if record.get("grpo/zero_std_frac", 0) >= 1:
        out.append("every group has equal rewards: there is no learning signal at all")
    if record.get("grpo/adv_std", 1) < 1e-3:
        out.append(f"advantage std is {record['grpo/adv_std']:.2g} (< 1e-3): rewards give the policy no gradient")
    if record.get("grpo/clip_frac_low", 0) + record.get("grpo/clip_frac_high", 0) > 0.5:
        out.append("more than half of the sequences hit the PPO clip: lower --lr or --num-iterations")
    if record.get("grpo/kl_ref", 0) > 5:
        out.append(
            f"KL to the reference is {record['grpo/kl_ref']:.3g} nats per sequence: the policy is running away "
            f"from it; raise --kl-beta or lower --lr"
        )
    return out


def backward_parts(params: list[torch.nn.Parameter], ppo: Tensor, kl_term: Tensor) -> float:
    """Set .grad = d(ppo + kl_term) and return the KL term's share of the gradient norm.

    The PPO term's *value* is ~0 at ratio 1 (advantages are centred), so the KL's share of the loss value says
    little; its share of the gradient says whether the KL penalty drowns the reward signal.
    """
    g_ppo = torch.autograd.grad(ppo, params, retain_graph=True, allow_unused=True)
    g_kl = torch.autograd.grad(kl_term, params, allow_unused=True)
    n_ppo, n_kl = 0.0, 0.0
    for p, a, b in zip(params, g_ppo, g_kl):
        a = torch.zeros_like(p) if a is None else a
        b = torch.zeros_like(p) if b is None else b
        n_ppo, n_kl = n_ppo + a.square().sum().item(), n_kl + b.square().sum().item()
        p.grad = a + b
    return n_kl**0.5 / (n_ppo**0.5 + n_kl**0.5 + 1e-12)


class ScoreCache:
    """Backend scores by (query, ICD train rows); only unseen pairs go to the backend, in one batch."""

    def __init__(self, backend):
        self.backend, self.memo = backend, {}

    def fields(self, queries: Tensor, icds: Tensor) -> dict[str, Tensor]:
        """queries (N,), icds (N, S) train rows -> acc, correct, gt_prob, rel as (N,) float64."""
        keys = [(q, tuple(s)) for q, s in zip(queries.tolist(), icds.tolist())]
        new = [i for i, k in enumerate(keys) if k not in self.memo]
        if new:
            res = self.backend.score("train", queries[new], icds[new])
            cols = [res[f].double().tolist() for f in ("acc", "correct", "gt_prob", "rel")]
            for j, i in enumerate(new):
                self.memo[keys[i]] = tuple(c[j] for c in cols)
        vals = torch.tensor([self.memo[k] for k in keys], dtype=torch.float64)  # (N, 4)
        return dict(zip(("acc", "correct", "gt_prob", "rel"), vals.unbind(-1)))


def main(args: Args) -> None:
    check_args(args)
    out = args.out or default_out(args)
    ds = load_dataset(args.data, args.allow_truncated)
    split = split_queries(ds, args)
    resume_from = prepare_out(out, args, ds)
    backend = sim_backend(ds)  # true-accuracy validation: simulator only
    # online groups are scored by the dataset's backend: the simulator, or the LVLM that scored the data
    scorer = (backend or open_backend(ds.meta, ds.items, ds.emb)) if args.online else None
    torch.manual_seed(args.seed)
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
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    ref_greedy = greedy_picks(ref, ds, split.val)
    cache = ScoreCache(scorer) if args.online else None
    sampler = torch.Generator().manual_seed(args.seed + 2)
    S = ds.seq_len
    epoch_steps = steps_per_epoch(split, args.batch_size)

    def online_batch(idx: Tensor) -> Batch:
        """Sample G distinct sequences per query from the current policy and score them (cached)."""
        b = make_batch(ds, idx, split.reward)
        cand, _ = policy.sample(b.query, b.pool, b.pool_mask, S, 2 * args.group_size, sampler, args.temperature)
        order, ok = first_distinct(cand, args.group_size)  # (B, G) first G distinct of 2G samples
        seqs = cand.gather(1, order[..., None].expand(-1, -1, S)).masked_fill(~ok[..., None], -1)  # (B, G, S)
        rows = ds.groups.pools[idx].gather(1, seqs.clamp_min(0).flatten(1)).view(-1, S)  # (B*G, S) train rows
        fields = cache.fields(ds.groups.queries[idx].repeat_interleave(args.group_size), rows)
        reward = compute_reward({k: v.view(len(idx), -1) for k, v in fields.items()}, args).where(ok, 0.0)
        return Batch(b.query, b.pool, b.pool_mask, seqs, ok, reward)

    def step(idx: Tensor, step: int, state: dict) -> dict[str, float]:
        b = online_batch(idx) if args.online else make_batch(ds, idx, split.reward)
        m = b.seq_mask
        adv = group_advantages(b.reward, m, args.scale_rewards, args.rank_advantage).float()  # (B, G)
        step_mask = m[..., None].expand(-1, -1, S)  # (B, G, S)
        with torch.no_grad():
            ref_dist = ref(b.query, b.pool, b.pool_mask, b.seqs, m, with_dists=True).log_dist  # (B, G, S, K)
        beta = state.setdefault("beta", args.kl_beta)
        old = None
        for _ in range(args.num_iterations):
            cur = policy(b.query, b.pool, b.pool_mask, b.seqs, m, with_dists=True)
            logp = cur.logp.sum(-1)  # (B, G)
            old = logp.detach() if old is None else old  # the policy before this batch's updates: ratio starts at 1
            ppo, st = ppo_clip_loss(logp, old, adv, m, args.epsilon, args.epsilon_high)
            kl = exact_kl(cur.log_dist, ref_dist, step_mask)[m].mean()
            loss = ppo + beta * kl
            opt.zero_grad(set_to_none=True)
            if step % epoch_steps == 0:  # the split backward costs a second pass: measure once per epoch
                extra = {"grpo/kl_grad_share": backward_parts(params, ppo, beta * kl)}
            else:
                loss.backward()
                extra = {}
            norm = clipped_step(opt, params, args.grad_clip)
        with torch.no_grad():  # how far this batch's updates moved the policy: KL(old || new) at the sequences
            moved = k3_kl(old, policy(b.query, b.pool, b.pool_mask, b.seqs, m).logp.sum(-1), m).item()
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
            "grpo/approx_kl_old": moved,
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

    out.mkdir(parents=True, exist_ok=True)
    if resume_from is None:
        write_config(out, args, ds, split, {"out": str(out)})
    run = Loop(args, out, ds, split, policy, opt, "grpo", backend)
    loop = fit(
        run,
        step,
        resume_from,
        selection_change,
        warnings_for,
        {"beta": args.kl_beta},
        ("train/loss", "grpo/kl_ref", "grpo/reward_mean"),
        {"sampler": sampler},
        log_steps=args.kl_target is not None,
        init_is_candidate=True,
    )
    print(f"best epoch {loop['best_epoch']} (val/reward {loop['best']:.4f}) -> {out}/model.safetensors")


if __name__ == "__main__":
    run_cli(main, Args)
