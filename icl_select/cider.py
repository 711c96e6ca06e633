"""CIDEr-D for image captioning, equal to pycocoevalcap's `Cider`, and the PTB tokenization it is computed on, in pure
Python (no Java, no pycocoevalcap at run time).

    ptb_tokenize(["A dog's ball.", "Two (2) cats!"]) -> ["a dog 's ball", "two -lrb- 2 -rrb- cats"]
    cider_d(candidates, references) -> (mean, per-image scores)      # evaluation: pycocoevalcap's number
    CiderD(train_references).score(candidates, references)           # training rewards: fixed frequencies

CIDEr-D (Vedantam et al. 2015, as pycocoevalcap 1.2 computes it). A caption is its 1..4-grams (words split on white
space). Over a corpus of N images, the document frequency df(g) of an n-gram is the number of images whose reference
set holds it (once per image), idf(g) = log N - log max(1, df(g)), and a caption's vector of order n holds
tf(g) * idf(g) for its n-grams g. Against one reference r,

    sim_n(c, r) = sum_g min(c_g, r_g) * r_g / (|c_n| |r_n|) * exp(-(l_c - l_r)^2 / (2 sigma^2)),   sigma = 6,

(the candidate's weights clipped by the reference's; the norm factor is skipped when either norm is 0), l a caption's
length in words (pycocoevalcap counts its bigrams, max(words - 1, 0): the same differences, except against an empty
caption, which shares no n-gram and so scores 0 either way). CIDEr-D(c) = 10 * mean over n of the mean over the
image's references of sim_n; the corpus score is the mean over images. n is 4: pycocoevalcap's Cider fails for others.

Which corpus the document frequencies come from:
- Evaluation (`cider_d`): the references of the evaluated images, as pycocoevalcap does and the captioning literature
  reports (Karpathy test: 5,000 images). The number depends on which images are evaluated together, so compare runs
  only on the same image set; it is the number published results are comparable with.
- Training rewards (`CiderD`): a corpus fixed once, the training split's references (as self-critical sequence
  training does). A sequence's reward then depends on it and its references alone: with per-batch frequencies a
  caption's reward would change with the other captions scored beside it, and a batch of a few images makes every
  n-gram rare (idf near log of the batch size) so the reward would say little about what is common in captions.

The tokenizer reproduces the Stanford PTBTokenizer of CoreNLP 3.4.1 (pycocoevalcap's jar, run with -preserveLines
-lowerCase) followed by pycocoevalcap's punctuation filter. Possessives and contractions split ("dog's" -> "dog 's",
"can't" -> "ca n't", "cannot" -> "can not", "gonna" -> "gon na"); hyphenated words, numbers with commas or decimals,
fractions and times stay whole; brackets become -lrb- -rrb- -lsb- -rsb- -lcb- -rcb- and are KEPT (the filter lists them
upper-case, the tokens are lower-cased first); quotes become `` and '' and are dropped like . , ? ! : ; - -- ...
("?!" and "!!" stay); ½ ¼ ¾ ⅓ ⅔ become 1/2 1/4 3/4 1/3 2/3, £ #, € $, ¢ cents, "&amp;" "&"; characters the lexer has no
rule for (emoji and everything else outside the Basic Multilingual Plane, control characters, letters newer than its
Unicode 6.0 tables) are deleted. Java reads the captions of one call as the lines of one file, and a few rules look past
a caption's end into the next line (a single letter and a period before a line that opens with "The", "A", ...; "no."
before a digit; a smiley before the line break), so `ptb_tokenize` takes the captions as pycocoevalcap passes them: the
references of all evaluated images in one call, the candidates in another.

Known departures from the Java tokenizer: a caption holding a line break other than "\\n" (\\r, U+2028, U+2029, U+000B,
U+000C, U+0085) makes Java emit an extra line, which shifts every later caption of the call onto the wrong image in
pycocoevalcap; here those characters separate words and the captions stay aligned. A capital sigma between digits or
punctuation and letters (e.g. "ß-1Σ") may lower-case to the other form of σ/ς than Java's word-break rules give.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["CiderD", "cider_d", "coco_cider", "ptb_tokenize"]

N = 4  # n-gram orders 1..N

# ---------------------------------------------------------------------------------------------------------------------
# PTB tokenization


def _bmp_class(keep: Callable[[str], bool]) -> str:
    """The Basic Multilingual Plane characters for which `keep` is true, as the inside of a regex character class
    (the Java lexer reads UTF-16 units, so nothing above U+FFFF is a letter or a digit to it)."""
    ranges, start = [], None
    for cp in range(0x10001):
        inside = cp < 0x10000 and not 0xD800 <= cp < 0xE000 and keep(chr(cp))
        if inside and start is None:
            start = cp
        elif not inside and start is not None:
            ranges.append(f"\\u{start:04x}" if cp - 1 == start else f"\\u{start:04x}-\\u{cp - 1:04x}")
            start = None
    return "".join(ranges)


def _ci(literal: str) -> str:
    """A literal matched caselessly, as the lexer's %caseless does for characters outside classes."""
    return "".join(f"[{c.lower()}{c.upper()}]" if c.isascii() and c.isalpha() else re.escape(c) for c in literal)


