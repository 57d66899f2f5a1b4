"""README's main command installs the package alone (`pip install -e .`), so the demo must run
on pyproject's base dependencies: every raygpt module imports, and `raygpt train`'s defaults
resolve and pass the checks before Ray, with every module only the `test` extra brings hidden.
What is hidden is computed from the installed metadata: the test extra's closure less the base
dependencies' closure (fsspec, say, comes with torch and Ray, so it stays)."""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

# hide what only the test extra installs, then do what the demo does before Ray starts
PROBE = r"""
import importlib, pkgutil, sys
HIDDEN = set(sys.argv[1].split(","))
# None in sys.modules: `import x` fails and importlib.util.find_spec("x") is None, as if absent
sys.modules.update({name: None for name in HIDDEN})
import raygpt
for m in pkgutil.walk_packages(raygpt.__path__, "raygpt."):
    if not m.name.endswith("__main__"):  # (__main__ runs the command)
        importlib.import_module(m.name)
from raygpt.cli import _cluster_capacity
from raygpt.config import absolute_paths, parse_args, preflight
cfg = absolute_paths(parse_args(["-o", sys.argv[2]]))
gpus, cpus = _cluster_capacity()
preflight.check(cfg.resolve(gpus, cpus_available=cpus))
print("hidden and fine:", len(HIDDEN))
"""


def closure(requirements: list[str], extras: tuple[str, ...] = ()) -> set[str]:
    """The installed distributions `requirements` pull in, transitively (markers evaluated)."""
    seen: set[str] = set()
    todo = [(Requirement(r), extras) for r in requirements]
    while todo:
        req, asked = todo.pop()
        env_extras = asked or ("",)
        if req.marker and not any(req.marker.evaluate({"extra": e}) for e in env_extras):
            continue
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        key = name + "[" + ",".join(sorted(req.extras)) + "]"
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # a requirement this environment does not install (another platform)
        todo += [(Requirement(r), tuple(req.extras)) for r in dist.requires or []]
    return {k.partition("[")[0] for k in seen}


def only_test_modules() -> set[str]:
    base = closure(PYPROJECT["dependencies"])
    test = closure(PYPROJECT["optional-dependencies"]["test"])
    modules = md.packages_distributions()
    only = {re.sub(r"[-_.]+", "-", d).lower() for d in test - base}
    return {m for m, dists in modules.items()
            if m.isidentifier() and {re.sub(r"[-_.]+", "-", d).lower() for d in dists} <= only}


def test_readme_installs_the_package_for_the_demo_and_the_test_extra_for_the_tests():
    from tests.test_docs import read_page
    code = [line.strip() for _, line in read_page(ROOT / "README.md").code_lines]
    installs = [line for line in code if line.startswith("pip install")]
    assert installs[:2] == ["pip install -e . && python experiments/shakespeare.py",
                            'pip install -e ".[test]" && python -m pytest -q']
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci[-1] == installs[1]  # CI runs the test command exactly


def test_the_demo_needs_nothing_the_test_extra_brings(tmp_path):
    hidden = only_test_modules()
    # the extra's own packages are hidden; the base's (fsspec comes with torch) are not
    assert {"pytest", "moto", "mutmut", "transformers", "wandb", "matplotlib"} <= hidden
    assert not {"torch", "ray", "numpy", "pyarrow", "tiktoken", "fsspec"} & hidden
    out = subprocess.run([sys.executable, "-c", PROBE, ",".join(sorted(hidden)),
                          str(tmp_path / "run")], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("hidden and fine:"), out.stdout
