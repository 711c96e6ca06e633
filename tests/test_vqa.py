"""Tests for vqa.py: official VQA normalisation, VQA accuracy, generation post-processing and answer_rel."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from icl_select.vqa import CONTRACTIONS, NUMBER_WORDS, answer_rel, normalize_answer, postprocess, vqa_score

# database=None keeps Hypothesis from writing a .hypothesis/ directory into the repository.
FAST = settings(database=None, deadline=None, max_examples=150)

# ---------------------------------------------------------------------------------------------------------------
# normalize_answer: one hand-computed case per rule
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        # case and surrounding whitespace
        ("YES", "yes"),
        ("  Red  ", "red"),
        # newlines and tabs become spaces, runs of whitespace collapse
        ("red\tcar\nblue", "red car blue"),
        ("two   big    dogs", "2 big dogs"),
    ],
)
def test_normalize_case_and_whitespace(raw: str, expected: str) -> None:
    assert normalize_answer(raw) == expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        # digit grouping: the comma between digits disappears
        ("1,000", "1000"),
        ("1,000,000", "1000000"),
        # ... and the official rule then removes *all* listed punctuation instead of spacing it out
        ("1,000 red/blue", "1000 redblue"),
        # a comma not between digits is turned into a space (or removed when it touches a space)
        ("red,blue", "red blue"),
        ("red, blue", "red blue"),
        # decimal point between digits survives; sentence periods do not
        ("2.5", "2.5"),
        ("3.14 m.", "3.14 m"),
        ("yes.", "yes"),
        ("e.g", "eg"),
        # official quirk: a period is kept whenever a digit follows it (the look-behind in the regex is broken)
        ("v.2", "v.2"),
        # hyphen inside a word with no hyphen next to a space: replaced by a space
        ("hello-world", "hello world"),
        # a hyphen next to a space anywhere makes every hyphen in the text disappear
        ("hello - world-wide", "hello worldwide"),
        # other listed punctuation
        ("Yes!", "yes"),
        ("what?!", "what"),
        ("(red)", "red"),
        ("red/white", "red white"),
        ('"red"', "red"),
        ("snake_case", "snake case"),
        ("?", ""),
        # the apostrophe is not punctuation in the official script, so contractions survive
        ("don't", "don't"),
        ("it's", "it's"),
        # characters outside the official list are left alone
        ("50%", "50%"),
        ("#1", "#1"),
        ("a:b", "a:b"),
    ],
)
def test_normalize_punctuation(raw: str, expected: str) -> None:
    assert normalize_answer(raw) == expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("two", "2"),
        ("Ten", "10"),
        ("zero", "0"),
        ("three cats", "3 cats"),
        ("none", "0"),  # the official number map includes "none"
        ("eleven", "eleven"),  # only zero..ten are mapped
        ("twenty two", "twenty 2"),
        ("someone", "someone"),  # whole words only
    ],
)
def test_normalize_number_words(raw: str, expected: str) -> None:
    assert normalize_answer(raw) == expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("a dog", "dog"),
        ("The Cat", "cat"),
        ("an apple", "apple"),
        ("the", ""),
        ("another theme", "another theme"),  # whole words only
        ("on the left of a table", "on left of table"),
    ],
)
def test_normalize_articles(raw: str, expected: str) -> None:
    assert normalize_answer(raw) == expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("dont", "don't"),
        ("isnt", "isn't"),
        ("whats", "what's"),
        ("youre", "you're"),
        ("wont", "won't"),
        ("Doesnt", "doesn't"),
        ("twas", "'twas"),
        ("oclock", "o'clock"),
        ("i dont know", "i don't know"),
        ("dont!", "don't"),
        # official quirks kept on purpose: capitalised keys never match after lower-casing, and a reversed entry
        ("Im", "im"),
        ("somebody'd", "somebodyd"),
    ],
)
def test_normalize_contractions(raw: str, expected: str) -> None:
    assert normalize_answer(raw) == expected


def test_contraction_table_is_the_official_one() -> None:
    assert len(CONTRACTIONS) == 120
    assert CONTRACTIONS["yall'd've"] == "y'all'd've"
    words = ["none", "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
    assert {w: str(max(i - 1, 0)) for i, w in enumerate(words)} == NUMBER_WORDS


# ---------------------------------------------------------------------------------------------------------------
# vqa_score
# ---------------------------------------------------------------------------------------------------------------


def _ten(matching: int, answer: str = "yes") -> list[str]:
    """Ten annotator answers of which `matching` equal `answer` and the rest are distinct other strings."""
    return [answer] * matching + [f"other{i}" for i in range(10 - matching)]


@pytest.mark.parametrize(
    ("matching", "expected"),
    [(0, 0.0), (1, 0.3), (2, 0.6), (3, 0.9), (4, 1.0), (5, 1.0), (10, 1.0)],
)
def test_vqa_score_levels_with_ten_answers(matching: int, expected: float) -> None:
    assert vqa_score("yes", _ten(matching)) == expected


def test_vqa_score_normalises_both_sides() -> None:
    # "Yes." and "YES!" both normalise to "yes": 3 matches -> 0.9
    answers = ["YES!", "yes", "Yes.", "no", "no", "no", "no", "no", "no", "no"]
    assert vqa_score("  Yes.\n", answers) == 0.9
    assert vqa_score("two", ["2"] * 10) == 1.0
    assert vqa_score("1,000", ["1000", *_ten(0)[1:]]) == 0.3


def test_vqa_score_okvqa_five_answers() -> None:
    answers = ["red", "red", "blue", "green", "Red."]
    # "red" given by 3 of 5. The 3 red annotators each see 2 other reds -> 2/3; the other 2 see 3 -> 1.
    # (3 * 2/3 + 2 * 1) / 5 = 4/5
    assert vqa_score("red", answers) == 0.8
    # "blue" given by 1: the 4 others each see 1 match -> 1/3; (4/3) / 5 = 4/15
    assert vqa_score("blue", answers) == round(4 / 15, 6) == 0.266667
    assert vqa_score("pink", answers) == 0.0
    # 2 of 5: (2 * 1/3 + 3 * 2/3) / 5 = 8/15
    assert vqa_score("dog", ["cat", "cat", "dog", "dog", "bird"]) == 0.533333


def test_vqa_score_okvqa_doubled_list() -> None:
    # OK-VQA stores 5 answers each repeated twice; a prediction matching one of them is matched by 2 annotators.
    answers = [a for a in ["red", "blue", "green", "pink", "black"] for _ in range(2)]
    assert vqa_score("blue", answers) == 0.6


def test_vqa_score_short_lists_cannot_reach_one() -> None:
    # Leave-one-out on tiny lists: a single answer can never be confirmed by another annotator.
    assert vqa_score("yes", ["yes"]) == 0.0
    assert vqa_score("yes", ["yes", "yes", "yes"]) == round(2 / 3, 6)


def test_vqa_score_empty_answers_raises() -> None:
    with pytest.raises(ValueError, match="empty"):
        vqa_score("yes", [])


# ---------------------------------------------------------------------------------------------------------------
# postprocess
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("generation", "expected"),
    [
        ("Yes.", "Yes"),
        ("\n\n  Answer: two dogs.\nExplanation: there are two.", "two dogs"),
        ("Short answer: red", "red"),
        ("ANSWER:red", "red"),
        ("a: blue!", "blue"),
        ("A: 2.5.", "2.5"),
        ("2.5", "2.5"),
        ("3.14159", "3.14159"),
        ("version 2.", "version 2"),
        ('"blue"', "blue"),
        ('"blue".', "blue"),
        ('"blue."', "blue"),
        ("\u201cblue\u201d", "blue"),
        ("'red'", "red"),
        ("What?!", "What"),
        ("Answer:\nyes", "yes"),  # prefix alone on a line: the answer is on the next one
        ("A dog.", "A dog"),  # no colon, so "A" is part of the answer
        ("dogs'", "dogs'"),  # an unpaired quote is kept
        ("red; blue", "red; blue"),  # only trailing punctuation is removed
        ("", ""),
        ("   \n \t\n", ""),
    ],
)
def test_postprocess(generation: str, expected: str) -> None:
    assert postprocess(generation) == expected


# ---------------------------------------------------------------------------------------------------------------
# answer_rel
# ---------------------------------------------------------------------------------------------------------------


def test_answer_rel_exact_match_is_one() -> None:
    assert answer_rel("red", ["blue", "red"]) == 1.0
    assert answer_rel("The Dog.", ["dog"]) == 1.0  # equal after normalisation


def test_answer_rel_disjoint_is_zero() -> None:
    # No shared token, and every character must be substituted: lev("cat", "dog") = 3 -> 1 - 3/3 = 0
    assert answer_rel("cat", ["dog"]) == 0.0
    assert answer_rel("", ["yes"]) == 0.0


def test_answer_rel_partial() -> None:
    # token F1: 1 shared token, precision 1/2, recall 1 -> 2/3; edit: lev("red car", "red") = 4 -> 3/7. Max is 2/3.
    assert answer_rel("red car", ["red"]) == 0.666667
    assert answer_rel("red car", ["blue", "red"]) == 0.666667
    # token F1 0; lev("colour", "color") = 1 -> 1 - 1/6 = 5/6
    assert answer_rel("colour", ["color"]) == 0.833333
    # lev("kitten", "sitting") = 3 -> 1 - 3/7 = 4/7
    assert answer_rel("kitten", ["sitting"]) == 0.571429


def test_answer_rel_both_empty_is_one() -> None:
    # "a" and "the" both normalise to the empty string
    assert answer_rel("a", ["the"]) == 1.0


def test_answer_rel_empty_answers_raises() -> None:
    with pytest.raises(ValueError, match="empty"):
        answer_rel("yes", [])


# ---------------------------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------------------------

_SPECIAL_TOKENS = sorted(CONTRACTIONS) + sorted(CONTRACTIONS.values()) + sorted(NUMBER_WORDS)
_SPECIAL_TOKENS += ["a", "an", "the", "1,000", "2.5", "yes.", "hello-world", "-", ".", ",", "'"]
_ALPHABET = "abcdeXYZ0123456789 \t\n.,;:/[]\"{}()=+\\_-><@`?!'#%^&$*\u00e9\u00a0"

messy_text = st.one_of(
    st.text(alphabet=_ALPHABET, max_size=25),
    st.lists(st.one_of(st.sampled_from(_SPECIAL_TOKENS), st.text(alphabet=_ALPHABET, max_size=6)), max_size=6).map(
        " ".join
    ),
    st.text(max_size=15),
)
# Short answers drawn from a small pool so that predictions and annotator answers actually collide.
short_answer = st.sampled_from(["yes", "Yes.", "no", "2", "two", "red", "the red", "dont", "don't", "1,000", "cat"])


@FAST
@given(messy_text)
def test_normalize_is_idempotent(s: str) -> None:
    once = normalize_answer(s)
    assert normalize_answer(once) == once


@FAST
@given(st.floats(min_value=0, max_value=1e6, allow_nan=False), st.integers(min_value=1, max_value=4))
def test_decimal_numbers_survive(x: float, digits: int) -> None:
    number = f"{x:.{digits}f}"
    assert normalize_answer(number) == number
    assert postprocess(f"Answer: {number}.") == number


@FAST
@given(short_answer, st.lists(short_answer, min_size=1, max_size=12))
def test_vqa_score_in_unit_interval(prediction: str, answers: list[str]) -> None:
    assert 0.0 <= vqa_score(prediction, answers) <= 1.0


@FAST
@given(short_answer, st.lists(short_answer, min_size=10, max_size=10))
def test_vqa_score_levels_for_ten_answers(prediction: str, answers: list[str]) -> None:
    score = vqa_score(prediction, answers)
    assert score in {0.0, 0.3, 0.6, 0.9, 1.0}
    # closed form for 10 annotators: each match adds 0.3 until it saturates at 4 matches
    matches = sum(normalize_answer(a) == normalize_answer(prediction) for a in answers)
    assert score == (1.0 if matches >= 4 else round(0.3 * matches, 6))


@FAST
@given(short_answer, st.lists(short_answer, min_size=1, max_size=12), st.randoms(use_true_random=False))
def test_vqa_score_order_invariant(prediction: str, answers: list[str], rnd: random.Random) -> None:
    shuffled = list(answers)
    rnd.shuffle(shuffled)
    assert vqa_score(prediction, shuffled) == vqa_score(prediction, answers)


@FAST
@given(messy_text, st.integers(min_value=4, max_value=12))
def test_unanimous_answer_scores_one(answer: str, n: int) -> None:
    assert vqa_score(answer, [answer] * n) == 1.0


@FAST
@given(messy_text, st.integers(min_value=1, max_value=3))
def test_unanimous_short_list_scores_leave_one_out(answer: str, n: int) -> None:
    assert vqa_score(answer, [answer] * n) == round((n - 1) / 3, 6)


@FAST
@given(messy_text, st.lists(messy_text, min_size=1, max_size=5))
def test_answer_rel_bounds_and_consistency(prediction: str, answers: list[str]) -> None:
    rel = answer_rel(prediction, answers)
    assert 0.0 <= rel <= 1.0
    # any VQA credit requires an exact normalised match, which answer_rel must rate 1
    if vqa_score(prediction, answers) > 0:
        assert rel == 1.0
    if prediction in answers:
        assert rel == 1.0


@FAST
@given(messy_text, messy_text)
def test_answer_rel_symmetric(a: str, b: str) -> None:
    assert answer_rel(a, [b]) == answer_rel(b, [a])


@FAST
@given(messy_text)
def test_postprocess_output_shape(generation: str) -> None:
    out = postprocess(generation)
    assert out == out.strip()
    assert not out.endswith(tuple(".!?,;:"))
    assert "\n" not in out
    assert out in generation  # it only ever cuts, never rewrites
