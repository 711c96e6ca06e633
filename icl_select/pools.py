"""Candidate pools and candidate ICD sequences, as pure torch functions.

Every query (a `val` question at evaluation, a `train` anchor during data generation) gets its own pool of K
train rows to pick demonstrations from. A pool never holds the query itself nor any other question on the same
image: an ICD showing the query's own image would leak its answer. Sequences are positions into the pool (0..K-1),
in prompt order.

Samplers (`build_pools`):
- "random": K uniformly random allowed rows, in random order;
- "image" / "text": the K allowed rows most similar to the query by the image / text similarity matrix, most similar
  first (RICES-style);
- "mix": the K//2 most image-similar rows, then the most text-similar rows not taken yet.

Candidate sequences: `random_sequences` draws G distinct random ones per query, `first_distinct` keeps the first G
distinct ones of a larger sample (e.g. from a policy), `similarity_ranking` orders a pool by cosine to the query.

Everything random is drawn from an explicit `torch.Generator`, so a pool or a sequence set is a pure function of
its inputs and the generator state.
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
]

SAMPLERS: tuple[str, ...] = ("random", "image", "text", "mix")

# Queries x train rows per chunk of `query_pools`: its (C, N) float32 similarities or random keys (two matrices for
# "mix", 128 MiB each) bound the memory of pool building whatever Q and N are.
CHUNK_ELEMENTS = 2**25


def exclusion_mask(query_image_ids: Tensor, train_image_ids: Tensor, query_rows: Tensor) -> Tensor:
    """Which train rows may NOT enter each query's pool: its own row and every row sharing its image.

    query_image_ids (Q,) long, train_image_ids (N,) long, query_rows (Q,) long: the query's own train row, or -1
    when the query is not a train item (e.g. a val question). Returns (Q, N) bool, True = excluded.
    """
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
    """Build one pool of `pool_size` distinct allowed train rows per query.

    exclude (Q, N) bool from `exclusion_mask`; image_sim / text_sim (Q, N) similarities, needed by the samplers
    that use them. Returns (Q, K) long train-row ids. `generator` is only consumed by the "random" sampler.
    """
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
    """One pool per query: rows `queries` of `split` -> (Q, K) train rows, as `build_pools` builds them from
    `exclusion_mask` and the similarities of the views the sampler uses.

    emb: "<split>_image" / "<split>_text" (N, d) views, read only by the samplers that use them; image_ids: split ->
    (N,) image id per row; query_rows: the queries' own train rows, or -1 (see `exclusion_mask`).

    Built `chunk` queries at a time (default: CHUNK_ELEMENTS // N), so memory grows with the chunk, not with Q x N,
    and without any (Q, N) mask: the excluded rows are looked up among the train rows sorted by image. A query's pool
    depends only on its own row of the matrices, and a chunk's random keys are the next rows of the same generator
    stream, so the pools (and the generator's state afterwards) equal one `build_pools` call on the whole (Q, N)
    matrices, whatever the chunk.
    """
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
    """Draw `group_size` pairwise-distinct random sequences of `seq_len` distinct valid pool positions per query.

    pool_mask (Q, K) bool, True = a valid candidate. Returns (Q, G, S) long positions into the pool. Each sequence
    is uniform over ordered S-subsets of the valid positions; duplicates within a group are redrawn (only the
    duplicated rows, all queries at once) until the group is distinct.
    """
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
    """Pick the first `count` pairwise-distinct sequences of each group, in sample order (e.g. of 2G policy samples).

    seqs (Q, M, S) long. Returns order (Q, count) long indices into M and ok (Q, count) bool. A group with fewer
    than `count` distinct sequences gets ok = False on its last entries, whose indices then point at repeats (safe
    to gather, to be masked).
    """
    num_samples = seqs.shape[1]
    if count > num_samples:
        raise ValueError(f"cannot pick {count} distinct sequences out of {num_samples} samples")
    repeat = _repeats(seqs)  # (Q, M)
    # A stable sort on the repeat flag lists first occurrences in sample order, then the repeats.
    order = repeat.long().argsort(dim=1, stable=True)[:, :count]  # (Q, count)
    return order, ~repeat.gather(1, order)


def similarity_ranking(query_emb: Tensor, pool_emb: Tensor, pool_mask: Tensor) -> Tensor:
    """Rank each pool by cosine similarity to its query, most similar first, invalid positions last.

    query_emb (Q, d), pool_emb (Q, K, d), pool_mask (Q, K) bool. Returns (Q, K) long pool positions.
    """
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
) -> tuple[Tensor, list[list[str]]]:
    """The G distinct sequences scored per anchor query, in priority order, with their sources.

    ranking (Q, K): each full pool's positions, most similar to the query first (`pool_ranking`); `prefix` (Q, C, S)
    are sequences that come first (e.g. a trained selector's picks). Then one similarity-retrieval sequence (the S
    most similar, most similar last, next to the query), then random sequences; duplicates are dropped and the first
    G kept. Returns (Q, G, S) pool positions and per query the source of each sequence.
    """
    mask = torch.ones(ranking.shape, dtype=torch.bool)
    parts = [] if prefix is None else [prefix]
    sources = list(prefix_sources or [])
    parts += [ranking[:, None, :seq_len].flip(-1), random_sequences(mask, group_size, seq_len, generator)]
    sources += ["retrieval"] + ["random"] * group_size
    cand = torch.cat(parts, 1)  # (Q, C, S)
    order, ok = first_distinct(cand, group_size)  # (Q, G)
    if not ok.all():
        raise ValueError(f"could not find {group_size} distinct sequences for every anchor; lower the group size")
    return cand.gather(1, order[..., None].expand(-1, -1, seq_len)), [
        [sources[c] for c in row] for row in order.tolist()
    ]
