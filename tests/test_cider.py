"""Tests for cider.py against pycocoevalcap itself: CIDEr-D (mean and every per-image score) equal to its `Cider` on the
same tokenized captions, the fixed-corpus scorer's independence from the rest of a batch, and the tokenizer equal to
its PTBTokenizer (the Java one; slow, skipped without a Java runtime)."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pycocoevalcap.cider.cider import Cider

from icl_select.cider import CiderD, cider_d, ptb_tokenize

FAST = settings(database=None, deadline=None, max_examples=100)
VOCAB = ["a", "man", "dog", "on", "the", "red", "bus"]  # small, so n-grams repeat within and across images

# Tokenized COCO-style references and candidates of six images (as ptb_tokenize returns them).
COCO_REFS = [
    [
        "a man riding a wave on top of a surfboard",
        "a surfer riding a large wave in the ocean",
        "a person on a surf board riding a wave",
        "a man on a surfboard rides on a wave",
        "a surfer in a black wetsuit catches a wave",
    ],
    [
        "a kitchen with a stove and a refrigerator",
        "a small kitchen with white cabinets and a stove",
        "a kitchen has a stove a fridge and a sink",
        "an empty kitchen with a stove and cabinets",
    ],
    [
        "two giraffes standing next to each other in a field",
        "a couple of giraffes standing in a grassy field",
        "two giraffes in the wild near some trees",
        "giraffes stand together on the savanna",
        "two tall giraffes standing in a field",
        "a pair of giraffes in a field with trees",
    ],
    ["a plate of food with broccoli and rice", "a white plate topped with rice and broccoli"],
    [
        "a red double decker bus driving down a street",
        "a double decker bus on a city street",
        "a red bus is parked on the side of the road",
        "the bus is red and has two levels",
        "a tour bus driving down the road",
    ],
    ["a dog 's head resting on a couch", "a brown dog lying on a sofa", "the dog is sleeping on the couch"],
]
COCO_CANDIDATES = [
    "a man riding a wave on a surfboard",
    "a kitchen with a stove and a sink",
    "two giraffes standing in a field",
    "a plate of food",
    "a red double decker bus on a street",
    "a dog laying on a couch",
]


def reference_cider(candidates: list[str], references: list[list[str]]) -> tuple[float, np.ndarray]:
    """pycocoevalcap's Cider on the same tokenized captions, one image per candidate."""
    gts = {i: list(refs) for i, refs in enumerate(references)}
    res = {i: [cand] for i, cand in enumerate(candidates)}
    score, scores = Cider().compute_score(gts, res)
    return float(score), np.asarray(scores, dtype=np.float64)


@st.composite
def caption_sets(draw, max_images: int = 6):
    """Tokenized candidates and reference sets of several images: words from VOCAB, 0-12 words (one reference of 1+ so
    pycocoevalcap's frequencies are not empty), 1-6 references per image."""
    r = random.Random(draw(st.integers(0, 2**32 - 1)))
    n_images = draw(st.integers(1, max_images))

    def caption(min_len: int) -> str:
        return " ".join(r.choice(VOCAB) for _ in range(r.randint(min_len, 12)))

    references = [[caption(1 if i == j == 0 else 0) for j in range(r.randint(1, 6))] for i in range(n_images)]
    candidates = [caption(0) for _ in range(n_images)]
    return candidates, references


def assert_scores_equal(mine: tuple[float, np.ndarray], theirs: tuple[float, np.ndarray]) -> None:
    assert mine[0] == pytest.approx(theirs[0], abs=1e-9, rel=0)
    np.testing.assert_allclose(mine[1], theirs[1], atol=1e-9, rtol=0)


@FAST
@given(caption_sets())
def test_cider_d_equals_pycocoevalcap(data):
    candidates, references = data
    assert_scores_equal(cider_d(candidates, references), reference_cider(candidates, references))


def test_cider_d_equals_pycocoevalcap_on_coco_captions():
    mine = cider_d(COCO_CANDIDATES, COCO_REFS)
    assert_scores_equal(mine, reference_cider(COCO_CANDIDATES, COCO_REFS))
    assert 0.5 < mine[0] < 5  # real numbers, not all zero: the n-grams meet
    # a reference scored as a candidate matches itself: far above the others
    echo = [refs[0] for refs in COCO_REFS]
    assert_scores_equal(cider_d(echo, COCO_REFS), reference_cider(echo, COCO_REFS))
    assert cider_d(echo, COCO_REFS)[0] > mine[0]


@FAST
@given(caption_sets())
def test_fixed_corpus_scorer_on_the_evaluated_references_is_pycocoevalcap(data):
    candidates, references = data
    scores = CiderD(references).score(candidates, references)
    assert_scores_equal((float(scores.mean()), scores), reference_cider(candidates, references))