def _alts(*literals: str) -> str:
    return "(?:" + "|".join(_ci(w) for w in sorted(literals, key=len, reverse=True)) + ")"


# Letters and digits of Python's Unicode tables that the 3.4.1 lexer's tables (Unicode 6.0) do not have: it deletes
# them as untokenizable (found by running the jar on every BMP character); U+1885-U+1886 were letters then.
_NEWER = (
    "037F 0528-052F 0560 0588 05EF 0860-086A 0870-0887 0889-088E 08A1 08AD-08C9 0978 0980 09FC 0AF9 0C34 0C5A 0C5D "
    "0C80 0CDD 0D04 0D54-0D56 0D5F 0DE6-0DEF 0E86 0E89 0E8C 0E8E-0E93 0E98 0EA0 0EA8-0EA9 0EAC 13F5 13F8-13FD "
    "16F1-16F8 170D 171F 1878 191D-191E 19B0-19C0 19C8-19C9 1B4C 1C80-1C88 1C90-1CBA 1CBD-1CBF 1CF2-1CF3 1CFA 2C2F "
    "2C5F 312E-312F 31BB-31BF 4DB6-4DBF 9FCD-9FFF A698-A69D A78F A794-A79F A7AB-A7CA A7D0-A7D1 A7D3 A7D5-A7D9 "
    "A7F2-A7F7 A8FD-A8FE A9E0-A9E4 A9E6-A9FE AA7E-AA7F AB30-AB5A AB5C-AB69 AB70-ABBF"
)
_NEWER_SET = {chr(cp) for r in _NEWER.split() for cp in range(int(r.split("-")[0], 16), int(r.split("-")[-1], 16) + 1)}
_ALPHA_CLASS = _bmp_class(lambda c: (c.isalpha() and c not in _NEWER_SET) or c in "\u1885\u1886")
_ALPHA = f"[{_ALPHA_CLASS}]"  # JFlex [:letter:]
_DIGIT = f"[{_bmp_class(lambda c: c.isdecimal() and c not in _NEWER_SET)}\\u07c0-\\u07c9]"  # [:digit:], N'Ko digits
_UPPER = f"[{_bmp_class(lambda c: c.isupper() and c not in _NEWER_SET)}]"
_LETTER_EXTRA = (
    "\\u00ad\\u0237-\\u024f\\u02c2-\\u02c5\\u02d2-\\u02df\\u02e5-\\u02ff\\u0300-\\u036f\\u0370-\\u037d\\u0384\\u0385"
    "\\u03cf\\u03f6\\u03fc-\\u03ff\\u0483-\\u0487\\u04cf\\u04f6-\\u04ff\\u0510-\\u0525\\u055a-\\u055f\\u0591-\\u05bd"
    "\\u05bf\\u05c1\\u05c2\\u05c4\\u05c5\\u05c7\\u0615-\\u061a\\u063b-\\u063f\\u064b-\\u065e\\u0670\\u06d6-\\u06ef"
    "\\u06fa-\\u06ff\\u070f\\u0711\\u0730-\\u074f\\u0750-\\u077f\\u07a6-\\u07b1\\u07ca-\\u07f5\\u07fa\\u0900-\\u0903"
    "\\u093c\\u093e-\\u094e\\u0951-\\u0955\\u0962-\\u0963\\u0981-\\u0983\\u09bc-\\u09c4\\u09c7\\u09c8\\u09cb-\\u09cd"
    "\\u09d7\\u09e2\\u09e3\\u0a01-\\u0a03\\u0a3c\\u0a3e-\\u0a4f\\u0a81-\\u0a83\\u0abc-\\u0acf\\u0b82\\u0bbe-\\u0bc2"
    "\\u0bc6-\\u0bc8\\u0bca-\\u0bcd\\u0c01-\\u0c03\\u0c3e-\\u0c56\\u0d3e-\\u0d44\\u0d46-\\u0d48\\u0e30-\\u0e3a"
    "\\u0e47-\\u0e4e\\u0eb1-\\u0ebc\\u0ec8-\\u0ecd"
)
_SPLET = "&[aeiouAEIOU]" + _alts("acute", "grave", "uml") + ";"  # &eacute; inside words
_LETTER = f"(?:[{_ALPHA_CLASS}{_LETTER_EXTRA}]|{_SPLET})"
_LD = f"(?:{_LETTER}|{_DIGIT})"
_AD = f"(?:{_ALPHA}|{_DIGIT})"  # THING's letters and digits: [:letter:] without the lexer's extra LETTER characters
_SPACE = "[ \\t\\u00a0\\u2000-\\u200a\\u3000]"
_NEWLINE = "(?:\\r\\n|[\\r\\n\\u2028\\u2029\\u000b\\u000c\\u0085])"
_SPACENL = f"(?:{_SPACE}|{_NEWLINE})"
_SGML = (
    "<(?:[!?][A-Za-z\\-][^>\\r\\n]*|[A-Za-z][A-Za-z0-9_:.\\-]*(?:[ ]+(?:[A-Za-z][A-Za-z0-9_:.\\-]*[ ]*=[ ]*"
    "(?:'[^']*'|\"[^\"]*\")|[A-Za-z][A-Za-z0-9_:.\\-]*))*[ ]*/?|/[A-Za-z][A-Za-z0-9_:.\\-]*)[ ]*>"
)
_WORD = f"{_LETTER}{_LD}*(?:[.!?]{_LETTER}{_LD}*)*"
_APOS = "(?:['\\u0092\\u2019]|" + _ci("&apos;") + ")"
_APOSETC = f"(?:{_APOS}|[`\\u0091\\u2018\\u201b])"
_ACRO_ALTS = (
    "[A-Za-z](?:\\.[A-Za-z])*",
    _alts("Canada", "Sino", "Korean", "EU", "Japan", "non") + "-" + _ci("U.S"),
    _ci("U.S.-") + _alts("U.K", "U.S.S.R"),
)
_ACRO2 = "(?:[A-Za-z](?:\\.[A-Za-z])+|" + "|".join(_ACRO_ALTS[1:]) + ")"
_HYPHEN = "[\\-_\\u058a\\u2010\\u2011]"
_THING_PART = f"(?:[dDoOlL]{_APOSETC}{_AD})?{_AD}+"
_ABTITLE = (
    _alts("Mr", "Mrs", "Ms", "Dr", "Drs", "Prof", "Profs", "Sen", "Sens", "Rep", "Reps", "Atty", "Attys", "Lt", "Col")
    + "|M"
    + _ci("iss")
    + "|"
    + _alts("Gen", "Messrs", "Gov", "Govs", "Adm", "Rev", "Maj", "Sgt", "Cpl", "Pvt", "Capt", "St", "Ste", "Ave")
    + "|"
    + _alts("Pres", "Lieut", "Hon", "Brig", "Comdr", "Cmdr", "Pfc", "Spc", "Supt", "Supts", "Det", "Mt", "Ft", "Adj")
    + "|"
    + _alts("Adv", "Asst", "Assoc", "Ens", "Insp", "Mlle", "Mme", "Msgr", "Sfc")
)
_ABBREV4_ALTS = (
    f"(?:{_ABTITLE})",
    _alts("vs", "Alex", "Wm", "Jos", "Cie", "a.k.a", "cf", "TREAS", "Ph", "Invt", "Elec", "Natl", "Dept"),
    _ci("M") + "[ft]" + _ci("g"),
    *_ACRO_ALTS,
)
_ABBREV1 = (
    "(?:"
    + _alts("Jan", "Feb", "Mar", "Apr", "Jun", "Jul", "Aug", "Sep", "Sept", "Oct", "Nov", "Dec")
    + "|"
    + _alts("Mon", "Tue", "Tues", "Wed", "Thu", "Thurs", "Fri")
    + "|"
    + _alts("Ala", "Ariz", "Calif", "Colo", "Conn", "Ct", "Dak", "Fla", "Ga", "Ind", "Kan", "Kans", "Ky", "Md")
    + "|"
    + "|".join(u + _ci(rest) for u, rest in (("A", "z"), ("A", "rk"), ("D", "el"), ("I", "ll"), ("L", "a")))
    + "|"
    + "|".join(u + _ci(rest) for u, rest in (("M", "ass"), ("M", "iss"), ("O", "re"), ("P", "a"), ("T", "ex")))
    + "|W"
    + _ci("ash")
    + "|"
    + _alts("Mich", "Minn", "Mo", "Mont", "Neb", "Nev", "Okla", "Penn", "Tenn", "Va", "Vt", "Wis", "Wisc", "Wyo")
    + "|"
    + _alts("Inc", "Co", "Cos", "Corp", "Ltd", "Plc", "Rt", "Bancorp", "Bhd", "Assn", "Univ", "Intl", "Sys")
    + "|"
    + _ci("P")
    + _ci("p")
    + "?"
    + _ci("t")
    + "[ye]"
    + _ci("s")
    + "?|"
    + _alts("tel", "est", "ext", "sq", "Jr", "Sr", "Bros", "Ed.D", "Ph.D", "Blvd", "Rd", "Esq", "etc", "al", "seq")
    + "|"
    + _ci("Bldg")
    + ")\\."
)
_FILENAME_EXT = _alts(
    *("bat", "bmp", "c", "class", "cgi", "cpp", "dll", "doc", "docx", "exe", "gif", "gz", "h", "htm", "html", "jar"),
    *("java", "jpeg", "jpg", "mov", "mp3", "pdf", "php", "pl", "png", "ppt", "ps", "py", "sql", "tar", "txt", "wav"),
    *("x", "xml", "zip"),
)
_QUOTE_CHARS = (
    "`\\u2018\\u2019\\u201a\\u201b\\u201c\\u201d\\u0091\\u0092\\u0093\\u0094\\u201e\\u201f\\u2039\\u203a\\u00ab\\u00bb"
)
_MISCSYMBOL = (
    "[+%&~^|\\\\\\u00a6\\u00a7\\u00a8\\u00a9\\u00ac\\u00ae\\u00af\\u00b0-\\u00ba\\u00d7\\u00f7\\u0387\\u05be\\u05c0"
    "\\u05c3\\u05c6\\u05f3\\u05f4\\u0600-\\u0603\\u0606-\\u060a\\u060c\\u0614\\u061b\\u061e\\u066a\\u066d"
    "\\u0703-\\u070d\\u07f6-\\u07f8\\u0964\\u0965\\u0e4f\\u1fbd\\u2016\\u2017\\u2020-\\u2023\\u2030-\\u2038\\u203b"
    "\\u203e-\\u2042\\u2044\\u207a-\\u207f\\u208a-\\u208e\\u2100-\\u214f\\u2190-\\u21ff\\u2200-\\u2bff\\u3012\\u30fb"
    "\\uff01-\\uff0f\\uff1a-\\uff20\\uff3b-\\uff40\\uff5b-\\uff65]"
)
_ACRONYM_FOLLOWERS = (
    *("About", "According", "Additionally", "After", "An", "A", "As", "At", "But", "Earlier", "He", "Her", "Here"),
    *("However", "If", "In", "It", "Last", "Many", "More", "Now", "Once", "One", "Other", "Our", "She", "Since", "So"),
    *("Some", "Such", "That", "The", "Their", "Then", "There", "These", "They", "This", "We", "When", "While", "What"),
    *("Yet", "You"),
)
_ACRONYM_NEXT = (
    "(?:"
    + "|".join(w[0] + _ci(w[1:]) for w in sorted(_ACRONYM_FOLLOWERS, key=len, reverse=True))
    + "|M"
    + _ci("r.")
    + "|M"
    + _ci("s.")
    + "|"
    + _SGML
    + ")"
)


