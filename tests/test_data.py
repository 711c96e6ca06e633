"""The dataset loader: reward modes, curriculum filters, and one clear error per kind of malformed input."""

import errno
import json
import os
import re
import shutil

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from strategies import rng, seeds

from icl_select import files
from icl_select.data import (
    INFO_FLOOR,
    REWARD_MODES,
    ZERO_SHOT,
    DataError,
    RewardArgs,
    compute_reward,
    data_digest,
    filter_queries,
    load_dataset,
    quality_labels,
)


@pytest.fixture
def folder(small_data, tmp_path):
    out = tmp_path / "d"
    shutil.copytree(small_data, out)
    return out


def edit_line(folder, n, fn):
    """Apply fn to the n-th record of rl_data.jsonl (1-based)."""
    path = folder / "rl_data.jsonl"
    lines = path.read_text().splitlines()
    rec = json.loads(lines[n - 1])
    fn(rec)
    lines[n - 1] = json.dumps(rec)
    path.write_text("\n".join(lines) + "\n")


# Patterns name the file (and line), the field and the offending value, never the wording around them.
META = r"meta\.json\b.*"
LINE3 = r"rl_data\.jsonl line 3\b.*"


def expect(folder, pattern):
    with pytest.raises(DataError, match=pattern):
        load_dataset(folder)


def test_digest_keeps_regenerated_data_and_changes_with_a_reward(folder):
    """Regenerating the same data elsewhere writes another time and speed into meta.json, not other data; an edited
    reward is other data. compare.py pairs runs by this digest."""
    before = data_digest(folder)
    meta = json.loads((folder / "meta.json").read_text()) | {"created_at": "2030-01-01T00:00:00+00:00"}
    (folder / "meta.json").write_text(json.dumps(meta | {"lvlm_seq_per_s": 9.5}))
    assert data_digest(folder) == before
    edit_line(folder, 1, lambda rec: rec["seqs"][0].update(acc=1.0 - rec["seqs"][0]["acc"]))
    assert data_digest(folder) != before


def test_loads_clean_folder(small_data):
    ds = load_dataset(small_data)
    assert ds.groups.seqs.dtype == torch.long and ds.emb["train"].shape[0] == len(ds.items["train"])


def test_missing_files_and_versions(folder, tmp_path):
    expect(tmp_path / "nope", rf"^{re.escape(str(tmp_path / 'nope'))}:")  # the folder, not a file in it
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({**meta, "format_version": 99}))
    expect(folder, META + r"'format_version'.*\b99\b.*\b2\b")
    (folder / "meta.json").write_text(json.dumps(meta))
    (folder / "eval_pools.json").unlink()
    expect(folder, r"eval_pools\.json\b")


@pytest.mark.parametrize(
    "edit, pattern",
    [
        (lambda m: m.__setitem__("seq_len", "4"), META + r"'seq_len'.*'4'"),
        (lambda m: m.__setitem__("pool_size", 0), META + r"'pool_size'.*\b0\b"),
        (lambda m: m.__setitem__("complete", "yes"), META + r"'complete'.*'yes'"),
        (lambda m: m.pop("source"), META + r"'source'"),
        (lambda m: m["sim_config"].__setitem__("band", float("nan")), META + r"'sim_config\.band'.*\bnan\b"),
        (lambda m: m["calibration"].__setitem__("random_1", float("inf")), META + r"'calibration\.random_1'.*\binf\b"),
        (lambda m: m["calibration"].__setitem__("random_1", "high"), META + r"'calibration\.random_1'.*'high'"),
        (lambda m: m["sim_config"].__setitem__("num_train", 600.0), META + r"'sim_config\.num_train'.*\b600\.0\b"),
        (
            lambda m: m["sim_config"].__setitem__("image_group_probs", 1),
            META + r"'sim_config\.image_group_probs'.*\b1$",
        ),
        (lambda m: m["sim_config"].__setitem__("typo", 1), META + r"'sim_config\.typo'"),
        (lambda m: m.__setitem__("source", "okvqa"), META + r"'prompt_template\.icd'.*\bNone\b"),
    ],
)
def test_bad_meta_fields(folder, edit, pattern):
    meta = json.loads((folder / "meta.json").read_text())
    edit(meta)
    (folder / "meta.json").write_text(json.dumps(meta))
    expect(folder, pattern)


