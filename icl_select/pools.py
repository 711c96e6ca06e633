"""Candidate pools and candidate ICD sequences, as pure torch functions of their inputs and an explicit generator.

Every query gets its own pool of K train rows, never holding the query nor another question on its image (such an ICD
would leak the answer). Samplers: random; image / text (the most similar first, RICES-style); mix (the K//2 most
image-similar, then the most text-similar not taken). Sequences are pool positions (0..K-1) in prompt order.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "SAMPLERS",
    "CHUNK_ELEMENTS",
    "exclusion_mask",
    "build_pools",
    "query_pools",
    "random_sequences",
    "first_distinct",
    "similarity_ranking",
    "pool_ranking",
    "pool_chunks",
    "candidate_groups",
    "mmr_order",
    "mmices_order",
    "coreset_order",
]

SAMPLERS: tuple[str, ...] = ("random", "image", "text", "mix")

# Queries x train rows per chunk of `query_pools`: its (C, N) float32 similarities or random keys (two matrices for
# "mix", 128 MiB each) bound the memory of pool building whatever Q and N are.
CHUNK_ELEMENTS = 2**25


def exclusion_mask(query_image_ids: Tensor, train_image_ids: Tensor, query_rows: Tensor) -> Tensor:
    """Which train rows may NOT enter each query's pool: its own row and every row sharing its image. query_image_ids
    (Q,), train_image_ids (N,), query_rows (Q,) its own train row or -1 -> (Q, N) bool, True = excluded."""
    same_image = query_image_ids[:, None] == train_image_ids[None, :]  # (Q, N)
    rows = torch.arange(train_image_ids.shape[0], device=train_image_ids.device)  # (N,)
    # -1 never equals a row index, so non-train queries exclude nothing by row.
    own_row = rows[None, :] == query_rows[:, None]  # (Q, N)
    return same_image | own_row


def _check_allowed(allowed: Tensor, pool_size: int) -> None:
    """Fail, naming the first short query, unless every query has at least pool_size allowed rows. allowed (Q,)."""
    if pool_size < 1:
        raise ValueError(f"pool_size must be >= 1, got {pool_size}")
    short = (allowed < pool_size).nonzero()
    if len(short):
        q = int(short[0])
        raise ValueError(
            f"query {q} has only {int(allowed[q])} allowed train rows, fewer than pool_size={pool_size} "
            f"({len(short)} queries are short)"
        )


def _select(
    sampler: str,
    pool_size: int,
    excluded: tuple[Tensor, Tensor],
    shape: tuple[int, int],
    generator: torch.Generator,
    image_sim: Tensor | None = None,
    text_sim: Tensor | None = None,
) -> Tensor:
    """The pools, given the excluded (query, train row) index pairs and the (Q, N) similarities, which it overwrites
    (excluded rows set to -inf in place): callers pass matrices of their own. Returns (Q, K) long."""
    if sampler == "random":
        # Uniform random keys with excluded rows at +inf: the K smallest keys are a uniform K-subset of the allowed
        # rows, and their key order is a uniform random order.
        keys = torch.rand(shape, generator=generator, device=generator.device)  # (Q, N)
        keys[excluded] = float("inf")
        return keys.topk(pool_size, dim=1, largest=False).indices  # (Q, K)
    first, second = (image_sim, text_sim) if sampler in ("image", "mix") else (text_sim, None)
    n_first = pool_size // 2 if sampler == "mix" else pool_size
    first[excluded] = float("-inf")
    top = first.topk(n_first, dim=1).indices  # (Q, K) or (Q, K//2), most similar first
    if second is None:
        return top
    # Mix: the rest by text, never a row already taken by image.
    second[excluded] = float("-inf")
    rest = second.scatter_(1, top, float("-inf")).topk(pool_size - n_first, dim=1).indices  # (Q, K - K//2)
    return torch.cat([top, rest], dim=1)  # (Q, K)


def build_pools(
    sampler: str,
    pool_size: int,
    exclude: Tensor,
    generator: torch.Generator,
    image_sim: Tensor | None = None,
    text_sim: Tensor | None = None,
) -> Tensor:
    """One pool of `pool_size` distinct allowed train rows per query: exclude (Q, N) bool from `exclusion_mask`,
    image_sim / text_sim (Q, N) for the samplers that use them -> (Q, K) train rows."""
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}; expected one of {SAMPLERS}")
    needs = {"random": (), "image": ("image_sim",), "text": ("text_sim",), "mix": ("image_sim", "text_sim")}[sampler]
    given = {"image_sim": image_sim, "text_sim": text_sim}
    for name in needs:
        if given[name] is None:
            raise ValueError(f"sampler {sampler!r} needs {name}, which was not given")
        if given[name].shape != exclude.shape:
            raise ValueError(f"{name} has shape {tuple(given[name].shape)}, expected {tuple(exclude.shape)}")
    _check_allowed((~exclude).sum(dim=1), pool_size)
    sims = {name: given[name].clone() if name in needs else None for name in given}  # _select writes into them
    return _select(sampler, pool_size, exclude.nonzero(as_tuple=True), exclude.shape, generator, **sims)


def query_pools(
    sampler: str,
    pool_size: int,
    emb: dict[str, Tensor],
    image_ids: dict[str, Tensor],
    split: str,
    queries: Tensor,
    query_rows: Tensor,
    generator: torch.Generator,
    chunk: int | None = None,
) -> Tensor:
    """One pool per query: rows `queries` of `split` -> (Q, K) train rows, from the "<split>_image" / "<split>_text" (N,
    d) views of `emb` and image_ids (split -> (N,)); query_rows: the queries' own train rows, or -1. Equal to one
    `build_pools` call on the whole (Q, N) matrices, generator state included, but built `chunk` queries at a time with
    no (Q, N) mask, so memory grows with the chunk, not with Q x N."""
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}; expected one of {SAMPLERS}")
    train_ids, query_ids = image_ids["train"], image_ids[split][queries]  # (N,), (Q,)
    num_train = train_ids.shape[0]
    by_image = train_ids.argsort(stable=True)  # (N,) train rows grouped by image id
    sorted_ids = train_ids[by_image]  # (N,)
    first = torch.searchsorted(sorted_ids, query_ids)  # (Q,) a query's image rows are by_image[first : first+count]
    count = torch.searchsorted(sorted_ids, query_ids, right=True) - first  # (Q,)
    own = query_rows >= 0  # (Q,)
    own_elsewhere = torch.zeros_like(own)
    own_elsewhere[own] = train_ids[query_rows[own]] != query_ids[own]  # own row not already excluded by its image
    _check_allowed(num_train - count - own_elsewhere.long(), pool_size)  # every query, before any work

    views = {"random": (), "image": ("image",), "text": ("text",), "mix": ("image", "text")}[sampler]
    if chunk is None:
        chunk = max(1, CHUNK_ELEMENTS // max(num_train, 1))
    # Near-equal chunks, so none is a sliver: BLAS multiplies matrices of 1-3 rows another way, and those
    # similarities can differ from the whole matrix's in the last bit (and flip a tie at the pool's edge).
    parts = torch.arange(queries.shape[0]).tensor_split(max(1, math.ceil(queries.shape[0] / chunk)))
    out = []
    for part in parts:
        n = count[part]  # (C,)
        # Every (query, row) pair on the query's image: query i of the chunk repeated n[i] times, next to the
        # n[i] rows from first[i] on.
        at = torch.arange(int(n.sum())) - (n.cumsum(0) - n).repeat_interleave(n)  # (P,) position within the image
        q_same = torch.arange(len(part)).repeat_interleave(n)  # (P,)
        rows_same = by_image[first[part].repeat_interleave(n) + at]  # (P,)
        q_own = own[part].nonzero()[:, 0]  # (O,)
        excluded = (torch.cat([q_same, q_own]), torch.cat([rows_same, query_rows[part][q_own]]))
        sims = {f"{v}_sim": emb[f"{split}_{v}"][queries[part]] @ emb[f"train_{v}"].T for v in views}  # (C, N) each
        out.append(_select(sampler, pool_size, excluded, (len(part), num_train), generator, **sims))  # (C, K)
    return torch.cat(out)  # (Q, K)


def random_sequences(pool_mask: Tensor, group_size: int, seq_len: int, generator: torch.Generator) -> Tensor:
    """`group_size` pairwise-distinct sequences of `seq_len` distinct valid positions per query, each uniform over
    ordered S-subsets: pool_mask (Q, K) bool -> (Q, G, S) positions. Only duplicated rows are redrawn."""
    num_queries, pool_len = pool_mask.shape
    if seq_len < 1 or group_size < 1:
        raise ValueError(f"group_size and seq_len must be >= 1, got {group_size} and {seq_len}")
    if num_queries:
        # perm(n, S) grows with n, so the query with the fewest valid candidates is the binding one.
        valid = pool_mask.sum(dim=1)  # (Q,)
        q_min = int(valid.argmin())
        n_min = int(valid[q_min])
        if n_min < seq_len:
            raise ValueError(f"query {q_min} has only {n_min} valid pool candidates, fewer than seq_len={seq_len}")
        if math.perm(n_min, seq_len) < group_size:
            raise ValueError(
                f"query {q_min} has {n_min} valid pool candidates: only {math.perm(n_min, seq_len)} distinct "
                f"sequences of length {seq_len}, fewer than group_size={group_size}"
            )

    def draw(rows: Tensor) -> Tensor:
        # Random keys with invalid positions at +inf: the S smallest keys, in key order, are a uniform ordered
        # S-subset of the valid positions.
        keys = torch.rand(rows.shape[0], pool_len, generator=generator, device=pool_mask.device)  # (R, K)
        keys = keys.masked_fill(~pool_mask[rows], float("inf"))  # (R, K)
        return keys.topk(seq_len, dim=1, largest=False).indices  # (R, S)

    flat_query = torch.arange(num_queries, device=pool_mask.device).repeat_interleave(group_size)  # (Q*G,)
    seqs = draw(flat_query).view(num_queries, group_size, seq_len)  # (Q, G, S)
    while True:
        # A sequence is redrawn when it repeats an earlier one of its group; the first copy is kept. Redrawing
        # only the repeats until none is left samples the group uniformly without replacement.
        dup = _repeats(seqs)  # (Q, G)
        if not dup.any():
            return seqs
        q_idx, g_idx = dup.nonzero(as_tuple=True)
        seqs[q_idx, g_idx] = draw(q_idx)


def _repeats(seqs: Tensor) -> Tensor:
    """Which sequences equal an earlier one of their group: (Q, M, S) -> (Q, M) bool."""
    num_samples = seqs.shape[1]
    same = (seqs[:, :, None, :] == seqs[:, None, :, :]).all(dim=-1)  # (Q, M, M)
    earlier = torch.ones(num_samples, num_samples, dtype=torch.bool, device=seqs.device).tril(-1)  # (M, M)
    return (same & earlier).any(dim=-1)  # (Q, M)


def first_distinct(seqs: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """The first `count` pairwise-distinct sequences of each group, in sample order: seqs (Q, M, S) -> order (Q,
    count) indices into M, ok (Q, count) bool; a group short of distinct ones gets ok = False on indices that point
    at repeats."""
    num_samples = seqs.shape[1]
    if count > num_samples:
        raise ValueError(f"cannot pick {count} distinct sequences out of {num_samples} samples")
    repeat = _repeats(seqs)  # (Q, M)
    # A stable sort on the repeat flag lists first occurrences in sample order, then the repeats.
    order = repeat.long().argsort(dim=1, stable=True)[:, :count]  # (Q, count)
    return order, ~repeat.gather(1, order)


def similarity_ranking(query_emb: Tensor, pool_emb: Tensor, pool_mask: Tensor) -> Tensor:
    """Pool positions by cosine to the query, most similar first, invalid last: (Q, d), (Q, K, d), (Q, K) -> (Q, K)."""
    cos = torch.einsum("qd,qkd->qk", F.normalize(query_emb, dim=-1), F.normalize(pool_emb, dim=-1))  # (Q, K)
    cos = cos.masked_fill(~pool_mask, float("-inf"))  # (Q, K)
    return cos.argsort(dim=1, descending=True, stable=True)  # (Q, K)


def pool_chunks(num_queries: int, pool_size: int, dim: int) -> tuple[Tensor, ...]:
    """Query indices in near-equal chunks whose (chunk, K, d) pool embeddings hold at most CHUNK_ELEMENTS floats:
    whatever gathers a pool's embeddings does it a chunk at a time, never for all Q queries at once."""
    n = max(1, min(num_queries, math.ceil(num_queries * pool_size * dim / CHUNK_ELEMENTS)))  # none empty
    return torch.arange(num_queries).tensor_split(n)


