"""Training never reads the simulator's hidden truth: RCE, offline GRPO and a budgeted online GRPO run (its warm start
included) learn from what a real LVLM would give them, the dataset folder and the scores of the prompts they send, and
nothing else.

Every part of `sim.Simulator` that holds or reads the planted truth is guarded: the latents and the answer tables
(instance state), and every method and cached property but OPEN, which read only what the dataset folder holds (so a
method added later is guarded too): the answer model (helpfulness, the logit, the features and reply behind `score`),
the oracle and its search, and the probes behind the observable ceiling (they read the latents to fit; evaluation
only). A guarded part may be read only while a simulator is being built, or inside `Simulator.score` called by a method
of `backends.SimBackend`, the scoring path (behind the score cache, the one the budget counts). Anything else, such as
grpo.py reading `sim.latents` or calling `sim.oracle`, or scoring through the simulator behind the backend's back,
fails the test. Not guarded: `cfg` (meta.json records it), `emb` and `items` (the folder's embeddings and items.json).
The captioning world's `sim_caption.CaptionSimulator` is guarded alike (its latents, memo of scores and templates, every
method and cached property but those of OPEN); not guarded there either: its references and their CIDEr-D scorer,
which items.json holds.
"""

from __future__ import annotations

import functools
import inspect
import sys
import traceback
from types import SimpleNamespace

import pytest
from conftest import SMALL_NET

import gen_rl_data
import grpo
import rce
from icl_select import sim
from icl_select.backends import SimBackend, sim_from_meta
from icl_select.data import read_meta
from icl_select.sim_caption import CaptionSimulator

# Per simulator: the instance attributes __init__ sets that hold the truth, and the methods that read only cfg and the
# train embeddings (or build an empty state); every other method and cached property is guarded, whatever its name
# (__init__ and score open the guard instead).
STATES = {
    sim.Simulator: ("latents", "_acc", "_rel", "_predictions"),
    CaptionSimulator: ("latents", "_memo", "_templates"),
}
OPENS = {
    sim.Simulator: ("position_weights", "redundancy", "_pair_penalty"),
    CaptionSimulator: ("position_weights", "_start"),
}
STATE, OPEN = STATES[sim.Simulator], OPENS[sim.Simulator]


def methods(cls: type) -> list[str]:
    return [
        name
        for name, f in vars(cls).items()
        if inspect.isfunction(f) and not name.startswith("__") and name not in (*OPENS[cls], "score")
    ]


def cached(cls: type) -> list[str]:
    return [name for name, f in vars(cls).items() if isinstance(f, functools.cached_property)]


METHODS, CACHED = methods(sim.Simulator), cached(sim.Simulator)
FAST = dict(batch_size=8, val_frac=0.25)


