"""Property tests for pools.py: exclusion, pool samplers, chunked pool building, random candidate sequences,
similarity ranking.

All randomness comes from hypothesis-drawn seeds turned into torch.Generators, so failures replay.
"""

from __future__ import annotations

import math
from unittest.mock import patch

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import rng, seeds

from icl_select import pools


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _setup(seed: int, num_train: int, num_images: int, num_queries: int):
    """Train image ids with repeated images; queries: about half train anchors (own row), the rest outside (-1)."""
    g = _gen(seed)
    train_img = torch.randint(num_images, (num_train,), generator=g)  # (N,)
    rows = torch.randint(num_train, (num_queries,), generator=g)  # (Q,)
    is_anchor = torch.rand(num_queries, generator=g) < 0.5  # (Q,)
    # Outside queries may still share an image with train rows (exercises exclusion by image alone).
    outside_img = torch.randint(num_images + 3, (num_queries,), generator=g)  # (Q,)
    # Some anchors carry an image id that differs from their row's, so the own-row rule is tested on its own.
    own_image = is_anchor & (torch.rand(num_queries, generator=g) < 0.7)  # (Q,)
    query_img = torch.where(own_image, train_img[rows], outside_img)  # (Q,)
    query_rows = torch.where(is_anchor, rows, torch.full_like(rows, -1))  # (Q,)
    return query_img, train_img, query_rows, g


@given(seed=seeds, num_train=st.integers(1, 40), num_images=st.integers(1, 15), num_queries=st.integers(1, 8))
def test_exclusion_mask_matches_definition(seed, num_train, num_images, num_queries):
    query_img, train_img, query_rows, _ = _setup(seed, num_train, num_images, num_queries)
    mask = pools.exclusion_mask(query_img, train_img, query_rows)
    assert mask.shape == (num_queries, num_train) and mask.dtype == torch.bool
    for q in range(num_queries):
        for j in range(num_train):
            expected = bool(train_img[j] == query_img[q]) or int(query_rows[q]) == j
            assert bool(mask[q, j]) == expected, (q, j)


@given(
    seed=seeds,
    sampler=st.sampled_from(pools.SAMPLERS),
    num_train=st.integers(8, 60),
    num_images=st.integers(4, 30),
    num_queries=st.integers(1, 6),
    pool_size=st.integers(1, 8),
)
def test_build_pools_distinct_sized_allowed(seed, sampler, num_train, num_images, num_queries, pool_size):
    query_img, train_img, query_rows, g = _setup(seed, num_train, num_images, num_queries)
    exclude = pools.exclusion_mask(query_img, train_img, query_rows)
    if int((~exclude).sum(1).min()) < pool_size:
        with pytest.raises(ValueError):
            pools.build_pools(sampler, pool_size, exclude, g, *torch.rand(2, *exclude.shape, generator=g))
        return
    image_sim = torch.rand(exclude.shape, generator=g)
    text_sim = torch.rand(exclude.shape, generator=g)
    pool = pools.build_pools(sampler, pool_size, exclude, g, image_sim, text_sim)
    assert pool.shape == (num_queries, pool_size) and pool.dtype == torch.long
    for q in range(num_queries):
        ids = pool[q].tolist()
        assert len(set(ids)) == pool_size, "pool has repeated rows"
        assert all(0 <= j < num_train for j in ids)
        # Never the query's own row nor a question on the same image.
        assert not exclude[q, pool[q]].any()
        assert int(query_rows[q]) not in ids
        assert not (train_img[pool[q]] == query_img[q]).any()


