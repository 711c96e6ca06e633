"""The pointer selector and the RL math, shared by every stage (no CLI; the selector writes and reads its own two
files, icl_select/runs.py the rest of a run, icl_select/hub.py carries a selector to and from the Hugging Face Hub).

`PointerSelector` picks S in-context demonstrations, one at a time, from a per-query candidate pool of K embeddings:
the query attends over its pool (L cross-attention layers, residual + LayerNorm), query state and candidates are
projected (near-identity init) and L2-normalised, step t is a softmax over the unchosen, unpadded pool of
cosine / temperature, and the state absorbs each pick through a gate: g = sigma(W[s; c]), s <- norm(g*s + (1-g)*c).
With an item memory (grpo.py --item-bias), a learned score of each train item adds to its cosine wherever it is a
candidate. A selector that may stop (--can-stop) decides at each step first whether to stop, then which candidate
given that it goes on: how sure it is of its picks never decides whether it stops. Before the first pick p(stop) =
sigmoid((s . w + b_0) / temperature), reading the query's state s without training it (no gradient from the stop
reaches the weights its picks use); after t picks, sigmoid(b_t / temperature), alike for every question (a stop that
read the state there drifted toward stopping as the state moved with its picks, where going on won). Its stop starts
at w = b = 0, a coin flip that greedy decoding resolves by going on.

Each query and its pool are encoded once and shared by all G sequences of its group: teacher forcing is vectorised
over queries x sequences, with a Python loop only over the S steps, whose state is sequential. Log-distributions keep
-inf on chosen and padded candidates (probability exactly 0); every consumer here masks before multiplying, so no NaN
reaches values or gradients. The RL math (`group_advantages`, `ppo_clip_loss`, `going_on_logp`, `stop_loss`,
`exact_kl`, `k3_kl`, `rce_weights`) is pure functions of tensors.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Literal, NamedTuple, get_args

import torch
import torch.nn.functional as F
from einops import rearrange
from huggingface_hub import ModelCard, ModelHubMixin
from torch import Tensor, nn

from icl_select import hub
from icl_select.files import DataError, atomic_write_text, read_json, read_tensors, save_tensors

# ----------------------------------------------------------------------------------------------------------------------
# The selector

PickOrder = Literal["prompt", "nearest_first"]


@dataclass
class SelectorConfig:
    """Architecture of the pointer selector, saved beside its weights as model.json; rce.py's flags for a fresh
    selector."""

    dim: int = 512
    """Input embedding size (CLIP ViT-B/32 fused image+question vectors are 512-d)."""
    hidden: int = 256
    """Width of the projected query/candidate space."""
    num_layers: int = 1
    """Cross-attention layers (the query attends over its pool)."""
    num_heads: int = 4
    """Attention heads; must divide `hidden`."""
    dropout: float = 0.1
    """Dropout after attention and on the projected features (train mode only)."""
    temperature: float = 0.1
    """Scores are cosine / temperature: how sharp the selector's distribution over its pool is."""
    state_update: bool = True
    """Whether a pick moves the query state (the gated update); off, every step scores the pool against the query
    alone, so greedy decoding is the top k by score: a bi-encoder retriever (rce.py --retriever)."""
    can_stop: bool = False
    """Whether it may end a sequence before its last pick (a stop choice at every step, none picked included)."""
    pick_order: PickOrder = "nearest_first"
    """How picks become a prompt: nearest_first (first pick next to the query) or prompt (Lever-Plus)."""
    # Decoders return picks in pick order; to_prompt / from_prompt convert wherever picks meet scored data or the LVLM.
    picks: int = 4
    """Demonstrations it is trained to pick (its data's sequence length): evaluate.py asks for at most this many."""

    def __post_init__(self):
        if self.hidden % self.num_heads:
            raise ValueError(f"SelectorConfig: hidden={self.hidden} is not divisible by num_heads={self.num_heads}")
        if self.temperature <= 0:
            raise ValueError(f"SelectorConfig: temperature must be > 0, got {self.temperature}")
        if self.pick_order not in get_args(PickOrder):
            raise ValueError(
                f"SelectorConfig: pick_order must be one of {get_args(PickOrder)}, got {self.pick_order!r}"
            )

    def to_prompt(self, picks: Tensor) -> Tensor:
        """Picks (..., S) in pick order, -1 after a stop -> the same demonstrations in prompt order (the query comes
        after the last), -1 still at the end."""
        return reverse_picks(picks) if self.pick_order == "nearest_first" else picks

    def from_prompt(self, seqs: Tensor) -> Tensor:
        """Sequences (..., S) in prompt order (as scored data stores them) -> pick order; the inverse of to_prompt."""
        return self.to_prompt(seqs)  # a reversal is its own inverse


def reverse_picks(seqs: Tensor) -> Tensor:
    """Each sequence's demonstrations (..., S) in reverse order, the -1 after the last of a shorter one left at the
    end (a reversal of the whole row would move them to the front)."""
    n = (seqs >= 0).sum(-1, keepdim=True)  # (..., 1) demonstrations in each sequence
    t = torch.arange(seqs.shape[-1], device=seqs.device)  # (S,)
    return seqs.gather(-1, (n - 1 - t).where(t < n, t))


