"""The command-line layer every stage shares: one-line errors, Ctrl-C, --threads, and a --help that reads well."""

import importlib
import re
import sys
from dataclasses import dataclass

import pytest
import torch
from tqdm import tqdm

from icl_select.cli import CpuArgs, run_cli


@dataclass
class _NoFlags:
    pass


def test_cli_error_gets_a_line_of_its_own_after_a_progress_bar(monkeypatch, capsys):
    problem = "data/x/rl_data.jsonl: line 5: field 'seqs' is missing"

    def main(_):
        bar = tqdm(total=10, desc="scoring", mininterval=0)  # a bar held by a variable, as in clip_embed
        bar.update(5)
        raise ValueError(problem)

    monkeypatch.setattr(sys, "argv", ["prog"])
    with pytest.raises(SystemExit) as stop:
        run_cli(main, _NoFlags)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "scoring" in err  # the bar was drawn ...
    last = err.rstrip("\n").split("\n")[-1].split("\r")[-1]  # ... and the terminal shows the error alone on its line
    assert last == f"error: {problem}"  # the message as raised, nothing of the bar before it


@dataclass
class _Resumable:
    out: str = "runs/x"


def test_ctrl_c_is_one_line_with_the_command_that_continues(monkeypatch, capsys):
    def main(_):
        bar = tqdm(total=10, desc="rce epoch 1/10", mininterval=0)
        bar.update(3)
        raise KeyboardInterrupt

    monkeypatch.setattr(sys, "argv", ["rce.py", "--out", "runs/my run"])
    with pytest.raises(SystemExit) as stop:
        run_cli(main, _Resumable)
    assert stop.value.code == 130
    last = capsys.readouterr().err.rstrip("\n").split("\n")[-1].split("\r")[-1]
    assert last.startswith("interrupted") and last.endswith("python rce.py --out 'runs/my run'")


def test_threads_flag_sets_torch_threads_and_rejects_zero(monkeypatch, capsys):
    seen = []
    before = torch.get_num_threads()
    try:
        for argv, code in ((["x"], None), (["x", "--threads", "2"], None), (["x", "--threads", "0"], 2)):
            monkeypatch.setattr(sys, "argv", argv)
            if code is None:
                run_cli(lambda a: seen.append(torch.get_num_threads()), CpuArgs)
            else:
                with pytest.raises(SystemExit) as stop:
                    run_cli(lambda a: seen.append("ran"), CpuArgs)
                assert stop.value.code == code and re.search(r"--threads.*0", capsys.readouterr().err)
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 2]  # the default is one thread; a bad count stops before main runs


@pytest.mark.parametrize(
    "stage, first",
    [
        ("gen_rl_data", ["--out", "--lvlm", "--dataset", "--data-root", "--task"]),
        ("rce", ["--data", "--out", "--init"]),
        ("grpo", ["--init", "--data", "--out", "--online", "--kl-beta"]),
        ("evaluate", ["--baseline", "--data", "--out", "--lvlm"]),
    ],
)
def test_help_opens_with_one_line_and_the_most_used_flags(stage, first, monkeypatch, capsys):
    """tyro would list inherited flags (--threads, the reward weights) first and print the dataclass docstring."""
    module = importlib.import_module(stage)
    monkeypatch.setenv("COLUMNS", "300")
    monkeypatch.setattr(sys, "argv", [f"{stage}.py", "--help"])
    with pytest.raises(SystemExit) as stop:
        run_cli(module.main, module.Args)
    assert stop.value.code == 0
    out = capsys.readouterr().out
    lines = out.split("\n")
    assert lines[2] == module.__doc__.strip().split("\n")[0] and lines[3] == ""  # usage, blank, what it does
    assert lines[4].removeprefix("Most used: ").split(", ") == first
    rows = [ln.strip("│ ") for ln in lines]  # tyro draws a box on a terminal, none here
    flags = {w.rstrip(",") for r in rows if r.startswith("--") for w in r.split() if w.startswith("--")}
    assert set(first) <= flags  # each one named is a flag
    for row in rows:  # a flag whose default depends on others says what it is, once
        assert row.count("(default:") <= 1, row
