"""The package's import graph: no module imports one that imports it back (at any depth, a
function-local import counted too: a cycle is a cycle whenever it is taken), the model imports
nothing above it (no config, no run log), and no module imports a layer above its own (the
layers of docs/development.md, "The layout and its budget").

`python tests/test_layers.py` lists every import that runs back up the layers."""

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


# docs/development.md's layers, bottom first: a module may import its own layer and those below
LAYERS = (
    ("storage", "ops"),                                 # where bytes live; the kernels
    ("llmc", "model"),                                  # llm.c's formats; GPT-2 on one device
    ("config", "data", "checkpointing", "train", "eval", "interop", "runlog", "artifacts"),
    ("ray",),                                           # the Ray seam
    ("cli", "__main__", "tools"),                       # the commands
)
FACE = "raygpt"  # the package's __init__: run before any module of it; importing it adds nothing


def layer_of(module: str) -> int:
    # a folder's knobs.py (its settings, declared with config/knobs.py's `knob`) is the config
    # layer's: TrainConfig composes every component's knobs
    room = "config" if module.endswith(".knobs") else (
        module.split(".")[1] if "." in module else module)
    for i, rooms in enumerate(LAYERS):
        if room in rooms:
            return i
    raise AssertionError(f"{module}: in no layer of LAYERS (a new folder gets a layer here and "
                         f"in docs/development.md)")


def upward(g: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) for every import of a module in a higher layer than the importer's;
    a leaf (a module importing nothing of raygpt's, an error type) sits on the floor wherever
    its folder is: it brings nothing up with it."""
    leaves = {m for m, deps in g.items() if not deps}
    return sorted((m, d) for m, deps in g.items() if m != FACE for d in deps
                  if d != FACE and d not in leaves and layer_of(d) > layer_of(m))


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_the_model_imports_nothing_above_it():
    below = {"raygpt.ops", "raygpt.ops.reference", "raygpt.model.shapes"}
    assert graph()["raygpt.model.classifier_loss"] <= below
    assert graph()["raygpt.model.gpt"] <= below | {"raygpt.model.classifier_loss"}


def test_no_module_imports_a_layer_above_its_own():
    # model/memory.py reads -e's shape from a Hugging Face folder through interop/hf.py; it
    # moves to interop/ once config/preflight.py (another change's) imports it from there
    assert upward(graph()) == [("raygpt.model.memory", "raygpt.interop.hf")]


def test_the_layer_check_sees_an_upward_import_and_lets_a_leaf_through():
    g = {"raygpt.storage.a": {"raygpt.runlog.b", "raygpt.config.errors"},
         "raygpt.runlog.b": {"raygpt.ray.c"}, "raygpt.ray.c": {"raygpt.storage.a"},
         "raygpt.config.errors": set(), "raygpt.cli": {"raygpt.ray.c", FACE},
         "raygpt.data.d": {FACE}, FACE: {"raygpt.runlog.b"}}
    assert upward(g) == [("raygpt.runlog.b", "raygpt.ray.c"),
                         ("raygpt.storage.a", "raygpt.runlog.b")]
    assert [layer_of(m) for m in ("raygpt.ops.x", "raygpt.model.gpt", "raygpt.eval.sets",
                                  "raygpt.ray.driver", "raygpt.cli", "raygpt.ray.knobs",
                                  "raygpt.model.knobs")] == [0, 1, 2, 3, 4, 2, 2]


def test_the_cycle_check_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


BUDGET = 600  # lines a module may hold (docs/development.md, "The layout and its budget")


def test_no_module_is_over_the_budget():
    sizes = {module_name(p): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert {m: n for m, n in sizes.items() if n > BUDGET} == {}
    assert max(sizes.values()) > BUDGET // 2  # (the count sees the package's real modules)


if __name__ == "__main__":  # the list, for a change that moves modules
    for importer, imported in upward(graph()):
        print(f"{importer} -> {imported}")
