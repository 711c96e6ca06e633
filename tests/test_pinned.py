"""Speed work must not change results where the maths did not change: the bytes of tiny trained selectors are
pinned here. A change of these hashes is a change of results; make it only on purpose (a fix of the maths), say so
in the commit, and re-pin with `PIN=1 pytest tests/test_pinned.py -s`.

CPU kernels are chosen by instruction set and round differently, so the run is made in a child process held to
run.sh's kernels (icl_select.runs.KERNELS: AVX2 for ATen, MKL and oneDNN, one thread).
"""

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from icl_select.runs import KERNELS

PINNED = {
    "rce": "8198cd714926ec52",
    "offline": "1ded03deae296c83",
    "online": "efbd3c05c6d43fad",
}
ROOT = Path(__file__).resolve().parent.parent


def train_tiny(root: Path) -> dict[str, str]:
    """A small simulated dataset, RCE (2 epochs), offline GRPO (2 epochs) and online GRPO (1 epoch) from it."""
    import torch

    import gen_rl_data
    import grpo
    import rce

    torch.set_num_threads(1)
    data, fast = root / "data", dict(batch_size=8, val_frac=0.25)
    gen_rl_data.generate(
        gen_rl_data.Args(out=data, num_train=600, num_val=150, num_queries=48, group_size=8, pool_size=24)
    )
    rce.main(rce.Args(data=data, out=root / "rce", epochs=2, **fast))
    grpo.main(grpo.Args(data=data, init=root / "rce", out=root / "offline", epochs=2, **fast))
    online = dict(epochs=1, online=True, replay_steps=0, item_bias=False)  # pinned before replay and the item scores
    grpo.main(grpo.Args(data=data, init=root / "rce", out=root / "online", **online, **fast))
    return {
        name: hashlib.sha256((root / name / "model.safetensors").read_bytes()).hexdigest()[:16]
        for name in ("rce", "offline", "online")
    }


def cpu_model() -> str:
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "unknown")


def test_trained_bytes_are_pinned(tmp_path):
    # Pinned on AMD EPYC machines (the development and CI machines). The AVX2 settings should give the same bytes on
    # any x86-64 CPU, but a BLAS may still pick other kernels on another vendor's CPU: there the pins are not checked.
    if os.uname().machine != "x86_64" or not cpu_model().startswith("AMD EPYC"):
        pytest.skip(f"pins are for AVX2 kernels on AMD EPYC CPUs, this is {cpu_model()}")
    env = {**os.environ, **KERNELS, "PYTHONPATH": str(ROOT)}
    child = subprocess.run(
        [sys.executable, __file__, str(tmp_path)], env=env, capture_output=True, text=True, check=True
    )
    got = json.loads(child.stdout.strip().split("\n")[-1])
    if os.environ.get("PIN"):
        print(f"\nPINNED = {json.dumps(got)}")
    assert got == PINNED


def test_run_sh_trains_on_the_pinned_kernels():
    """run.sh's figures are the README's on any x86-64 machine only if it exports the settings pinned here."""
    exports = re.findall(r"^export ((?:\w+=\S+ ?)+)$", (ROOT / "run.sh").read_text(), re.M)
    settings = dict(kv.split("=") for line in exports for kv in line.split())
    assert {k: settings.get(k) for k in KERNELS} == KERNELS


if __name__ == "__main__":
    print(json.dumps(train_tiny(Path(sys.argv[1]))))