@FAST
@given(caption_sets(), caption_sets(), st.integers(0, 5))
def test_fixed_corpus_score_does_not_depend_on_the_rest_of_the_batch(corpus_data, batch, pick):
    """A caption's reward is its score alone, whatever else is scored with it; the frequencies are the corpus's."""
    _, corpus = corpus_data
    candidates, references = batch
    pick %= len(candidates)
    scorer = CiderD(corpus)
    in_batch = scorer.score(candidates, references)[pick]
    alone = scorer.score([candidates[pick]], [references[pick]])[0]
    assert in_batch == pytest.approx(alone, abs=1e-12, rel=0)
    # the same candidate in pycocoevalcap beside the corpus's images (whose references make the frequencies), with
    # its own references added as one more document: the fixed scorer over corpus + those references agrees
    gts, cands = [*corpus, references[pick]], [*(refs[0] for refs in corpus), candidates[pick]]
    expected = reference_cider(cands, gts)[1][-1]
    assert CiderD(gts).score([candidates[pick]], [references[pick]])[0] == pytest.approx(expected, abs=1e-9, rel=0)


def test_cider_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match=r"^CiderD\.score: 2 candidates but 1 reference lists$"):
        CiderD([["a b"]]).score(["a", "b"], [["a"]])
    with pytest.raises(ValueError, match=r"^CiderD\.score: candidate 0 has no references$"):
        CiderD([["a b"]]).score(["a"], [[]])
    with pytest.raises(ValueError, match=r"^CiderD: the reference corpus is empty"):
        CiderD([])


# ---------------------------------------------------------------------------------------------------------------------
# The tokenizer

# COCO-style captions covering punctuation, case, possessives, contractions, numbers, hyphens, quotes, brackets,
# abbreviations and unicode. The order matters: Java reads them as the lines of one file, and a few rules look into
# the next line ("letter A." before "The ...", "no." before a digit).
COCO_STYLE = [
    "A man riding a wave on top of a surfboard.",
    "A dog's head resting on a couch.",
    "Two dogs' toys are on the floor",
    "The man's shirt is RED and the woman's is blue!",
    "A woman can't decide which donut to eat.",
    "It's a sunny day; the kids aren't in school.",
    "They're standing next to a bus that's parked.",
    "I'm sure he'll want the pizza, won't he?",
    "A cat that cannot get down from a tree",
    "Kids gonna play some baseball, wanna watch?",
    "A 10-year-old boy in a black-and-white t-shirt.",
    "A double-decker bus on a two-lane road -- in London.",
    "Three planes fly by at 1,000 feet and 3.5 miles apart.",
    "The clock reads 10:30 on the tower.",
    'A sign that says "STOP" at the corner.',
    "A sign reading 'No Parking' next to the curb",
    "A \u201cfancy\u201d cake with \u2018pink\u2019 frosting",
    "A man\u2019s bike is leaning on the wall.",
    "A bowl of fruit (apples, oranges and bananas).",
    "A desk with a laptop [and] a mouse {on it}.",
    "A pizza cut into 8 slices... yum",
    "Is that a frisbee?! Yes!!",
    "People at the U.S. Open watching tennis",
    "Mr. Smith walks his dog on St. Patrick's day",
    "A train at 5 p.m. near Washington D.C.",
    "The letter A.",
    "The bus number no.",
    "5 buses parked in a lot",
    "A man with a sign that says 50% off & more",
    "A $5 bill and a #2 pencil on a table.",
    "A caf\u00e9 with na\u00efve art and a pi\u00f1ata",
    "A plate with \u00bd a sandwich and \u00bc of a pie",
    "Temperature is 30\u00b0 outside \u2014 very hot",
    "A smiley face :) drawn on a window",
    "A cell phone with an emoji \U0001f600 on the screen",
    "  Two   zebras   grazing  in the   field  ",
    "a tennis player swinging a racket\n at a ball",
    "A baseball player at bat in the 9th inning",
    "A 2x4 board and some 1/2 inch nails",
    "A website www.example.com on a screen",
    "Rock'n'roll band playing on stage at 8 o'clock",
    "A kite flying high over the beach at 7am.",
    "An old-fashioned clock on the wall of a caf\u00e9-bar",
    "Several people skiing down a snow-covered slope",
    "A black and white photo of a man on a horse",
    "",
    "A plate of food with broccoli, carrots, and rice",
    "A 'Welcome' mat in front of the door",
    "Two men talking; one is holding a surfboard",
    "A giraffe standing in the grass-- next to a tree",
    "A shirt with the letters \u0528\ua7b5 and \u00e9 on it",
]