def pool_ranking(query_emb: Tensor, train_emb: Tensor, pool: Tensor) -> Tensor:
    """`similarity_ranking` of each query's pool (Q, K) of train rows (-1 = padding) -> (Q, K) pool positions, most
    similar first; computed by `pool_chunks`, each row as in one whole (Q, K, d) call."""
    parts = pool_chunks(*pool.shape, train_emb.shape[1])
    return torch.cat([similarity_ranking(query_emb[c], train_emb[pool[c].clamp_min(0)], pool[c] >= 0) for c in parts])


def candidate_groups(
    ranking: Tensor,
    group_size: int,
    seq_len: int,
    generator: torch.Generator,
    prefix: Tensor | None = None,
    prefix_sources: list[str] | None = None,
    min_len: int | None = None,
) -> tuple[Tensor, list[list[str]]]:
    """The G distinct sequences scored per anchor query, with their sources: `prefix` (Q, C, S) first (a trained
    selector's picks), then one retrieval sequence (the S most similar, most similar last), then random ones; duplicates
    dropped. ranking (Q, K) from `pool_ranking` -> (Q, G, S) pool positions. With min_len < seq_len the random ones are
    cut to lengths drawn uniformly from max(min_len, 1)..seq_len (-1 after the last), and min_len 0 adds the empty
    sequence (the zero-shot prompt) after the retrieval one."""
    mask = torch.ones(ranking.shape, dtype=torch.bool)
    parts = [] if prefix is None else [prefix]
    sources = list(prefix_sources or [])
    parts.append(ranking[:, None, :seq_len].flip(-1))
    sources.append("retrieval")
    if min_len is None or min_len == seq_len:
        parts.append(random_sequences(mask, group_size, seq_len, generator))
    else:  # twice as many, since cut ones may coincide
        if min_len == 0:
            parts.append(torch.full_like(parts[-1], -1))
            sources.append("zero-shot")
        rand = random_sequences(mask, 2 * group_size, seq_len, generator)  # (Q, 2G, S)
        lengths = torch.randint(max(min_len, 1), seq_len + 1, rand.shape[:2], generator=generator)  # (Q, 2G)
        parts.append(rand.masked_fill(torch.arange(seq_len) >= lengths[..., None], -1))
    sources += ["random"] * parts[-1].shape[1]
    cand = torch.cat(parts, 1)  # (Q, C, S)
    order, ok = first_distinct(cand, group_size)  # (Q, G)
    if not ok.all():
        raise ValueError(f"could not find {group_size} distinct sequences for every anchor; lower the group size")
    return cand.gather(1, order[..., None].expand(-1, -1, seq_len)), [
        [sources[c] for c in row] for row in order.tolist()
    ]


