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
