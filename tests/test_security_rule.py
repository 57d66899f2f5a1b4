"""SECURITY.md's rule, enforced on the source: no byte read from a run directory, a sweep
directory, a node cache or an object store is unpickled, imported, executed or written through,
unless it is authenticated as this user's.

The scan resolves every call in raygpt/ to a dotted name (through the module's imports) and
fails on a call that can run code or unpickle (`DANGEROUS`), or write a file (`WRITES`), outside
the reviewed places listed below, each with the line that says why it is safe. A new call site is
a failure to review, not a test to update blindly: it either goes through the reviewed owner
(the signed-file reader, RunDir's writers) or is added here with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "raygpt"

# Calls that run code or unpickle whatever bytes they are given. A name ending in "*" matches every
# name it starts; ".name" matches a method of that name on any object.
DANGEROUS = (
    "pickle.*", "cloudpickle.*", "ray.cloudpickle.*", "dill.*", "marshal.*", "shelve.*",
    "jsonpickle.*",
    "torch.load", "torch.serialization.load", "numpy.load",
    "torch.compiler.load_cache_artifacts", ".load_cache_artifacts",
    "ray.tune.ExperimentAnalysis", "ray.tune.analysis.ExperimentAnalysis", ".from_json_state",
    "ray.tune.Tuner.restore", "ray.tune.Tuner.can_restore", "ray.tune.ResultGrid",
    "ray.train.Result.from_path",
    "eval", "exec", "compile", "__import__", "importlib.import_module",
    "runpy.*", "ctypes.*", "os.system", "os.popen", "os.exec*", "os.spawn*",
    "yaml.load", "yaml.unsafe_load", "yaml.full_load",
    ".extractall", ".extract",
    "raygpt.artifacts.kernel_bundle.install",  # puts .so files into Triton's cache, which imports them
)
# Calls that create or change a file. Only the reviewed writers may make them: they refuse to
# write through a link and never truncate what raygpt did not create.
WRITES = (
    "open", "io.open", "os.open", "os.fdopen", ".open", ".write_text", ".write_bytes",
    "shutil.copy", "shutil.copy2", "shutil.copyfile", "shutil.copytree", "shutil.move",
    "os.rename", "os.replace", "os.link", "os.symlink", "os.truncate", ".savefig",
    ".open_output_stream", ".open_append_stream", ".move", ".copy_file",
)

# (module, function): why this call site is safe. Reviewed by hand; keep each reason one line.
REVIEWED_DANGEROUS: dict[tuple[str, str], str] = {
    ("raygpt/artifacts/compile_cache.py", "load_compile_artifacts"):
        "unpickles only the payload signed_file.verified returned (the user's HMAC key, its name)",
    ("raygpt/artifacts/compile_cache.py", "load_kernel_bundle"):
        "installs only a bundle whose bytes signed_file.verified returned",
    ("raygpt/artifacts/kernel_bundle.py", "raygpt_kernel_names"):
        "imports KERNEL_MODULES, a constant tuple of raygpt's own modules",
    ("raygpt/config/__init__.py", "__getattr__"):
        "imports only the face's literal tables of raygpt's own modules (_FACE, _MODULES)",
}
REVIEWED_WRITES: dict[tuple[str, str], str] = {
    ("raygpt/storage/atomic_file.py", "atomic_local_file"): "the writer: O_EXCL|O_NOFOLLOW temp, rename",
    ("raygpt/storage/atomic_file.py", "_create_new"): "O_CREAT|O_EXCL|O_NOFOLLOW in a checked directory",
    ("raygpt/storage/atomic_file.py", "move_local_file"): "rename of a staged file into a checked directory",
    ("raygpt/storage/atomic_file.py", "open_local_append"): "O_APPEND|O_NOFOLLOW, directories walked without links",
    ("raygpt/storage/arrow_store.py", "ArrowStore.open_publish"): "object stores only (no links); local: LocalStore's atomic_file",
    ("raygpt/storage/rundir.py", "RunDir.move_file"): "the store's move: LocalStore's by atomic_file (no links)",
    ("raygpt/storage/arrow_store.py", "ArrowStore.move"): "object stores only (no links); local: LocalStore's atomic_file",
    ("raygpt/checkpointing/local_copy.py", "LocalCopies.keep"):
        "hard links into the private node-local copy root (atomic_file.private_dir)",
    ("raygpt/checkpointing/runtime.py", "Checkpointer._write_files"):
        "a new file in this process's private mkdtemp staging directory",
    ("raygpt/artifacts/compile_cache.py", "_touch"): "O_NOFOLLOW marker in the private node compile cache",
    ("raygpt/storage/local_store.py", "LocalStore.lock"):
        "the lock file, O_NOFOLLOW, in a directory this user claimed; never truncated",
    ("raygpt/artifacts/signed_file.py", "_create_key"):
        "the user's own key: a 0600 mkstemp file linked to its name in the user's config dir",
    ("raygpt/runlog/plot.py", "plot_run"): "savefig into io.BytesIO; stored by store_png (atomic_file)",
    ("raygpt/data/sources.py", "ShardCache._fetch"):
        "O_EXCL|O_NOFOLLOW temp in the private shard cache, renamed once verified",
    ("raygpt/data/sources.py", "_flocked"): "O_NOFOLLOW lock files in the private shard cache",
    ("raygpt/data/sources.py", "_write_marker"): "O_EXCL|O_NOFOLLOW marker in the private shard cache",
    ("raygpt/data/sources.py", "ShardFetcher._run"): "ShardCache.open, a read: not a write",
    ("raygpt/interop/hf.py", "export_hf"):
        "a private mkdtemp folder beside the new or empty -o, renamed onto it when complete",
    ("raygpt/interop/hf.py", "write_gpt2_tokenizer"):
        "vocab.json and merges.txt in a TemporaryDirectory, for transformers 4 to read",
    ("raygpt/ray/sweep_results.py", "plot_val_curves"):
        "savefig into io.BytesIO; stored by storage.store_png (atomic_file)",
    ("raygpt/tools/local_s3.py", "upload_shards"):
        "the package's own shards into the bucket of the moto server this process just started",
}


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> dotted name, from every import in the module (function-local ones too)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.ImportFrom) and node.level == 1 and node.module is None:
            for a in node.names:
                names[a.asname or a.name] = f".{a.name}"
    names["np"] = names.get("np", "numpy")
    return names


def _dotted(func: ast.expr, aliases: dict[str, str]) -> str | None:
    """`a.b.c(...)`'s callee as a dotted name, its head resolved through the imports; a method
    of a computed object (`f().x`, `self.y.z`) as ".z"."""
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name):
        return "." + parts[0] if parts else None
    if func.id not in aliases and parts:
        return "." + parts[0]  # a local object's method
    head = aliases.get(func.id, func.id)
    return ".".join([head, *reversed(parts)])


def _matches(name: str, patterns) -> str | None:
    for p in patterns:
        if p.startswith("."):
            if name.endswith(p) or name == p:
                return p
        elif p.endswith("*"):
            if name.startswith(p[:-1]):
                return p
        elif name == p or name.startswith(p + "."):
            return p
    return None


def _is_safe_literal_call(name: str, call: ast.Call) -> bool:
    """Forms of a dangerous or writing call that cannot do harm: `torch.load(..., weights_only=
    True)`, `numpy.load` without allow_pickle, `open`/`io.open` for reading."""
    kw = {k.arg: k.value for k in call.keywords}
    if name in ("torch.load", "torch.serialization.load"):
        v = kw.get("weights_only")
        return isinstance(v, ast.Constant) and v.value is True
    if name == "numpy.load":
        v = kw.get("allow_pickle")
        return v is None or (isinstance(v, ast.Constant) and v.value is False)
    if name in ("open", "io.open") or name.endswith(".open") and name != "os.open":
        mode = call.args[1] if len(call.args) > 1 else kw.get("mode")
        if mode is None:
            return True
        return isinstance(mode, ast.Constant) and isinstance(mode.value, str) and \
            not set(mode.value) & set("wax+")
    if name == "os.open":
        flags = call.args[1] if len(call.args) > 1 else kw.get("flags")
        return flags is not None and not any(
            isinstance(n, ast.Attribute) and n.attr in ("O_WRONLY", "O_RDWR", "O_CREAT", "O_TRUNC",
                                                        "O_APPEND")
            for n in ast.walk(flags))
    if name == "os.fdopen":
        mode = call.args[1] if len(call.args) > 1 else kw.get("mode")
        return isinstance(mode, ast.Constant) and not set(str(mode.value)) & set("wax+")
    return False


def calls_in(path: Path, patterns) -> list[tuple[str, str, int, str]]:
    """(module, enclosing function, line, matched pattern) of every call in `path` matching one
    of `patterns`, safe literal forms left out."""
    tree = ast.parse(path.read_text(), str(path))
    aliases = _aliases(tree)
    module = path.relative_to(PACKAGE.parent).as_posix()
    found = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, f"{where}.{child.name}" if where else child.name)
                continue
            if isinstance(child, ast.Call):
                name = _dotted(child.func, aliases)
                if name and _matches(name, patterns) and not _is_safe_literal_call(name, child):
                    found.append((module, where or "<module>", child.lineno, name))
                for part in [*child.args, *child.keywords]:  # `map(pickle.loads, ...)` too
                    visit_reference(part.value if isinstance(part, ast.keyword) else part, where)
            visit(child, where)

    def visit_reference(node: ast.AST, where: str) -> None:
        if isinstance(node, (ast.Name, ast.Attribute)):
            name = _dotted(node, aliases)
            if name and not name.startswith(".") and _matches(name, patterns):
                found.append((module, where or "<module>", node.lineno, name))

    visit(tree, "")
    return found


def _violations(patterns, reviewed) -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for module, where, line, name in calls_in(path, patterns):
            if (module, where) not in reviewed:
                out.append(f"{module}:{line} in {where}: {name}")
    return out


def test_nothing_read_runs_as_code_outside_the_reviewed_places():
    assert _violations(DANGEROUS, REVIEWED_DANGEROUS) == [], \
        "a call that unpickles or runs code outside SECURITY.md's reviewed places"


def test_files_are_written_only_by_the_reviewed_writers():
    assert _violations(WRITES, REVIEWED_WRITES) == [], \
        "a file written outside the reviewed writers (they refuse links, never truncate foreign files)"


# Calls that turn a string into a place (a filesystem, a store): only the URI door makes them, so
# that options from files are refused, endpoints applied and calls bounded in one place.
OPENS_A_STORE = ("pyarrow.fs.FileSystem.from_uri", ".from_uri", "pyarrow.fs.S3FileSystem",
                 "pyarrow.fs.GcsFileSystem", "fsspec.filesystem", "fsspec.open")
DOOR = "raygpt/storage/uri.py"


def _stores_opened(path: Path) -> list[str]:
    """`line: name` of every call in `path` that opens a store (isinstance checks are no call)."""
    tree = ast.parse(path.read_text(), str(path))
    aliases = _aliases(tree)
    return [f"{node.lineno}: {name}" for node in ast.walk(tree) if isinstance(node, ast.Call)
            and (name := _dotted(node.func, aliases)) and _matches(name, OPENS_A_STORE)]


def test_every_uri_is_opened_through_the_one_door():
    found = [f"{path.relative_to(PACKAGE.parent)}:{hit}" for path in sorted(PACKAGE.rglob("*.py"))
             if path.relative_to(PACKAGE.parent).as_posix() != DOOR for hit in _stores_opened(path)]
    assert found == [], "a store opened outside raygpt/storage/uri.py (the URI door)"
    assert len(_stores_opened(PACKAGE.parent / DOOR)) >= 3, "the door's own calls not seen"


def test_every_reviewed_place_still_exists():
    """A reviewed entry whose call is gone is removed, so the list stays the truth."""
    seen = {(m, w) for path in sorted(PACKAGE.rglob("*.py"))
            for m, w, _, _ in calls_in(path, DANGEROUS + WRITES)}
    assert sorted(k for k in {**REVIEWED_DANGEROUS, **REVIEWED_WRITES} if k not in seen) == []


def test_the_scan_sees_each_form(tmp_path, monkeypatch):
    """Each form the rule names is found (the scan would pass vacuously otherwise), and the safe
    forms are not."""
    pkg = tmp_path / "raygpt"
    pkg.mkdir()
    probe = pkg / "probe.py"
    probe.write_text(
        "import pickle, torch, os\n"
        "import numpy as np\n"
        "from ray import tune\n"
        "from torch.compiler import load_cache_artifacts as lca\n"
        "from raygpt.artifacts import kernel_bundle\n"
        "def f(data, path, z):\n"
        "    pickle.loads(data)\n"                                   # 7
        "    torch.load(path)\n"                                     # 8
        "    torch.load(path, weights_only=True)\n"                  # safe
        "    np.load(path, allow_pickle=True)\n"                     # 10
        "    np.load(path)\n"                                        # safe
        "    lca(data)\n"                                            # 12
        "    tune.ExperimentAnalysis(path)\n"                        # 13
        "    tune.Tuner.restore(path)\n"                             # 14
        "    z.extractall(path)\n"                                   # 15
        "    kernel_bundle.install(data)\n"                          # 16
        "    eval(data)\n"                                           # 17
        "    list(map(pickle.loads, data))\n"                         # 18
        "class C:\n"
        "    def g(self, path, fig):\n"
        "        open(path, 'a')\n"                                  # 21
        "        open(path)\n"                                       # safe
        "        open(path, 'rb')\n"                                 # safe
        "        os.open(path, os.O_WRONLY | os.O_CREAT)\n"          # 24
        "        os.open(path, os.O_RDONLY)\n"                       # safe
        "        fig.savefig(path)\n"                                # 26
        "        os.replace(path, path + '.x')\n"                    # 27
    )
    monkeypatch.setattr(__import__(__name__), "PACKAGE", pkg)
    assert [line for _, _, line, _ in calls_in(probe, DANGEROUS)] == \
        [7, 8, 10, 12, 13, 14, 15, 16, 17, 18]
    writes = calls_in(probe, WRITES)
    assert [line for _, _, line, _ in writes] == [21, 24, 26, 27]
    assert {w for _, w, _, _ in writes} == {"C.g"}