# ----------------------------------------------------------------------------------------------------------------------
# Training-free rivals (evaluate.py --baseline): each returns pool positions in pick order, the most relevant first, a
# chunk of queries at a time (`pool_chunks`); evaluate.py puts the first pick next to the query, as RICES does.


def _chunked(fn, query_emb: Tensor, train_emb: Tensor, pool: Tensor, *rest) -> Tensor:
    """fn(query (C, d), candidates (C, K, d), valid (C, K), *rest) over `pool_chunks` of the queries, concatenated."""
    parts = pool_chunks(*pool.shape, train_emb.shape[1])
    return torch.cat([fn(query_emb[c], train_emb[pool[c].clamp_min(0)], pool[c] >= 0, *rest) for c in parts])


def mmr_order(query_emb: Tensor, train_emb: Tensor, pool: Tensor, k: int, lam: float) -> Tensor:
    """Maximal marginal relevance: each pick maximises lam * cos(query, c) - (1 - lam) * max over picked p of cos(c, p).
    (Q, d), (N, d), pool (Q, K) train rows -> (Q, k) pool positions; ties go to the more query-similar candidate, so
    lam = 1 is the similarity ranking itself."""
    if not 0 <= lam <= 1:
        raise ValueError(f"MMR lambda must be in [0, 1], got {lam}")

    def pick(query: Tensor, cands: Tensor, valid: Tensor) -> Tensor:
        ranking = similarity_ranking(query, cands, valid)  # (C, K) candidates by relevance: argmax keeps that order
        cands, valid = cands.gather(1, ranking[..., None].expand_as(cands)), valid.gather(1, ranking)
        c = F.normalize(cands, dim=-1)  # (C, K, d)
        rel = torch.einsum("cd,ckd->ck", F.normalize(query, dim=-1), c)  # (C, K)
        sim = torch.einsum("ckd,cjd->ckj", c, c)  # (C, K, K)
        avail, red, out = valid.clone(), torch.full_like(rel, -1.0), []
        rows = torch.arange(len(rel))
        for t in range(k):
            score = lam * rel - (1 - lam) * red if t else rel  # nothing picked yet: relevance alone
            choice = score.masked_fill(~avail, float("-inf")).argmax(1)  # (C,)
            out.append(ranking[rows, choice])
            avail[rows, choice] = False
            red = torch.maximum(red, sim[rows, choice])  # (C, K) each candidate's closest pick so far
        return torch.stack(out, 1)  # (C, k)

    return _chunked(pick, query_emb, train_emb, pool)