# Token actions: the matched text -> (the token the Java lexer returns, or None for none; how much of it is consumed,
# less than all where the lexer pushes characters back to be read again).
_AMP_RE = re.compile("&[aA][mM][pP];")
_QUOTE_MAPS = (
    (re.compile("[\\u0091\\u2018\\u201b\\u2039]"), "`"),
    (re.compile("[\\u0092\\u2019\\u203a]"), "'"),
    (re.compile("[\\u0093\\u201c\\u00ab]"), "``"),
    (re.compile("[\\u0094\\u201d\\u00bb]"), "''"),
)
_FRACTIONS = str.maketrans({"\u00bc": "1/4", "\u00bd": "1/2", "\u00be": "3/4", "\u2153": "1/3", "\u2154": "2/3"})
_CURRENCY = str.maketrans(
    {"\u00a2": "cents", "\u00a3": "#", "\u0080": "$", "\u00a4": "$", "\u20a0": "$", "\u20ac": "$"}
)
_PARENS = str.maketrans({"(": "-LRB-", ")": "-RRB-"})


def _keep(t: str):
    return t, len(t)


def _soft(t: str):  # soft hyphens are line-breaking hints: removed, and a token of them alone is "-"
    return t.replace("\u00ad", "") or "-", len(t)


def _push(k: int):  # the lexer pushes the last k characters back to be read again and returns the rest
    return lambda t: (t[:-k], len(t) - k)


