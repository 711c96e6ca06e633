"""The shape of the code: who imports whom, and how long a function may grow.

- The package (icl_select/ and model.py) imports no stage script and nothing of tests/; a stage script (the five stages)
  imports no other stage; the tools over them (ablate.py, bench.py, gpu_report.py) may import the stages.
- No circle of imports, lazy imports inside functions included (type-checking imports aside).
- No function of the package or a stage outgrows FUNCTION_LINES; the tools' longest stay where they are.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("gen_rl_data", "rce", "grpo", "evaluate", "compare")
TOOLS = ("ablate", "bench", "gpu_report")
FUNCTION_LINES, TOOL_FUNCTION_LINES = 100, 230


def modules() -> dict[str, Path]:
    """Every module of the kit: root scripts by name, the package's as icl_select.<name>."""
    found = {p.stem: p for p in ROOT.glob("*.py")}
    return found | {f"icl_select.{p.stem}": p for p in (ROOT / "icl_select").glob("*.py") if p.stem != "__init__"}


def type_checking_only(tree: ast.Module) -> set[ast.AST]:
    """The import nodes under `if TYPE_CHECKING:`."""
    return {
        node
        for branch in ast.walk(tree)
        if isinstance(branch, ast.If) and getattr(branch.test, "id", None) == "TYPE_CHECKING"
        for stmt in branch.body
        for node in ast.walk(stmt)
    }


def imports() -> dict[str, set[str]]:
    """module -> the kit's modules it imports, anywhere in it (top level or inside a function)."""
    known, graph = modules(), {}
    for name, path in known.items():
        tree = ast.parse(path.read_text())
        skip, found = type_checking_only(tree), set()
        for node in ast.walk(tree):
            if node in skip:
                continue
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
                found |= {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = {m for m in found if m in known and m != name}
    return graph


def test_no_module_imports_one_above_it():
    graph = imports()
    package = [m for m in graph if m.startswith("icl_select.") or m == "model"]
    for m in package:
        assert not graph[m] & {*STAGES, *TOOLS}, f"{m} imports a script: {graph[m] & {*STAGES, *TOOLS}}"
    for m in STAGES:
        assert not graph[m] & {*STAGES, *TOOLS}, f"{m} imports another script: {graph[m] & {*STAGES, *TOOLS}}"
    for path in [*ROOT.glob("*.py"), *(ROOT / "icl_select").glob("*.py")]:
        text = path.read_text()
        assert "real_fixtures" not in text and "tests" not in [
            part for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ImportFrom) and n.module
            for part in n.module.split(".")
        ], f"{path.name} imports from tests/"  # fmt: skip


def test_no_circle_of_imports():
    graph, state, path = imports(), {}, []

    def visit(m: str) -> None:
        state[m] = "open"
        path.append(m)
        for n in sorted(graph[m]):
            assert state.get(n) != "open", f"a circle: {' -> '.join(path[path.index(n) :] + [n])}"
            if n not in state:
                visit(n)
        path.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_no_function_outgrows_its_bound():
    for name, path in modules().items():
        limit = TOOL_FUNCTION_LINES if name in TOOLS else FUNCTION_LINES
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                lines = node.end_lineno - node.lineno + 1
                assert lines <= limit, f"{path.name}: {node.name} is {lines} lines, more than {limit}"