def mmices_order(
    image_q: Tensor, image_train: Tensor, text_q: Tensor, text_train: Tensor, pool: Tensor, k: int, prefilter: int
) -> Tensor:
    """MMICES: the `prefilter` most image-similar candidates of each pool, reranked by question (text) similarity;
    the first k. Image and text views (Q, d) / (N, d), pool (Q, K) -> (Q, k) pool positions. A prefilter as large as
    the pool is the text-similarity ranking."""
    if prefilter < k:
        raise ValueError(f"the MMICES prefilter ({prefilter}) must hold at least the {k} demonstrations asked for")
    by_image = pool_ranking(image_q, image_train, pool)[:, :prefilter]  # (Q, P)
    kept = torch.zeros(pool.shape, dtype=torch.bool).scatter_(1, by_image, True) & (pool >= 0)  # (Q, K)
    return pool_ranking(text_q, text_train, pool.masked_fill(~kept, -1))[:, :k]


def coreset_order(query_emb: Tensor, train_emb: Tensor, pool: Tensor, k: int, iters: int = 10) -> Tensor:
    """A diverse, relevant set in the spirit of CoDR: the pool in k clusters (spherical k-means, `iters` rounds, seeded
    deterministically by farthest points from the most query-similar candidate), and from each cluster its most
    query-similar member; picks ordered by similarity to the query. (Q, d), (N, d), pool (Q, K) -> (Q, k)."""

    def pick(query: Tensor, cands: Tensor, valid: Tensor) -> Tensor:
        c = F.normalize(cands, dim=-1)  # (C, K, d)
        rel = torch.einsum("cd,ckd->ck", F.normalize(query, dim=-1), c).masked_fill(~valid, float("-inf"))  # (C, K)
        rows = torch.arange(len(rel))
        seeds = [rel.argmax(1)]  # (C,) each
        near = torch.einsum("ckd,cd->ck", c, c[rows, seeds[0]])  # (C, K) cosine to the closest seed so far
        for _ in range(1, k):
            far = near.masked_fill(~valid, float("inf")).argmin(1)  # the candidate farthest from every seed
            seeds.append(far)
            near = torch.maximum(near, torch.einsum("ckd,cd->ck", c, c[rows, far]))
        centres = c[rows[:, None], torch.stack(seeds, 1)]  # (C, k, d)
        for _ in range(iters):
            member = torch.einsum("ckd,cjd->ckj", c, centres).argmax(-1)  # (C, K) nearest centre
            onehot = F.one_hot(member, k).to(c.dtype) * valid[..., None]  # (C, K, k)
            sums = torch.einsum("ckj,ckd->cjd", onehot, c)  # (C, k, d)
            empty = onehot.sum(1) == 0  # (C, k) a centre no candidate chose keeps its place
            centres = torch.where(empty[..., None], centres, F.normalize(sums, dim=-1))
        member = torch.einsum("ckd,cjd->ckj", c, centres).argmax(-1)  # (C, K)
        # each cluster's most relevant member, then the clusters by that relevance (an empty cluster: the next best)
        best = rel[:, :, None].masked_fill(member[..., None] != torch.arange(k), float("-inf")).argmax(1)  # (C, k)
        filled = rel.gather(1, best) > float("-inf")  # (C, k)
        taken = torch.zeros_like(valid).scatter_(1, best.where(filled, 0), filled)
        spare = rel.masked_fill(taken, float("-inf")).argsort(dim=1, descending=True, stable=True)  # (C, K)
        best = best.where(filled, spare[:, :k].gather(1, ((~filled).long().cumsum(1) - 1).clamp_min(0)))
        return best.gather(1, rel.gather(1, best).argsort(dim=1, descending=True, stable=True))  # (C, k)

    return _chunked(pick, query_emb, train_emb, pool)
