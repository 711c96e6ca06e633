"""The README and docs keep their evidence reachable: every `python ablate.py ...` command they print names variants
ablate.py still has (a renamed variant would leave a figure without the command that reproduces it), and every
relative link, #anchor included, lands on a file and a heading that exist (a moved section would leave a dangling
link). Text only: milliseconds."""

import json
import re
import shlex
from collections import Counter
from pathlib import Path

import tyro

import ablate

ROOT = Path(__file__).parent.parent


def documents(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def documented_ablate_commands() -> list[tuple[str, str]]:
    """(file, command) for every `python ablate.py ...` in the README and docs: bash blocks (continuations joined) and
    inline code (which may wrap), less the templates (a placeholder NAME or "...")."""
    found = []
    for path in documents():
        text = path.read_text()
        bash = re.findall(r"```bash\n(.*?)```", text, re.S)
        blocks = [ln for b in bash for ln in b.replace("\\\n", " ").splitlines()]
        spans = re.findall(r"`(python ablate\.py[^`]*)`", text)
        found += [(path.name, " ".join(c.split())) for c in blocks + spans if c.startswith("python ablate.py")]
    return [(f, c) for f, c in found if "NAME" not in c and "..." not in c]


def test_every_documented_ablate_command_names_known_variants():
    commands = documented_ablate_commands()
    assert {"README.md", "ablations.md", "results.md"} <= {name for name, _ in commands}  # it finds them at all
    for name, cmd in commands:
        args = tyro.cli(ablate.Args, args=shlex.split(cmd)[2:])  # the flags and worlds parse
        assert set(args.only) <= set(ablate.VARIANTS), (name, cmd, set(args.only) - set(ablate.VARIANTS))


def prose(text: str) -> str:
    """The text with fenced code blocks and inline code blanked (line count kept): links and headings are read from
    what Markdown renders as text."""
    text = re.sub(r"^```.*?^```", lambda m: "\n" * m.group().count("\n"), text, flags=re.S | re.M)
    return re.sub(r"`(?:[^`\n]|\n(?!\n))*`", lambda m: "\n" * m.group().count("\n"), text)  # spans may wrap


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text (a link's text, code without backticks, no emphasis stars),
    lower-cased, every character but letters, digits, underscores, hyphens and spaces dropped, spaces made hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings; a repeated one gets -1, -2, ... as GitHub numbers them."""
    found, seen = set(), Counter()
    for line in re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M).splitlines():
        if m := re.match(r"#{1,6} +(.*?)\s*#*\s*$", line):
            base = slug(m.group(1))
            found.add(f"{base}-{seen[base]}" if seen[base] else base)
            seen[base] += 1
    return found


def broken_links(paths: list[Path], root: Path = ROOT) -> list[str]:
    """'file:line: target (why)' for every relative link in `paths` whose file or #anchor does not exist."""
    out = []
    for path in paths:
        for number, line in enumerate(prose(path.read_text()).splitlines(), 1):
            for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", line):
                if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
                    continue
                file, _, anchor = target.partition("#")
                dest = (path.parent / file).resolve() if file else path
                why = (
                    "no such file"
                    if not dest.exists()
                    else "no such heading"
                    if anchor and dest.suffix == ".md" and anchor not in anchors(dest)
                    else None
                )
                if why:
                    out.append(f"{path.relative_to(root)}:{number}: {target} ({why})")
    return out


def test_every_relative_link_in_the_readme_and_docs_resolves():
    broken = broken_links(documents())
    assert not broken, "\n".join(broken)


def test_links_to_missing_files_and_headings_are_reported(tmp_path):
    """The checker itself, on planted documents: GitHub's anchors (written out by hand here), a repeated heading's
    numbering, links in code ignored, and every kind of broken link reported with its line."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "# Kit\n\nSee [worlds](docs/w.md#where-saturatings-pairs-go), [flags](docs/w.md#grpopy),\n"
        "[again](docs/w.md#notes-1), [top](#kit), [site](https://example.com/x#y) and `[code](nowhere.md)`.\n"
        "```bash\n[block](nowhere.md)\n```\n"
        "[gone](docs/gone.md), [moved](docs/w.md#learning-in-every-world), [self](#nope)\n"
    )
    (tmp_path / "docs" / "w.md").write_text(
        "# Worlds\n\n## Where `saturating`'s pairs go\n\n### grpo.py\n\n## Notes\n\n## Notes\n\n"
        "```python\n# Learning in every world\n```\n\n[up](../README.md#kit), [rce → oracle](#rce--oracle-share)\n"
        "\n## RCE → oracle: share\n"
    )
    assert slug("Where `saturating`'s pairs go") == "where-saturatings-pairs-go"
    assert slug("RCE → oracle: share") == "rce--oracle-share"
    assert anchors(tmp_path / "docs" / "w.md") == {
        "worlds",
        "where-saturatings-pairs-go",
        "grpopy",
        "notes",
        "notes-1",
        "rce--oracle-share",
    }
    assert broken_links([tmp_path / "README.md", tmp_path / "docs" / "w.md"], tmp_path) == [
        "README.md:8: docs/gone.md (no such file)",
        "README.md:8: docs/w.md#learning-in-every-world (no such heading)",
        "README.md:8: #nope (no such heading)",
    ]


def test_the_combination_tables_are_those_the_test_walks():
    """docs/combinations.md shows the axes and refusals tests/combinations.py declares, as they are there."""
    from combinations import markdown

    assert markdown() in (ROOT / "docs" / "combinations.md").read_text()


# The docs' sizes, and the README's words that need defining: a reader with half an hour reads them whole.
README_WORDS, DOCS_WORDS, TABLE_COLUMNS, PARAGRAPH_WORDS = 1500, 12000, 8, 120
# Terms a newcomer cannot guess: where the README uses one, its glossary ("## Words") defines it.
JARGON = (
    "LVLM",
    "demonstration",
    "pool",
    "anchor",
    "group",
    "RCE",
    "GRPO",
    "warm start",
    "LVLM calls",
    "budget",
    "item scores",
    "zero-shot",
    "RICES",
    "MMICES",
    "MMR",
    "coreset",
    "retriever",
    "Lever-LM",
    "InfoScore",
    "Lever-Plus",
    "world",
    "additive",
    "copy",
    "saturating",
    "strong",
    "order",
    "harmful",
    "oracle",
    "observable ceiling",
    "share of the gap",
    "up to k",
    "exactly k",
    "CIDEr-D",
)


def all_docs(root: Path = ROOT) -> list[Path]:
    return [*documents(root), root / "CONTRIBUTING.md"]


def blocks(text: str) -> list[str]:
    """The paragraphs and list items of a Markdown text (code, tables and headings left out)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    out = []
    for chunk in re.split(r"\n\s*\n", text):
        lines = [ln for ln in chunk.splitlines() if ln.strip() and not ln.lstrip().startswith(("|", "#"))]
        items, current = [], []
        for ln in lines:
            if re.match(r"\s*([-*]|\d+\.) ", ln) and current:
                items.append(" ".join(current))
                current = []
            current.append(ln)
        out += items + ([" ".join(current)] if current else [])
    return out


def glossary(readme: str) -> set[str]:
    """The terms the README's glossary defines: its first column's, and the names it lists in code in a meaning (the
    worlds)."""
    section = readme.split("## Words", 1)[1].split("\n## ", 1)[0]
    terms = {t.strip().lower() for row in re.findall(r"^\| ([^|]+) \|", section, re.M) for t in row.split(",")}
    return terms | {t.lower() for t in re.findall(r"`([\w-]+)`", section)}


def doc_problems(paths: list[Path], readme: Path) -> list[str]:
    """Every rule of the docs a file breaks, one line each."""
    problems = []
    words = {p: len(p.read_text().split()) for p in paths}
    if words[readme] > README_WORDS:
        problems.append(f"{readme.name}: {words[readme]} words, more than {README_WORDS}")
    if sum(words.values()) > DOCS_WORDS:
        problems.append(f"the docs hold {sum(words.values())} words, more than {DOCS_WORDS}")
    for p in paths:
        text = p.read_text()
        for row in re.findall(r"^\|.*\|$", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M), re.M):
            if (n := row.count("|") - 1) > TABLE_COLUMNS:
                problems.append(f"{p.name}: a table of {n} columns: {row[:60]}")
                break
        for block in blocks(text):
            if (n := len(block.split())) > PARAGRAPH_WORDS:
                problems.append(f"{p.name}: a paragraph of {n} words: {block[:60]}")
    text = readme.read_text()
    defined, used = (
        glossary(text),
        prose(text.split("## Words", 1)[0] + text.split("## Words", 1)[1].split("\n## ", 1)[1]),
    )
    for term in JARGON:
        if re.search(rf"(?<![\w-]){re.escape(term)}(?![\w-])", used, re.I) and term.lower() not in defined:
            problems.append(f"{readme.name}: '{term}' is used but not in its glossary")
    return problems


def test_the_docs_keep_their_sizes_and_define_their_words():
    problems = doc_problems(all_docs(), ROOT / "README.md")
    assert not problems, "\n".join(problems)


def test_the_docs_rules_catch_what_they_forbid(tmp_path):
    """The checker itself, on planted documents: a long paragraph, a wide table, an undefined term, too many words."""
    readme = tmp_path / "README.md"
    body = "Trained by GRPO.\n\n## Words\n\n| word | meaning |\n|---|---|\n| RCE | a warm-up |\n\n"
    body += "## More\n\nRCE is here.\n"
    readme.write_text(body + "\n" + " ".join(["word"] * 121) + "\n\n| " + " | ".join("abcdefghi") + " |\n")
    problems = doc_problems([readme], readme)
    assert any("'GRPO' is used but not in its glossary" in p for p in problems)
    assert not any("'RCE'" in p for p in problems)
    assert any("a paragraph of 121 words" in p for p in problems) and any("a table of 9 columns" in p for p in problems)
    readme.write_text(body + (" word" * 1600))
    assert any("more than 1500" in p for p in doc_problems([readme], readme))


def test_every_flag_the_flags_page_names_is_declared_and_every_flag_that_points_there_is_on_it():
    """docs/flags.md against the stages' declarations: no flag it explains is gone (or misspelt), and every flag whose
    help says "docs/flags.md" is explained there."""
    import dataclasses
    import typing

    import ablate
    import bench
    import compare
    import evaluate
    import gen_rl_data
    import gpu_report
    import grpo
    import rce

    stages = (gen_rl_data, rce, grpo, evaluate, compare, ablate, bench, gpu_report)
    declared, pointing = {"--help"}, set()
    for stage in stages:
        for f in dataclasses.fields(stage.Args):
            flag = f"--{f.name.replace('_', '-')}"
            declared.add(flag)
            hint = typing.get_type_hints(stage.Args, include_extras=True)[f.name]
            names = [a for m in getattr(hint, "__metadata__", ()) for a in (getattr(m, "aliases", None) or ())]
            declared |= set(names)
    page = (ROOT / "docs" / "flags.md").read_text()
    named = set(re.findall(r"`(--[a-z][a-z-]*)", page))
    assert named <= declared, f"docs/flags.md explains flags no stage declares: {sorted(named - declared)}"
    for stage in stages:
        source = Path(stage.__file__).read_text()
        for f in dataclasses.fields(stage.Args):
            field_doc = re.search(rf"\n    {f.name}: [^\n]*\n    \"\"\"(.*?)\"\"\"", source, re.S)
            if field_doc and "docs/flags.md" in field_doc.group(1):
                pointing.add(f"--{f.name.replace('_', '-')}")
    assert pointing and pointing <= named, f"flags pointing at docs/flags.md but not on it: {sorted(pointing - named)}"


def first_screen(readme: Path = ROOT / "README.md") -> str:
    """The README up to its first section: what a reader sees before scrolling."""
    return readme.read_text().split("\n## ", 1)[0]


def unjudged_numbers(screen: str, judged: str) -> list[str]:
    """Every decimal number of `screen`, its sign included, that the judgement's file does not hold."""
    numbers = [n.replace("−", "-") for n in re.findall(r"(?<![\w./−-])[+−-]?\d+\.\d+", screen)]  # not Qwen2.5
    return [n for n in numbers if not re.search(rf"(?<![\d.+-]){re.escape(n)}(?!\d)", judged)]


def seeds_named(text: str) -> set[int]:
    """The seeds a phrase names: "seed 7", "seeds 89–92", "seeds 100, 101 and 104"."""
    found = set()
    for run in re.findall(r"\bseeds? ((?:\d+(?:[–-]\d+)?(?:,\s*|\s+and\s+|\s+)?)+)", text):
        for a, b in re.findall(r"(\d+)(?:[–-](\d+))?", run):
            found |= set(range(int(a), int(b or a) + 1))
    return found


def stale_fresh_claims(texts: dict[str, str], ledger: dict, judgement: str | None) -> list[str]:
    """Every sentence of `texts` that calls seeds fresh, untuned or held out while the ledger says one of them tuned or
    judged something (the judgement the docs report, at commit `judgement`, aside; None: no judgement yet)."""
    spent = [u for u in ledger["uses"] if judgement is None or u.get("commit") != judgement]
    used = {s for u in spent for s in range(u["seeds"][0], u["seeds"][1] + 1)}
    claims = r"fresh|untuned|tuned nothing|held[- ]out|unseen|never (?:tuned|used|seen)"
    return [
        f"{name}: {' '.join(sentence.split())[:100]!r} names seeds {sorted(seeds_named(sentence) & used)}"
        for name, text in texts.items()
        for sentence in re.split(r"(?<=[.;])\s|\n\s*\n", text)
        if re.search(claims, sentence, re.I) and seeds_named(sentence) & used
    ]


def test_the_first_screen_cites_the_judgement_only():
    """Every decimal figure on the README's first screen is one `ablate.py --judge` wrote (docs/judged.json; none
    before it has), and no sentence of the docs calls a seed fresh, untuned or held out that the ledger
    (docs/seeds.json) says tuned or judged anything before."""
    path = ROOT / "docs" / "judged.json"
    judged = path.read_text() if path.is_file() else ""
    assert not unjudged_numbers(first_screen(), judged)
    ledger, commit = json.loads((ROOT / "docs" / "seeds.json").read_text()), judged and json.loads(judged)["commit"]
    assert not stale_fresh_claims({p.name: p.read_text() for p in all_docs()}, ledger, commit or None)


def test_the_results_page_and_the_ledger_are_the_judgement_s_as_written():
    """docs/results.md and docs/seeds.json are what `ablate.py --judge` writes from docs/judged.json and the ledger:
    a figure typed into the page, or a use into the ledger by hand in another layout, fails here."""
    judged, ledger = (json.loads((ROOT / "docs" / name).read_text()) for name in ("judged.json", "seeds.json"))
    assert (ROOT / "docs" / "results.md").read_text() == ablate.results_page(judged, ledger)
    assert (ROOT / "docs" / "seeds.json").read_text() == ablate.ledger_text(ledger)


def test_the_first_screen_rules_catch_what_they_forbid():
    judged = json.dumps({"figures": {"a": {"b": "+2.84 [+2.10, +3.61]", "c": "12.50"}}})
    screen = "Qwen2.5-VL, LLaVA-1.5: above by +2.84 [+2.10, +3.61]; 12.50 against 2.50 and −2.10; level (+0.78)."
    assert unjudged_numbers(screen, judged) == ["2.50", "-2.10", "+0.78"]
    ledger = {"uses": [{"seeds": [89, 94], "did": "tuned"}, {"seeds": [100, 101], "did": "judged", "commit": "c"}]}
    texts = {"README.md": "Where they hurt (fresh seeds 89–92), it wins. On held-out seeds 100 and 101 it holds."}
    assert stale_fresh_claims(texts, ledger, "c") == [
        "README.md: 'Where they hurt (fresh seeds 89–92), it wins.' names seeds [89, 90, 91, 92]"
    ]
    assert len(stale_fresh_claims(texts, ledger, None)) == 2  # before any judgement, every use counts
    assert seeds_named("seeds 100, 101 and 104; seed 7") == {100, 101, 104, 7}


def recipe_commands(readme: Path = ROOT / "README.md") -> list[list[str]]:
    """The README's real-data recipe: each command of the first code block under "## Real data", split."""
    section = readme.read_text().split("\n## Real data", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.startswith("python ")]


def test_the_gpu_plan_counts_the_readme_s_recipe():
    """gpu_report.PIPELINE, the GPU-hours the docs quote, prices the recipe the README gives: its processes that load
    the LVLM, the selectors and baselines it evaluates (a recipe changed in the README alone would leave the price)."""
    import gpu_report

    commands = recipe_commands()
    scripts = Counter(c[1] for c in commands)
    assert scripts["gen_rl_data.py"] == scripts["rce.py"] == scripts["grpo.py"] == 1
    loading = [c for c in commands if c[1] != "compare.py"]
    assert gpu_report.PIPELINE["processes"] == len(loading)
    evaluated = [c for c in commands if c[1] == "evaluate.py"]
    baselines = [c[c.index("--baseline") + 1] for c in evaluated if "--baseline" in c]
    runs = [a for c in evaluated if "--baseline" not in c for a in c[2 : c.index("--data")]]
    assert sorted(baselines) == ["image-sim", "zero-shot"] and len(runs) == 2
    assert gpu_report.PIPELINE["eval_selectors"] == (len(runs) + 1) * 800 * 4  # RICES is asked as a selector is
    grpo = next(c for c in commands if c[1] == "grpo.py")
    assert gpu_report.PIPELINE["online"] == int(grpo[grpo.index("--lvlm-budget") + 1])
