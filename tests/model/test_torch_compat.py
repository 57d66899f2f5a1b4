"""PyTorch's private API is used in one module, raygpt/model/torch_compat.py: a torch upgrade is
checked there, each hook naming the versions it was checked on."""

import ast
from pathlib import Path

from tests.ray_seam.test_seam import PACKAGE, private_uses

TORCH_COMPAT = PACKAGE / "model" / "torch_compat.py"


def test_only_torch_compat_uses_private_torch_names():
    outside = {str(p.relative_to(PACKAGE.parent)): hits
               for p in sorted(PACKAGE.rglob("*.py")) if p != TORCH_COMPAT
               for hits in [private_uses(p, "torch")] if hits}
    assert outside == {}, f"private torch names used outside raygpt/model/torch_compat.py: {outside}"


def test_every_hook_says_what_it_was_checked_on():
    tree = ast.parse(TORCH_COMPAT.read_text())
    hooks = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert hooks and all("Checked on torch" in (ast.get_docstring(h) or "") for h in hooks)
    assert private_uses(TORCH_COMPAT, "torch")  # the scan sees what is there


def test_the_scan_sees_private_torch(tmp_path: Path):
    probe = tmp_path / "probe.py"
    probe.write_text("import torch\nimport torch._dynamo\nx = torch._functorch.config.y\n"
                     "from torch._inductor import codecache\ny = torch.compiler.config\n")
    assert sorted(int(h.split(":")[0]) for h in private_uses(probe, "torch")) == [2, 3, 4]
