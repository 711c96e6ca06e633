"""gen_rl_data.py on the simulator: folder contents, determinism, resume, refusal to mix settings, report."""

import errno
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import SMALL

import gen_rl_data
from gen_rl_data import Args, generate, report
from icl_select import files, pools, sharding, sim
from icl_select.backends import sim_from_meta
from icl_select.data import ZERO_SHOT, load_dataset
from icl_select.files import DataError, selector_digest
from model import PointerSelector

ROOT = Path(__file__).resolve().parent.parent
FILES = ("items.json", "embeddings.safetensors", "rl_data.jsonl", "eval_pools.json")
SPARE = dict(num_train=300, num_val=40)  # a small simulator for runs of their own


def test_folder_contents(small_data):
    ds = load_dataset(small_data)
    g = ds.groups
    assert len(g) == SMALL["num_queries"] and g.seq_mask.all() and g.seqs.shape[1:] == (SMALL["group_size"], 4)
    assert ds.meta["complete"] and ds.meta["simulation"] and ds.meta["calibration"]["random_1"] > 0
    image = torch.tensor([it["image_id"] for it in ds.items["train"]])
    # pools never hold the query itself nor an item on its image
    assert not (g.pools == g.queries[:, None]).any()
    assert not (image[g.pools] == image[g.queries][:, None]).any()
    # sequences distinct within a group, picks distinct within a sequence
    for seqs in g.seqs:
        assert len({tuple(s) for s in seqs.tolist()}) == len(seqs)
        assert all(len(set(s)) == len(s) for s in seqs.tolist())
    assert all(src[0] == "retrieval" and set(src[1:]) == {"random"} for src in g.sources)
    assert ds.eval_pools.shape == (SMALL["num_val"], SMALL["pool_size"])


def test_probabilities_at_full_precision_and_zero_shot(small_data):
    """gt_prob is stored exactly as the backend returned it (log-space rewards need the tiny ones), and each query's
    zero-shot gt_prob beside its group."""
    ds = load_dataset(small_data)
    g, sim = ds.groups, sim_from_meta(ds.meta)
    Q, G, S = g.seqs.shape
    icds = g.pools.gather(1, g.seqs.flatten(1)).view(-1, S)  # (Q*G, S) train rows, prompt order
    want = sim.score("train", g.queries.repeat_interleave(G), icds)["gt_prob"].double().view(Q, G)
    assert torch.equal(g.fields["gt_prob"], want)
    zero_shot = sim.score("train", g.queries, torch.zeros(Q, 0, dtype=torch.long))["gt_prob"].double()  # (Q,)
    assert torch.equal(g.fields[ZERO_SHOT], zero_shot[:, None].expand(Q, G))


def test_same_seed_byte_identical_and_resume_after_kill(small_data, tmp_path):
    again = tmp_path / "again"
    generate(Args(out=again, **SMALL))
    for name in FILES:
        assert (again / name).read_bytes() == (small_data / name).read_bytes(), name
    meta_a, meta_b = (json.loads((d / "meta.json").read_text()) for d in (small_data, again))
    meta_a.pop("created_at"), meta_b.pop("created_at")
    assert meta_a == meta_b
    # a kill mid-run: 20 complete lines plus half of the next one, and meta.json not yet finalised
    killed = tmp_path / "killed"
    shutil.copytree(small_data, killed)
    lines = (small_data / "rl_data.jsonl").read_text().splitlines(keepends=True)
    (killed / "rl_data.jsonl").write_text("".join(lines[:20]) + lines[20][: len(lines[20]) // 2])
    meta = json.loads((killed / "meta.json").read_text())
    meta["complete"] = False
    (killed / "meta.json").write_text(json.dumps(meta))
    generate(Args(out=killed, **SMALL))
    assert (killed / "rl_data.jsonl").read_bytes() == (small_data / "rl_data.jsonl").read_bytes()
    # two writers appended some queries twice: the loader says how to repair, and re-running the command does
    twice = tmp_path / "twice"
    shutil.copytree(small_data, twice)
    (twice / "rl_data.jsonl").write_text("".join(lines + lines[3:7]))
    with pytest.raises(ValueError, match=rf"rl_data\.jsonl line {len(lines) + 1}\b.*\bline 4\b.*\bgen_rl_data\.py"):
        load_dataset(twice)
    generate(Args(out=twice, **SMALL))
    assert (twice / "rl_data.jsonl").read_bytes() == (small_data / "rl_data.jsonl").read_bytes()


def test_different_seed_differs_and_mixing_settings_is_refused(small_data, tmp_path):
    other = tmp_path / "other"
    generate(Args(out=other, **{**SMALL, "seed": 1}))
    assert (other / "rl_data.jsonl").read_bytes() != (small_data / "rl_data.jsonl").read_bytes()
    before = {p.name: p.read_bytes() for p in other.iterdir()}
    with pytest.raises(ValueError, match=rf"{re.escape(str(other))}\b.*\bgroup_size\b.*\b8\b.*\b9\b"):
        generate(Args(out=other, **{**SMALL, "seed": 1, "group_size": 9}))
    assert {p.name: p.read_bytes() for p in other.iterdir()} == before  # nothing written


def test_refuses_foreign_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(tmp_path))}\b.*\bmeta\.json\b"):
        generate(Args(out=tmp_path, **SMALL))