@given(seed=seeds, num_train=st.integers(10, 50), num_queries=st.integers(1, 5), pool_size=st.integers(1, 9))
def test_similarity_samplers_return_true_top_k(seed, num_train, num_queries, pool_size):
    query_img, train_img, query_rows, g = _setup(seed, num_train, num_train, num_queries)
    exclude = pools.exclusion_mask(query_img, train_img, query_rows)
    if int((~exclude).sum(1).min()) < pool_size:
        return
    # Continuous random similarities: ties have probability 0, so the top-K is unique.
    image_sim, text_sim = torch.randn(2, *exclude.shape, generator=g)
    img_pool = pools.build_pools("image", pool_size, exclude, g, image_sim=image_sim)
    txt_pool = pools.build_pools("text", pool_size, exclude, g, text_sim=text_sim)
    mix_pool = pools.build_pools("mix", pool_size, exclude, g, image_sim=image_sim, text_sim=text_sim)
    for q in range(num_queries):
        allowed = (~exclude[q]).nonzero().flatten().tolist()
        by_image = sorted(allowed, key=lambda j: -float(image_sim[q, j]))
        by_text = sorted(allowed, key=lambda j: -float(text_sim[q, j]))
        assert img_pool[q].tolist() == by_image[:pool_size]
        assert txt_pool[q].tolist() == by_text[:pool_size]
        half = by_image[: pool_size // 2]
        assert mix_pool[q].tolist() == half + [j for j in by_text if j not in half][: pool_size - len(half)]


@given(seed=seeds, pool_size=st.integers(1, 10))
def test_random_pools_deterministic_by_generator(seed, pool_size):
    query_img, train_img, query_rows, _ = _setup(seed, 30, 12, 4)
    exclude = pools.exclusion_mask(query_img, train_img, query_rows)
    if int((~exclude).sum(1).min()) < pool_size:
        return
    a = pools.build_pools("random", pool_size, exclude, _gen(seed + 1))
    assert torch.equal(a, pools.build_pools("random", pool_size, exclude, _gen(seed + 1)))


@given(seed=seeds)
def test_random_pool_covers_all_allowed_rows(seed):
    # Over many draws from one generator every allowed row shows up and no excluded one does: the sampler is
    # random (not a fixed prefix of the allowed rows) and honours the exclusion. A row is missed by 200 draws of 3
    # out of 10 with probability 0.7**200, i.e. never.
    exclude = torch.zeros(200, 12, dtype=torch.bool)  # 200 queries with the same allowed rows
    exclude[:, [0, 5]] = True
    seen = torch.zeros(12, dtype=torch.bool)
    seen[pools.build_pools("random", 3, exclude, _gen(seed)).flatten()] = True
    assert seen.tolist() == [j not in (0, 5) for j in range(12)]


@given(seed=seeds, num_allowed=st.integers(0, 6), pool_size=st.integers(1, 8))
def test_build_pools_error_names_first_short_query(seed, num_allowed, pool_size):
    g = _gen(seed)
    exclude = torch.zeros(4, 10, dtype=torch.bool)
    bad = int(torch.randint(4, (1,), generator=g))
    exclude[bad, num_allowed:] = True  # query `bad` keeps only num_allowed rows
    if num_allowed >= pool_size:
        assert pools.build_pools("random", pool_size, exclude, g).shape == (4, pool_size)
        return
    with pytest.raises(ValueError, match=rf"\bquery {bad}\b.*\b{num_allowed}\b.*\bpool_size={pool_size}\b"):
        pools.build_pools("random", pool_size, exclude, g)


def test_build_pools_rejects_unknown_sampler_and_missing_similarity():
    exclude = torch.zeros(2, 10, dtype=torch.bool)
    g = _gen(0)
    with pytest.raises(ValueError, match=r"'clip'.*'random'"):
        pools.build_pools("clip", 3, exclude, g)
    with pytest.raises(ValueError, match=r"'image'.*\bimage_sim\b"):
        pools.build_pools("image", 3, exclude, g)
    with pytest.raises(ValueError, match=r"'text'.*\btext_sim\b"):
        pools.build_pools("text", 3, exclude, g)
    with pytest.raises(ValueError, match=r"'mix'.*\btext_sim\b"):
        pools.build_pools("mix", 3, exclude, g, image_sim=torch.rand(2, 10))


@given(
    seed=seeds,
    num_queries=st.integers(1, 6),
    pool_len=st.integers(4, 12),
    group_size=st.integers(1, 12),
    seq_len=st.integers(1, 4),
)
@settings(deadline=None)
def test_random_sequences_distinct_valid(seed, num_queries, pool_len, group_size, seq_len):
    g = _gen(seed)
    mask = torch.rand(num_queries, pool_len, generator=g) < 0.8
    mask[:, :seq_len] = True  # enough valid candidates for one sequence
    num_valid = int(mask.sum(1).min())
    if math.perm(num_valid, seq_len) < group_size:
        with pytest.raises(ValueError):
            pools.random_sequences(mask, group_size, seq_len, g)
        return
    seqs = pools.random_sequences(mask, group_size, seq_len, _gen(seed))
    assert seqs.shape == (num_queries, group_size, seq_len) and seqs.dtype == torch.long
    assert torch.equal(seqs, pools.random_sequences(mask, group_size, seq_len, _gen(seed)))
    for q in range(num_queries):
        group = [tuple(s) for s in seqs[q].tolist()]
        assert len(set(group)) == group_size, "repeated sequence within a group"
        for s in group:
            assert len(set(s)) == seq_len, "repeated position within a sequence"
            assert all(mask[q, p] for p in s), "invalid position"


@given(seed=seeds, num_valid=st.integers(2, 4))
def test_random_sequences_exhaust_small_space(seed, num_valid):
    # Exactly as many sequences as exist: resampling must find all of them (a hard case for rejection).
    mask = torch.zeros(3, 6, dtype=torch.bool)
    mask[:, :num_valid] = True
    total = math.perm(num_valid, 2)
    seqs = pools.random_sequences(mask, total, 2, _gen(seed))
    for q in range(3):
        assert sorted(map(tuple, seqs[q].tolist())) == sorted(
            (a, b) for a in range(num_valid) for b in range(num_valid) if a != b
        )


def test_random_sequences_errors_name_the_query():
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1, 2:] = False  # query 1 has 2 valid candidates
    with pytest.raises(ValueError, match=r"\bquery 1\b.*\b2\b.*\bseq_len=3\b"):
        pools.random_sequences(mask, 1, 3, _gen(0))
    with pytest.raises(ValueError, match=r"\bquery 1\b.*\b2\b.*\bgroup_size=3\b"):
        pools.random_sequences(mask, 3, 2, _gen(0))


