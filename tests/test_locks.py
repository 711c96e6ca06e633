"""One writer per folder: a second process (or a second open in this one) stops at once, naming the holder."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import evaluate
import gen_rl_data
import rce
from icl_select.locks import exclusive, lock_file

ROOT = Path(__file__).resolve().parents[1]
FAST = dict(batch_size=8, val_frac=0.25, epochs=1)


def test_a_second_holder_is_refused_with_the_first_ones_name_and_a_killed_holder_frees_it(tmp_path):
    target = tmp_path / "runs" / "rce"
    code = (
        f"from icl_select.locks import exclusive; import time\n"
        f"with exclusive({str(target)!r}):\n print('held', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        held = rf"^{re.escape(str(target))}\b.*\bpid {holder.pid}\b"
        with pytest.raises(ValueError, match=held), exclusive(target):
            pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with exclusive(target):  # the kernel released the dead holder's lock: no stale lock to clean up
        assert f"pid {os.getpid()}" in lock_file(target).read_text()


def test_every_stage_refuses_a_folder_another_process_writes(small_data, tmp_path):
    out = tmp_path / "rce"
    with exclusive(out):  # a second open file description conflicts like a second process would
        with pytest.raises(ValueError, match=rf"^{re.escape(str(out))}\b.*\bpid {os.getpid()}\b"):
            rce.main(rce.Args(data=small_data, out=out, **FAST))
        assert not out.exists()  # nothing written, no config.json, no metrics lines
    rce.main(rce.Args(data=small_data, out=out, **FAST))  # free again
    data = tmp_path / "data"
    with exclusive(data), pytest.raises(ValueError, match=rf"^{re.escape(str(data))}\b.*\bpid {os.getpid()}\b"):
        gen_rl_data.generate(gen_rl_data.Args(out=data, num_queries=8, num_train=64, num_val=16, pool_size=8))
    assert not data.exists() and not data.with_name("data.building").exists()
    target = out / "eval" / "val.json"
    with exclusive(target), pytest.raises(ValueError, match=rf"^{re.escape(str(target))}\b.*\bpid {os.getpid()}\b"):
        evaluate.main(evaluate.Args(runs=[out], data=small_data, num_samples=[8]))
    assert not target.exists()
