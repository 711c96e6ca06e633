"""torchrun scale-out on CPU (gloo, 2 processes): sharded runs write exactly what a single process writes."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import SMALL
from hypothesis import example, given
from hypothesis import strategies as st

from gen_rl_data import Args, generate

ROOT = Path(__file__).resolve().parent.parent
FLAGS = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]


def torchrun(script: str, *args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", script, *args]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow  # two processes that import torch
def test_gen_rl_data_two_ranks_equal_one(small_data, tmp_path):
    out = tmp_path / "sharded"
    torchrun("gen_rl_data.py", f"--out={out}", *FLAGS)
    assert (out / "rl_data.jsonl").read_bytes() == (small_data / "rl_data.jsonl").read_bytes()
    assert not list(out.glob("rl_data.rank*.jsonl"))
    assert json.loads((out / "meta.json").read_text())["complete"]


def test_leftover_shards_of_a_crashed_run_are_resumed_and_merged(small_data, tmp_path):
    out = tmp_path / "crashed"
    lines = (small_data / "rl_data.jsonl").read_text().splitlines(keepends=True)
    generate(Args(out=out, **SMALL))
    # as if rank 0 had finished its even queries and rank 1 died in the middle of its 5th line
    (out / "rl_data.jsonl").unlink()
    (out / "rl_data.rank0.jsonl").write_text("".join(lines[0::2]))
    (out / "rl_data.rank1.jsonl").write_text("".join(lines[1::2][:4]) + lines[9][:40])
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps({**meta, "complete": False}))
    generate(Args(out=out, **SMALL))
    assert (out / "rl_data.jsonl").read_bytes() == (small_data / "rl_data.jsonl").read_bytes()
    assert not list(out.glob("rl_data.rank*.jsonl"))


@pytest.mark.slow  # two processes that import torch
@pytest.mark.parametrize("baseline", ["random", "oracle"])  # the oracle's best of 0..k reuses its exactly-k answers
def test_evaluate_two_ranks_equal_one(small_data, tmp_path, baseline):
    import evaluate

    args = ["--baseline", baseline, "--num-samples", "50", "150", "--batch-size", "16"]
    torchrun("evaluate.py", "--data", str(small_data), "--out", str(tmp_path / "two"), *args)
    evaluate.main(
        evaluate.Args(data=small_data, baseline=baseline, out=tmp_path / "one", num_samples=[50, 150], batch_size=16)
    )
    for name in ["val.json"] + ["val-upto.json"] * (baseline == "oracle"):
        two, one = ((tmp_path / d / "eval" / name).read_text() for d in ("two", "one"))
        assert two == one
    assert not list((tmp_path / "two" / "eval").glob("*.partial.jsonl"))


def test_share_and_chunk_are_disjoint_covers():
    from icl_select import sharding

    for n in range(0, 30):
        for world in range(1, 5):
            for split in (sharding.share, sharding.chunk):
                parts = [list(split(n, r, world)) for r in range(world)]
                assert sorted(sum(parts, [])) == list(range(n))
            sizes = [len(sharding.chunk(n, r, world)) for r in range(world)]
            assert sum(parts, []) == list(range(n)) and max(sizes) - min(sizes) <= 1  # chunks: in order, even


@given(st.lists(st.integers(0, 50), min_size=1, max_size=12, unique=True), st.integers(0, 80), st.booleans())
@example(items=[3, 7], cut=1, same_settings=True)  # only the last newline lost: the record is whole
def test_progress_files_keep_every_complete_line_and_resume_after_a_cut(items, cut, same_settings):
    """A killed write leaves a truncated last line: `done` skips it, `own_file` cuts it and appends after it; a file
    started by other settings (another header) counts for nothing and is started afresh."""
    from icl_select import sharding

    with tempfile.TemporaryDirectory() as tmp:
        path, header = Path(tmp) / "rank0.jsonl", {"shots": [1, 2]}
        with sharding.own_file(path, header if same_settings else {"shots": [8]}) as f:
            for i in items:
                f.write(json.dumps({"i": i, "v": [i] * 3}) + "\n")
        text = path.read_text()
        path.write_text(text[: len(text) - cut % len(text.split("\n")[-2])])  # cut inside the last line, or not
        survived = sharding.done([path], "i", header)
        complete = items if cut % len(text.split("\n")[-2]) <= 1 else items[:-1]
        assert sorted(survived) == (sorted(complete) if same_settings else [])
        with sharding.own_file(path, header) as f:
            f.write(json.dumps({"i": 99, "v": []}) + "\n")
        assert sorted(sharding.done([path], "i", header)) == sorted([*survived, 99])


# grpo.py under torchrun, each rank appending the size of every batch it asks the simulator to score to count.<rank>;
# rank 1 kills itself at its DIE_AT-th batch, if given (torchrun then stops the other rank: the job dies mid-epoch).
COUNTING = """
import os, runpy, signal, sys
sys.path.insert(0, os.getcwd())
from icl_select.backends import SimBackend
real, count = SimBackend.score, os.path.join(sys.argv[1], "count." + os.environ["RANK"])
def score(self, split, queries, icds, gt_prob=True):
    with open(count, "a") as f:
        f.write(f"{len(queries)}\\n")
    if os.environ["RANK"] == "1" and sum(1 for _ in open(count)) == int(os.environ.get("DIE_AT", 0)):
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, split, queries, icds, gt_prob)
SimBackend.score = score
sys.argv = ["grpo.py", *sys.argv[2:]]
runpy.run_path("grpo.py", run_name="__main__")
"""


@pytest.mark.slow  # three trainings, two of them torchrun jobs
def test_online_grpo_two_ranks_train_the_bytes_of_one_and_resume_after_a_kill(small_data, tmp_path):
    """Each rank scores its chunk of every batch of new sequences and all apply the same update: the run folder of 2
    ranks, killed and resumed, is the one-process run's, byte for byte, and no sequence is scored by both ranks."""
    import grpo
    import rce

    init, one, two = tmp_path / "rce", tmp_path / "one", tmp_path / "two"
    rce.main(rce.Args(data=small_data, out=init, epochs=1, batch_size=8, val_frac=0.25))
    flags = dict(data=small_data, init=init, epochs=6, batch_size=8, val_frac=0.25, group_size=6, online=True)
    grpo.main(grpo.Args(out=one, keep_every=1, **flags))

    (tmp_path / "counting.py").write_text(COUNTING)
    argv = [str(tmp_path / "counting.py"), str(tmp_path)]
    argv += [f"--{k.replace('_', '-')}={v}" for k, v in flags.items() if k != "online"]
    argv += ["--online", "--keep-every=1", f"--out={two}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed = subprocess.run(cmd, cwd=ROOT, env={**env, "DIE_AT": "25"}, capture_output=True, text=True, timeout=300)
    done = sorted(int(p.stem.split("_")[1]) for p in (two / "ckpt").glob("epoch_*.safetensors"))
    assert killed.returncode != 0 and 1 <= done[-1] < 6, killed.stderr[-3000:]  # died mid-run, after a checkpoint
    for rank in (0, 1):
        (tmp_path / f"count.{rank}").unlink()
    torchrun(*argv)

    for name in ["model.safetensors", "scores.safetensors", *(f"ckpt/epoch_{e:03d}.safetensors" for e in range(1, 7))]:
        assert (two / name).read_bytes() == (one / name).read_bytes(), name
    assert (two / "metrics.jsonl").read_text() == (one / "metrics.jsonl").read_text()
    config = [json.loads((d / "config.json").read_text()) for d in (one, two)]
    for c in config:  # where each run went and the command that started it differ, nothing else
        del c["argv"], c["out"], c["args"]["out"]
    assert config[0] == config[1]
    calls = [r["lvlm/calls"] for r in map(json.loads, (one / "metrics.jsonl").read_text().splitlines())]
    scored = [sum(map(int, (tmp_path / f"count.{rank}").read_text().split())) for rank in (0, 1)]
    assert min(scored) > 0 and sum(scored) == calls[-1] - calls[done[-1]]  # the resumed epochs' calls, shared