@given(
    seed=seeds,
    num_queries=st.integers(1, 5),
    num_samples=st.integers(1, 10),
    seq_len=st.integers(1, 3),
    vocab=st.integers(1, 4),
    data=st.data(),
)
def test_first_distinct_keeps_first_occurrences_in_order(seed, num_queries, num_samples, seq_len, vocab, data):
    count = data.draw(st.integers(1, num_samples))
    # A tiny vocabulary makes repeated samples common.
    seqs = torch.randint(vocab, (num_queries, num_samples, seq_len), generator=_gen(seed))
    order, ok = pools.first_distinct(seqs, count)
    assert order.shape == ok.shape == (num_queries, count)
    for q in range(num_queries):
        rows = [tuple(r) for r in seqs[q].tolist()]
        firsts = [i for i, r in enumerate(rows) if r not in rows[:i]][:count]
        assert order[q, : len(firsts)].tolist() == firsts
        assert ok[q].tolist() == [True] * len(firsts) + [False] * (count - len(firsts))
        for i in order[q, len(firsts) :].tolist():  # padding entries point at repeats
            assert rows[i] in rows[:i]
    with pytest.raises(ValueError):
        pools.first_distinct(seqs, num_samples + 1)


@given(seed=seeds, num_queries=st.integers(1, 5), pool_len=st.integers(1, 10), dim=st.integers(2, 8))
def test_similarity_ranking_sorted_by_cosine_padded_last(seed, num_queries, pool_len, dim):
    g = _gen(seed)
    query = torch.randn(num_queries, dim, generator=g)
    pool = torch.randn(num_queries, pool_len, dim, generator=g) * torch.rand(num_queries, pool_len, 1, generator=g)
    mask = torch.rand(num_queries, pool_len, generator=g) < 0.7
    ranking = pools.similarity_ranking(query, pool, mask)
    assert ranking.shape == (num_queries, pool_len)
    cos = torch.nn.functional.cosine_similarity(query[:, None], pool, dim=-1)
    for q in range(num_queries):
        order = ranking[q].tolist()
        assert sorted(order) == list(range(pool_len))
        n_valid = int(mask[q].sum())
        assert all(mask[q, p] for p in order[:n_valid]) and not any(mask[q, p] for p in order[n_valid:])
        values = [float(cos[q, p]) for p in order[:n_valid]]
        assert all(a >= b - 1e-6 for a, b in zip(values, values[1:]))
        # Scale-invariant: the ranking is by cosine, not by dot product.
        assert (
            ranking[q].tolist()
            == pools.similarity_ranking(query[q : q + 1] * 3.0, pool[q : q + 1], mask[q : q + 1])[0].tolist()
        )


