"""raygpt.artifacts.kernel_bundle: the run's bundle of raygpt's own Triton kernels, written, read back,
refused when damaged, and installed where Triton's cache manager looks a kernel up. Compiling
and launching the kernels needs a GPU: tests/artifacts/test_compile.py's GPU test resumes a run on a new
node and checks that none of raygpt's kernels is compiled there."""

from __future__ import annotations

import hashlib
import io
import json
import zipfile

import pytest

from raygpt.artifacts import compile_cache, kernel_bundle, signed_file
from raygpt.artifacts.kernel_bundle import BundleError, Kernel
from raygpt.artifacts.signed_file import ArtifactKey
from raygpt.storage import open_run_dir
from tests.helpers import log_lines
from tests.ops.interpreter import needs_triton

KEY = ArtifactKey(bytes(range(32)))  # the user's


def _kernel(name: str, payload: bytes = b"\x7fELF cubin") -> Kernel:
    key = hashlib.sha256(name.encode()).hexdigest()
    meta = json.dumps({"name": name, "hash": key}).encode()
    return Kernel(key, f"{name}.json", {f"{name}.json": meta, f"{name}.cubin": payload,
                                        f"{name}.ptx": b"// ptx"})


LAUNCHER = "__triton_launcher.cpython-312-x86_64-linux-gnu.so"
MODULE = Kernel(hashlib.sha256(b"launcher source").hexdigest(), None, {LAUNCHER: b"\x7fELF so"})
KERNELS = [_kernel("_adamw_kernel"), _kernel("_norm_kernel", b"\x00" * 4096), MODULE]


def test_a_bundle_reads_back_as_written():
    data = kernel_bundle.write_bundle(KERNELS)
    assert kernel_bundle.read_bundle(data, "run/x.kernels.zip") == KERNELS


def _rezip(data: bytes, change) -> bytes:
    """The bundle's members, rewritten after `change(dict of name -> bytes)`."""
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        members = {n: z.read(n) for n in z.namelist()}
    change(members)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for n, b in members.items():
            z.writestr(n, b)
    return buf.getvalue()


def _index(change):
    def edit(members):
        index = json.loads(members["index.json"])
        change(index)
        members["index.json"] = json.dumps(index).encode()
    return edit