def selector_config(raw: object, where: str) -> SelectorConfig:
    """Selector settings read from the file `where`: every field of SelectorConfig, each of its type, nothing else."""
    if not isinstance(raw, dict):
        raise DataError(f"{where}: expected a JSON object of selector settings, got {type(raw).__name__}")
    kinds = {f.name: type(f.default) for f in fields(SelectorConfig)}
    if set(raw) != set(kinds):
        missing, unknown = sorted(set(kinds) - set(raw)), sorted(set(raw) - set(kinds))
        raise DataError(f"{where}: fields missing {missing}, unknown {unknown}; expected {sorted(kinds)}")
    for name, kind in kinds.items():
        value = raw[name]
        numeric = (int, float) if kind is float else kind
        if (isinstance(value, bool) and kind is not bool) or not isinstance(value, numeric):
            what = {float: "a number", bool: "true or false"}.get(kind, kind.__name__)
            raise DataError(f"{where}: field {name!r} must be {what}, got {value!r}")
    if raw["picks"] < 1:
        raise DataError(f"{where}: field 'picks' must be >= 1, got {raw['picks']}")
    try:
        return SelectorConfig(**raw)
    except ValueError as e:
        raise DataError(f"{where}: {e}") from None


def load_state_strict(model: PointerSelector, tensors: dict[str, Tensor], source: Path) -> None:
    """load_state_dict that names every missing, unexpected or mis-shaped tensor instead of skipping it; a selector
    whose tensors hold an item memory gets one first (its size is its training data's, not a setting)."""
    if "items.keys" in tensors and model.items is None:
        model.items = ItemMemory(len(tensors["items.keys"]), model.cfg.dim)
    own = model.state_dict()
    missing = sorted(set(own) - set(tensors))
    unexpected = sorted(set(tensors) - set(own))
    shapes = [
        f"{k}: {tuple(tensors[k].shape)} in file, {tuple(v.shape)} in model"
        for k, v in own.items()
        if k in tensors and tensors[k].shape != v.shape
    ]
    problems = [f"missing tensors {missing}"] * bool(missing) + [f"unexpected tensors {unexpected}"] * bool(unexpected)
    problems += [f"shape mismatch {s}" for s in shapes]
    if problems:
        raise ValueError(f"{source}: does not match the selector architecture: " + "; ".join(problems))
    model.load_state_dict(tensors, strict=True)


class Steps(NamedTuple):
    """Teacher-forced outputs of `PointerSelector.forward` (entries of masked sequences and steps are 0)."""

    logp: Tensor  # (B, G, S) log-probability of each step's choice (a pick, or the stop)
    entropy: Tensor  # (B, G, S) entropy of each step's distribution
    log_dist: Tensor | None  # (B, G, S, K [+ 1]) per-step log-distribution (-inf on unavailable; stop last), if asked
    taken: Tensor  # (B, G, S) bool: the steps a sequence took (its picks, and its stop if it stopped early)


class CrossAttention(nn.Module):
    """One query vector attends over its pool; residual + LayerNorm (post-norm)."""

    def __init__(self, hidden: int, num_heads: int, dropout: float):
        super().__init__()
        self.num_heads = num_heads
        self.q = nn.Linear(hidden, hidden)
        self.kv = nn.Linear(hidden, 2 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.drop = nn.Dropout(dropout)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x: Tensor, pool: Tensor, pool_mask: Tensor) -> Tensor:
        # the kv projection's output is laid out (k|v, head, head dim): split it into K and V per head
        q = rearrange(self.q(x), "b (nh hd) -> b nh hd", nh=self.num_heads)
        k, v = rearrange(self.kv(pool), "b k (two nh hd) -> two b k nh hd", two=2, nh=self.num_heads)
        att = torch.einsum("bnd,bknd->bnk", q, k) / q.shape[-1] ** 0.5  # (B, nh, K)
        att = att.masked_fill(~pool_mask[:, None, :], float("-inf")).softmax(-1)
        y = rearrange(torch.einsum("bnk,bknd->bnd", att, v), "b nh hd -> b (nh hd)")  # (B, H)
        return self.norm(x + self.drop(self.out(y)))


def _near_identity(n: int) -> nn.Linear:
    lin = nn.Linear(n, n)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(n) + 0.01 * torch.randn(n, n))
        lin.bias.zero_()
    return lin


