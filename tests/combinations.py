"""The kit's axes, their values, and the combinations it refuses: declared once, here.

A run of the kit is one value of each axis. tests/test_combinations.py draws a pairwise design over these axes
(covertable: every pair of values of every two axes in at least one row, under REFUSED), runs each row through the
command lines and checks what it writes; each refused combination is run too, and must stop in one line before any
work. docs/combinations.md shows this table to readers. A new flag or feature adds its values here (and, if some
pairs make no sense, a rule to REFUSED with the one-line refusal the kit gives): the test then covers its pairs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from covertable import make

# axis -> (values, what the axis is). The first value of each axis is the kit's default.
AXES: dict[str, tuple[tuple, str]] = {
    "task": (("vqa", "caption"), "gen_rl_data.py --task: questions about pictures, or captions"),
    "world": (
        ("additive", "copy", "saturating", "strong", "order", "harmful", "base", "instruct", "real"),
        "--world of the simulator (base and instruct caption; the rest answer questions), or real: tiny random-weight "
        "Qwen2.5-VL and CLIP on OK-VQA- or COCO-format files",
    ),
    "groups": (("sampled", "infoscore"), "gen_rl_data.py --groups: sampled sequences, or Lever-LM's InfoScore beams"),
    "min_shots": (("all", "some", "none"), "gen_rl_data.py --min-shots: the sequence length, 1, or 0"),
    "sampler": (("random", "image", "text", "mix"), "gen_rl_data.py --sampler: how each question's pool is built"),
    "selector": (
        ("pointer", "lever-lm", "retriever"),
        "rce.py: reward weights, --weights uniform (Lever-LM's objective), or --retriever (a bi-encoder)",
    ),
    "can_stop": ((False, True), "rce.py --can-stop: a selector that may give fewer demonstrations, or none"),
    "picks": (("seq-len", "more"), "rce.py --picks: the data's sequence length, or two more (asked for more)"),
    "init": (
        ("none", "data", "rce"),
        "what is trained first and started from: nothing; a selector whose picks gen_rl_data.py --init adds to the "
        "groups; a selector rce.py --init continues",
    ),
    "training": (
        ("rce", "offline", "online", "budget"),
        "the last stage: RCE alone, then grpo.py offline, --online, or --online --lvlm-budget",
    ),
    "ranks": ((1, 2), "processes of gen_rl_data.py, grpo.py and evaluate.py (torchrun --nproc-per-node 2)"),
    "evaluation": (("exactly", "up-to"), "what Demonstrations is asked for and checked against: exactly k, or up to k"),
    "use": (
        ("run", "library", "hub"),
        "Demonstrations from the run folder (pick_val), over a Library of the run's items (pick_embedded, pick_batch "
        "on real pictures), or from the files a Hub push uploads",
    ),
    "interrupted": ((False, True), "the last training stage killed after its first epoch and run again"),
}

CAPTION_WORLDS = ("base", "instruct", "real")
VQA_WORLDS = tuple(w for w in AXES["world"][0] if w not in ("base", "instruct"))


@dataclass(frozen=True)
class Refused:
    """A combination the kit refuses: `when(row)` over the `axes` it reads, why, which stage stops, what it says."""

    axes: tuple[str, ...]
    combination: str  # in words, for the table
    when: Callable[[dict], bool]
    why: str
    stage: str
    says: str  # a regex of the one line the stage prints after "error: "
    example: dict  # the smallest row that hits it (other axes at their defaults)


REFUSED = [
    Refused(
        ("task", "world"),
        "a simulated world of the other task (vqa with base or instruct, caption with a VQA world)",
        lambda r: (r["task"] == "caption") != (r["world"] in CAPTION_WORLDS) and r["world"] != "real",
        "each simulated world is of one task",
        "gen_rl_data.py",
        r"^--world \w+ ",
        {"task": "caption", "world": "copy"},
    ),
    Refused(
        ("task", "sampler"),
        "caption with sampler text or mix",
        lambda r: r["task"] == "caption" and r["sampler"] in ("text", "mix"),
        "a picture to caption has no text to compare",
        "gen_rl_data.py",
        r"^--sampler (text|mix) compares captions",
        {"task": "caption", "world": "base", "sampler": "text"},
    ),
    Refused(
        ("groups", "min_shots"),
        "groups infoscore with min_shots some or none",
        lambda r: r["groups"] == "infoscore" and r["min_shots"] != "all",
        "InfoScore's beams are all of the sequence length",
        "gen_rl_data.py",
        r"^--min-shots must be in 0\.\.\d+ \(sampled groups only\)",
        {"groups": "infoscore", "min_shots": "none"},
    ),
    Refused(
        ("groups", "init"),
        "groups infoscore with init data",
        lambda r: r["groups"] == "infoscore" and r["init"] == "data",
        "InfoScore searches its own beams; a selector's picks have no place in them",
        "gen_rl_data.py",
        r"^--init adds a selector's picks to sampled groups",
        {"groups": "infoscore", "init": "data"},
    ),
    Refused(
        ("selector", "can_stop"),
        "selector retriever with can_stop",
        lambda r: r["selector"] == "retriever" and r["can_stop"],
        "a retriever scores each demonstration alone and learns from no sequence, so it cannot learn when to stop",
        "rce.py",
        r"^--retriever scores each demonstration alone",
        {"selector": "retriever", "can_stop": True},
    ),
    Refused(
        ("can_stop", "training"),
        "can_stop with training offline",
        lambda r: r["can_stop"] and r["training"] == "offline",
        "a selector's stop is set from its stop ladders, which only an online run scores",
        "grpo.py",
        r"^--init \S+ may stop, and GRPO learns when to stop online only: add --online",
        {"can_stop": True, "training": "offline"},
    ),
]


def allowed(row: dict) -> bool:
    """Whether no rule refuses the row (a rule whose axes the row lacks does not apply)."""
    return not any(all(a in row for a in rule.axes) and rule.when(row) for rule in REFUSED)


def pairwise() -> list[dict]:
    """The rows of the pairwise design, each a dict axis -> value, in the order covertable makes them (the same on
    every machine: its sorter hashes the pairs)."""
    constraints = [
        {"operator": "fn", "requires": list(rule.axes), "evaluate": lambda row, rule=rule: not rule.when(row)}
        for rule in REFUSED
    ]
    rows = make({a: list(values) for a, (values, _) in AXES.items()}, constraints=constraints)
    return [{a: row[a] for a in AXES} for row in rows]


def pairs_of(row: dict) -> set[tuple]:
    """Every pair of (axis, value) the row covers."""
    items = sorted(row.items(), key=lambda kv: kv[0])
    return {(a, b) for i, a in enumerate(items) for b in items[i + 1 :]}


def every_pair() -> set[tuple]:
    """Every pair of values of two axes that some allowed row holds (a world of captions never meets a text sampler,
    though no rule names the two: the task stands between them)."""
    ruled = sorted({a for rule in REFUSED for a in rule.axes})
    rows = [dict(zip(ruled, v)) for v in itertools.product(*(AXES[a][0] for a in ruled))]
    feasible = [row for row in rows if allowed(row)]
    names = sorted(AXES)
    return {
        ((a, x), (b, y))
        for i, a in enumerate(names)
        for b in names[i + 1 :]
        for x in AXES[a][0]
        for y in AXES[b][0]
        if any(row.get(a, x) == x and row.get(b, y) == y for row in feasible)
    }


def markdown() -> str:
    """The two tables docs/combinations.md shows: the axes, and the combinations refused (tests/test_docs.py checks
    the file holds them as they are here)."""
    axes = ["| axis | values (the first is the default) | what it is |", "|---|---|---|"]
    axes += [f"| {a} | {', '.join(map(str, values))} | {what} |" for a, (values, what) in AXES.items()]
    refused = ["| combination | why | refused by |", "|---|---|---|"]
    refused += [f"| {rule.combination} | {rule.why} | {rule.stage} |" for rule in REFUSED]
    return "\n".join(axes) + "\n\n" + "\n".join(refused) + "\n"