K = KERNELS[0].key
DAMAGED = {
    "truncated": (lambda d: d[: len(d) // 2], "not a readable kernel bundle"),
    "a member's bytes changed": (  # zipfile's CRC check (members stored, not deflated, here)
        lambda d: _rezip(d, lambda m: None).replace(b"\x00" * 64, b"\x01" * 64, 1),
        "not a readable kernel bundle"),
    "no index": (lambda d: _rezip(d, lambda m: m.pop("index.json")), "no index.json"),
    "another format": (lambda d: _rezip(d, _index(lambda i: i.update(format="v9"))),
                       "expected 'raygpt-triton-kernels-1'"),
    "a member missing": (lambda d: _rezip(d, lambda m: m.pop(f"{K}/_adamw_kernel.cubin")),
                         f"names {K}/_adamw_kernel.cubin, which the archive does not hold"),
    "a path for a file": (lambda d: _rezip(d, _index(
        lambda i: i["kernels"][0]["files"].append("../../.bashrc"))), "'../../.bashrc'"),
    "a path for a key": (lambda d: _rezip(d, _index(
        lambda i: i["kernels"][0].update(key="../x"))), "'../x' is not a Triton cache key"),
    "a group that is not its metadata": (lambda d: _rezip(d, _index(
        lambda i: i["kernels"][0].update(group="_adamw_kernel.cubin"))), "group"),
    "a module entry of two files": (lambda d: _rezip(d, lambda m: (
        m.__setitem__(f"{MODULE.key}/x.so", b"ELF"),
        _index(lambda i: i["kernels"][2]["files"].append("x.so"))(m))),
        "must be one of Triton's C modules"),
    "a kernel without its group": (lambda d: _rezip(d, _index(
        lambda i: i["kernels"][0].update(group=None))), "must be one of Triton's C modules"),
    "Triton's own group file": (lambda d: _rezip(d, lambda m: (
        m.__setitem__(f"{K}/__grp___adamw_kernel.json", b"{}"),
        _index(lambda i: i["kernels"][0]["files"].append("__grp___adamw_kernel.json"))(m))),
        "not plain files"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGED))
def test_a_damaged_or_foreign_bundle_is_refused_naming_the_file(damage):
    how, says = DAMAGED[damage]
    data = how(kernel_bundle.write_bundle(KERNELS))
    with pytest.raises(BundleError, match="run/x.kernels.zip") as e:
        kernel_bundle.read_bundle(data, "run/x.kernels.zip")
    assert says in str(e.value)


@needs_triton
def test_installed_kernels_are_where_triton_looks_them_up(tmp_path, monkeypatch):
    """What triton.compiler.compile does before compiling: the cache manager for the kernel's
    key, its group by the metadata file's name; a hit needs the metadata among the group's
    files, each at a path holding the bundled bytes. A kernel the node has is left alone."""
    from triton.runtime.cache import get_cache_manager

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    assert kernel_bundle.install(KERNELS) == 3
    # a C module: where triton.runtime.build.compile_module_from_src looks for it
    assert open(get_cache_manager(MODULE.key).get_file(LAUNCHER), "rb").read() == MODULE.files[
        LAUNCHER]
    for k in KERNELS[:2]:
        group = get_cache_manager(k.key).get_group(k.group)
        assert group is not None and sorted(group) == sorted(k.files), group
        assert {n: open(p, "rb").read() for n, p in group.items()} == k.files
    assert kernel_bundle.install(KERNELS) == 0  # already there: nothing rewritten
    # a kernel whose group file is missing (its files were written, the group not) is a miss
    # for Triton, and installing it again completes it
    k = KERNELS[0]
    cache = get_cache_manager(k.key)
    (tmp_path / "triton" / cache.key / f"__grp__{k.group}").unlink()
    assert kernel_bundle.install(KERNELS) == 1
    assert k.group in cache.get_group(k.group)


@needs_triton
def test_the_kernels_triton_compiles_are_noted_and_raygpts_read_back(tmp_path, monkeypatch):
    """record_compiled_kernels chains a listener onto Triton's (what triton.compiler.compile
    calls after every compilation or cache hit, as it calls it here); launched_kernels keeps
    raygpt's by name and reads their files from the paths the metadata group names. A kernel
    of Inductor's, one whose files left the cache, and a listener set before stay as they were."""
    from triton import knobs

    from raygpt.ops import triton_kernels

    earlier = []
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "node_cache"))
    monkeypatch.setattr(knobs.compilation, "listener", lambda **kw: earlier.append(kw))
    monkeypatch.setattr(kernel_bundle, "_recording", False)
    monkeypatch.setattr(kernel_bundle, "_compiled", {})
    kernel_bundle.record_compiled_kernels()
    ours = knobs.compilation.listener
    kernel_bundle.record_compiled_kernels()  # once per process: not chained onto itself
    assert knobs.compilation.listener is ours

    def compiled(k: Kernel, name: str, present: bool = True, hit: bool = False):
        paths = {}
        for file, data in k.files.items():
            path = tmp_path / k.key / file
            path.parent.mkdir(exist_ok=True)
            if present:
                path.write_bytes(data)
            paths[file] = str(path)
        knobs.compilation.listener(src=None, metadata={"hash": k.key, "name": name},
                                   metadata_group=paths, times=None, cache_hit=hit)

    compiled(KERNELS[0], "_adamw_kernel")
    compiled(KERNELS[1], "_norm_kernel", hit=True)  # found in the cache: noted as well
    compiled(_kernel("triton_poi_fused_add_0"), "triton_poi_fused_add_0")  # Inductor's own
    compiled(_kernel("_gone_kernel"), "_gone_kernel", present=False)
    assert len(earlier) == 4  # the listener set before still hears every compilation
    names = {"_adamw_kernel", "_norm_kernel", "_gone_kernel"}
    assert kernel_bundle.launched_kernels(names) == sorted(KERNELS[:2], key=lambda k: k.key)
    # by default, the names of raygpt.ops's kernels
    assert {"adamw", "cross_entropy_rows", "attn_fwd"} <= kernel_bundle.raygpt_kernel_names()
    assert "_adamw_kernel" not in kernel_bundle.raygpt_kernel_names()
    assert triton_kernels  # imported for its kernels' names


@needs_triton
def test_the_c_modules_triton_built_during_the_run_are_found_in_the_cache(tmp_path, monkeypatch):
    """Triton builds a C module (its CUDA utilities, a launcher per kernel signature) with the
    host's compiler on a node's first launch, cached by key, no listener told: launched_kernels
    takes the modules the node's Triton cache got after record_compiled_kernels, and leaves
    older ones and every other entry (a kernel Inductor compiled in a worker, named like one
    of raygpt's: a new node looks it up under another key, so it is not bundled)."""
    import base64
    import os
    import time

    from triton import knobs

    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    monkeypatch.setattr(knobs.compilation, "listener", None)
    monkeypatch.setattr(kernel_bundle, "_recording", False)
    monkeypatch.setattr(kernel_bundle, "_compiled", {})
    monkeypatch.setattr(kernel_bundle, "_recording_since", 0.0)  # a new process

    def entry(k: Kernel, age_s: float = 0.0):
        d = cache / base64.b32encode(bytes.fromhex(k.key)).decode().rstrip("=")
        d.mkdir(parents=True)
        for file, data in k.files.items():
            (d / file).write_bytes(data)
            if age_s:
                os.utime(d / file, (time.time() - age_s, time.time() - age_s))
        return d

    old_utils = Kernel(hashlib.sha256(b"old").hexdigest(), None,
                       {"cuda_utils.cpython-312-x86_64-linux-gnu.so": b"ELF"})
    entry(old_utils, age_s=60)  # before this run recorded anything
    assert kernel_bundle.launched_kernels({"attn_fwd"}) == []  # not recording: a CPU run
    kernel_bundle.record_compiled_kernels()
    entry(MODULE)
    inductors_copy = entry(_kernel("attn_fwd"))
    (inductors_copy / "__grp__attn_fwd.json").write_text("{}")
    (cache / "not_an_entry").mkdir()
    (cache / "not_an_entry" / "cuda_utils.so").write_text("x")  # not a key's directory
    (cache / "stray_file").write_text("x")
    assert kernel_bundle.launched_kernels({"attn_fwd"}) == [MODULE]


