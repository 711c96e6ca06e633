"""Tensor tests for the pointer selector: distributions, equivariance, padding, batching, decoding, persistence."""

import copy
import itertools
import json
import math
import tempfile
from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import rng, seeds
from torch import Tensor

from icl_select.runs import load_selector
from model import PointerSelector, SelectorConfig, going_on_logp

CFG = SelectorConfig(dim=12, hidden=16, num_heads=2, num_layers=2, dropout=0.3)


def make_model(seed: int, cfg: SelectorConfig = CFG) -> PointerSelector:
    torch.manual_seed(seed)  # parameter init only; the inputs below come from explicit generators
    return PointerSelector(cfg).eval()


@st.composite
def batches(draw, max_b=4, max_g=5, max_s=4, max_k=9):
    """A random batch: query, pool, pool_mask (some padding), seqs of distinct valid picks, seq_mask."""
    B, G, S = draw(st.integers(1, max_b)), draw(st.integers(1, max_g)), draw(st.integers(1, max_s))
    K = draw(st.integers(S, max_k))
    g = rng(draw(seeds))
    query, pool = torch.randn(B, CFG.dim, generator=g), torch.randn(B, K, CFG.dim, generator=g)
    n_valid = torch.randint(S, K + 1, (B,), generator=g)
    keys = torch.rand(B, K, generator=g)
    pool_mask = keys.argsort(-1).argsort(-1) < n_valid[:, None]  # n_valid random valid slots per query
    order = torch.rand(B, G, K, generator=g).masked_fill(~pool_mask[:, None], 2).argsort(-1)  # valid slots first
    seqs = order[..., :S]
    seq_mask = torch.rand(B, G, generator=g) < 0.8
    seq_mask[:, 0] = True
    seqs = seqs.masked_fill(~seq_mask[..., None], -1)  # padded sequences hold garbage
    return query, pool, pool_mask, seqs, seq_mask, draw(seeds)


@given(batches())
def test_distributions_normalised_and_zero_on_unavailable(batch):
    query, pool, pool_mask, seqs, seq_mask, seed = batch
    out = make_model(seed)(query, pool, pool_mask, seqs, seq_mask, with_dists=True)
    p = out.log_dist.exp()  # (B, G, S, K)
    B, G, S, K = p.shape
    for b, g in zip(*seq_mask.nonzero(as_tuple=True)):
        for t in range(S):
            unavailable = ~pool_mask[b].clone()
            unavailable[seqs[b, g, :t]] = True
            assert (p[b, g, t][unavailable] == 0).all()
            assert torch.allclose(p[b, g, t].sum(), torch.tensor(1.0), atol=1e-5)
            assert torch.allclose(out.logp[b, g, t], out.log_dist[b, g, t, seqs[b, g, t]])
    assert (out.logp[~seq_mask] == 0).all() and (out.entropy[~seq_mask] == 0).all()
    assert torch.isfinite(out.logp).all() and torch.isfinite(out.entropy).all() and (out.entropy >= -1e-6).all()


@given(batches())
def test_pool_permutation_equivariance(batch):
    query, pool, pool_mask, seqs, seq_mask, seed = batch
    model = make_model(seed)
    perm = torch.randperm(pool.shape[1], generator=rng(seed))  # new slot j holds old candidate perm[j]
    inv = perm.argsort()
    seqs_p = torch.where(seq_mask[..., None], inv[seqs.clamp_min(0)], -1)
    a = model(query, pool, pool_mask, seqs, seq_mask, with_dists=True)
    b = model(query, pool[:, perm], pool_mask[:, perm], seqs_p, seq_mask, with_dists=True)
    assert torch.allclose(a.logp, b.logp, atol=1e-5)
    assert torch.allclose(a.log_dist[..., perm].exp(), b.log_dist.exp(), atol=1e-5)


@given(batches(), st.integers(1, 4), st.integers(1, 3))
def test_padding_candidates_and_sequences_changes_nothing(batch, extra_k, extra_g):
    query, pool, pool_mask, seqs, seq_mask, seed = batch
    model = make_model(seed)
    B, G, S = seqs.shape
    g = rng(seed + 1)
    pool2 = torch.cat([pool, torch.randn(B, extra_k, CFG.dim, generator=g) * 100], 1)
    mask2 = torch.cat([pool_mask, torch.zeros(B, extra_k, dtype=torch.bool)], 1)
    seqs2 = torch.cat([seqs, torch.randint(-1, 3, (B, extra_g, S), generator=g)], 1)
    smask2 = torch.cat([seq_mask, torch.zeros(B, extra_g, dtype=torch.bool)], 1)
    a = model(query, pool, pool_mask, seqs, seq_mask)
    b = model(query, pool2, mask2, seqs2, smask2)
    assert torch.allclose(a.logp, b.logp[:, :G], atol=1e-5)
    assert torch.allclose(a.entropy, b.entropy[:, :G], atol=1e-5)
    assert (b.logp[:, G:] == 0).all()


