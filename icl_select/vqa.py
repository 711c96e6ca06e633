"""VQA answer normalisation, the official VQA accuracy, and helpers for scoring LVLM generations.

`normalize_answer` follows the rules of the official VQA evaluation script (VQA v2 / OK-VQA):
punctuation handling, number words, articles and the official contraction table.
"""

from __future__ import annotations

import functools
import re
from collections import Counter

__all__ = ["answer_counts", "answer_rel", "normalize_answer", "postprocess", "shown_answer", "vqa_score"]

# The official contraction table, verbatim, quirks included: the capitalised keys ("Im", "Ive", ...) can never
# match because words are lower-cased first, and "somebody'd" maps to "somebodyd". Kept as-is so scores stay
# comparable with published numbers.
CONTRACTIONS: dict[str, str] = {
    "aint": "ain't",
    "arent": "aren't",
    "cant": "can't",
    "couldve": "could've",
    "couldnt": "couldn't",
    "couldn'tve": "couldn't've",
    "couldnt've": "couldn't've",
    "didnt": "didn't",
    "doesnt": "doesn't",
    "dont": "don't",
    "hadnt": "hadn't",
    "hadnt've": "hadn't've",
    "hadn'tve": "hadn't've",
    "hasnt": "hasn't",
    "havent": "haven't",
    "hed": "he'd",
    "hed've": "he'd've",
    "he'dve": "he'd've",
    "hes": "he's",
    "howd": "how'd",
    "howll": "how'll",
    "hows": "how's",
    "Id've": "I'd've",
    "I'dve": "I'd've",
    "Im": "I'm",
    "Ive": "I've",
    "isnt": "isn't",
    "itd": "it'd",
    "itd've": "it'd've",
    "it'dve": "it'd've",
    "itll": "it'll",
    "let's": "let's",
    "maam": "ma'am",
    "mightnt": "mightn't",
    "mightnt've": "mightn't've",
    "mightn'tve": "mightn't've",
    "mightve": "might've",
    "mustnt": "mustn't",
    "mustve": "must've",
    "neednt": "needn't",
    "notve": "not've",
    "oclock": "o'clock",
    "oughtnt": "oughtn't",
    "ow's'at": "'ow's'at",
    "'ows'at": "'ow's'at",
    "'ow'sat": "'ow's'at",
    "shant": "shan't",
    "shed've": "she'd've",
    "she'dve": "she'd've",
    "she's": "she's",
    "shouldve": "should've",
    "shouldnt": "shouldn't",
    "shouldnt've": "shouldn't've",
    "shouldn'tve": "shouldn't've",
    "somebody'd": "somebodyd",
    "somebodyd've": "somebody'd've",
    "somebody'dve": "somebody'd've",
    "somebodyll": "somebody'll",
    "somebodys": "somebody's",
    "someoned": "someone'd",
    "someoned've": "someone'd've",
    "someone'dve": "someone'd've",
    "someonell": "someone'll",
    "someones": "someone's",
    "somethingd": "something'd",
    "somethingd've": "something'd've",
    "something'dve": "something'd've",
    "somethingll": "something'll",
    "thats": "that's",
    "thered": "there'd",
    "thered've": "there'd've",
    "there'dve": "there'd've",
    "therere": "there're",
    "theres": "there's",
    "theyd": "they'd",
    "theyd've": "they'd've",
    "they'dve": "they'd've",
    "theyll": "they'll",
    "theyre": "they're",
    "theyve": "they've",
    "twas": "'twas",
    "wasnt": "wasn't",
    "wed've": "we'd've",
    "we'dve": "we'd've",
    "weve": "we've",
    "werent": "weren't",
    "whatll": "what'll",
    "whatre": "what're",
    "whats": "what's",
    "whatve": "what've",
    "whens": "when's",
    "whered": "where'd",
    "wheres": "where's",
    "whereve": "where've",
    "whod": "who'd",
    "whod've": "who'd've",
    "who'dve": "who'd've",
    "wholl": "who'll",
    "whos": "who's",
    "whove": "who've",
    "whyll": "why'll",
    "whyre": "why're",
    "whys": "why's",
    "wont": "won't",
    "wouldve": "would've",
    "wouldnt": "wouldn't",
    "wouldnt've": "wouldn't've",
    "wouldn'tve": "wouldn't've",
    "yall": "y'all",
    "yall'll": "y'all'll",
    "y'allll": "y'all'll",
    "yall'd've": "y'all'd've",
    "y'alld've": "y'all'd've",
    "y'all'dve": "y'all'd've",
    "youd": "you'd",
    "youd've": "you'd've",
    "you'dve": "you'd've",
    "youll": "you'll",
    "youre": "you're",
    "youve": "you've",
}

# The official script also maps "none" to "0", not only zero..ten.
NUMBER_WORDS: dict[str, str] = {
    "none": "0",
    "zero": "0",
    "one": "1",
    "two": "2",
    "three": "3",
    "four": "4",
    "five": "5",
    "six": "6",
    "seven": "7",
    "eight": "8",
    "nine": "9",
    "ten": "10",
}

ARTICLES: frozenset[str] = frozenset({"a", "an", "the"})

# Characters the official script treats as punctuation. Periods are handled separately, and the apostrophe is
# deliberately absent so that contractions ("don't") survive to the contraction table.
PUNCTUATION: tuple[str, ...] = tuple(';/[]"{}()=+\\_-><@`,?!')

# The official period pattern is "(?!<=\d)(\.)(?!\d)"; its first group is a (buggy) lookahead that never rejects
# a period, so in effect a period is removed unless a digit follows it. Reproduced as that effective behaviour.
_PERIOD_STRIP = re.compile(r"\.(?!\d)")
_DIGIT_COMMA_DIGIT = re.compile(r"\d,\d")