def test_truncated_last_line(folder):
    path = folder / "rl_data.jsonl"
    text = path.read_text()
    path.write_text(text + text.splitlines()[0][:50])
    n = len(text.splitlines()) + 1
    expect(folder, rf"rl_data\.jsonl line {n}\b")
    assert len(load_dataset(folder, allow_unfinished=True).groups) == n - 1


@pytest.mark.parametrize(
    "edit, pattern",
    [
        (lambda r: r["seqs"][2].__setitem__("icds", [1, 1, 2, 3]), LINE3 + r"'seqs\[2\]\.icds'.*\b1\b"),
        (lambda r: r["seqs"][1].__setitem__("icds", [0, 1, 2, 99]), LINE3 + r"'seqs\[1\]\.icds'.*\b99\b"),
        (lambda r: r["pool"].__setitem__(0, 10**6), LINE3 + r"'pool'.*\b1000000\b"),
        (lambda r: r.__setitem__("query", r["pool"][0]), LINE3 + r"'pool'"),
        (lambda r: r["seqs"][0].__setitem__("gt_prob", float("nan")), LINE3 + r"'seqs\[0\]\.gt_prob'.*\bnan\b"),
        (lambda r: r["seqs"][0].__setitem__("acc", 1.5), LINE3 + r"'seqs\[0\]\.acc'.*\b1\.5\b"),
        (lambda r: r["seqs"][0].__setitem__("acc", float("inf")), LINE3 + r"'seqs\[0\]\.acc'.*\binf\b"),
        (lambda r: r["seqs"][0].__setitem__("correct", 0.5), LINE3 + r"'seqs\[0\]\.correct'.*\b0\.5\b"),
        (lambda r: r.pop(ZERO_SHOT), LINE3 + rf"'{ZERO_SHOT}'"),
        (lambda r: r.__setitem__(ZERO_SHOT, float("nan")), LINE3 + rf"'{ZERO_SHOT}'.*\bnan\b"),
        (lambda r: r.__setitem__(ZERO_SHOT, "0.5"), LINE3 + rf"'{ZERO_SHOT}'.*'0\.5'"),
        (lambda r: r["seqs"][0].pop("rel"), LINE3 + r"'seqs\[0\]\.rel'"),
        (lambda r: r.__setitem__("pool", r["pool"][:3]), LINE3 + r"'pool'.*\b3\b.*\b4\b"),
        (lambda r: r["seqs"][0].__setitem__("icds", [0, 1]), LINE3 + r"'seqs\[0\]\.icds'.*\b2\b.*\b4\b"),
        (lambda r: r["seqs"].__setitem__(1, dict(r["seqs"][0])), LINE3 + r"'seqs\[1\]\.icds'"),
    ],
)
def test_bad_rl_data_lines(folder, edit, pattern):
    edit_line(folder, 3, edit)
    expect(folder, pattern)


def test_duplicate_query_line(folder):
    path = folder / "rl_data.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines + [lines[0]]) + "\n")
    expect(folder, rf"rl_data\.jsonl line {len(lines) + 1}\b.*'query'.*\bline 1\b")


def test_embeddings_must_match_items(folder):
    emb = load_file(folder / "embeddings.safetensors")
    save_file({**emb, "train": emb["train"][:-1]}, folder / "embeddings.safetensors")
    expect(folder, r"embeddings\.safetensors\b.*'train'.*\(599, 512\).*items\.json.*\b600\b")
    emb["val"][7, 3] = float("inf")
    save_file(emb, folder / "embeddings.safetensors")
    expect(folder, r"embeddings\.safetensors\b.*'val'.*\brow 7\b")


@pytest.mark.parametrize(
    "edit, pattern",
    [
        (
            lambda it: it["train"][5].__setitem__("image_id", float("nan")),
            r"items\.json\b.*'train\[5\]\.image_id'.*\bnan\b",
        ),
        (
            lambda it: it["val"][2].__setitem__("answers", ["a", 3]),
            r"items\.json\b.*'val\[2\]\.answers'",
        ),
        (lambda it: it["val"][0].__setitem__("question", None), r"items\.json\b.*'val\[0\]\.question'.*\bNone\b"),
    ],
)
def test_bad_items(folder, edit, pattern):
    items = json.loads((folder / "items.json").read_text())
    edit(items)
    (folder / "items.json").write_text(json.dumps(items))
    expect(folder, pattern)


def test_eval_pools_validated(folder):
    pools = json.loads((folder / "eval_pools.json").read_text())
    pools["pools"][5][0] = pools["pools"][5][1]
    (folder / "eval_pools.json").write_text(json.dumps(pools))
    expect(folder, rf"eval_pools\.json\b.*'pools\[5\]'.*\b{pools['pools'][5][0]}\b")


