"""Markdown tables shared by evaluate.py (its summary), compare.py and ablate.py."""


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def accuracy_table(doc: dict) -> str:
    """An evaluation file's summary: VQA accuracy (%) per question count (rows) and shot count, with the average."""
    shots = doc["shots"]
    rows = []
    for n, v in doc["summary"].items():
        vals = [v[str(s)] for s in shots]
        rows.append([n] + [f"{x:.2f}" for x in vals] + [f"{sum(vals) / len(vals):.2f}"])
    return md_table(["n"] + [f"shot {s}" for s in shots] + ["avg"], rows)