def _process_punctuation(text: str) -> str:
    """Apply the official per-character punctuation rule, then strip non-decimal periods."""
    # The decision is made per punctuation character on the *input* text and applies to all its occurrences:
    # remove it everywhere if any occurrence touches a space (or if the text has digit grouping like "1,000"),
    # otherwise turn every occurrence into a space (so "hello-world" -> "hello world").
    has_digit_grouping = _DIGIT_COMMA_DIGIT.search(text) is not None
    out = text
    for p in PUNCTUATION:
        remove = has_digit_grouping or f"{p} " in text or f" {p}" in text
        out = out.replace(p, "" if remove else " ")
    return _PERIOD_STRIP.sub("", out)


@functools.lru_cache(maxsize=1 << 16)
def normalize_answer(s: str) -> str:
    """Normalise an answer string exactly as the official VQA evaluation script does. Memoised: answers repeat
    (ten annotators, a small vocabulary), and building the simulator normalised 37k of them at every start."""
    text = s.replace("\n", " ").replace("\t", " ").strip()
    text = _process_punctuation(text)
    words = [NUMBER_WORDS.get(w, w) for w in text.lower().split()]
    words = [w for w in words if w not in ARTICLES]
    return " ".join(CONTRACTIONS.get(w, w) for w in words)


def vqa_score(prediction: str, answers: list[str]) -> float:
    """Official VQA accuracy: mean over annotators of min(1, matches among the other annotators / 3)."""
    if not answers:
        raise ValueError("vqa_score needs at least one annotator answer, got an empty list")
    pred = normalize_answer(prediction)
    gts = [normalize_answer(a) for a in answers]
    total_matches = sum(g == pred for g in gts)
    # Leave-one-out: annotator i's own answer is excluded from the matches it is credited with.
    accs = [min(1.0, (total_matches - (g == pred)) / 3.0) for g in gts]
    # Rounding removes float noise so that e.g. 3/10 compares equal to the literal 0.3.
    return round(sum(accs) / len(accs), 6)


_ANSWER_PREFIX = re.compile(r"^\s*(?:(?:short|final)\s+answer|answer|a)\s*:\s*", re.IGNORECASE)
_QUOTE_PAIRS: dict[str, str] = {'"': '"', "'": "'", "`": "`", "\u201c": "\u201d", "\u2018": "\u2019"}
_TRAILING_PUNCT = ".!?,;:"


def answer_counts(answers: list[str]) -> list[tuple[str, int]]:
    """Distinct annotator answers, most frequent first (ties in first-occurrence order): (most common raw spelling,
    count) per answer under the official VQA normalisation ("Red" and "red" are one)."""
    groups: dict[str, Counter] = {}
    for a in answers:
        groups.setdefault(normalize_answer(a), Counter())[a] += 1
    counted = [(spellings.most_common(1)[0][0], spellings.total()) for spellings in groups.values()]
    return sorted(counted, key=lambda sc: -sc[1])


def shown_answer(answers: list[str], task: str) -> str:
    """What a demonstration shows of its item: its most common answer (in its most common spelling), or for a caption
    its first reference, as Lever-LM shows one."""
    return answers[0] if task == "caption" else answer_counts(answers)[0][0]


def _clean_line(line: str) -> str:
    """Strip prefix, surrounding quotes and trailing sentence punctuation from one line until stable."""
    text = line.strip()
    text = _ANSWER_PREFIX.sub("", text, count=1)
    prev = None
    # Quotes and punctuation can nest either way ('"yes".' or '"yes."'), so peel layers until nothing changes.
    while text != prev:
        prev = text
        text = text.strip().rstrip(_TRAILING_PUNCT).rstrip()
        if len(text) >= 2 and _QUOTE_PAIRS.get(text[0]) == text[-1]:
            text = text[1:-1]
    return text


def postprocess(generation: str) -> str:
    """Cut a raw LVLM generation down to the short answer on its first non-empty line."""
    for line in generation.splitlines():
        # A line holding only a prefix ("Answer:") carries no answer; the answer is then on a later line.
        cleaned = _clean_line(line)
        if cleaned:
            return cleaned
    return ""


def _levenshtein(a: str, b: str) -> int:
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        cur = [i]
        for j, cb in enumerate(b, start=1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def _edit_similarity(a: str, b: str) -> float:
    """1 - levenshtein / max length; two empty strings are identical."""
    longest = max(len(a), len(b))
    if longest == 0:
        return 1.0
    return 1.0 - _levenshtein(a, b) / longest


def _token_f1(a: str, b: str) -> float:
    """Bag-of-words F1 between whitespace tokens; two empty strings are identical."""
    ta, tb = a.split(), b.split()
    if not ta and not tb:
        return 1.0
    common = sum((Counter(ta) & Counter(tb)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(ta), common / len(tb)
    return 2 * precision * recall / (precision + recall)


@functools.lru_cache(maxsize=1 << 16)  # the simulator asks the same few thousand pairs of answers again and again
def _closeness(a: str, b: str) -> float:
    return max(_token_f1(a, b), _edit_similarity(a, b))


def answer_rel(prediction: str, answers: list[str]) -> float:
    """Graded closeness to the ground truth: best max(token-F1, edit similarity) over distinct normalised answers."""
    if not answers:
        raise ValueError("answer_rel needs at least one annotator answer, got an empty list")
    pred = normalize_answer(prediction)
    best = max(_closeness(pred, g) for g in {normalize_answer(a) for a in answers})
    return round(best, 6)
