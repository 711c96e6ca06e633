"""LVLM backends behind one interface: score a query given an ordered list of ICDs.

    backend.score(split, queries (N,), icds (N, k) train rows) -> {"prediction": [str], "acc", "correct",
                                                                  "gt_prob", "rel": (N,) tensors}
    backend.describe() -> dict recorded in meta.json / eval files (id, revision, prompt template, generation args)

`SimBackend` wraps the built-in simulator (default, CPU, instant). The transformers backend (Qwen2.5-VL & co.)
implements the same two methods.
"""

from __future__ import annotations

from dataclasses import asdict

import torch
from torch import Tensor

from sim import SimConfig, Simulator


class SimBackend:
    """The simulated LVLM; every output it produces is labelled as simulation."""

    name = "sim"

    def __init__(self, sim: Simulator):
        self.sim = sim

    def score(self, split: str, queries: Tensor, icds: Tensor) -> dict:
        return self.sim.score(split, queries, icds)

    def describe(self) -> dict:
        return {"lvlm": "sim", "simulation": True, "sim_config": asdict(self.sim.cfg)}


def open_backend(meta: dict, emb: dict[str, Tensor] | None = None) -> SimBackend:
    """The backend a dataset folder was scored with, rebuilt from its meta.json.

    For the simulator the folder's embeddings must be the ones the rebuilt simulator produces, else the stored
    scores and the backend would disagree.
    """
    if meta.get("source") != "sim":
        raise ValueError(f"dataset source {meta.get('source')!r}: only the simulator backend is available so far")
    cfg = {k: tuple(v) if isinstance(v, list) else v for k, v in meta["sim_config"].items()}  # JSON lists -> tuples
    sim = Simulator(SimConfig(**cfg))
    if emb is not None and not all(torch.equal(sim.emb[k], emb[k]) for k in ("train", "val")):
        raise ValueError("the dataset's embeddings differ from those of the simulator its meta.json describes")
    return SimBackend(sim)