@given(batches())
def test_batched_equals_one_by_one(batch):
    query, pool, pool_mask, seqs, seq_mask, seed = batch
    model = make_model(seed)
    full = model.log_probs(query, pool, pool_mask, seqs, seq_mask)
    for b in range(len(query)):
        one = model.log_probs(
            query[b : b + 1], pool[b : b + 1], pool_mask[b : b + 1], seqs[b : b + 1], seq_mask[b : b + 1]
        )
        assert torch.allclose(full[b : b + 1], one, atol=1e-5)
        for g in seq_mask[b].nonzero()[:, 0].tolist():  # and each sequence on its own
            single = model.log_probs(
                query[b : b + 1],
                pool[b : b + 1],
                pool_mask[b : b + 1],
                seqs[b : b + 1, g : g + 1],
                seq_mask[b : b + 1, g : g + 1],
            )
            assert torch.allclose(full[b, g], single[0, 0], atol=1e-5)


@given(batches())
def test_encodes_each_pool_once(batch):
    query, pool, pool_mask, seqs, seq_mask, seed = batch
    model = make_model(seed)
    rows = []
    model.in_proj.register_forward_hook(lambda m, i, o: rows.append(i[0].shape[:-1].numel()))
    model(query, pool, pool_mask, seqs, seq_mask)
    assert sum(rows) == query.shape[0] * (1 + pool.shape[1])  # B queries + B*K candidates, whatever G is


@given(batches())
def test_gradients_finite_with_padding(batch):
    query, pool, pool_mask, seqs, seq_mask, seed = batch
    model = make_model(seed).train()
    out = model(query, pool, pool_mask, seqs, seq_mask, with_dists=True)
    (out.logp.sum() + out.entropy.sum()).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    if (pool_mask.sum(-1) >= 2).any():  # some step has a real choice, so the scores get a gradient
        assert model.query_proj.weight.grad.abs().sum() > 0


@given(batches())
def test_greedy_valid_and_equals_width_one_beam_and_teacher_forcing(batch):
    query, pool, pool_mask, seqs, _, seed = batch
    S = seqs.shape[2]
    model = make_model(seed)
    picks, logp = model.greedy(query, pool, pool_mask, S)
    assert pool_mask.gather(1, picks).all()
    assert all(len(set(row.tolist())) == S for row in picks)
    beam, score = model.beam_search(query, pool, pool_mask, S, 1)
    assert torch.equal(beam[:, 0], picks) and torch.allclose(score[:, 0], logp, atol=1e-5)
    tf = model.log_probs(query, pool, pool_mask, picks[:, None], torch.ones(len(query), 1, dtype=torch.bool))
    assert torch.allclose(tf.sum(-1)[:, 0], logp, atol=1e-5)


@given(seeds, st.integers(2, 5), st.integers(1, 3))
def test_exhaustive_beam_finds_the_best_sequences(seed, K, S):
    S = min(S, K)
    model = make_model(seed)
    g = rng(seed)
    query, pool = torch.randn(1, CFG.dim, generator=g), torch.randn(1, K, CFG.dim, generator=g)
    mask = torch.ones(1, K, dtype=torch.bool)
    every = torch.tensor(list(itertools.permutations(range(K), S)))  # (N, S)
    tf = model.log_probs(query, pool, mask, every[None], torch.ones(1, len(every), dtype=torch.bool)).sum(-1)[0]
    beam, score = model.beam_search(query, pool, mask, S, len(every))  # width = every sequence: beam is exact
    assert torch.allclose(score[0], tf.sort(descending=True).values, atol=1e-5)
    assert len({tuple(s) for s in beam[0].tolist()}) == len(every)
    beam2, score2 = model.beam_search(query, pool, mask, S, len(every) + 2)  # more beams than sequences: -inf
    assert torch.isinf(score2[0, -2:]).all() and torch.isfinite(score2[0, :-2]).all()


@given(batches(), st.integers(1, 6), st.floats(0.3, 3.0))
def test_sampling_valid_reproducible_and_scored(batch, n, temperature):
    query, pool, pool_mask, seqs, _, seed = batch
    S = seqs.shape[2]
    model = make_model(seed)
    a, la = model.sample(query, pool, pool_mask, S, n, rng(seed), temperature)
    b, lb = model.sample(query, pool, pool_mask, S, n, rng(seed), temperature)
    assert torch.equal(a, b) and torch.equal(la, lb)
    assert pool_mask.gather(1, a.flatten(1)).all()
    assert all(len(set(row.tolist())) == S for row in a.flatten(0, 1))
    tf = model.log_probs(query, pool, pool_mask, a, torch.ones(a.shape[:2], dtype=torch.bool)).sum(-1)
    assert torch.allclose(tf, la, atol=1e-5)


def test_sampling_follows_the_policy():
    """Empirical first-pick frequencies match the step-0 distribution (temperature 1)."""
    model = make_model(0)
    g = rng(0)
    query, pool = torch.randn(1, CFG.dim, generator=g), torch.randn(1, 4, CFG.dim, generator=g)
    mask = torch.ones(1, 4, dtype=torch.bool)
    picks, _ = model.sample(query, pool, mask, 1, 20000, rng(1))
    freq = torch.bincount(picks[0, :, 0], minlength=4) / 20000
    every = torch.arange(4)[:, None]
    p = model.log_probs(query, pool, mask, every[None], torch.ones(1, 4, dtype=torch.bool))[0, :, 0].exp()
    assert torch.allclose(freq, p, atol=0.015)