@needs_triton
def test_a_run_stores_its_kernels_and_a_new_node_installs_them_once(tmp_path, monkeypatch):
    """compile_cache's side: the bundle beside the run's artifacts (rank 0 after its first
    step), installed by a node that lacks it before anything launches, once per node (its
    marker); a damaged bundle warns with the file's name and costs only a compilation."""
    from triton.runtime.cache import get_cache_manager

    run_dir = open_run_dir(str(tmp_path / "run"))
    name = compile_cache.kernels_name("compile_cache/abc.bin")
    assert name == "compile_cache/abc.kernels.zip"
    monkeypatch.setattr(kernel_bundle, "launched_kernels", lambda: KERNELS)
    compile_cache.save_kernel_bundle(run_dir, name, str(tmp_path / "node_a"), KEY)
    assert run_dir.exists(name)

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "node_b" / "triton"))
    node_b = str(tmp_path / "node_b")
    assert compile_cache.load_kernel_bundle(run_dir, name, node_b, KEY) is True
    assert all(k.group in (get_cache_manager(k.key).get_group(k.group) or {})
               for k in KERNELS[:2])
    assert get_cache_manager(MODULE.key).get_file(LAUNCHER) is not None
    installs = []
    monkeypatch.setattr(kernel_bundle, "install", lambda ks: installs.append(ks))
    assert compile_cache.load_kernel_bundle(run_dir, name, node_b, KEY) is True
    assert installs == []  # the node's marker: not read again

    # signed, but damaged before it was signed: the bundle's own checks refuse it
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "node_c" / "triton"))
    damaged = b"PK\x03\x04 not a whole archive"
    run_dir.write_bytes_atomic(name, signed_file.sign(KEY, name, damaged))
    with pytest.raises(BundleError):
        kernel_bundle.read_bundle(damaged, name)
    with log_lines(compile_cache.__name__) as warnings:
        assert compile_cache.load_kernel_bundle(run_dir, name, str(tmp_path / "node_c"),
                                                KEY) is True
    assert installs == [] and any(run_dir.uri(name) in w for w in warnings)
    assert compile_cache.load_kernel_bundle(run_dir, "compile_cache/none.kernels.zip",
                                            node_b, KEY) is False


def test_a_cpu_run_stores_no_bundle(tmp_path, monkeypatch):
    """No kernel of raygpt's ran (a CPU run): no file, so a GPU run resumed from this one
    stores its own after its first step."""
    run_dir = open_run_dir(str(tmp_path / "run"))
    monkeypatch.setattr(kernel_bundle, "launched_kernels", lambda: [])
    compile_cache.save_kernel_bundle(run_dir, "compile_cache/abc.kernels.zip", str(tmp_path), KEY)
    assert not run_dir.exists("compile_cache/abc.kernels.zip")


@needs_triton
def test_a_planted_bundle_installs_nothing_in_the_triton_cache(tmp_path, monkeypatch):
    """Issue 43: a well-formed bundle that someone who can write the run directory put there (a
    C module named like Triton's launcher: native code Triton imports), unsigned or signed with
    another key, is not installed: the node's Triton cache stays empty, one warning names the
    file, and the run's first step stores this user's own signed bundle in its place."""
    run_dir, node = open_run_dir(str(tmp_path / "run")), str(tmp_path / "node")
    name = compile_cache.kernels_name("compile_cache/abc.bin")
    triton_cache = tmp_path / "node" / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(triton_cache))
    launcher = Kernel(hashlib.sha256(b"planted").hexdigest(), None,
                      {LAUNCHER: b"\x7fELF code that runs when Triton imports it"})
    planted = kernel_bundle.write_bundle([launcher])
    other = ArtifactKey(bytes(32))
    for how, data in (("unsigned", planted), ("other key", signed_file.sign(other, name, planted))):
        run_dir.write_bytes_atomic(name, data)
        with log_lines(compile_cache.__name__) as warnings:
            loaded = compile_cache.load_kernel_bundle(run_dir, name, node, KEY)
        assert not triton_cache.exists() or list(triton_cache.rglob("*")) == [], how
        assert loaded is False, how  # as with none: rank 0 stores its own
        [warning] = warnings
        assert warning.startswith(f"raygpt | WARNING: {run_dir.uri(name)}: not signed by this "
                                  f"user's key ("), (how, warning)

    monkeypatch.setattr(kernel_bundle, "launched_kernels", lambda: KERNELS)
    compile_cache.CompileCache("compile_cache/abc.bin", node, KEY, had_artifacts=True,
                               had_kernels=False).save_if_new(run_dir)
    ours = signed_file.verified(KEY, name, run_dir.read_bytes(name))
    assert kernel_bundle.read_bundle(ours, name) == KERNELS