# What pycocoevalcap's PTBTokenizer (the Java jar, -preserveLines -lowerCase, then its punctuation filter) returns for
# COCO_STYLE, recorded from the jar: a fast check that needs no Java runtime.
JAVA_OUTPUT = [
    "a man riding a wave on top of a surfboard",
    "a dog 's head resting on a couch",
    "two dogs toys are on the floor",
    "the man 's shirt is red and the woman 's is blue",
    "a woman ca n't decide which donut to eat",
    "it 's a sunny day the kids are n't in school",
    "they 're standing next to a bus that 's parked",
    "i 'm sure he 'll want the pizza wo n't he",
    "a cat that can not get down from a tree",
    "kids gon na play some baseball wan na watch",
    "a 10-year-old boy in a black-and-white t-shirt",
    "a double-decker bus on a two-lane road in london",
    "three planes fly by at 1,000 feet and 3.5 miles apart",
    "the clock reads 10:30 on the tower",
    "a sign that says stop at the corner",
    "a sign reading no parking next to the curb",
    "a fancy cake with pink frosting",
    "a man 's bike is leaning on the wall",
    "a bowl of fruit -lrb- apples oranges and bananas -rrb-",
    "a desk with a laptop -lsb- and -rsb- a mouse -lcb- on it -rcb-",
    "a pizza cut into 8 slices yum",
    "is that a frisbee ?! yes !!",
    "people at the u.s. open watching tennis",
    "mr. smith walks his dog on st. patrick 's day",
    "a train at 5 p.m. near washington d.c.",
    "the letter a",
    "the bus number no.",
    "5 buses parked in a lot",
    "a man with a sign that says 50 % off & more",
    "a $ 5 bill and a # 2 pencil on a table",
    "a caf\u00e9 with na\u00efve art and a pi\u00f1ata",
    "a plate with 1/2 a sandwich and 1/4 of a pie",
    "temperature is 30 \u00b0 outside very hot",
    "a smiley face :-rrb- drawn on a window",
    "a cell phone with an emoji on the screen",
    "two zebras grazing in the field",
    "a tennis player swinging a racket at a ball",
    "a baseball player at bat in the 9th inning",
    "a 2x4 board and some 1/2 inch nails",
    "a website www.example.com on a screen",
    "rock 'n' roll band playing on stage at 8 o'clock",
    "a kite flying high over the beach at 7am",
    "an old-fashioned clock on the wall of a caf\u00e9-bar",
    "several people skiing down a snow-covered slope",
    "a black and white photo of a man on a horse",
    "",
    "a plate of food with broccoli carrots and rice",
    "a welcome mat in front of the door",
    "two men talking one is holding a surfboard",
    "a giraffe standing in the grass next to a tree",
    "a shirt with the letters and \u00e9 on it",
]


def test_tokenizer_matches_recorded_ptb_tokenizer_output():
    got = ptb_tokenize(COCO_STYLE)
    assert [(c, g) for c, g, e in zip(COCO_STYLE, got, JAVA_OUTPUT) if g != e] == []


def test_tokenizer_reads_into_the_next_caption_as_java_does():
    # alone, "The letter A." ends the file: "a." stays whole; before a line opening with "The", the lexer returns
    # the letter and the period apart (the period is then dropped)
    assert ptb_tokenize(["The letter A.", "The end"]) == ["the letter a", "the end"]
    assert ptb_tokenize(["The letter A."]) == ["the letter a."]
    assert ptb_tokenize(["Number no.", "5 cats"]) == ["number no.", "5 cats"]
    assert ptb_tokenize(["Number no.", "cats"]) == ["number no", "cats"]


@pytest.mark.slow
def test_tokenizer_equals_pycocoevalcap_ptb_tokenizer():
    """The Java tokenizer itself on the COCO-style captions and on shuffled mixes of their pieces."""
    if shutil.which("java") is None:
        pytest.skip("no java on PATH: pycocoevalcap's PTBTokenizer runs the Stanford jar with a Java runtime")
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    r = random.Random(0)
    pieces = [w for c in COCO_STYLE for w in c.split(" ")]
    mixes = [" ".join(r.choice(pieces) for _ in range(r.randint(1, 15))) for _ in range(2000)]
    for captions in (COCO_STYLE, mixes):
        java = PTBTokenizer().tokenize({0: [{"caption": c} for c in captions]})[0]
        assert [(c, p, j) for c, p, j in zip(captions, ptb_tokenize(captions), java) if p != j] == []


def test_scores_are_the_same_bits_in_every_process():
    """A training reward must not change with the process that computes it (a resumed run is another process): the
    n-gram sums run in the candidate's n-gram order, never in a set's, whose order follows the string hashes."""
    code = (
        "import random; from icl_select.cider import CiderD; r = random.Random(0); "
        "words = [f'w{i}' for i in range(12)]; "
        "cap = lambda: ' '.join(r.choice(words) for _ in range(r.randint(6, 14))); "
        "refs = [[cap() for _ in range(5)] for _ in range(40)]; cands = [cap() for _ in range(40)]; "
        "print([float(x).hex() for x in CiderD(refs).score(cands, refs)])"
    )
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ)
    outs = set()
    for seed in ("1", "2", "3", "4"):
        run = [sys.executable, "-c", code]
        outs.add(
            subprocess.run(run, cwd=root, env=env | {"PYTHONHASHSEED": seed}, capture_output=True, text=True).stdout
        )
    assert len(outs) == 1 and "0x" in next(iter(outs)), outs