def _reread_period(t: str):  # the token keeps its period, which is read again as a token of its own
    return t, len(t) - 1


def _lit(token: str):
    return lambda t: (token, len(t))


def _skip(t: str):
    return None, len(t)


def _quotes(left: bool):
    """LaTeX quotes: ' and " become ` and `` where they probably open, ' and '' elsewhere; curly ones by their side."""

    def action(t: str):
        s = re.sub("&apos;|'", "`" if left else "'", t)
        s = re.sub('"|&quot;', "``" if left else "''", s)
        for pattern, repl in _QUOTE_MAPS:
            s = pattern.sub(repl, s)
        return s, len(t)

    return action


def _acronym(t: str):
    # Before a capitalised sentence opener: "I." gives "I" then "."; "U.S." gives "U.S." and then "." as well.
    return (t[0], 1) if len(t) == 2 else (t, len(t) - 1)


_RIGHTQ, _LEFTQ, _NBSP = _quotes(False), _quotes(True), (lambda t: (t.replace(" ", "\u00a0"), len(t)))
_THINGA = "[A-Z]+(?:(?:[+&]|" + _ci("&amp;") + ")[A-Z]+)+"
_HTHING = "[A-Za-z0-9][A-Za-z0-9.,\\u00ad]*(?:-(?:" + _ACRO2 + "\\.|[A-Za-z0-9\\u00ad]+))+"
_THING = f"{_THING_PART}(?:{_HYPHEN}{_THING_PART})*"
_REDAUX = _APOS + "(?:[msdMSD]|" + _alts("re", "ve", "ll") + ")"
_SREDAUX = _ci("n") + _APOSETC + _ci("t")
_INSENTP = "[,;:\\u3001]"
_NOT_URL = ' \\t\\n\\f\\r"<>|'