class ItemMemory(nn.Module):
    """A learned score for each train item, added to the selector's score of that candidate wherever it sits in a
    pool (grpo.py --item-bias): it remembers which demonstrations helped, beyond what their embeddings tell.

    Items are recognised by a fixed random projection of their embedding, `keys` (sorted, distinct), so every caller
    keeps passing embeddings alone; a candidate that matches no key (a demonstration the selector never trained on)
    scores 0."""

    def __init__(self, num: int, dim: int):
        super().__init__()
        self.register_buffer("keys", torch.zeros(num, dtype=torch.float64))
        self.bias = nn.Parameter(torch.zeros(num))
        proj = torch.randn(dim, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        self.register_buffer("proj", proj, persistent=False)  # the same on every machine: never saved

    def key(self, emb: Tensor) -> Tensor:
        """(..., d) -> (...,) float64: equal embeddings give `same` keys, distinct ones almost surely distinct keys."""
        return emb.double() @ self.proj

    def forward(self, pool: Tensor) -> Tensor:
        """(B, K, d) -> (B, K) each candidate's learned score, 0 for one that is no remembered item."""
        key = self.key(pool)
        hi = torch.searchsorted(self.keys, key).clamp(max=len(self.keys) - 1)  # (B, K) the keys either side
        lo = (hi - 1).clamp(min=0)
        near = torch.where((key - self.keys[lo]).abs() < (self.keys[hi] - key).abs(), lo, hi)
        return self.bias[near].where(self.same(self.keys[near], key), 0.0)

    @staticmethod
    def same(a: Tensor, b: Tensor) -> Tensor:
        """Keys of one embedding: float64 sums of the same float32 numbers differ by rounding alone (the order of a
        matrix product's sums varies with its shape), far below the spacing of distinct items' keys."""
        return (a - b).abs() <= 1e-12 * b.abs().clamp_min(1)


class PointerSelector(
    nn.Module, ModelHubMixin, tags=["icl-select", "in-context-learning"], model_card_template=hub.CARD
):
    """Pointer network over a per-query candidate pool. All methods are batched over queries (B) and sequences (G).

    `from_pretrained(run folder or Hub id)` and `push_to_hub(id)` come from huggingface_hub's ModelHubMixin."""

    run_files: dict[str, bytes] | None = None  # RUN_FILES of the folder `from_pretrained` read, to travel with it
    run_eval: dict | None = None  # its eval/val.json, where it evaluated these weights, for the model card
    # what it reads and was trained for: {"task", "encoder", "data"} (icl_select/lineage.py), in model.json
    made_from: dict | None = None

    def __init__(self, cfg: SelectorConfig):
        super().__init__()
        self.cfg = cfg
        self.in_proj = nn.Linear(cfg.dim, cfg.hidden)
        self.layers = nn.ModuleList(
            CrossAttention(cfg.hidden, cfg.num_heads, cfg.dropout) for _ in range(cfg.num_layers)
        )
        self.drop = nn.Dropout(cfg.dropout)
        self.query_proj = _near_identity(cfg.hidden)
        self.cand_proj = _near_identity(cfg.hidden)
        self.gate = nn.Linear(2 * cfg.hidden, cfg.hidden)
        if cfg.can_stop:  # stopping against going on: logit (state . stop_weight [t = 0 only] + stop_bias[t]) / temp.
            self.stop_weight = nn.Parameter(torch.zeros(cfg.hidden))  # untrained: a coin flip, and greedy goes on
            self.stop_bias = nn.Parameter(torch.zeros(cfg.picks))
        self.items: ItemMemory | None = None  # remember_items, or a loaded selector that has one

    def remember_items(self, train: Tensor) -> None:
        """Give the selector an item memory over the train embeddings `train` (N, d), every score 0: the policy is
        unchanged until training moves them."""
        memory = ItemMemory(0, self.cfg.dim)
        keys = memory.key(train).sort().values
        memory.keys = keys[torch.cat([keys.new_ones(1, dtype=torch.bool), ~memory.same(keys[1:], keys[:-1])])]
        memory.bias = nn.Parameter(torch.zeros(len(memory.keys)))
        self.items = memory.to(next(self.parameters()).device)

    def set_picks(self, picks: int) -> None:
        """Make it a selector of `picks` demonstrations. Its stop bias, one per step, is cut or extended by its last
        entry, which every later step used already: the policy over the steps both lengths share is unchanged."""
        if self.cfg.can_stop:
            bias = self.stop_bias.data
            self.stop_bias = nn.Parameter(torch.cat([bias, bias[-1:].expand(max(picks - len(bias), 0))])[:picks])
        self.cfg = replace(self.cfg, picks=picks)

    def stop_parameters(self) -> list[nn.Parameter]:
        """The stop choice's weight and per-step bias (none for a selector that fills every slot)."""
        return [self.stop_weight, self.stop_bias] if self.cfg.can_stop else []

    def backbone_parameters(self) -> list[nn.Parameter]:
        """Input projection and cross-attention: what `--freeze-backbone` freezes."""
        return [*self.in_proj.parameters(), *self.layers.parameters()]

    # -- building blocks -----------------------------------------------------------------------------------------------
    def encode(self, query: Tensor, pool: Tensor, pool_mask: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """(B, d), (B, K, d), (B, K) -> initial state (B, H) and candidate keys (B, K, H), both unit-norm, and the
        candidates' remembered scores (B, K) (None without an item memory)."""
        x = self.in_proj(query)  # (B, H)
        c = self.in_proj(pool)  # (B, K, H)
        for layer in self.layers:
            x = layer(x, c, pool_mask)
        s = F.normalize(self.query_proj(self.drop(x)), dim=-1)  # (B, H)
        keys = F.normalize(self.cand_proj(self.drop(c)), dim=-1)  # (B, K, H)
        return s, keys, None if self.items is None else self.items(pool)

    def step_log_dist(
        self, s: Tensor, keys: Tensor, prior: Tensor | None, avail: Tensor, temperature: float = 1.0, t: int = 0
    ) -> Tensor:
        """State (B, M, H), keys (B, K, H), remembered scores (B, K) or None, available (B, M, K) -> log-distribution
        (B, M, K); -inf = unavailable. A remembered score adds to the cosine, before the temperature. A selector that
        can stop takes avail (B, M, K + 1) and gives (B, M, K + 1): the last column stops after `t` picks.

        `temperature` scales the configured one (sampling at temperature T is the policy at temperature T)."""
        scores = torch.einsum("bmh,bkh->bmk", s, keys)  # (B, M, K)
        if prior is not None:
            scores = scores + prior[:, None, :]
        if not self.cfg.can_stop:
            return (scores / (self.cfg.temperature * temperature)).masked_fill(~avail, float("-inf")).log_softmax(-1)
        can_go, can_stop = avail[..., :-1].any(-1), avail[..., -1]  # (B, M) x2
        picks = (scores / self.cfg.temperature).masked_fill(~avail[..., :-1], float("-inf"))  # (B, M, K)
        picks = picks.masked_fill(~can_go[..., None], 0.0).log_softmax(-1)  # which candidate, given going on
        # before the first pick the stop reads the state the picks train, detached (a stop pulling the weights the
        # picks share cost picks: docs/ablations.md); later, a constant per step
        z = self.stop_bias[min(t, len(self.stop_bias) - 1)] + (s.detach() @ self.stop_weight if t == 0 else 0.0)
        z = z / self.cfg.temperature
        go = F.logsigmoid(-z).where(can_stop, 0.0)  # (B, M) log p(go on), 0 where it must
        stop = F.logsigmoid(z).where(can_go, 0.0)  # (B, M) log p(stop), 0 where it must
        log_dist = torch.cat([picks + go[..., None], stop[..., None]], -1).masked_fill(~avail, float("-inf"))
        return log_dist if temperature == 1 else (log_dist / temperature).log_softmax(-1)  # as `sample` draws

    def advance(self, s: Tensor, keys: Tensor, pick: Tensor) -> Tensor:
        """Gated state update with the picked candidates: s (B, M, H), pick (B, M) -> s (B, M, H); the state as it was
        without `state_update`."""
        if not self.cfg.state_update:
            return s
        c = keys[torch.arange(keys.shape[0], device=keys.device)[:, None], pick]  # (B, M, H)
        g = torch.sigmoid(self.gate(torch.cat([s, c], -1)))  # (B, M, H)
        return F.normalize(g * s + (1 - g) * c, dim=-1)

    # -- teacher forcing -----------------------------------------------------------------------------------------------
    def forward(
        self,
        query: Tensor,
        pool: Tensor,
        pool_mask: Tensor,
        seqs: Tensor,
        seq_mask: Tensor,
        with_dists: bool = False,
        temperature: float = 1.0,
    ) -> Steps:
        """Teacher-forced per-step log-probs and entropies of G given sequences per query.

        query (B, d), pool (B, K, d), pool_mask (B, K) bool, seqs (B, G, S) long pool positions, seq_mask (B, G) bool.
        Masked sequences may hold anything (e.g. -1 padding); their outputs are exactly 0. `temperature` gives the
        distributions of `sample(..., temperature)`, whose samples online GRPO scores. A selector that can stop reads
        a sequence's -1 after its last pick as its stop: the step after its last pick chooses the stop (column K of
        the distributions), and the steps after that are not taken.
        """
        check_shapes(query, pool, pool_mask, seqs, seq_mask)
        B, G, S = seqs.shape
        K, stops = pool.shape[1], self.cfg.can_stop
        # Masked sequences get a harmless stand-in (the first S valid candidates) so no garbage index is touched.
        filler = pool_mask.float().argsort(dim=-1, descending=True, stable=True)[:, :S]  # (B, S)
        seqs = torch.where(seq_mask[..., None], seqs, filler[:, None, :])  # (B, G, S)
        t = torch.arange(S, device=seqs.device)  # (S,)
        n = (seqs >= 0).sum(-1, keepdim=True) if stops else torch.full_like(seqs[..., :1], S)  # (B, G, 1) picks
        taken = seq_mask[..., None] & (t <= n)  # (B, G, S) the picks, and the stop of a sequence that stopped
        act = seqs.where(t < n, K)  # (B, G, S) each step's choice: a pick, or the stop (K)
        s, keys, prior = self.encode(query, pool, pool_mask)
        s = s[:, None, :].expand(B, G, -1)  # (B, G, H): one encoding shared by the whole group
        avail = pool_mask[:, None, :].expand(B, G, -1).clone()  # (B, G, K)
        can = torch.ones_like(avail[..., :1])  # (B, G, 1) stopping is open at every step
        logps, ents, dists = [], [], []
        for step in range(S):
            a = torch.cat([avail, can], -1) if stops else avail  # (B, G, K [+ 1])
            log_dist = self.step_log_dist(s, keys, prior, a, temperature, step)
            choice = act[:, :, step]  # (B, G)
            logps.append(log_dist.gather(-1, choice[..., None])[..., 0])
            ents.append(_entropy(log_dist, a))
            if with_dists:
                dists.append(log_dist)
            pick = choice.clamp(max=K - 1)  # a stopped sequence's later steps are not taken: any pick will do
            avail = avail.scatter(-1, pick[..., None], False)
            if step + 1 < S:
                s = self.advance(s, keys, pick)
        logp = torch.stack(logps, -1).where(taken, 0.0)  # (B, G, S)
        entropy = torch.stack(ents, -1).where(taken, 0.0)  # (B, G, S)
        log_dist = torch.stack(dists, 2).where(taken[..., None], 0.0) if with_dists else None  # (B, G, S, K [+ 1])
        return Steps(logp, entropy, log_dist, taken)

    def log_probs(self, query: Tensor, pool: Tensor, pool_mask: Tensor, seqs: Tensor, seq_mask: Tensor) -> Tensor:
        """(B, G, S) teacher-forced per-step log-probabilities (0 for masked sequences)."""
        return self(query, pool, pool_mask, seqs, seq_mask).logp

    # -- decoding ------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def greedy(
        self, query: Tensor, pool: Tensor, pool_mask: Tensor, steps: int, min_picks: int = 0
    ) -> tuple[Tensor, Tensor]:
        """Greedy decoding: -> picks (B, S) and their summed log-prob (B,). A selector that can stop may end once it
        has made `min_picks` picks (0: anywhere; `steps`: never, every slot filled), -1 after its last. Each step is the
        more likely branch of two decisions in turn: to stop or go on (it stops where stopping is more likely than
        going on, p > 1/2), then which candidate."""
        check_shapes(query, pool, pool_mask)
        decode = functools.partial(self._decode, steps=steps, num=1, choose=self.most_likely, min_picks=min_picks)
        seqs, logp = in_chunks(decode, query, pool, pool_mask)
        return seqs[:, 0], logp[:, 0]

    def most_likely(self, log_dist: Tensor) -> Tensor:
        """Greedy choice of `_decode`: (B, N, A) -> (B, N); with a stop choice (the last column), the stop where its
        probability is above 1/2, else the most likely candidate."""
        if not self.cfg.can_stop:
            return log_dist.argmax(-1)
        stop = log_dist.shape[-1] - 1
        return log_dist[..., :stop].argmax(-1).where(log_dist[..., stop] <= math.log(0.5), stop)

    @torch.no_grad()
    def sample(
        self,
        query: Tensor,
        pool: Tensor,
        pool_mask: Tensor,
        steps: int,
        num_samples: int,
        generator: torch.Generator | None = None,
        temperature: float = 1.0,
        min_picks: int = 0,
    ) -> tuple[Tensor, Tensor]:
        """Ancestral sampling at `temperature`: -> picks (B, N, S) and their log-prob under the policy (B, N);
        `min_picks` as in `greedy`.

        Samples are independent, so they may repeat; callers that need distinct sequences deduplicate.
        """
        if temperature <= 0:
            raise ValueError(f"sample: temperature must be > 0, got {temperature}")
        check_shapes(query, pool, pool_mask)

        def draw(log_dist: Tensor) -> Tensor:  # (B, N, A) -> (B, N)
            probs = (log_dist / temperature).softmax(-1).flatten(0, 1)  # (B*N, A)
            return torch.multinomial(probs, 1, generator=generator).view(log_dist.shape[:2])

        return self._decode(query, pool, pool_mask, steps, num_samples, draw, min_picks)

    def choices(self, avail: Tensor, done: Tensor, may_stop: bool) -> Tensor:
        """What a decoding step may choose: the candidates left (B, N, K), and for a selector that can stop the stop
        column too, open where `may_stop` or where the sequence is done (B, N) -- its only choice then, at
        log-probability 0, so a finished sequence stays finished and its score stays as it was."""
        if not self.cfg.can_stop:
            return avail
        return torch.cat([avail & ~done[..., None], (done | may_stop)[..., None]], -1)  # (B, N, K + 1)

    def _decode(self, query, pool, pool_mask, steps: int, num: int, choose: Callable[[Tensor], Tensor], min_picks=0):
        """`num` sequences per query, each step's choice made by `choose(log_dist (B, N, A)) -> (B, N)` (A = K, plus
        the stop for a selector that can stop); picks after a stop are -1."""
        B, K = pool_mask.shape
        s, keys, prior = self.encode(query, pool, pool_mask)
        s = s[:, None, :].expand(B, num, -1)  # (B, N, H)
        avail = pool_mask[:, None, :].expand(B, num, -1).clone()  # (B, N, K)
        done = torch.zeros(B, num, dtype=torch.bool, device=query.device)  # (B, N) stopped
        picks, total = [], torch.zeros(B, num, device=query.device)
        for t in range(steps):
            log_dist = self.step_log_dist(s, keys, prior, self.choices(avail, done, t >= min_picks), t=t)  # (B, N, A)
            choice = choose(log_dist)  # (B, N)
            total = total + log_dist.gather(-1, choice[..., None])[..., 0]
            done = done | (choice == K)
            picks.append(choice.masked_fill(done, -1))
            pick = choice.clamp(max=K - 1)  # a stopped sequence's state no longer matters
            avail = avail.scatter(-1, pick[..., None], False)
            if t + 1 < steps:
                s = self.advance(s, keys, pick)
        return torch.stack(picks, -1), total  # (B, N, S), (B, N)

    @torch.no_grad()
    def beam_search(
        self, query: Tensor, pool: Tensor, pool_mask: Tensor, steps: int, width: int, min_picks: int = 0
    ) -> tuple[Tensor, Tensor]:
        """Beam search: -> the `width` best sequences (B, W, S) with their summed log-probs (B, W), best first;
        `min_picks` as in `greedy` (a finished beam keeps its score).

        Beams beyond the number of distinct sequences a pool allows come back with score -inf.
        """
        check_shapes(query, pool, pool_mask)
        return in_chunks(lambda *b: self._beam(*b, steps, width, min_picks), query, pool, pool_mask)

    def _beam(self, query: Tensor, pool: Tensor, pool_mask: Tensor, steps: int, width: int, min_picks: int = 0):
        B, K = pool_mask.shape
        s, keys, prior = self.encode(query, pool, pool_mask)
        s = s[:, None, :].expand(B, width, -1)  # (B, W, H)
        avail = pool_mask[:, None, :].expand(B, width, -1).clone()  # (B, W, K)
        done = torch.zeros(B, width, dtype=torch.bool, device=query.device)  # (B, W) stopped
        # All beams start identical: only beam 0 is live, so step 0 cannot produce duplicates.
        score = torch.full((B, width), float("-inf"), device=query.device)
        score[:, 0] = 0.0
        seqs = torch.zeros(B, width, 0, dtype=torch.long, device=query.device)
        rows = torch.arange(B, device=query.device)[:, None]
        for t in range(steps):
            step = self.step_log_dist(s, keys, prior, self.choices(avail, done, t >= min_picks), t=t)  # (B, W, A)
            A = step.shape[-1]
            score, flat = (score[..., None] + step).flatten(1).topk(width, -1)  # (B, W) best first
            beam, choice = flat // A, flat % A  # (B, W) parent beam and its new choice
            done = done[rows, beam] | (choice == K)
            seqs = torch.cat([seqs[rows, beam], choice.masked_fill(done, -1)[..., None]], -1)  # (B, W, t+1)
            pick = choice.clamp(max=K - 1)
            avail = avail[rows, beam].scatter(-1, pick[..., None], False)
            if t + 1 < steps:
                s = self.advance(s[rows, beam], keys, pick)
        return seqs, score

    # -- persistence ---------------------------------------------------------------------------------------------------
    def save(self, directory: str | os.PathLike) -> None:
        """Write `model.safetensors` (the network's settings also in its metadata) and `model.json` (every setting),
        each atomically."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = asdict(self.cfg)
        # the weights' metadata describes the network alone: the same network trained alike gives the same bytes,
        # whatever the sequence length of its data
        network = json.dumps({k: v for k, v in config.items() if k != "picks"}, indent=2)
        save_tensors(directory / "model.safetensors", self.state_dict(), {"config": network})
        made_from = {"made_from": self.made_from} if self.made_from is not None else {}
        atomic_write_text(directory / "model.json", json.dumps(config | made_from, indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | os.PathLike) -> PointerSelector:
        """What `save` wrote, read strictly: a bad field or tensor is one line naming the file."""
        directory = Path(directory)
        raw = read_json(directory / "model.json")
        made_from = raw.pop("made_from", None) if isinstance(raw, dict) else None
        model = cls(selector_config(raw, str(directory / "model.json")))
        load_state_strict(model, read_tensors(directory / "model.safetensors"), directory / "model.safetensors")
        model.made_from = made_from
        return model

    # -- the Hub: huggingface_hub.ModelHubMixin's hooks, carried out by icl_select/hub.py ------------------------------
    @classmethod
    def from_pretrained(cls, source: str | Path, **kwargs) -> PointerSelector:
        """A selector from a run folder or a Hub repository id (`revision=`, `cache_dir=`... as in huggingface_hub)."""
        with hub.one_line(source):
            return super().from_pretrained(source, **kwargs)

    @classmethod
    def _from_pretrained(cls, *, model_id: str, **hub_kwargs) -> PointerSelector:
        return hub.load(cls, model_id, **hub_kwargs)

    def _save_pretrained(self, save_directory: Path) -> None:
        hub.save(self, save_directory)

    def save_pretrained(self, save_directory: str | Path, **kwargs) -> str | None:
        """What `push_to_hub` uploads, in a folder; only for a selector read from its run folder with config.json."""
        hub.check_run(self)  # before the mixin replaces save_directory's config.json
        return super().save_pretrained(save_directory, **kwargs)

    def push_to_hub(self, repo_id: str, **kwargs) -> str:
        """Upload model.safetensors, model.json, the run's config.json and metrics.jsonl and a model card."""
        hub.check_run(self)  # before the repository is created
        kwargs["model_card_kwargs"] = {"repo_id": repo_id} | (kwargs.get("model_card_kwargs") or {})
        return super().push_to_hub(repo_id, **kwargs)

    def generate_model_card(self, *args, **kwargs) -> ModelCard:
        return super().generate_model_card(*args, **(hub.card_facts(self) | kwargs))


# Decoding works in slices of queries: one call over hundreds of pools streams every intermediate through memory, while
# slices stay in cache (`python bench.py --only decode`). Rows never interact, so the slices give the same picks.
DECODE_CHUNK = 64


# Matrix products of fewer rows than this may take other CPU kernels, which round differently: a slice this small joins
# the one before, so each row gets the bits it gets in any larger batch.
MIN_SLICE = 4


def slices(n: int, size: int) -> list[slice]:
    """Consecutive slices of `size` rows covering n; a last slice of fewer than MIN_SLICE rows joins the one before."""
    starts = list(range(0, n, size))
    if len(starts) > 1 and n - starts[-1] < MIN_SLICE:
        starts.pop()
    return [slice(a, b) for a, b in zip(starts, [*starts[1:], n])]


def in_chunks(decode, query: Tensor, pool: Tensor, pool_mask: Tensor) -> tuple[Tensor, Tensor]:
    """`decode(query, pool, pool_mask) -> (seqs, scores)` over `slices` of DECODE_CHUNK queries, concatenated."""
    outs = [decode(query[s], pool[s], pool_mask[s]) for s in slices(query.shape[0], DECODE_CHUNK)]
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


def _entropy(log_dist: Tensor, avail: Tensor) -> Tensor:
    """Entropy over available entries only (0 * -inf would be NaN): (..., K) -> (...)."""
    safe = log_dist.masked_fill(~avail, 0.0)
    return -(safe.exp() * safe).where(avail, 0.0).sum(-1)


# ----------------------------------------------------------------------------------------------------------------------
# Shapes: the values (ids inside their pools, distinct picks, pools no smaller than the picks, finite embeddings) are
# checked where they are read from files (data.py, evaluate.py's preflight), with one line naming file and field


def check_shapes(
    query: Tensor, pool: Tensor, pool_mask: Tensor, seqs: Tensor | None = None, seq_mask: Tensor | None = None
) -> None:
    """Assert that a batch's tensors fit together: query (B, d), pool (B, K, d), bool pool_mask (B, K), and for
    teacher forcing long seqs (B, G, S) with bool seq_mask (B, G)."""
    B, d = query.shape[0], query.shape[-1]
    assert query.dim() == 2 and pool.dim() == 3 and (pool.shape[0], pool.shape[2]) == (B, d), (
        f"expected query (B, d) and pool (B, K, d), got {tuple(query.shape)} and {tuple(pool.shape)}"
    )
    assert pool_mask.shape == pool.shape[:2] and pool_mask.dtype == torch.bool, (
        f"expected a bool pool_mask {tuple(pool.shape[:2])}, got {pool_mask.dtype} {tuple(pool_mask.shape)}"
    )
    if seqs is not None:
        assert seqs.dim() == 3 and seqs.shape[0] == B and seqs.dtype == torch.long, (
            f"expected long seqs (B={B}, G, S), got {seqs.dtype} {tuple(seqs.shape)}"
        )
        assert seq_mask.shape == seqs.shape[:2] and seq_mask.dtype == torch.bool, (
            f"expected a bool seq_mask {tuple(seqs.shape[:2])}, got {seq_mask.dtype} {tuple(seq_mask.shape)}"
        )


# ----------------------------------------------------------------------------------------------------------------------
# RL math: pure functions of (B, G) tensors; masked entries never influence valid ones and come out exactly 0


def _masked_mean(x: Tensor, mask: Tensor, dim=None) -> Tensor:
    n = mask.sum(dim) if dim is not None else mask.sum()
    return x.where(mask, 0.0).sum(dim) / n.clamp_min(1)


def reward_spread(rewards: Tensor, mask: Tensor) -> Tensor:
    """max - min of each group's valid rewards (B,); 0 for a group with no valid entry. 0 = no learning signal."""
    big = torch.finfo(rewards.dtype).max
    spread = rewards.where(mask, -big).amax(-1) - rewards.where(mask, big).amin(-1)
    return spread.where(mask.any(-1), 0.0)


def group_advantages(
    rewards: Tensor, mask: Tensor, scale: str = "group", rank: bool = False, eps: float = 1e-4
) -> Tensor:
    """GRPO advantages (B, G) from rewards (B, G) over each group's valid entries.

    scale="group": (r - group mean) / (group std + eps); "batch": divided by the std of all valid entries; "none":
    centred only. Std is the population std (ddof=0). rank=True replaces rewards by their within-group rank mapped
    evenly onto [-1, 1] (best +1, worst -1, ties share their mean rank); those are centred and bounded already, so
    `scale` does not apply. A group whose valid rewards are all equal gets exactly 0; masked entries are exactly 0.
    """
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    if rewards.shape != mask.shape or mask.dtype != torch.bool:
        raise ValueError(f"rewards {tuple(rewards.shape)} and bool mask {tuple(mask.shape)} must have the same shape")
    r = rewards.double().where(mask, 0.0)
    if not torch.isfinite(r).all():
        raise ValueError("rewards contain NaN or inf")
    flat = reward_spread(r, mask) == 0  # (B,) all-equal (or empty) groups
    if rank:
        pair = mask[:, None, :] & mask[:, :, None]  # (B, G, G) both valid
        less = ((r[:, None, :] < r[:, :, None]) & pair).sum(-1)  # (B, G) valid entries below each entry
        equal = ((r[:, None, :] == r[:, :, None]) & pair).sum(-1)  # (B, G) including itself
        n = mask.sum(-1, keepdim=True).to(r.dtype)  # (B, 1)
        mean_rank = less.to(r.dtype) + (equal.to(r.dtype) - 1) / 2  # (B, G) in 0..n-1
        adv = 2 * mean_rank / (n - 1).clamp_min(1) - 1
    else:
        mean = _masked_mean(r, mask, -1)[:, None]  # (B, 1)
        adv = r - mean
        if scale == "group":
            std = _masked_mean(adv**2, mask, -1).sqrt()[:, None]  # (B, 1)
            adv = adv / (std + eps)
        elif scale == "batch":
            adv = adv / (_masked_mean(adv**2, mask).sqrt() + eps)
    adv = adv.where(mask & ~flat[:, None], 0.0)
    return adv.to(rewards.dtype)


def ppo_clip_loss(
    logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, eps_low: float = 0.2, eps_high: float | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate over per-sequence log-probs (B, G); returns (loss, stats).

    loss = -mean_valid min(rho A, clip(rho, 1-eps_low, 1+eps_high) A), rho = exp(logp - old_logp).
    clip_frac_low/high: share of valid entries where the clip is active (rho < 1-eps_low with A < 0, or
    rho > 1+eps_high with A > 0), i.e. where the gradient is zeroed.
    """
    eps_high = eps_low if eps_high is None else eps_high
    if eps_low <= 0 or eps_high <= 0:
        raise ValueError(f"clip epsilons must be > 0, got eps_low={eps_low}, eps_high={eps_high}")
    # A log-ratio beyond +-20 is clipped anyway; bounding it keeps exp() finite, so inf * 0 never makes NaN.
    ratio = (logp - old_logp).where(mask, 0.0).clamp(-20.0, 20.0).exp()  # (B, G)
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    obj = torch.minimum(ratio * adv, clipped * adv)  # (B, G)
    loss = -_masked_mean(obj, mask)
    with torch.no_grad():
        stats = {
            "clip_frac_low": _masked_mean(((ratio < 1 - eps_low) & (adv < 0)).float(), mask),
            "clip_frac_high": _masked_mean(((ratio > 1 + eps_high) & (adv > 0)).float(), mask),
            "ratio_mean": _masked_mean(ratio, mask),
        }
    return loss, stats


def going_on_logp(steps: Steps, seqs: Tensor) -> Tensor:
    """Each sequence's log-prob of its picks given that it went on at each, (B, G): the sum over its picks of
    log p(pick) - log(1 - p(stop)), from `forward(..., with_dists=True)`'s steps on seqs (B, G, S). Where a selector
    that may stop is trained by PPO on this, its stop is left to `stop_loss`."""
    picks = steps.taken & (seqs >= 0)  # (B, G, S) a sequence's picks come first, -1 after its last
    going = steps.log_dist[..., :-1].logsumexp(-1)  # (B, G, S) log(1 - p(stop)), exact where p(stop) is near 1
    return (steps.logp - going).where(picks, 0.0).sum(-1)


def picks_given_going_on(log_dist: Tensor) -> Tensor:
    """A may-stop selector's log-distribution over its candidates given that it goes on: (..., K + 1) -> (..., K);
    -inf throughout where none is left."""
    return log_dist[..., :-1] - log_dist[..., :-1].logsumexp(-1, keepdim=True).clamp_min(-1e30)


def stop_loss(stop_logp: Tensor, gain: Tensor) -> Tensor:
    """Cross-entropy of the stop against whether stopping won, weighted by how much it won or lost by: stop_logp (P,)
    log p(stop) where a sequence was cut short, gain (P,) its reward minus going on's. For one stop probability p
    shared by all P, the loss is least at p = (sum of wins) / (sum of |gain|), so p >= 1/2 (where greedy decoding
    stops) exactly where stopping gains on average, however rare or large its wins. 0 where every gain is 0."""
    logp = stop_logp.double().clamp(max=-1e-9)  # (P,) log 1 would make the other side's log -inf
    ce = -torch.where(gain > 0, logp, torch.log(-torch.expm1(logp)))  # (P,)
    w = gain.double().abs()  # (P,)
    return (w * ce).sum() / w.sum().clamp_min(1e-12)


def exact_kl(logp_dist: Tensor, ref_logp_dist: Tensor, step_mask: Tensor) -> Tensor:
    """Sum over valid steps of KL(pi || pi_ref), exact over the K candidates: (B, G, S, K) x2, (B, G, S) -> (B, G).

    Entries where pi is 0 (chosen/padded, -inf) contribute 0; finite stand-ins keep -inf out of the arithmetic so
    gradients stay finite.
    """
    live = torch.isfinite(logp_dist)
    lp = logp_dist.masked_fill(~live, 0.0)
    lq = ref_logp_dist.masked_fill(~live, 0.0)
    per_step = (lp.exp() * (lp - lq)).where(live, 0.0).sum(-1)  # (B, G, S)
    return per_step.where(step_mask, 0.0).sum(-1)


def k3_kl(logp: Tensor, ref_logp: Tensor, mask: Tensor) -> Tensor:
    """The k3 estimator of KL(pi || pi_ref) at the sampled actions: mean_valid exp(r) - r - 1, r = ref_logp - logp."""
    r = (ref_logp - logp).where(mask, 0.0)
    return _masked_mean((torch.expm1(r) - r).clamp_min(0.0), mask)  # >= 0 exactly; clamp only removes rounding


Credit = Literal["mean", "best"]


def demo_credits(seqs: Tensor, seq_mask: Tensor, rewards: Tensor, pool_len: int, how: Credit) -> tuple[Tensor, Tensor]:
    """Each candidate's share of its group's rewards, for a retriever that scores demonstrations one by one: seqs (B,
    G, S) pool positions, seq_mask (B, G), rewards (B, G) -> credit (B, K) and seen (B, K), whether the candidate is in
    any valid sequence (credit 0 where not). how="mean": the mean reward of the sequences holding it, minus the group's
    mean reward; how="best": 1 for the demonstrations of the group's best sequence (the first on ties), 0 elsewhere."""
    B, G, S = seqs.shape
    member = F.one_hot(seqs.clamp_min(0), pool_len).amax(2).to(rewards.dtype) * seq_mask[..., None]  # (B, G, K)
    seen = member.sum(1) > 0  # (B, K)
    if how == "mean":
        centred = rewards - _masked_mean(rewards, seq_mask, -1)[:, None]  # (B, G)
        credit = torch.einsum("bg,bgk->bk", centred.where(seq_mask, 0.0), member) / member.sum(1).clamp_min(1)
    elif how == "best":
        best = rewards.masked_fill(~seq_mask, float("-inf")).argmax(-1)  # (B,)
        credit = member[torch.arange(B), best]  # (B, K)
    else:
        raise ValueError(f"credit must be 'mean' or 'best', got {how!r}")
    return credit.where(seen, 0.0), seen


def rce_weights(rewards: Tensor, mask: Tensor, temperature: float) -> Tensor:
    """Reward-weighted CE weights: softmax(reward / tau) over each group's valid entries (B, G); 0 when masked."""
    if temperature <= 0:
        raise ValueError(f"RCE temperature must be > 0, got {temperature}")
    logits = (rewards / temperature).masked_fill(~mask, float("-inf"))
    w = logits.softmax(-1)
    return w.nan_to_num(0.0)  # a group with no valid entry is all -inf -> NaN -> weights 0