@given(seeds, st.sampled_from(REWARD_MODES))
def test_reward_modes(seed, mode):
    g = rng(seed)
    correct = (torch.rand(6, 5, generator=g) < 0.5).double()
    acc = correct * torch.randint(1, 4, (6, 5), generator=g).double() * 0.3
    fields = {
        "correct": correct,
        "acc": acc,
        "gt_prob": torch.rand(6, 5, generator=g, dtype=torch.float64),
        "rel": torch.rand(6, 5, generator=g, dtype=torch.float64),
        ZERO_SHOT: torch.rand(6, 1, generator=g, dtype=torch.float64).repeat(1, 5),
    }
    fields["gt_prob"][0, :2] = 0.0  # an underflow: info_score floors it
    fields[ZERO_SHOT][1] = 1e-9
    args = RewardArgs(mode, hard_weight=1.0, soft_weight=0.5, rel_weight=0.3)
    r = compute_reward(fields, args)
    expected = {
        "hard_plus_soft": correct + 0.5 * acc,
        "separated": torch.where(correct > 0, 2 + acc, acc),
        "hard_only": correct,
        "soft_only": acc,
        "hard_plus_gtprob": correct + 0.5 * fields["gt_prob"],
        "hard_plus_gtprob_plus_rel": correct + 0.5 * fields["gt_prob"] + 0.3 * (1 - correct) * fields["rel"],
        "info_score": 0.5 * (fields["gt_prob"].clamp_min(INFO_FLOOR) / fields[ZERO_SHOT].clamp_min(INFO_FLOOR)).log(),
    }[mode]
    assert torch.isfinite(r).all()
    assert torch.allclose(r, expected)
    # a correct answer never earns less than a wrong one with the same soft fields, in every mode
    flipped = compute_reward({**fields, "correct": torch.ones_like(correct), "acc": acc.clamp_min(0.3)}, args)
    assert (flipped >= r - 1e-12).all()


def test_info_score_needs_the_zero_shot_probability():
    fields = {k: torch.full((2, 3), 0.5, dtype=torch.float64) for k in ("correct", "acc", "gt_prob", "rel")}
    with pytest.raises(ValueError, match=ZERO_SHOT):
        compute_reward(fields, RewardArgs("info_score"))


def test_quality_and_filters(small_data):
    g = load_dataset(small_data).groups
    reward = compute_reward(g.fields, RewardArgs())
    labels = quality_labels(g, reward)
    for i, lab in enumerate(labels):
        r, pos = reward[i], int(g.fields["correct"][i].sum())
        gap, both = float(r.max() - r.min()), min(pos, len(r) - pos)
        want = "high" if gap >= 1.5 and both >= 3 else "medium" if gap >= 1.0 and both >= 2 else "low"
        assert lab == want
    high = filter_queries(g, reward, "high", False).tolist()
    medium = filter_queries(g, reward, "medium", False).tolist()
    assert set(high) <= set(medium) and len(filter_queries(g, reward, "all", False)) == len(g)
    positive = filter_queries(g, reward, "all", True)
    assert (g.fields["correct"][positive].sum(-1) > 0).all()


def test_full_disk_is_one_line_naming_the_file_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    target = tmp_path / "meta.json"
    target.write_text("old")
    real_open = open

    class FullDisk:
        """A file on a disk that fills after 10 bytes."""

        def __init__(self, path, mode):
            self.f = real_open(path, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[:10])
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files, "open", FullDisk, raising=False)
    for write in (
        lambda: files.atomic_write_text(target, "new" * 100),
        lambda: files.save_tensors(target, {"x": torch.ones(3)}),
    ):
        with pytest.raises(files.DiskFull, match=rf"^{re.escape(str(target))}: [^\n]*$"):
            write()
        assert target.read_text() == "old" and list(tmp_path.iterdir()) == [target]


def test_every_file_gets_the_mode_a_plain_open_gives(tmp_path):
    umask = os.umask(0o027)
    try:
        (tmp_path / "plain").write_text("x")
        files.atomic_write_text(tmp_path / "a.json", "{}")
        files.save_tensors(tmp_path / "t.safetensors", {"x": torch.ones(3)})
    finally:
        os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert modes == {"plain": 0o640, "a.json": 0o640, "t.safetensors": 0o640}