# The lexer's rules in its order, each as alternatives of (main, trailing context or None) and an action. The longest
# match (trailing context included) wins, the earlier rule on a tie, as in JFlex; a rule's alternatives are tried
# separately because Python's regex alternation takes the first that matches, not the longest.
_RULES_SRC = [
    ([(_ci("c++"), None)], _keep),
    ([("[cCfF]#", None)], _keep),
    ([(_ci("cannot"), None)], _push(3)),
    ([("'" + _ci("twas"), None)], _push(3)),
    ([("'" + _ci("tis"), None)], _push(2)),
    ([(_alts("gonna", "gotta", "lemme", "gimme", "wanna"), None)], _push(2)),
    ([(_SGML, None)], _NBSP),
    ([("&" + _alts("MD", "mdash", "ndash") + ";|[\\u0096\\u0097\\u2013\\u2014\\u2015]", None)], _lit("--")),
    ([(_ci("&amp;"), None)], lambda t: ("&", len(t))),
    ([("&(?:" + _alts("HT", "TL", "UR", "LR", "QC", "QL", "QR", "odq", "cdq") + "|#[0-9]+);", None)], _keep),
    ([(_WORD, _REDAUX)], _soft),
    ([("[A-Za-z\\u00ad]*[A-MO-Za-mo-z]\\u00ad*", _SREDAUX)], _soft),
    ([(_WORD, None)], _soft),
    (
        [
            (a, None)
            for a in (
                _APOS + _ci("n") + _APOS + "?",
                "[lLdDjJ]" + _APOS,
                _alts("Dunkin", "somethin", "ol") + _APOS,
                _APOS + _ci("em"),
                f"[A-HJ-XZn]{_APOSETC}{_ALPHA}{{2}}{_ALPHA}*",
                _APOS + "[2-9]0" + _ci("s"),
                _APOS + _ci("till") + "?",
                f"{_ALPHA}{_ALPHA}*[aeiouyAEIOUY]{_APOSETC}[aeiouA-Z]{_ALPHA}*",
                _APOS + _ci("cause"),
                _ci("cont'd") + "\\.?",
                _alts("'twas", "nor'easter", "c'mon", "e'er", "s'mores", "ev'ry", "li'l", "nat'l"),
                _ci("O") + _APOSETC + _ci("o"),
            )
        ],
        _keep,
    ),
    ([(_ci("y") + _APOS, _ALPHA)], _keep),
    ([(_ci("http") + _ci("s") + f"?://[^{_NOT_URL}(){{}}]+[^{_NOT_URL}.!?(){{}},-]", None)], _keep),
    (
        [
            (head + f"(?:/[^{_NOT_URL}()]+[^{_NOT_URL}.!?(){{}},-])?", None)
            for head in (
                _ci("www.") + f"(?:[^{_NOT_URL}.!?(){{}},]+\\.)+[a-zA-Z]{{2,4}}",
                f"(?:[^{_NOT_URL}`'.!?(){{}},-_$]+\\.)+" + _alts("com", "net", "org", "edu"),
            )
        ],
        _keep,
    ),
    (
        [
            (
                "(?:" + _ci("&lt;") + f"|<)?[a-zA-Z0-9][^{_NOT_URL}()\\u00a0{{}}]*@(?:[^{_NOT_URL}(){{}}.\\u00a0]+\\.)*"
                f"[^{_NOT_URL}(){{}}.\\u00a0]+(?:" + _ci("&gt;") + "|>)?",
                None,
            )
        ],
        _keep,
    ),
    ([("@[a-zA-Z_][a-zA-Z_0-9]*", None), (f"#{_LETTER}+", None)], _keep),
    ([(_REDAUX, "[^A-Za-z]")], _RIGHTQ),
    ([(_SREDAUX, "[^A-Za-z]")], _RIGHTQ),
    ([(f"{_DIGIT}{{1,2}}[\\-/]{_DIGIT}{{1,2}}[\\-/]{_DIGIT}{{2,4}}", None)], _keep),
    ([(f"[\\-+]?{_DIGIT}+", None), (f"[\\-+]?{_DIGIT}*(?:[.:,\\u00ad\\u066b\\u066c]{_DIGIT}+)+", None)], _soft),
    (
        [
            (
                "[\\u207a\\u207b\\u208a\\u208b]?(?:[\\u2070\\u00b9\\u00b2\\u00b3\\u2074-\\u2079]+|[\\u2080-\\u2089]+)",
                None,
            )
        ],
        _keep,
    ),
    ([(f"(?:{_DIGIT}{{1,4}}[\\- \\u00a0])?{_DIGIT}{{1,4}}(?:\\\\?/|\\u2044){_DIGIT}{{1,4}}", None)], _NBSP),
    ([("[\\u00bc\\u00bd\\u00be\\u2153-\\u215e]", None)], lambda t: (t.translate(_FRACTIONS), len(t))),
    (
        [
            ("-" + _alts("RRB", "LRB", "RCB", "LCB", "RSB", "LSB") + "-", None),
            (_alts("C.D.s", "pro-", "anti-"), None),
            (_ci("S") + "(?:&|" + _ci("&amp;") + ")" + _alts("P-500", "Ls"), None),
            (_ci("Cap") + _APOS + _ci("n"), None),
            (_ci("c") + _APOS + _ci("est"), None),
        ],
        lambda t: (_AMP_RE.sub("&", t), len(t)),
    ),
    ([("[A-Za-z0-9]+(?:-[A-Za-z]+){0,2}(?:\\\\?/[A-Za-z0-9]+(?:-[A-Za-z]+){0,2}){1,2}", None)], _keep),
    ([("[A-Z]*\\$|#", None)], _keep),
    (
        [
            (
                "[\\u00a2\\u00a3\\u00a4\\u00a5\\u0080\\u20a0\\u20ac\\u060b\\u0e3f\\u20a4\\uffe0\\uffe1\\uffe5\\uffe6]",
                None,
            )
        ],
        lambda t: (t.translate(_CURRENCY), len(t)),
    ),
    ([(f"(?:{a})\\.", f"{_SPACENL}+{_ACRONYM_NEXT}{_SPACENL}") for a in _ACRO_ALTS], _acronym),
    (
        [
            (
                "(?:" + _alts("ca", "fig", "figs", "prop", "no", "nos", "art", "bldg", "pp", "op") + ")\\.",
                f"{_SPACENL}?{_DIGIT}",
            )
        ],
        _keep,
    ),
    ([("(?:" + _ci("pt") + "[eyEY]|" + _ci("co") + ")\\.", _SPACE + _alts("ltd", "lim"))], _keep),
    ([(_ABBREV1, f"{_SPACENL}(?:{_SPACENL}|{_UPPER}|{_SGML})")], _reread_period),
    ([(_ABBREV1, "[\\s\\S][\\s\\S]")], _keep),
    ([(_ABBREV1, None)], _reread_period),
    ([(f"(?:{a})\\.", None) for a in _ABBREV4_ALTS], _keep),
    ([(f"(?:{a})", _SPACE) for a in _ABBREV4_ALTS], _keep),
    ([(a, _SPACENL) for a in _ACRO_ALTS], _keep),
    ([(_APOS + "[0-9][0-9]", _SPACENL)], _keep),
    ([(f"{_LD}+(?:[.]{_LD}+)*[.]{_FILENAME_EXT}", f"{_SPACENL}|[.?!,]")], _keep),
    ([(_WORD + "\\.", _INSENTP)], _soft),
    (
        [
            (
                "(?:\\([0-9]{2,3}\\)[ \\u00a0]?|(?:\\+\\+?)?(?:[0-9]{2,4}[\\- \\u00a0])?[0-9]{2,4}[\\- \\u00a0])"
                "[0-9]{3,4}[\\- \\u00a0]?[0-9]{3,5}",
                None,
            ),
            ("(?:(?:\\+\\+?)?[0-9]{2,4}\\.)?[0-9]{2,4}\\.[0-9]{3,4}\\.[0-9]{3,5}", None),
        ],
        lambda t: (t.replace(" ", "\u00a0").translate(_PARENS), len(t)),
    ),
    ([('"|' + _ci("&quot;"), "[A-Za-z0-9$]")], _LEFTQ),
    ([('"|' + _ci("&quot;"), None)], _RIGHTQ),
    ([("\\x7f", None)], _skip),
    ([("<|" + _ci("&lt;"), None)], _lit("<")),
    ([(">|" + _ci("&gt;"), None)], _lit(">")),
    ([("[<>]?[:;=][\\-o*']?[()DPdpO\\\\{@|\\[\\]]", "[^A-Za-z0-9]")], lambda t: (t.translate(_PARENS), len(t))),
    (
        [
            ("[\\^x=~<>]\\.\\[\\^" + _ci("x") + "=~<>\\]", None),
            ("[\\-\\^x=~<>']_[\\-\\^x=~<>']", None),
            ("\\([\\-\\^x=~<>'][_.]?[\\-\\^x=~<>']\\)", None),
            ("\\([\\^x=~<>']-[\\^x=~<>'`]\\)", None),
        ],
        lambda t: (t.translate(_PARENS), len(t)),
    ),
    ([("\\{", None)], _lit("-LCB-")),
    ([("\\}", None)], _lit("-RCB-")),
    ([("\\[", None)], _lit("-LSB-")),
    ([("\\]", None)], _lit("-RSB-")),
    ([("\\(", None)], _lit("-LRB-")),
    ([("\\)", None)], _lit("-RRB-")),
    ([("-+", None)], lambda t: ("--" if 3 <= len(t) <= 4 else t, len(t))),
    ([("\\.{3,5}", None), ("(?:\\.[ \\u00a0]){2,4}\\.", None), ("[\\u0085\\u2026]", None)], _lit("...")),
    ([("@+", None), ("#+", None), ("_+", None)], _keep),
    ([("\\*+", None), ("(?:\\\\\\*){1,3}", None)], _keep),
    ([(_INSENTP, None)], _keep),
    ([("[?!]+", None)], _keep),
    ([("[.\\u00a1\\u00bf\\u037e\\u0589\\u061f\\u06d4\\u0700-\\u0702\\u07fa\\u3002]", None)], _keep),
    ([("=", None)], _keep),
    ([("/", None)], _keep),
    ([(_HTHING + "\\.", _INSENTP)], _soft),
    ([(_HTHING, None)], _soft),
    ([(_THING + "\\.", _INSENTP)], _keep),
    ([(_THING, None)], _keep),
    ([(_THINGA + "\\.", _INSENTP)], lambda t: (_AMP_RE.sub("&", t), len(t))),
    ([(_THINGA, None)], lambda t: (_AMP_RE.sub("&", t), len(t))),
    ([("'", "[A-Za-z][^ \\t\\n\\r\\u00a0]")], _LEFTQ),
    ([(_REDAUX, None)], _RIGHTQ),
    ([(_SREDAUX, None)], _RIGHTQ),
    ([(_APOS, None), ("''", None), (f"[{_QUOTE_CHARS}]{{1,2}}", None)], _RIGHTQ),
    ([("<<|>>", None)], _keep),
    ([(_MISCSYMBOL, None)], _keep),
    ([("\\x00|[\\u200b\\u200e\\u200f\\ufeff]", None), (f"{_SPACE}+", None)], _skip),
    ([(_NEWLINE, None)], _skip),
    ([(_ci("&nbsp;"), None)], _skip),
]
# One regex tries every alternative at a position in a single call: each sits in an optional lookahead whose groups
# record its match (m<i>) and trailing context (t<i>), so the longest can be picked as JFlex does.
_ALTERNATIVES = [(main, trail, action) for alts, action in _RULES_SRC for main, trail in alts]
_ALL_RULES = re.compile(
    "".join(
        f"(?:(?=(?P<m{i}>{main}){'' if trail is None else f'(?=(?P<t{i}>{trail}))'})|)"
        for i, (main, trail, _) in enumerate(_ALTERNATIVES)
    )
)
# The common cases, fast: white space is skipped (no rule that starts with it matches longer), and a run of ASCII
# letters before white space or the end is one word token for every rule (none that could match longer crosses white
# space after letters alone), except the words the lexer splits.
_PLAIN_WORD = re.compile(f"(?P<space>{_SPACE}+|{_NEWLINE})|[A-Za-z]+(?={_SPACENL}|$)")
_SPLIT_WORDS = {"cannot", "gonna", "gotta", "lemme", "gimme", "wanna"}
# pycocoevalcap drops these tokens after tokenizing.
_BRACKETS_LISTED = ("-LRB-", "-RRB-", "-LCB-", "-RCB-")  # upper-case in the filter, so the lower-cased tokens stay
PUNCTUATIONS = {"''", "'", "``", "`", *_BRACKETS_LISTED, ".", "?", "!", ",", ":", "-", "--", "...", ";"}


