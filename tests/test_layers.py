"""The package's import graph: no module imports one that imports it back (at any depth, a
function-local import counted too: a cycle is a cycle whenever it is taken), and the model
imports nothing above it (no config, no run log)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "raygpt"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, known: set[str]) -> set[str]:
    """The raygpt modules the file imports (`from raygpt.x import y` counts as raygpt.x.y when
    that is a module, else raygpt.x), except under `if __name__ == "__main__":` (a script's
    entry, not the module's)."""
    tree = ast.parse(path.read_text(), str(path))
    skip = {id(n) for node in tree.body if isinstance(node, ast.If)
            and "__name__" in ast.unparse(node.test) for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in known:
            subs = {f"{node.module}.{a.name}" for a in node.names} & known
            found |= subs or {node.module}
    return found - {module_name(path)}


def graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    known = {module_name(p) for p in paths}
    return {module_name(p): imports(p, known) for p in paths}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_the_model_imports_nothing_above_it():
    below = {"raygpt.ops", "raygpt.ops.reference", "raygpt.model.shapes"}
    assert graph()["raygpt.model.classifier_loss"] <= below
    assert graph()["raygpt.model.gpt"] <= below | {"raygpt.model.classifier_loss"}


def test_the_cycle_check_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


BUDGET = 600  # lines a module may hold (docs/development.md, "The layout and its budget")


def test_no_module_is_over_the_budget():
    sizes = {module_name(p): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert {m: n for m, n in sizes.items() if n > BUDGET} == {}
    assert max(sizes.values()) > BUDGET // 2  # (the count sees the package's real modules)
