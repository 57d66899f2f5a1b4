"""The Ray seam: raygpt/ray/ is the only package that imports Ray. Every other module (the
loop, the model, checkpoints, the run log, the config) runs and is tested without it."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "raygpt"
SEAM = PACKAGE / "ray"


def ray_imports(path: Path) -> list[str]:
    """Each `import ray...` / `from ray... import` in the file (at any depth: a function-local
    import counts too), as "line: statement"."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:  # absolute imports only
            names = [node.module or ""]
        else:
            continue
        if any(n == "ray" or n.startswith("ray.") for n in names):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_only_the_ray_package_imports_ray():
    outside = {str(p.relative_to(PACKAGE.parent)): hits
               for p in sorted(PACKAGE.rglob("*.py")) if SEAM not in p.parents
               for hits in [ray_imports(p)] if hits}
    assert outside == {}, f"Ray imported outside raygpt/ray/: {outside}"


def test_the_check_sees_ray_imports(tmp_path):
    """The scan finds each form of import (it would pass vacuously otherwise), and the seam
    itself does import Ray."""
    probe = tmp_path / "probe.py"
    probe.write_text("import os\nimport ray.train\ndef f():\n    from ray import tune\n"
                     "from raygpt.ray import driver\nfrom . import ray\n")
    assert [h.split(":")[0] for h in ray_imports(probe)] == ["2", "4"]
    assert ray_imports(SEAM / "driver.py")


COMPAT = SEAM / "compat.py"


def private_uses(path: Path, top: str) -> list[str]:
    """Each use of a private name of package `top` ("ray", "torch") in the file, as "line:
    what": an import of a private module (a dotted part starting with "_": ray._private,
    torch._dynamo) or of a private name (`from ray.train.torch.config import _TorchBackend`), an
    attribute starting with "_" reached through a name bound to the package
    (`torch._functorch.config.x`), and a call of a private method through super() (an
    overridden private method of the package's classes)."""
    def private(part: str) -> bool:
        return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))

    tree = ast.parse(path.read_text(), str(path))
    bound: set[str] = set()  # local names of the package's modules
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == top or a.name.startswith(top + "."):
                    bound.add(a.asname or top)
                    if any(private(p) for p in a.name.split(".")):
                        found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                node.module == top or node.module.startswith(top + ".")):
            bound.update(a.asname or a.name for a in node.names)
            if any(private(p) for p in node.module.split(".")) or any(
                    private(a.name) for a in node.names):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not private(node.attr):
            continue
        root = node.value
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(root, ast.Name) and root.id in bound:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif (isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
              and node.value.func.id == "super" and path.is_relative_to(PACKAGE / top)):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_only_compat_uses_private_ray_names():
    """A Ray upgrade is checked in one module: raygpt/ray/compat.py."""
    outside = {str(p.relative_to(PACKAGE.parent)): hits
               for p in sorted(PACKAGE.rglob("*.py")) if p != COMPAT
               for hits in [private_uses(p, "ray")] if hits}
    assert outside == {}, f"private Ray names used outside raygpt/ray/compat.py: {outside}"


def test_every_compat_hook_says_what_it_was_checked_on():
    """Each hook of compat.py names the Ray version it was checked on, the one pyproject pins."""
    tree = ast.parse(COMPAT.read_text())
    hooks = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name != "__getattr__"]
    source = COMPAT.read_text().splitlines()
    unchecked = [h.name for h in hooks
                 if "Checked on Ray 2.60.0" not in " ".join(source[h.lineno - 1:h.end_lineno])]
    assert hooks and unchecked == []
    pyproject = (PACKAGE.parent / "pyproject.toml").read_text()
    assert '"ray[train,tune,data]>=2.60,<2.61"' in pyproject


def test_the_private_scan_sees_each_form(tmp_path):
    """The scan finds each form of private use (it would pass vacuously otherwise), and
    compat.py itself has them."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import ray\n"
        "from ray.train.torch.config import _TorchBackend\n"
        "from ray.train import Checkpoint\n"
        "def f():\n"
        "    from ray._private.utils import get_num_cpus\n"
        "    return ray._private.worker, ray.__version__\n"
        "import ray.train.v2._internal.execution as ex\n"
        "x = Checkpoint._private_thing\n")
    assert sorted(int(h.split(":")[0]) for h in private_uses(probe, "ray")) == [2, 5, 6, 7, 8]
    assert private_uses(COMPAT, "ray")


def test_compat_and_capacity_import_none_of_ray():
    """compat.py resolves Ray's private names on first use: importing it, and capacity with it
    (raygpt train's and raygpt sweep's checks before Ray starts), loads no Ray."""
    import os
    import subprocess
    import sys

    code = ("import sys, raygpt.ray.compat, raygpt.ray.capacity\n"
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=PACKAGE.parent, env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