def _lex(text: str) -> list[tuple[int, str]]:
    """(start, token) of each token the Java PTB lexer returns for `text`."""
    out, pos, end = [], 0, len(text)
    while pos < end:
        m = _PLAIN_WORD.match(text, pos)
        if m and m.group().lower() not in _SPLIT_WORDS:
            if m.group("space") is None:
                out.append((pos, m.group()))
            pos = m.end()
            continue
        groups = _ALL_RULES.match(text, pos).groups()  # (m0, t0?, m1, ...) in _ALTERNATIVES order
        best_total, best, g = 0, None, 0
        for _, trail, action in _ALTERNATIVES:
            matched, context = groups[g], "" if trail is None else groups[g + 1]
            g += 1 if trail is None else 2
            # the longest match, trailing context included, wins; the earlier rule on a tie
            if matched is not None and len(matched) + len(context) > best_total:
                best_total, best = len(matched) + len(context), (matched, action)
        if best is None:  # untokenizable: the Java lexer deletes the character
            pos += 1
            continue
        token, consumed = best[1](best[0])
        if token is not None:
            out.append((pos, token))
        pos += consumed
    return out


def _cased(c: str) -> bool:
    return c.islower() or c.isupper() or c.istitle()


def _java_lower(token: str) -> str:
    """Java's toLowerCase, near enough: a capital sigma becomes final (ς) when a cased letter comes anywhere before it
    in the token and none after (Python's lower() looks only at its neighbours; Java uses its word-break rules, which
    this follows except around digits and punctuation, e.g. "ß-1Σ"); the rest as Python's."""
    if "\u03a3" not in token:
        return token.lower()
    return "".join(
        ("\u03c2" if any(map(_cased, token[:i])) and not any(map(_cased, token[i + 1 :])) else "\u03c3")
        if c == "\u03a3"
        else c.lower()
        for i, c in enumerate(token)
    )