@pytest.fixture
def guard(monkeypatch):
    """Guards every hidden part of sim.Simulator for the test: -> .reads (each read outside scoring, with where it came
    from; the read also raises) and .scored (prompts scored through the one scoring path)."""
    state = SimpleNamespace(open=0, reads=[], scored=0)
    scoring = {f.__code__ for f in vars(SimBackend).values() if inspect.isfunction(f)}  # before anything wraps them

    def check(name: str) -> None:
        if not state.open:
            where = "".join(traceback.format_stack(limit=6)[:-2])
            state.reads.append(f"{name} read outside scoring:\n{where}")
            raise AssertionError(state.reads[-1])

    def opened(fn):
        """fn runs with the hidden parts open."""

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            state.open += 1
            try:
                return fn(*args, **kwargs)
            finally:
                state.open -= 1

        return wrapper

    def guarded_method(name: str, fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            check(name)
            return fn(self, *args, **kwargs)

        return wrapper

    def guarded_state(name: str, attribute: str) -> property:
        def get(self):
            check(name)
            return self.__dict__[attribute]

        def put(self, value):
            self.__dict__[attribute] = value

        return property(get, put)

    def guarded_cache(name: str, cls: type, prop: functools.cached_property) -> property:
        def get(self):
            check(name)
            return prop.__get__(self, cls)  # computed once, kept in the instance's __dict__

        return property(get)

    for cls in STATES:
        real_score = opened(cls.score)

        def score(self, split, queries, icds, real_score=real_score, where=f"{cls.__name__}.score"):
            if sys._getframe(1).f_code not in scoring:
                check(where)  # the answer model asked behind the backend (and the score cache) is a read too
            state.scored += len(queries)
            return real_score(self, split, queries, icds)

        monkeypatch.setattr(cls, "__init__", opened(cls.__init__))
        monkeypatch.setattr(cls, "score", score)
        for name in methods(cls):
            monkeypatch.setattr(cls, name, guarded_method(f"{cls.__name__}.{name}", getattr(cls, name)))
        for name in STATES[cls]:
            monkeypatch.setattr(cls, name, guarded_state(f"{cls.__name__}.{name}", name), raising=False)
        for name in cached(cls):
            monkeypatch.setattr(cls, name, guarded_cache(f"{cls.__name__}.{name}", cls, cls.__dict__[name]))
    return state


def test_the_guard_stops_every_read_but_the_scoring_path(small_data, guard):
    """The guard itself: the simulator a training stage rebuilds scores through its backend, and every hidden part
    read from outside raises and is recorded."""
    import torch

    backend = SimBackend(sim_from_meta(read_meta(small_data)))
    queries, icds = torch.tensor([0, 1]), torch.tensor([[2, 3], [4, 5]])
    assert len(backend.score("train", queries, icds)["acc"]) == 2 and guard.scored == 2 and not guard.reads
    s = backend.sim
    reads = [
        lambda: s.score("train", queries, icds),
        lambda: s.oracle("train", queries, icds, 1),
        *(lambda name=name: getattr(s, name) for name in (*STATE, *CACHED)),
        *(lambda name=name: getattr(s, name)() for name in METHODS),  # refused before its arguments are looked at
    ]
    for read in reads:
        with pytest.raises(AssertionError, match=r"^Simulator\.\w+ read outside scoring"):
            read()
    assert len(guard.reads) == len(reads) and guard.scored == 2
    assert {"helpfulness", "logit", "oracle", "_features", "_reply"} <= set(METHODS) and "probes" in CACHED


def test_training_reads_nothing_of_the_simulator_but_its_scores(small_data, tmp_path, guard):
    """RCE, offline GRPO from it, and online GRPO on a budget short enough for a warm start (offline GRPO first), each
    scoring through the backend (it validates on the simulator), none reading the hidden truth."""
    rce.main(rce.Args(data=small_data, out=tmp_path / "rce", epochs=1, **SMALL_NET, **FAST))
    after_rce = guard.scored
    grpo.main(grpo.Args(data=small_data, init=tmp_path / "rce", out=tmp_path / "offline", epochs=1, **FAST))
    after_offline = guard.scored
    online = dict(online=True, group_size=6, lvlm_budget=1060)
    grpo.main(grpo.Args(data=small_data, init=tmp_path / "rce", out=tmp_path / "online", **online, **FAST))
    assert (tmp_path / "online" / "offline" / "model.safetensors").is_file()  # the warm start ran
    assert 0 < after_rce < after_offline < guard.scored, (after_rce, after_offline, guard.scored)
    assert not guard.reads, "\n".join(guard.reads)


@pytest.fixture(scope="module")
def caption_data(tmp_path_factory):
    """A small dataset of the captioning world, built before (and so outside) the guard."""
    data = tmp_path_factory.mktemp("captions") / "data"
    small = dict(num_train=300, num_val=60, num_queries=32, group_size=6, pool_size=16)
    gen_rl_data.generate(gen_rl_data.Args(out=data, task="caption", **small))
    return data


def test_training_on_captions_reads_nothing_of_the_captioning_simulator_but_its_scores(caption_data, tmp_path, guard):
    """The same for a dataset of the captioning world: RCE and a budgeted online GRPO score through the backend only."""
    rce.main(rce.Args(data=caption_data, out=tmp_path / "rce", epochs=1, **SMALL_NET, **FAST))
    online = dict(online=True, group_size=4, lvlm_budget=700)
    grpo.main(grpo.Args(data=caption_data, init=tmp_path / "rce", out=tmp_path / "online", **online, **FAST))
    assert guard.scored > 0 and not guard.reads, "\n".join(guard.reads)
    backend = SimBackend(sim_from_meta(read_meta(caption_data)))
    with pytest.raises(AssertionError, match=r"^CaptionSimulator\.latents read outside scoring"):
        backend.sim.latents  # noqa: B018  (the read itself is what is tested)