def test_dropout_only_in_train_mode():
    model = make_model(0)
    g = rng(0)
    q, pool = torch.randn(2, CFG.dim, generator=g), torch.randn(2, 6, CFG.dim, generator=g)
    mask = torch.ones(2, 6, dtype=torch.bool)
    seqs, smask = torch.tensor([[[0, 1]], [[2, 3]]]), torch.ones(2, 1, dtype=torch.bool)
    assert torch.equal(model.log_probs(q, pool, mask, seqs, smask), model.log_probs(q, pool, mask, seqs, smask))
    model.train()
    assert not torch.equal(model.log_probs(q, pool, mask, seqs, smask), model.log_probs(q, pool, mask, seqs, smask))


def test_save_load_round_trip_bitwise(tmp_path):
    model = make_model(3)
    model.save(tmp_path)
    loaded = load_selector(tmp_path)
    assert loaded.cfg == model.cfg
    for (k, a), (k2, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(a, b)
    assert not list(tmp_path.glob("*.tmp"))


@st.composite
def remembered(draw, max_n=30):
    """A selector that remembers n train embeddings (one of them twice), each item scored at random, and pools mixing
    train rows, embeddings it never saw and padding; -> model, train (n, d), pool rows (B, K) (-1 = unseen)."""
    g, n = rng(draw(seeds)), draw(st.integers(2, max_n))
    train = torch.randn(n, CFG.dim, generator=g)
    train[-1] = train[0]  # identical embeddings are one item
    model = make_model(draw(seeds) % 2**16)
    model.remember_items(train)
    with torch.no_grad():
        model.items.bias.copy_(torch.randn(len(model.items.bias), generator=g))
    B, K = draw(st.integers(1, 4)), draw(st.integers(4, 9))
    rows = torch.randint(n, (B, K), generator=g).masked_fill(torch.rand(B, K, generator=g) < 0.3, -1)
    return model, train, rows, g


def row_scores(model: PointerSelector, train: Tensor) -> Tensor:
    """Each train row's score, found by ranking the rows' keys (not by the memory's own lookup); a key's rounding is
    far below 1e-9."""
    key = train.double() @ model.items.proj
    rank = torch.tensor([int((model.items.keys < k - 1e-9).sum()) for k in key])
    return model.items.bias.detach()[rank]


@given(remembered())
def test_item_memory_scores_the_items_it_remembers_and_nothing_else(case):
    model, train, rows, g = case
    assert len(model.items.keys) == len(train) - 1
    pool = torch.where(rows[..., None] >= 0, train[rows.clamp_min(0)], torch.randn(*rows.shape, CFG.dim, generator=g))
    want = row_scores(model, train)[rows.clamp_min(0)].where(rows >= 0, 0.0)
    assert torch.equal(model.items(pool), want)
    assert torch.equal(model.items(pool.double().float()), want)  # the same numbers in another tensor


@given(remembered(), st.floats(0.5, 2.0))
def test_a_remembered_score_shifts_each_pick_by_score_over_temperature(case, temperature):
    model, train, rows, g = case
    rows = rows.clamp_min(0)
    B, K = rows.shape
    query, pool, mask = torch.randn(B, CFG.dim, generator=g), train[rows], torch.ones(B, K, dtype=torch.bool)
    seqs = torch.rand(B, 2, K, generator=g).argsort(-1)[..., :3]  # (B, 2, 3) distinct picks
    plain = copy.deepcopy(model)
    plain.items = None
    with_items = model(query, pool, mask, seqs, mask[:, :2], True, temperature).log_dist  # (B, 2, 3, K)
    without = plain(query, pool, mask, seqs, mask[:, :2], True, temperature).log_dist
    shift = row_scores(model, train)[rows] / (CFG.temperature * temperature)  # (B, K)
    avail = torch.isfinite(without)
    assert torch.equal(avail, torch.isfinite(with_items))
    diff = (with_items - without - shift[:, None, None, :]).where(avail, 0.0)  # a constant per step: normalisation
    spread = diff.where(avail, -math.inf).amax(-1) - diff.where(avail, math.inf).amin(-1)
    assert spread.abs().max() < 1e-4


def test_an_item_memory_saves_and_loads_and_a_selector_without_one_saves_no_such_tensor(tmp_path):
    model = make_model(1)
    model.save(tmp_path / "plain")
    assert not [k for k in load_selector(tmp_path / "plain").state_dict() if k.startswith("items.")]
    model.remember_items(torch.randn(7, CFG.dim, generator=rng(0)))
    with torch.no_grad():
        model.items.bias.copy_(torch.arange(7.0))
    model.save(tmp_path / "items")
    loaded = load_selector(tmp_path / "items")
    assert sorted(k for k in loaded.state_dict() if k.startswith("items.")) == ["items.bias", "items.keys"]
    for (k, a), (k2, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(a, b)


def test_load_names_missing_unexpected_and_misshaped_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    make_model(0).save(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state.pop("gate.bias")
    state["extra.weight"] = torch.zeros(1)
    state["in_proj.weight"] = torch.zeros(3, 3)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError) as e:
        load_selector(tmp_path)
    for name in ("gate.bias", "extra.weight", "in_proj.weight"):
        assert name in str(e.value)
    (tmp_path / "model.json").unlink()
    with pytest.raises(ValueError, match="model.json"):
        load_selector(tmp_path)


def test_tensors_that_do_not_fit_together_fail_a_shape_assert():
    """The network asserts only that its tensors fit together. Their values (ids inside their pools, distinct picks,
    pools no smaller than the picks, finite embeddings, a selector as wide as the data) are checked where they are
    read, each bad one a line naming file and field: tests/test_data.py, test_evaluate.py and test_train.py."""
    model = make_model(0)
    q, pool = torch.randn(2, CFG.dim), torch.randn(2, 5, CFG.dim)
    mask = torch.ones(2, 5, dtype=torch.bool)
    smask = torch.ones(2, 2, dtype=torch.bool)
    good = torch.tensor([[[0, 1], [1, 2]], [[0, 1], [2, 3]]])
    model.log_probs(q, pool, mask, good, smask)
    for args, pattern in (
        ((q[:, :4], pool, mask, good, smask), r"\bquery\b.*\bpool\b.*\(2, 4\).*\(2, 5, 12\)$"),
        ((q, pool, mask.float(), good, smask), r"\bpool_mask\b.*torch\.float32 \(2, 5\)$"),
        ((q, pool, mask, good[:, :, 0], smask), r"\bseqs\b.*torch\.int64 \(2, 2\)$"),
        ((q, pool, mask, good.int(), smask), r"\bseqs\b.*torch\.int32 \(2, 2, 2\)$"),
        ((q, pool, mask, good, smask[:, :1]), r"\bseq_mask\b.*torch\.bool \(2, 1\)$"),
    ):
        with pytest.raises(AssertionError, match=pattern):
            model.log_probs(*args)
    for decode in (
        lambda *a: model.greedy(*a, 2),
        lambda *a: model.sample(*a, 2, 3),
        lambda *a: model.beam_search(*a, 2, 3),
    ):
        with pytest.raises(AssertionError, match=r"\bpool\b.*\(2, 12\).*\(5, 12\)$"):
            decode(q, pool[0], mask)
    with pytest.raises(ValueError, match=r"\bhidden=10\b.*\bnum_heads=4\b"):
        SelectorConfig(hidden=10, num_heads=4)


@given(batches(), st.floats(0.2, 3.0))
def test_tempered_teacher_forcing_is_the_sampling_distribution(batch, temperature):
    """forward(temperature=T) gives the distributions sample(..., T) draws from: softmax(log pi / T) per step."""
    query, pool, pool_mask, seqs, seq_mask, seed = batch
    model = make_model(seed)
    plain = model(query, pool, pool_mask, seqs, seq_mask, with_dists=True).log_dist  # (B, G, S, K)
    tempered = model(query, pool, pool_mask, seqs, seq_mask, True, temperature).log_dist
    live = torch.isfinite(plain) & seq_mask[..., None, None]
    expect = (plain / temperature).log_softmax(-1)
    assert torch.allclose(tempered[live], expect[live], atol=1e-5)
    assert torch.equal(torch.isfinite(tempered), torch.isfinite(plain))


@given(seeds, st.integers(1, 5))
def test_pick_order_maps_picks_to_prompts_and_back(seed, S):
    picks = torch.rand(3, 4, S, generator=rng(seed)).argsort(-1)  # (B, G, S)
    nearest, prompt = SelectorConfig(pick_order="nearest_first"), SelectorConfig(pick_order="prompt")
    assert torch.equal(prompt.to_prompt(picks), picks) and torch.equal(prompt.from_prompt(picks), picks)
    assert torch.equal(nearest.to_prompt(picks)[..., -1], picks[..., 0])  # the first pick sits next to the query
    assert torch.equal(nearest.from_prompt(nearest.to_prompt(picks)), picks)
    # the k-shot prompt of the first k picks ends with the same demonstration for every k
    assert all(torch.equal(nearest.to_prompt(picks[..., :k])[..., -1], picks[..., 0]) for k in range(1, S + 1))


def test_pick_order_is_validated_and_model_json_must_name_every_setting(tmp_path):
    with pytest.raises(ValueError, match=r"\bpick_order\b.*'backwards'"):
        SelectorConfig(pick_order="backwards")
    model = make_model(0)
    model.save(tmp_path)
    raw = json.loads((tmp_path / "model.json").read_text())
    del raw["pick_order"]  # read as a default, it would silently change how the picks become a prompt
    (tmp_path / "model.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"model\.json\b.*\['pick_order'\]"):
        load_selector(tmp_path)


def test_model_json_records_the_pick_count_and_the_weights_do_not_depend_on_it(tmp_path):
    for picks in (2, 4):
        make_model(0, replace(CFG, picks=picks)).save(tmp_path / str(picks))
        assert json.loads((tmp_path / str(picks) / "model.json").read_text())["picks"] == picks
        assert load_selector(tmp_path / str(picks)).cfg.picks == picks
    assert (tmp_path / "2" / "model.safetensors").read_bytes() == (tmp_path / "4" / "model.safetensors").read_bytes()
    raw = json.loads((tmp_path / "2" / "model.json").read_text())
    for edit, pattern in (
        ({k: v for k, v in raw.items() if k != "picks"}, r"2/model\.json\b.*\['picks'\]"),
        (raw | {"picks": 0}, r"2/model\.json\b.*'picks'.*\b0$"),
        (raw | {"picks": 2.0}, r"2/model\.json\b.*'picks'.*\b2\.0$"),
    ):
        (tmp_path / "2" / "model.json").write_text(json.dumps(edit))
        with pytest.raises(ValueError, match=pattern):
            load_selector(tmp_path / "2")


@given(seeds, st.integers(1, 15), st.integers(4, 6))
def test_decoding_in_slices_picks_what_one_call_picks(seed, B, chunk):
    """Greedy and beam search decode in slices of DECODE_CHUNK queries; a short last slice joins the one before."""
    import model

    g = rng(seed)
    query, pool, mask = torch.randn(B, 6, generator=g), torch.randn(B, 5, 6, generator=g), torch.ones(B, 5).bool()
    net = PointerSelector(SelectorConfig(dim=6, hidden=8, num_heads=2)).eval()
    whole = net._decode(query, pool, mask, 3, 1, net.most_likely)
    beams = net._beam(query, pool, mask, 3, 2)
    sizes = []
    real = model.in_chunks

    def spy(decode, q, p, m):
        return real(lambda *b: sizes.append(len(b[0])) or decode(*b), q, p, m)

    old = model.DECODE_CHUNK
    try:
        model.DECODE_CHUNK, model.in_chunks = chunk, spy
        picks, logp = net.greedy(query, pool, mask, 3)
        beam_seqs, beam_scores = net.beam_search(query, pool, mask, 3, 2)
    finally:
        model.DECODE_CHUNK, model.in_chunks = old, real
    assert torch.equal(picks, whole[0][:, 0]) and torch.allclose(logp, whole[1][:, 0], atol=1e-5)
    assert torch.equal(beam_seqs, beams[0]) and torch.allclose(beam_scores, beams[1], atol=1e-5)
    short = [s for s in sizes if s < model.MIN_SLICE]
    assert sum(sizes) == 2 * B and all(s < chunk + model.MIN_SLICE for s in sizes)
    assert not short or B < model.MIN_SLICE


@given(batches())
def test_without_state_update_the_picks_are_the_top_k_and_every_step_scores_alike(batch):
    """A bi-encoder (no cross-attention, no state update): each step's distribution is the first one renormalised over
    what is left, so greedy decoding is the top k of the first step's scores, in order."""
    query, pool, pool_mask, seqs, seq_mask, seed = batch
    S = seqs.shape[2]
    model = make_model(seed, replace(CFG, num_layers=0, state_update=False))
    dists = model(query, pool, pool_mask, seqs, seq_mask, with_dists=True).log_dist  # (B, G, S, K)
    first = dists[:, :, 0]  # (B, G, K)
    for t in range(1, S):
        left = torch.isfinite(dists[:, :, t])  # (B, G, K)
        again = first.masked_fill(~left, float("-inf")).log_softmax(-1)
        live = seq_mask[..., None] & left
        assert torch.allclose(dists[:, :, t][live], again[live], atol=1e-5)
    picks, _ = model.greedy(query, pool, pool_mask, S)
    top = first[:, 0].masked_fill(~pool_mask, float("-inf")).topk(S, -1).indices  # (B, S)
    assert torch.equal(picks, top)
    state = replace(CFG, num_layers=0)  # the same network with the state update: its later steps do move
    moving = make_model(seed, state)(query, pool, pool_mask, seqs, seq_mask, with_dists=True).log_dist
    choice = (torch.isfinite(dists).sum(-1) > 1) & seq_mask[..., None]  # (B, G, S) steps with a choice left
    choice[:, :, 0] = False
    if choice.any():
        assert not torch.allclose(moving[choice].exp(), dists[choice].exp(), atol=1e-4)


def test_model_json_reads_true_and_false_and_refuses_a_number_for_a_switch(tmp_path):
    model = make_model(0, replace(CFG, state_update=False))
    model.save(tmp_path)
    assert load_selector(tmp_path).cfg.state_update is False
    raw = json.loads((tmp_path / "model.json").read_text())
    (tmp_path / "model.json").write_text(json.dumps(raw | {"state_update": 0}))
    with pytest.raises(ValueError, match=r"^\S+model\.json: field 'state_update' must be true or false, got 0$"):
        load_selector(tmp_path)


# ----------------------------------------------------------------------------------------------------------------------
# A selector that may stop: sequences of 0..S demonstrations, -1 after the last


STOP = replace(CFG, can_stop=True, picks=4)


def stopping(seed: int) -> PointerSelector:
    """A selector that may stop, its stop drawn away from the untrained coin flip: stopping is likelier at some steps
    and for some states than at others."""
    model = make_model(seed, STOP)
    with torch.no_grad():
        model.stop_bias.copy_(STOP.temperature * torch.randn(STOP.picks, generator=rng(seed + 2)))
        model.stop_weight.copy_(STOP.temperature * torch.randn(STOP.hidden, generator=rng(seed + 3)))
    return model


@st.composite
def stopped_batches(draw):
    """`batches()` with every valid sequence cut to a drawn length 0..S (-1 after its last pick)."""
    query, pool, pool_mask, seqs, seq_mask, seed = draw(batches())
    lengths = torch.randint(0, seqs.shape[2] + 1, seqs.shape[:2], generator=rng(seed + 3))  # (B, G)
    cut = seqs.masked_fill(torch.arange(seqs.shape[2]) >= lengths[..., None], -1)
    return query, pool, pool_mask, torch.where(seq_mask[..., None], cut, seqs), seq_mask, seed


@torch.no_grad()
def by_hand(model: PointerSelector, query, pool, pool_mask, seq: list[int], S: int) -> float:
    """log pi(seq) of one sequence, one step at a time from the step distributions (`forward` of growing prefixes is
    not used): each pick's probability among the candidates left and the stop, then the stop if it ended early."""
    total, picked = 0.0, []
    K = pool.shape[1]
    for t in range(S):
        prefix = torch.tensor(picked + [-1] * (S - len(picked)))[None, None]  # stopped after the picks so far
        dist = model(query, pool, pool_mask, prefix, torch.ones(1, 1, dtype=torch.bool), with_dists=True).log_dist
        step = dist[0, 0, t]  # (K + 1,) the distribution after the picks so far
        choice = seq[t] if t < len(seq) else K
        total += float(step[choice])
        if choice == K:
            break
        picked.append(choice)
    return total


@given(stopped_batches())
def test_stopped_sequences_are_scored_pick_by_pick_and_then_the_stop(batch):
    """log pi of a sequence of n < S picks = its picks' log-probs + the stop's at step n; steps after it are not taken
    (0, masked); each taken step's distribution covers the candidates left and the stop, and sums to 1."""
    query, pool, pool_mask, seqs, seq_mask, seed = batch
    model = stopping(seed)
    S, K = seqs.shape[2], pool.shape[1]
    out = model(query, pool, pool_mask, seqs, seq_mask, with_dists=True)
    assert out.log_dist.shape[-1] == K + 1
    n = (seqs >= 0).sum(-1)  # (B, G)
    for b, g in zip(*seq_mask.nonzero(as_tuple=True)):
        taken = [t <= n[b, g] for t in range(S)]
        assert out.taken[b, g].tolist() == taken
        assert (out.logp[b, g][~out.taken[b, g]] == 0).all()
        for t in range(S):
            if taken[t]:
                assert torch.allclose(out.log_dist[b, g, t].exp().sum(), torch.tensor(1.0), atol=1e-5)
        seq = [c for c in seqs[b, g].tolist() if c >= 0]
        want = by_hand(model, query[b : b + 1], pool[b : b + 1], pool_mask[b : b + 1], seq, S)
        assert out.logp[b, g].sum().item() == pytest.approx(want, abs=1e-4)
    assert not out.taken[~seq_mask].any() and (out.logp[~seq_mask] == 0).all()


@given(stopped_batches())
def test_going_on_scores_the_picks_among_the_candidates_alone_and_leaves_the_stop_untouched(batch):
    """going_on_logp of a sequence = the sum of its picks' log-probs among the candidates left, the stop ruled out
    (from the step distributions, one step at a time); no gradient reaches the stop's own parameters, which the plain
    log-prob moves (GRPO leaves a may-stop selector's stop to its stop loss)."""
    query, pool, pool_mask, seqs, seq_mask, seed = batch
    model = stopping(seed)
    S, K = seqs.shape[2], pool.shape[1]
    out = model(query, pool, pool_mask, seqs, seq_mask, with_dists=True)
    got = going_on_logp(out, seqs)  # (B, G)
    with torch.no_grad():
        for b, g in itertools.product(range(len(query)), range(seqs.shape[1])):
            picks = [c for c in seqs[b, g].tolist() if c >= 0] if seq_mask[b, g] else []
            want = 0.0
            for t, c in enumerate(picks):
                prefix = torch.tensor(picks[:t] + [-1] * (S - t))[None, None]
                one = model(query[b : b + 1], pool[b : b + 1], pool_mask[b : b + 1], prefix, seq_mask[:1, :1], True)
                want += float(one.log_dist[0, 0, t, c] - one.log_dist[0, 0, t, :K].logsumexp(-1))
            assert got[b, g].item() == pytest.approx(want, abs=1e-4)
    stop_grad = torch.cat(torch.autograd.grad(got.sum(), model.stop_parameters(), retain_graph=True))
    plain_grad = torch.cat(torch.autograd.grad(out.logp.sum(), model.stop_parameters()))
    assert stop_grad.abs().max() <= 1e-5 * max(1.0, plain_grad.abs().max().item())
    assert plain_grad.abs().max() > 0 or not (seqs >= 0).any()


@given(batches())
def test_the_stop_is_a_coin_of_its_own_beside_the_picks_of_the_selector_that_fills_every_slot(batch):
    """Before the first pick p(stop) = sigmoid((s . w + b_0) / temperature) of the query's state s, after t picks
    sigmoid(b_t / temperature) alike for every state (by hand; a stop that read the moving state drifted toward stopping
    where going on won), and the picks given going on are exactly those of the selector with the same weights that
    cannot stop, whatever the stop's parameters: how sure it is of its picks never decides whether it stops (scored
    among the candidates, a stop buried under sharp picks never rose within a budget). The stop reads the state and
    never trains it: its log-prob moves its own weight and bias alone (its loss, pulling the shared weights, cost the
    picks where demonstrations help). Untrained, its stop is a coin flip and greedy decoding fills every slot as the
    selector that cannot stop does."""
    query, pool, pool_mask, seqs, seq_mask, seed = batch  # full-length sequences
    S, K = seqs.shape[2], pool.shape[1]
    model = stopping(seed)
    plain = PointerSelector(replace(STOP, can_stop=False)).eval()
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("stop_")})
    out = model(query, pool, pool_mask, seqs, seq_mask, with_dists=True).log_dist[seq_mask]  # (N, S, K + 1)
    want = plain(query, pool, pool_mask, seqs, seq_mask, with_dists=True).log_dist[seq_mask]  # (N, S, K)
    going = out[..., :K] - out[..., :K].logsumexp(-1, keepdim=True)
    assert torch.allclose(going.exp(), want.exp(), atol=1e-6)
    with torch.no_grad():  # the state step by step, as the selector advances it on its picks
        s, keys, _ = model.encode(query, pool, pool_mask)
        s = s[:, None].expand(-1, seqs.shape[1], -1)  # (B, G, H)
        for t in range(S):
            z = ((s @ model.stop_weight) * (t == 0) + model.stop_bias[t]) / STOP.temperature  # (B, G)
            assert torch.allclose(out[:, t, K].exp(), torch.sigmoid(z)[seq_mask], atol=1e-6)
            s = model.advance(s, keys, seqs[..., t].clamp_min(0))
    stop = model(query, pool, pool_mask, seqs, seq_mask, with_dists=True).log_dist[..., K][seq_mask].sum()
    grads = torch.autograd.grad(stop, list(model.parameters()), allow_unused=True)
    moved = {n for (n, _), g in zip(model.named_parameters(), grads) if g is not None and g.abs().max() > 0}
    assert moved == {"stop_weight", "stop_bias"} or not seq_mask.any(), moved
    fresh, cannot = make_model(seed, STOP), make_model(seed, replace(STOP, can_stop=False))
    assert torch.equal(fresh.greedy(query, pool, pool_mask, S)[0], cannot.greedy(query, pool, pool_mask, S)[0])


@given(stopped_batches())
def test_greedy_and_sampling_may_stop_and_are_scored_as_teacher_forcing_scores_them(batch):
    """Greedy decoding stops where the stop is more likely than going on (p > 1/2), else takes the most likely
    candidate (checked step by step on the teacher-forced distributions); it and sampling are scored as teacher
    forcing scores them; exactly S never stops; a beam of one ranks the stop against each candidate instead."""
    query, pool, pool_mask, seqs, _, seed = batch
    S = seqs.shape[2]
    model = stopping(seed)
    picks, logp = model.greedy(query, pool, pool_mask, S)
    every = torch.ones(len(query), 1, dtype=torch.bool)
    out = model(query, pool, pool_mask, picks[:, None], every, with_dists=True)
    assert torch.allclose(out.logp.sum(-1)[:, 0], logp, atol=1e-5)
    for b in range(len(query)):
        n = int((picks[b] >= 0).sum())
        for t in range(min(n + 1, S)):
            p = out.log_dist[b, 0, t].exp()
            assert (p[-1] > 0.5) == (t == n) and (t == n or int(picks[b, t]) == int(p[:-1].argmax()))
    beam, score = model.beam_search(query, pool, pool_mask, S, 1)
    tf = model.log_probs(query, pool, pool_mask, beam, every).sum(-1)[:, 0]
    assert torch.allclose(score[:, 0], tf, atol=1e-5)
    full, _ = model.greedy(query, pool, pool_mask, S, min_picks=S)  # exactly S: never stops
    assert (full >= 0).all() and pool_mask.gather(1, full).all()
    for least in range(S + 1):  # at least `least` picks from every decoder, each a pool candidate, all distinct
        beams, score = model.beam_search(query, pool, pool_mask, S, 2, least)
        samples = model.sample(query, pool, pool_mask, S, 3, rng(seed), 1.0, least)[0]
        rows = torch.arange(len(query))[:, None]  # (B, 1)
        made = [  # (M, S) sequences, each of the question `of`; a beam past what a pool allows is -inf, no sequence
            (model.greedy(query, pool, pool_mask, S, least)[0], rows[:, 0]),
            (beams[score.isfinite()], rows.expand(score.shape)[score.isfinite()]),
            (samples.flatten(0, 1), rows.expand(samples.shape[:2]).flatten()),
        ]
        for seq, of in made:
            n = (seq >= 0).sum(-1)
            assert (n >= least).all() and ((seq >= 0).int().diff(dim=-1) <= 0).all()
            assert pool_mask[of].gather(1, seq.clamp_min(0))[seq >= 0].all()
            assert all(len(set(r[:k])) == k for r, k in zip(seq.tolist(), n.tolist()))
    drawn, lp = model.sample(query, pool, pool_mask, S, 5, rng(seed), 1.0)  # (B, 5, S)
    assert ((drawn >= 0).int().diff(dim=-1) <= 0).all()  # -1 only after the last pick
    tf = model.log_probs(query, pool, pool_mask, drawn, torch.ones(drawn.shape[:2], dtype=torch.bool)).sum(-1)
    assert torch.allclose(tf, lp, atol=1e-5)


@given(seeds, st.integers(2, 4), st.integers(1, 3))
def test_exhaustive_beam_with_stops_ranks_every_sequence_of_every_length(seed, K, S):
    """A beam as wide as the number of sequences of 0..S picks returns all of them, best first, scored as teacher
    forcing scores them."""
    S = min(S, K)
    model = stopping(seed)
    g = rng(seed)
    query, pool = torch.randn(1, CFG.dim, generator=g), torch.randn(1, K, CFG.dim, generator=g)
    mask = torch.ones(1, K, dtype=torch.bool)
    every = [list(p) + [-1] * (S - n) for n in range(S + 1) for p in itertools.permutations(range(K), n)]
    every = torch.tensor(every)  # (N, S)
    tf = model.log_probs(query, pool, mask, every[None], torch.ones(1, len(every), dtype=torch.bool)).sum(-1)[0]
    beam, score = model.beam_search(query, pool, mask, S, len(every))
    assert torch.allclose(score[0], tf.sort(descending=True).values, atol=1e-5)
    assert {tuple(s) for s in beam[0].tolist()} == {tuple(s) for s in every.tolist()}


def test_stopping_follows_the_policy():
    """How often sampling stops at once matches the stop's probability at step 0."""
    model = stopping(0)
    g = rng(0)
    query, pool = torch.randn(1, CFG.dim, generator=g), torch.randn(1, 4, CFG.dim, generator=g)
    mask = torch.ones(1, 4, dtype=torch.bool)
    picks, _ = model.sample(query, pool, mask, 2, 20000, rng(1))
    first = model(query, pool, mask, torch.full((1, 1, 2), -1), torch.ones(1, 1, dtype=torch.bool), True).log_dist
    p_stop = first[0, 0, 0, -1].exp().item()
    assert 0.05 < p_stop < 0.95 and (picks[0, :, 0] < 0).float().mean().item() == pytest.approx(p_stop, abs=0.015)


@given(seeds, st.integers(1, 6), st.integers(1, 6))
def test_set_picks_keeps_the_policy_over_the_steps_both_lengths_share_and_saves_what_it_loads(seed, before, after):
    """rce.py --picks and --init change how many demonstrations a selector makes: its stop bias (one per step) is cut
    or extended by its last entry, so the distributions over the shared steps stay bit for bit, and the selector saved
    with its new count loads back (Lever-Plus-style silent mismatches: `stop_bias (6,) in file, (4,) in model`)."""
    model = stopping(seed)
    model.set_picks(before)
    with torch.no_grad():
        model.stop_bias.copy_(torch.randn(before, generator=rng(seed)))
    g = rng(seed + 1)
    S = min(before, after, 4)
    query, pool = torch.randn(2, CFG.dim, generator=g), torch.randn(2, 6, CFG.dim, generator=g)
    mask, seqs = torch.ones(2, 6, dtype=torch.bool), torch.tensor([[[0, 1, 2, 3][:S]], [[5, 4, 3, 2][:S]]])
    one = torch.ones(2, 1, dtype=torch.bool)
    was = model(query, pool, mask, seqs, one, with_dists=True).log_dist
    model.set_picks(after)
    assert model.cfg.picks == after and model.stop_bias.shape == (after,)
    assert torch.equal(model(query, pool, mask, seqs, one, with_dists=True).log_dist, was)
    with tempfile.TemporaryDirectory() as folder:
        model.save(folder)
        back = load_selector(folder)
    assert back.cfg == model.cfg and torch.equal(back.stop_bias, model.stop_bias)


def test_prompt_order_reverses_each_sequences_demonstrations_and_keeps_the_padding_last():
    seqs = torch.tensor([[3, 1, 2, -1], [-1, -1, -1, -1], [0, 1, 2, 4]])
    assert STOP.to_prompt(seqs).tolist() == [[2, 1, 3, -1], [-1, -1, -1, -1], [4, 2, 1, 0]]
    assert torch.equal(STOP.from_prompt(STOP.to_prompt(seqs)), seqs)
    assert torch.equal(replace(STOP, pick_order="prompt").to_prompt(seqs), seqs)