@given(seed=st.integers(0, 2**31), sampler=st.sampled_from(pools.SAMPLERS))
def test_query_pools_is_build_pools_with_the_views_it_needs(seed, sampler):
    g = _gen(seed)
    n_train, n_val, d = 60, 7, 8
    emb = {
        f"{s}_{v}": F.normalize(torch.randn(n, d, generator=g), dim=-1)
        for s, n in (("train", n_train), ("val", n_val))
        for v in ("image", "text")
    }
    image_ids = {"train": torch.randint(30, (n_train,), generator=g), "val": torch.randint(30, 40, (n_val,))}
    queries = torch.arange(n_val)
    got = pools.query_pools(sampler, 10, emb, image_ids, "val", queries, torch.full((n_val,), -1), _gen(seed + 1))
    exclude = pools.exclusion_mask(image_ids["val"], image_ids["train"], torch.full((n_val,), -1))
    sims = {f"{v}_sim": emb[f"val_{v}"] @ emb[f"train_{v}"].T for v in ("image", "text")}
    assert torch.equal(got, pools.build_pools(sampler, 10, exclude, _gen(seed + 1), **sims))


def _whole_matrix_pools(sampler, pool_size, emb, image_ids, split, queries, query_rows, g):
    """Pools from the whole (Q, N) matrices at once: the reference chunked `query_pools` must equal. Short queries
    raise a ValueError whose message is the pattern `query_pools`'s error must match."""
    train_img = image_ids["train"]
    n_train = len(train_img)
    exclude = (image_ids[split][queries][:, None] == train_img[None, :]) | (
        torch.arange(n_train)[None, :] == query_rows[:, None]
    )  # (Q, N)
    allowed = (~exclude).sum(1)  # (Q,)
    if short := (allowed < pool_size).nonzero()[:, 0].tolist():
        q, n = short[0], int(allowed[short[0]])
        raise ValueError(rf"\bquery {q}\b.*\b{n}\b.*\bpool_size={pool_size}\b.*\b{len(short)}\b")
    if sampler == "random":
        keys = torch.rand(exclude.shape, generator=g).masked_fill(exclude, float("inf"))
        return keys.topk(pool_size, dim=1, largest=False).indices
    sim = {
        v: (emb[f"{split}_{v}"][queries] @ emb[f"train_{v}"].T).masked_fill(exclude, -math.inf)
        for v in ("image", "text")
    }
    if sampler != "mix":
        return sim[sampler].topk(pool_size, dim=1).indices
    half = sim["image"].topk(pool_size // 2, dim=1).indices
    rest = sim["text"].scatter(1, half, -math.inf).topk(pool_size - pool_size // 2, dim=1).indices
    return torch.cat([half, rest], 1)


@given(
    seed=seeds,
    split=st.sampled_from(["train", "val"]),
    num_train=st.integers(8, 40),
    num_images=st.integers(1, 12),
    num_queries=st.integers(0, 12),
    pool_size=st.integers(1, 8),
    chunk=st.integers(4, 14),
)
def test_chunked_query_pools_equal_whole_matrix_pools(
    seed, split, num_train, num_images, num_queries, pool_size, chunk
):
    # Embeddings with entries in {-1, 0, 1}: similarities are exact small integers, equal however the product is
    # blocked, and ties are common, so tie-breaking must not depend on the chunk either.
    g = _gen(seed)
    n = {"train": num_train, "val": 9}
    emb = {f"{s}_{v}": torch.randint(-1, 2, (n[s], 3), generator=g).float() for s in n for v in ("image", "text")}
    # Val images partly shared with train images, so exclusion by image applies to val queries too.
    image_ids = {s: torch.randint(num_images, (n[s],), generator=g) for s in n}
    queries = torch.randint(n[split], (num_queries,), generator=g)  # repeats allowed (online draws repeat)
    # Own train rows: mostly the query's row itself (a train anchor), some another row (on another image, so the
    # own-row rule counts on its own), the rest none (-1).
    other = torch.randint(num_train, (num_queries,), generator=g)
    own = torch.where((torch.rand(num_queries, generator=g) < 0.7) & (split == "train"), queries, other)
    query_rows = torch.where(torch.rand(num_queries, generator=g) < 0.7, own, -1)
    args = (emb, image_ids, split, queries, query_rows)
    for sampler in pools.SAMPLERS:
        try:
            want = _whole_matrix_pools(sampler, pool_size, *args, _gen(seed + 1))
        except ValueError as e:
            for c in (1, chunk):  # the first short query of all, not of its chunk
                with pytest.raises(ValueError, match=str(e)):
                    pools.query_pools(sampler, pool_size, *args, _gen(seed + 1), c)
            continue
        after_ref = _gen(seed + 1)
        _whole_matrix_pools(sampler, pool_size, *args, after_ref)
        next_ref = torch.rand(3, generator=after_ref)
        for c in (1, 3, chunk, None):
            after = _gen(seed + 1)
            assert torch.equal(pools.query_pools(sampler, pool_size, *args, after, c), want), f"{sampler} chunk={c}"
            # The generator ends where the whole-matrix draw leaves it, so what is drawn next is unchanged too.
            assert torch.equal(torch.rand(3, generator=after), next_ref), f"{sampler} chunk={c}"


def test_query_pools_never_builds_a_queries_by_train_matrix(monkeypatch):
    # Every (C, N) matrix belongs to one chunk, and no (Q, N) exclusion mask is made at all.
    n_train, n_queries, d = 1000, 50, 4
    g = _gen(0)
    emb = {f"train_{v}": torch.randn(n_train, d, generator=g) for v in ("image", "text")}
    image_ids = {"train": torch.arange(n_train) // 3}
    rows = torch.randperm(n_train, generator=g)[:n_queries]
    seen = []

    def spy(sampler, pool_size, excluded, shape, generator, **sims):
        seen.append(shape[0])
        assert all(s.shape == shape for s in sims.values())
        return select(sampler, pool_size, excluded, shape, generator, **sims)

    select = pools._select
    monkeypatch.setattr(pools, "_select", spy)
    monkeypatch.setattr(pools, "exclusion_mask", None)
    monkeypatch.setattr(pools, "CHUNK_ELEMENTS", 8 * n_train)
    for chunk, most in ((7, 7), (None, 8)):
        seen.clear()
        got = pools.query_pools("mix", 5, emb, image_ids, "train", rows, rows, g, chunk)
        assert got.shape == (n_queries, 5) and sum(seen) == n_queries and max(seen) <= most, (chunk, seen)


@given(
    seed=seeds,
    num_queries=st.integers(1, 40),
    pool_len=st.integers(1, 12),
    dim=st.integers(2, 16),
    budget=st.integers(1, 2000),
)
def test_pool_ranking_in_chunks_equals_one_whole_call(seed, num_queries, pool_len, dim, budget):
    """Any chunk budget gives the ranking of one (Q, K, d) call, padded positions last."""
    g = rng(seed)
    train = torch.randn(30, dim, generator=g).round(decimals=1)  # coarse values: exact ties happen
    query = torch.randn(num_queries, dim, generator=g).round(decimals=1)
    pool = torch.randint(-1, 30, (num_queries, pool_len), generator=g)
    whole = pools.similarity_ranking(query, train[pool.clamp_min(0)], pool >= 0)
    with patch.object(pools, "CHUNK_ELEMENTS", budget):
        chunks = pools.pool_chunks(num_queries, pool_len, dim)
        assert torch.equal(pools.pool_ranking(query, train, pool), whole)
    assert torch.equal(torch.cat(chunks), torch.arange(num_queries))
    assert len(chunks) == min(num_queries, -(-num_queries * pool_len * dim // budget))  # as large as the budget allows


# ----------------------------------------------------------------------------------------------------------------------
# Training-free rivals: MMR, MMICES, the clustered coreset


def _rival_setup(seed: int, num_queries: int, pool_len: int, dim: int):
    """Unit train embeddings, queries, pools of distinct train rows with some padding (-1) at the end."""
    g = _gen(seed)
    train = F.normalize(torch.randn(pool_len * 3, dim, generator=g), dim=-1)
    query = F.normalize(torch.randn(num_queries, dim, generator=g), dim=-1)
    pool = torch.stack([torch.randperm(len(train), generator=g)[:pool_len] for _ in range(num_queries)])
    pad = torch.randint(0, pool_len // 3 + 1, (num_queries,), generator=g)  # (Q,) padded slots at the end
    pool = pool.masked_fill(torch.arange(pool_len) >= pool_len - pad[:, None], -1)
    return train, query, pool


@settings(max_examples=25)
@given(seed=seeds, num_queries=st.integers(1, 6), pool_len=st.integers(6, 20), k=st.integers(1, 4), lam=st.floats(0, 1))
def test_mmr_picks_as_its_definition_says(seed, num_queries, pool_len, k, lam):
    """Each pick maximises lam * cos(q, c) - (1 - lam) * max over earlier picks cos(c, p), checked by a plain loop over
    the candidates; lam = 1 is the similarity ranking."""
    train, query, pool = _rival_setup(seed, num_queries, pool_len, 8)
    got = pools.mmr_order(query, train, pool, k, lam)
    assert torch.equal(pools.mmr_order(query, train, pool, k, 1.0), pools.pool_ranking(query, train, pool)[:, :k])

    def value(q: int, j: int, picked: list[int]) -> float:
        rel = float(train[pool[q, j]] @ query[q])
        red = max((float(train[pool[q, j]] @ train[pool[q, p]]) for p in picked), default=None)
        return rel if red is None else lam * rel - (1 - lam) * red

    for q in range(num_queries):
        cands = [j for j in range(pool_len) if pool[q, j] >= 0]
        picked: list[int] = []
        for t in range(k):
            assert int(got[q, t]) in cands and int(got[q, t]) not in picked
            best = max(value(q, j, picked) for j in cands if j not in picked)
            assert value(q, int(got[q, t]), picked) >= best - 1e-5
            picked.append(int(got[q, t]))


@settings(max_examples=25)
@given(seed=seeds, num_queries=st.integers(1, 6), pool_len=st.integers(6, 20), k=st.integers(1, 4), data=st.data())
def test_mmices_reranks_the_image_prefilter_by_text(seed, num_queries, pool_len, k, data):
    """The k most text-similar among the `prefilter` most image-similar candidates, most text-similar first; a
    prefilter as large as the pool is the text ranking."""
    train, query, pool = _rival_setup(seed, num_queries, pool_len, 8)
    text_train, text_query, _ = _rival_setup(seed + 1, num_queries, pool_len, 8)
    valid = int((pool >= 0).sum(1).min())
    prefilter = data.draw(st.integers(k, max(k, valid)))
    got = pools.mmices_order(query, train, text_query, text_train, pool, k, prefilter)
    whole = pools.mmices_order(query, train, text_query, text_train, pool, k, pool_len)
    assert torch.equal(whole, pools.pool_ranking(text_query, text_train, pool)[:, :k])
    for q in range(num_queries):
        cands = [j for j in range(pool_len) if pool[q, j] >= 0]
        by_image = sorted(cands, key=lambda j: -float(train[pool[q, j]] @ query[q]))[:prefilter]
        by_text = sorted(by_image, key=lambda j: -float(text_train[pool[q, j]] @ text_query[q]))[:k]
        assert got[q].tolist() == by_text


@settings(max_examples=25)
@given(seed=seeds, k=st.integers(1, 5), per=st.integers(2, 6))
def test_coreset_takes_one_from_each_planted_cluster(seed, k, per):
    """Pools made of k tight, far-apart clusters: the coreset picks one member of each cluster, the most
    query-similar of it, ordered by similarity to the query; picks are distinct pool positions."""
    g = _gen(seed)
    dim = 16
    centres = torch.linalg.qr(torch.randn(dim, dim, generator=g))[0][:k]  # (k, d) orthonormal: far apart
    members = F.normalize(centres.repeat_interleave(per, 0) + 0.05 * torch.randn(k * per, dim, generator=g), dim=-1)
    order = torch.randperm(k * per, generator=g)
    train, cluster = members[order], torch.arange(k).repeat_interleave(per)[order]  # pool = all of train, shuffled
    query = F.normalize(torch.randn(2, dim, generator=g), dim=-1)
    pool = torch.arange(k * per).expand(2, -1)
    got = pools.coreset_order(query, train, pool, k)
    for q in range(2):
        picks = got[q].tolist()
        assert sorted(cluster[picks].tolist()) == list(range(k))
        rel = (train @ query[q]).tolist()
        for p in picks:
            assert rel[p] == max(rel[j] for j in range(k * per) if cluster[j] == cluster[p])
        assert [rel[p] for p in picks] == sorted((rel[p] for p in picks), reverse=True)