def test_report_and_cli_errors(small_data):
    text = report(small_data, Args())
    for needle in (
        "anchor queries | 48",
        "scored sequences | 384",
        "group size min / median / max | 8 / 8 / 8",
        "| hard_plus_gtprob_plus_rel |",
        "| high (",
        "| medium (",
        "| low (",
    ):
        assert needle in text, needle
    shares = [
        float(line.split("|")[3].strip(" %"))
        for line in text.splitlines()
        if line.startswith("| high (") or line.startswith("| medium (") or line.startswith("| low (")
    ]
    assert abs(sum(shares) - 100) < 0.2
    cli = subprocess.run(
        [sys.executable, "gen_rl_data.py", "--seq-len", "30", "--pool-size", "8", "--out", "/nonexistent/x"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    err = cli.stderr.strip()
    assert cli.returncode == 2 and err.startswith("error: ") and "\n" not in err
    assert re.search(r"--seq-len 30\b.*--pool-size 8\b", err)
    assert not Path("/nonexistent/x").exists()


def test_init_adds_selector_sequences(small_data, tmp_path):
    import rce

    run = tmp_path / "rce"
    rce.main(rce.Args(data=small_data, out=run, epochs=1, batch_size=8, val_frac=0.25))
    out = tmp_path / "r2"
    generate(Args(out=out, init=run, init_beams=2, init_samples=3, **SMALL))
    ds = load_dataset(out)
    g, emb = ds.groups, ds.emb["train"]
    # the similarity-retrieval sequence (most similar next to the query) is in every group, as its own entry or as
    # a selector sequence it duplicates (a near-identity selector reading picks nearest-first often equals it)
    retrieval = pools.similarity_ranking(emb[g.queries], emb[g.pools], g.pool_mask)[:, : ds.seq_len].flip(1)
    for src, seqs, ret in zip(g.sources, g.seqs, retrieval.tolist()):
        assert src[0] == "greedy" and "beam" in src and len(src) == SMALL["group_size"]
        assert len({tuple(s) for s in seqs.tolist()}) == len(seqs) and ret in seqs.tolist()
    assert json.loads((out / "meta.json").read_text())["init"]["selector"] == selector_digest(run)[:16]


def test_a_selector_that_may_stop_fills_the_lengths_the_data_asks_for(tmp_path):
    """--init of a selector that may stop, its stop made certain: its greedy, beam and sampled sequences are as long as
    --min-shots asks (the whole --seq-len by default; once they stopped at none and the data was refused by its own
    reader), and at least that long with a smaller --min-shots."""
    import rce

    data, run = tmp_path / "d0", tmp_path / "rce"
    generate(Args(out=data, min_shots=0, num_queries=16, group_size=6, pool_size=12, **SPARE))
    rce.main(rce.Args(data=data, out=run, can_stop=True, epochs=1, batch_size=8, val_frac=0.25))
    model = PointerSelector.load(run)
    with torch.no_grad():
        model.stop_bias.fill_(50.0)  # it would give every question no demonstration at all
    model.save(run)
    for least in (None, 2):
        out = tmp_path / f"from-stop-{least}"
        generate(Args(out=out, init=run, min_shots=least, num_queries=16, group_size=8, pool_size=12, **SPARE))
        g = load_dataset(out).groups
        n = (g.seqs >= 0).sum(-1)[g.seq_mask]  # demonstrations in each scored sequence
        assert (n >= (least or 4)).all()
        from_selector = [i for i, s in enumerate(g.sources[0]) if s in ("greedy", "beam", "sample")]
        assert (g.seqs[:, from_selector] >= 0).sum(-1).min() >= (least or 4)
        if least:  # where it may stop, the selector's sequences stop as soon as the data allows
            assert (g.seqs[:, from_selector] >= 0).sum(-1).max() == least


def test_keeps_a_scratch_folder_it_did_not_make(tmp_path):
    out, build = tmp_path / "d", tmp_path / "d.building"
    build.mkdir()
    (build / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"/d\.building\b.*\bgen_rl_data\.py"):
        generate(Args(out=out, **SMALL))
    assert (build / "notes.txt").read_text() == "mine" and not out.exists()


def test_refuses_before_writing_anything(tmp_path):
    out = tmp_path / "d"
    with pytest.raises(ValueError, match=r"--group-size 30\b.*\b4\b.*\b24\b"):
        generate(Args(out=out, **{**SMALL, "pool_size": 4, "seq_len": 3, "group_size": 30}))
    with pytest.raises(ValueError, match=r"\bpool_size=599\b"):  # each anchor's image holds >= 1 more row
        generate(Args(out=out, **{**SMALL, "pool_size": 599}))
    assert list(tmp_path.iterdir()) == [tmp_path / ".d.lock"]  # the lock's small file, nothing else


def test_full_disk_leaves_no_half_made_folder(tmp_path, monkeypatch):
    def full(path, *a, **kw):
        raise files.DiskFull(f"{path}: the disk is full")

    monkeypatch.setattr(gen_rl_data, "save_tensors", full)
    with pytest.raises(files.DiskFull, match=r"/d\.building/embeddings\.safetensors\b"):
        generate(Args(out=tmp_path / "d", **SMALL))
    assert not (tmp_path / "d").exists() and not (tmp_path / "d.building").exists()
    monkeypatch.undo()
    # the disk fills while scored lines are appended: one line naming the file; the re-run resumes
    real_own_file = sharding.own_file

    class FillingFile:
        def __init__(self, f):
            self.f, self.writes = f, 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, line):
            self.writes += 1
            if self.writes > 10:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.f.write(line)

        def flush(self):
            self.f.flush()

    monkeypatch.setattr(sharding, "own_file", lambda path: FillingFile(real_own_file(path)))
    with pytest.raises(files.DiskFull, match=r"/d/rl_data\.jsonl\b"):
        generate(Args(out=tmp_path / "d", **SMALL))
    monkeypatch.undo()
    generate(Args(out=tmp_path / "d", **SMALL))
    assert len(load_dataset(tmp_path / "d").groups) == SMALL["num_queries"]


def test_rerun_of_a_complete_folder_says_so(small_data, tmp_path, capsys):
    out = tmp_path / "d"
    shutil.copytree(small_data, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    generate(Args(out=out, **SMALL))
    captured = capsys.readouterr()
    assert re.search(rf"^{re.escape(str(out))}\b.*\bcomplete\b.*\b48\b.*\b8\b", captured.out, re.M)
    assert "wrote" not in captured.out and "scoring" not in captured.err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_world_is_recorded_and_scores_every_later_stage(tmp_path):
    """--world and --sim-set land in meta.json's sim_config; the simulator rebuilt from it (what every later stage
    scores with) gives the folder's stored scores; another world does not resume the folder."""
    out = tmp_path / "copy"
    generate(Args(out=out, world="copy", sim_set=["copy_question=0.3"], **SMALL))
    ds = load_dataset(out)
    cfg = sim_from_meta(ds.meta).cfg
    assert (cfg.world, cfg.copy_weight, cfg.copy_question) == ("copy", sim.WORLDS["copy"]["copy_weight"], 0.3)
    g, s = ds.groups, sim_from_meta(ds.meta)
    Q, G, S = g.seqs.shape
    icds = g.pools.gather(1, g.seqs.flatten(1)).view(-1, S)
    res = s.score("train", g.queries.repeat_interleave(G), icds)
    assert torch.equal(g.fields["gt_prob"], res["gt_prob"].double().view(Q, G))
    assert "| observable |" in report(out, Args())  # the calibration table's ceiling rows
    with pytest.raises(ValueError, match=r"\bsim_config\.world\b.*'copy'.*'additive'"):
        generate(Args(out=out, **SMALL))


def test_a_folder_without_a_world_field_is_refused_in_one_line(small_data, tmp_path):
    out = tmp_path / "old"
    shutil.copytree(small_data, out)
    meta = json.loads((out / "meta.json").read_text())
    del meta["sim_config"]["world"]
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=r"meta\.json\b.*'sim_config\.world'"):
        generate(Args(out=out, **SMALL))


def test_bad_sim_set_is_one_line():
    cli = subprocess.run(
        [sys.executable, "gen_rl_data.py", "--calibrate", "--world", "saturating", "--sim-set", "gain_decay=1.5"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    err = cli.stderr.strip()
    assert cli.returncode == 2 and err.startswith("error: ") and "\n" not in err
    assert re.search(r"--sim-set\b.*\bgain_decay\b.*\b1\.5$", err)


def test_infoscore_groups_are_lever_lms_beams_and_every_prompt_is_counted(tmp_path, monkeypatch):
    """--groups infoscore: each anchor's group is what a plain beam search over the simulator finds (every beam grown
    by every candidate placed first, the W with the highest P(y | c + S, x) - P(y | S, x) kept), and meta.json's
    lvlm_calls is the number of prompts the simulator was asked about, counted here, not by the kit."""
    asked = []
    for name in ("score", "info_prob"):
        real = getattr(gen_rl_data.SimBackend, name)

        def counted(self, split, queries, icds, *a, real=real, **kw):
            asked.append(len(queries))
            return real(self, split, queries, icds, *a, **kw)

        monkeypatch.setattr(gen_rl_data.SimBackend, name, counted)
    out, W, S, K = tmp_path / "lever", 3, 2, 8
    generate(Args(out=out, groups="infoscore", group_size=W, seq_len=S, pool_size=K, num_queries=6, **SPARE))
    ds = load_dataset(out)
    assert sum(asked) == ds.meta["lvlm_calls"] == 6 * (1 + K + W * (K - 1) + W + 1)
    simulator = sim_from_meta(ds.meta)

    def p(query: int, pool: list[int], seq: list[int]) -> float:  # one prompt at a time
        rows = torch.tensor([[pool[c] for c in seq]], dtype=torch.long).view(1, len(seq))
        return simulator.score("train", torch.tensor([query]), rows)["gt_prob"].item()

    for i, (query, pool) in enumerate(zip(ds.groups.queries.tolist(), ds.groups.pools.tolist())):
        beams = [[]]
        for _ in range(S):
            grown = [
                ([c, *b], p(query, pool, [c, *b]) - p(query, pool, b)) for b in beams for c in range(K) if c not in b
            ]
            grown.sort(key=lambda x: -x[1])
            beams = [seq for seq, _ in grown[:W]]
        assert sorted(ds.groups.seqs[i].tolist()) == sorted(beams)
        assert ds.groups.sources[i] == ["infoscore"] * W


def test_sampled_data_counts_each_scored_sequence_and_zero_shot_prompt(small_data):
    meta = load_dataset(small_data).meta
    assert meta["groups"] == "sampled" and meta["lvlm_calls"] == SMALL["num_queries"] * (SMALL["group_size"] + 1)