def ptb_tokenize(captions: Sequence[str]) -> list[str]:
    """Each caption as pycocoevalcap's PTBTokenizer returns it: tokens lower-cased, punctuation dropped, joined by
    single spaces. Pass the captions of one pycocoevalcap call together (its tokenizer reads them as the lines of one
    file, and a few rules look into the next line)."""
    lines = [c.replace("\n", " ") for c in captions]
    starts = np.cumsum([0] + [len(line) + 1 for line in lines])
    tokens: list[list[str]] = [[] for _ in lines]
    for pos, token in _lex("\n".join(lines)):
        token = _java_lower(token)
        if token not in PUNCTUATIONS:
            tokens[int(np.searchsorted(starts, pos, side="right")) - 1].append(token)
    return [" ".join(t) for t in tokens]


# ---------------------------------------------------------------------------------------------------------------------
# CIDEr-D


def _ngrams(words: list[str], k: int) -> list[str]:
    """The caption's k-grams, each as its words joined by a space (the words hold no white space, so two n-grams are
    equal exactly when pycocoevalcap's word tuples are; a string caches its hash, a tuple does not)."""
    return words if k == 1 else [" ".join(words[i : i + k]) for i in range(len(words) - k + 1)]


class CiderD:
    """CIDEr-D whose document frequencies are fixed by a reference corpus (one list of tokenized reference captions
    per image): built once, e.g. from the training split's references, it scores any candidate against its own
    references, so a caption's score depends on it and its references alone (a training reward). `cider_d` builds one
    from the evaluated images' references, which is pycocoevalcap's `Cider`."""

    def __init__(self, corpus: Sequence[Sequence[str]], sigma: float = 6.0):
        if not corpus:
            raise ValueError("CiderD: the reference corpus is empty (need one list of references per image)")
        self.sigma = sigma
        df: Counter = Counter()
        for refs in corpus:  # one count per image, however many of its references hold the n-gram
            words = [ref.split() for ref in refs]
            df.update({g for w in words for k in range(1, N + 1) for g in _ngrams(w, k)})
        self.log_n = math.log(float(len(corpus)))
        # idf = log N - log max(1, df): df 0 (not in the corpus) and df 1 weigh the same, so only df >= 2 is kept.
        self._log_df = {g: math.log(c) for g, c in df.items() if c > 1}

    def _vector(self, caption: str) -> tuple[list[dict], list[float], int]:
        """Per n-gram order {n-gram: tf * idf} and its norm, and the caption's length in words."""
        words = caption.split()
        log_n, log_df = self.log_n, self._log_df
        vecs, norms = [], []
        for k in range(1, N + 1):
            vec = {g: tf * (log_n - log_df.get(g, 0.0)) for g, tf in Counter(_ngrams(words, k)).items()}
            vecs.append(vec)
            norms.append(math.sqrt(sum(v * v for v in vec.values())))
        return vecs, norms, len(words)

    def score(self, candidates: Sequence[str], references: Sequence[Sequence[str]]) -> np.ndarray:
        """CIDEr-D of each tokenized candidate against its own tokenized references: float64 [len(candidates)]."""
        if len(candidates) != len(references):
            raise ValueError(f"CiderD.score: {len(candidates)} candidates but {len(references)} reference lists")
        two_sigma_sq = 2.0 * self.sigma**2
        ref_cache: dict[tuple[str, ...], list] = {}  # a group scores many candidates against the same references
        out = np.empty(len(candidates))
        for i, (cand, refs) in enumerate(zip(candidates, references)):
            if not refs:
                raise ValueError(f"CiderD.score: candidate {i} has no references")
            key = tuple(refs)
            if key not in ref_cache:
                ref_cache[key] = [self._vector(r) for r in refs]
            vecs, norms, length = self._vector(cand)
            total = 0.0
            for ref_vecs, ref_norms, ref_length in ref_cache[key]:
                penalty = math.exp(-((length - ref_length) ** 2) / two_sigma_sq)
                for vec, ref_vec, norm, ref_norm in zip(vecs, ref_vecs, norms, ref_norms):
                    # the candidate's weights clipped by the reference's, times the reference's, summed in the order
                    # of the candidate's n-grams as pycocoevalcap sums them (a set's order changes with the process's
                    # string hashes, and with it the last bits of the sum)
                    dot = sum(min(w, ref_vec[g]) * ref_vec[g] for g, w in vec.items() if g in ref_vec)
                    total += (dot / (norm * ref_norm) if norm != 0 and ref_norm != 0 else dot) * penalty
            out[i] = total / N / len(refs) * 10.0  # mean over orders, mean over references, times 10
        return out


def cider_d(
    candidates: Sequence[str], references: Sequence[Sequence[str]], sigma: float = 6.0
) -> tuple[float, np.ndarray]:
    """pycocoevalcap's CIDEr-D of tokenized candidates (one per image) against their images' tokenized references,
    document frequencies over these references: (the mean, the per-image scores [len(candidates)])."""
    scores = CiderD(references, sigma).score(candidates, references)
    return float(scores.mean()), scores


def coco_cider(candidates: Sequence[str], references: Sequence[Sequence[str]]) -> tuple[float, np.ndarray]:
    """What pycocoevalcap's COCO evaluation reports for raw captions: both sides PTB-tokenized as it tokenizes them
    (the references in one call, the candidates in another), then `cider_d`: (the mean, the per-image scores)."""
    flat = iter(ptb_tokenize([r for refs in references for r in refs]))
    return cider_d(ptb_tokenize(list(candidates)), [[next(flat) for _ in refs] for refs in references])
