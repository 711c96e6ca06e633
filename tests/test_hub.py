"""PointerSelector on the Hugging Face Hub: from_pretrained of a run folder or a Hub id (offline, from a local cache,
at a revision), push_to_hub with the upload intercepted (no network): to the repository asked for, the kit's files and
the run's config.json and metrics.jsonl byte for byte, and a model card with the run's accuracy table. What loads is
compared with the selector that was saved, held in memory, not with another read of the same files."""

import json
import shutil

import pytest
import torch
from huggingface_hub import HfApi, ModelCard
from test_compare import write_run

from compare import read_run
from icl_select.files import DataError, selector_digest
from icl_select.runs import load_selector
from model import PointerSelector, SelectorConfig

CFG = SelectorConfig(dim=12, hidden=16, num_layers=1, num_heads=2, picks=2)
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def selector(seed: int = 0) -> PointerSelector:
    """The selector a run folder of `make_run` holds, built afresh (deterministic initialisation)."""
    torch.manual_seed(seed)
    return PointerSelector(CFG)


def make_run(folder):
    """A run folder as rce.py and evaluate.py leave it: the selector, config.json, metrics.jsonl, eval/val.json."""
    selector().save(folder)
    config = {
        "args": {"epochs": 3, "lr": 1e-4, "data": "data/sim", "out": str(folder)},
        "argv": ["/home/me/icl-select/rce.py", "--data", "data/sim", "--out", "runs/my rce"],
        "git_sha": "d71f92f416cd01f306d3b14e32de92bf045928db",
        "data": {"folder": "data/sim", "digest": "73cc9b8604145e65", "simulation": True},
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    epochs = [{"phase": "rce", "epoch": e, "val/acc": 40.0 + e} for e in range(4)]
    write_run(folder, {1: [1, 0, 0.6, 1], 2: [0, 0.3, 1, 1]}, metrics=epochs[:-1] + [epochs[-1] | {"best_epoch": 3}])
    doc = json.loads((folder / "eval" / "val.json").read_text())
    doc |= {"split": "val", "backend_info": {"sim_config": {"world": "copy"}}}
    doc["selector_digest"] = selector_digest(folder)  # the selector it evaluated
    (folder / "eval" / "val.json").write_text(json.dumps(doc))
    return folder


def push(model, repo_id, monkeypatch):
    """push_to_hub with HfApi's two calls intercepted: -> {file name: bytes} of the folder it would upload, once, to
    `repo_id` (the repository created and the one uploaded to)."""
    uploaded, created, targets = {}, [], []

    def create_repo(self, repo_id, **kwargs):
        created.append(repo_id)
        return type("RepoUrl", (), {"repo_id": repo_id})()

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        targets.append(repo_id)
        uploaded.update({p.name: p.read_bytes() for p in folder_path.iterdir()})
        return f"https://huggingface.co/{repo_id}/commit/{COMMIT}"

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    assert model.push_to_hub(repo_id).endswith(COMMIT)
    assert created == targets == [repo_id], (created, targets)
    return uploaded


def assert_same_selector(a: PointerSelector, b: PointerSelector):
    assert a.cfg == b.cfg
    for (k, x), (k2, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(x, y)


def cache_snapshot(cache, repo: str, commit: str, files: dict[str, bytes], *refs: str):
    """`files` laid out as huggingface_hub caches a download of `repo` at `commit`, which each of `refs` points at."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    (folder / "snapshots" / commit).mkdir(parents=True)
    (folder / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (folder / "refs" / ref).write_text(commit)
    for name, data in files.items():
        (folder / "snapshots" / commit / name).write_bytes(data)
    return folder / "snapshots" / commit


def test_a_run_folder_loads_the_selector_it_holds(tmp_path):
    run = make_run(tmp_path / "rce")
    model = PointerSelector.from_pretrained(run)
    assert_same_selector(model, selector())
    assert model.cfg == CFG and not model.training
    assert model.run_files == {name: (run / name).read_bytes() for name in ("config.json", "metrics.jsonl")}
    assert model.run_eval["summary"]["4"] == pytest.approx({"1": 65.0, "2": 57.5})


def test_push_uploads_the_runs_files_and_a_card_with_its_accuracy(tmp_path, monkeypatch):
    run = make_run(tmp_path / "rce")
    files = push(PointerSelector.from_pretrained(str(run)), "me/selector", monkeypatch)
    assert sorted(files) == ["README.md", "config.json", "metrics.jsonl", "model.json", "model.safetensors"]
    for name in ("model.safetensors", "model.json", "config.json", "metrics.jsonl"):
        assert files[name] == (run / name).read_bytes(), name
    card = ModelCard(files["README.md"].decode())
    assert {"icl-select", "model_hub_mixin"} <= set(card.data.tags)
    assert 'PointerSelector.from_pretrained("me/selector")' in card.text
    assert "hf download me/selector" in card.text and "python evaluate.py selector" in card.text
    # the run: its command (the script's name, not the folder it ran from), commit and data digest
    assert "python rce.py --data data/sim --out 'runs/my rce'" in card.text and "/home/me" not in card.text
    assert "d71f92f416cd" in card.text and "73cc9b8604145e65" in card.text and "world copy" in card.text
    assert selector_digest(run)[:16] in card.text
    # n=4: 65.00 at 1 shot, 57.50 at 2
    assert "| 4 | 65.00 | 57.50 | 61.25 |" in card.text and "| 2 | 50.00 | 15.00 | 32.50 |" in card.text


def test_a_hub_id_loads_offline_from_the_cache(tmp_path, monkeypatch):
    """What a push uploads, laid out as huggingface_hub caches a download, loads with no network."""
    run = make_run(tmp_path / "rce")
    files = push(PointerSelector.from_pretrained(run), "me/selector", monkeypatch)
    snapshot = cache_snapshot(tmp_path / "cache", "me/selector", COMMIT, files, "main")
    offline = dict(cache_dir=tmp_path / "cache", local_files_only=True)
    model = PointerSelector.from_pretrained("me/selector", **offline)
    assert_same_selector(model, selector())
    assert model.run_files == {name: files[name] for name in ("config.json", "metrics.jsonl")}
    # the downloaded folder is the run's to compare.py (its flags and history travelled), not an unfinished run
    assert read_run(snapshot, "val").kind() == "RCE, 3 epochs"
    assert model.run_eval is None  # no evaluation travels: pushed again, its card says how to make one
    again = push(model, "you/selector", monkeypatch)
    assert sorted(again) == sorted(files)
    for name in ("model.safetensors", "model.json", "config.json", "metrics.jsonl"):
        assert again[name] == files[name], name
    assert "## Accuracy" not in again["README.md"].decode() and "you/selector" in again["README.md"].decode()
    with pytest.raises(FileNotFoundError, match=r"^me/other: no such run folder, nor a selector on the Hub \(") as e:
        PointerSelector.from_pretrained("me/other", **offline)
    assert "\n" not in str(e.value)


def test_a_revision_loads_that_snapshot(tmp_path, monkeypatch):
    """revision= picks the snapshot: a commit hash or a branch; none is main."""
    files = push(PointerSelector.from_pretrained(make_run(tmp_path / "rce")), "me/selector", monkeypatch)
    later = tmp_path / "later"
    shutil.copytree(tmp_path / "rce", later)
    selector(1).save(later)  # the same run trained on: other weights
    other = {name: (later / name).read_bytes() for name in files if name != "README.md"}
    commit = "fedcba9876543210fedcba9876543210fedcba98"
    cache_snapshot(tmp_path / "cache", "me/selector", COMMIT, files, "main")
    cache_snapshot(tmp_path / "cache", "me/selector", commit, other, "v2")
    offline = dict(cache_dir=tmp_path / "cache", local_files_only=True)
    assert_same_selector(PointerSelector.from_pretrained("me/selector", **offline), selector(0))
    for revision in (commit, "v2"):
        assert_same_selector(PointerSelector.from_pretrained("me/selector", revision=revision, **offline), selector(1))
    assert_same_selector(PointerSelector.from_pretrained("me/selector", revision=COMMIT, **offline), selector(0))
    with pytest.raises(FileNotFoundError, match=r"^me/selector: no such run folder, nor a selector on the Hub \("):
        PointerSelector.from_pretrained("me/selector", revision="v3", **offline)


def test_an_evaluation_of_other_weights_stays_off_the_card(tmp_path, monkeypatch, capsys):
    run = make_run(tmp_path / "rce")
    torch.manual_seed(1)
    PointerSelector(CFG).save(run)  # training went on after the evaluation
    model = PointerSelector.from_pretrained(run)
    assert model.run_eval is None and "val.json evaluated other weights" in capsys.readouterr().err
    card = push(model, "me/selector", monkeypatch)["README.md"].decode()
    assert "## Accuracy" not in card and "65.00" not in card


def test_bad_folders_and_selectors_without_a_run_are_one_line(tmp_path, monkeypatch):
    run = make_run(tmp_path / "rce")
    bad = tmp_path / "bad"
    shutil.copytree(run, bad)
    (bad / "model.json").unlink()
    with pytest.raises(DataError, match=r"bad/model\.json: missing file$"):
        PointerSelector.from_pretrained(bad)
    with pytest.raises(FileNotFoundError, match=r"^runs/nothere: no such run folder"):
        PointerSelector.from_pretrained("runs/nothere", cache_dir=tmp_path / "cache", local_files_only=True)
    # a selector read without its run's config.json has nothing to share beside it; the run folder is left as it is
    loose = load_selector(run)
    monkeypatch.setattr(HfApi, "create_repo", lambda *a, **k: pytest.fail("a repository was created"))
    for call in (lambda: loose.push_to_hub("me/selector"), lambda: loose.save_pretrained(run)):
        with pytest.raises(ValueError, match=r"config\.json.*from_pretrained"):
            call()
    assert json.loads((run / "config.json").read_text())["args"]["epochs"] == 3
    assert not (run / "README.md").exists()
