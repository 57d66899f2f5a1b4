"""torch.compile compiles the training step once per process: nothing the compiled forward reads
may change between step 1 and step 2 (issue 24: every start paid a second 8-11 s compilation
on step 2 on an H200, because a module global read under compile was set after step 1).

Each check runs in a fresh Python process, as a Ray worker does after a restart: what an earlier
test left behind in this process (imported kernel modules, Dynamo's caches) could otherwise
hide a cause that a new worker meets. The loop runs through `raygpt.train.loop.train` with a session
that notes torch.compile's counters at every training step; from step 2 on, a recompilation
raises with Dynamo's guard-failure reason (error_on_recompile), and any new compilation at all
(a new frame, a new graph for AOTAutograd or Inductor) fails the check.

What may compile before step 1 ends: the training forward and backward, and validation at
step 0, which is legitimately a graph of its own (grad mode off, the model in eval mode: a second
entry in the forward's cache). Every later validation reuses it (checked by hand with
`val_every=3`: no compilation after step 1; not here, where it would cost a third Inductor
graph and hide causes, see the CPU test). Sampling runs the model eagerly.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest
import torch

from tests.ops.interpreter import needs_triton

REPO_ROOT = Path(__file__).resolve().parents[2]
# the user's key in these checks' processes (a driver hands its workers the same key)
TEST_KEY_BYTES = bytes(range(32))


def compile_counts() -> dict[str, int]:
    """How many times torch.compile has compiled something in this process, by stage: Dynamo
    frames (recompiles included), AOTAutograd graphs, Inductor graphs (forward and backward
    each, whether its cache had them or not)."""
    c = torch._dynamo.utils.counters
    return {"dynamo_frames": c["frames"]["total"], "aot_graphs": c["aot_autograd"]["total"],
            "inductor_graphs": sum(c["inductor"][k] for k in ("fxgraph_cache_miss",
                                                              "fxgraph_cache_hit",
                                                              "fxgraph_cache_bypass"))}


def _run_check(*args: str, timeout: float = 600) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT),
                                                       os.environ.get("PYTHONPATH", "")]))
    env.pop("TORCH_COMPILE_DISABLE", None)
    proc = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-6000:]
    return proc.stdout


def test_training_step_compiles_once_on_cpu(tmp_path):
    """Inductor on the CPU (C++), with checkpoints every 2 steps. One micro-step per step and
    no validation, so the first compiled call is step 1's one forward: a second micro-step or
    validation at step 0 would call the forward before step 2 and hide a cause such as an
    attribute the forward reads and sets (set by its first call, read changed by its second).
    The run stores its compiled artifacts beside it for a new node. (The whole new-node resume
    runs in the GPU test: on the CPU it would compile every C++ kernel again with g++, which
    Inductor does not bundle, a minute of CI for what the artifacts test below checks.)"""
    from raygpt.artifacts.compile_cache import COMPILE_ARTIFACTS

    run_dir = tmp_path / "run"
    out = _run_check("loop", "cpu", str(run_dir), str(tmp_path / "node_a"))
    assert "compile check passed" in out, out
    assert [p.suffix for p in (run_dir / COMPILE_ARTIFACTS).iterdir()] == [".bin"]


def test_compiled_artifacts_fill_a_new_nodes_cache(tmp_path):
    """compile_cache's round trip in two fresh processes: node A compiles a small training step
    (forward and backward through raygpt's fused loss, an autograd Function) and stores the
    artifacts in the run directory; node B, with an empty cache, loads them and compiles the
    same step from cache hits only, AOTAutograd's included, and loads them once per node."""
    run_dir = str(tmp_path / "run")
    a = _json_line(_run_check("artifacts-unit", "save", run_dir, str(tmp_path / "node_a")))
    assert a["loaded"] is False and a["miss"] >= 1, a  # nothing stored yet: compiled afresh
    b = _json_line(_run_check("artifacts-unit", "load", run_dir, str(tmp_path / "node_b")))
    assert b["loaded"] is True and b["miss"] == 0 and b["hit"] >= 1, b
    # AOTAutograd's entry too, though the graph holds raygpt's autograd Function: it bypassed
    # its cache for them, tracing and partitioning the joint graph again on every warm start
    assert b["aot_hit"] == 1 and a["aot_bypass"] == b["aot_bypass"] == 0, (a, b)
    assert b["marker"] is True  # a second worker on node B does not load them again


@pytest.mark.gpu
def test_training_step_compiles_once_on_gpu(tmp_path):
    """The GPU default path: bf16 working weights with fp32 masters, the fused loss's Triton
    kernel (a custom op inside the compiled forward), the Triton optimizer between steps; then
    a new node resumes from the run's artifacts (Inductor's Triton kernels come bundled, and
    raygpt's own in the run's kernel bundle: the new node compiles none of raygpt's)."""
    print(check_new_node_starts_warm(tmp_path, "cuda"))


@needs_triton
def test_compiled_code_keeps_its_kernel_lookup_after_the_first_eager_call():
    """The mechanism of issue 24 without a GPU: compiled code that reaches raygpt.ops's Triton
    module is traced before anything eager has loaded it (the step-1 forward), then the eager
    optimizer loads it; the compiled code must not recompile after that."""
    out = _run_check("kernel-lookup", timeout=120)
    assert "compile check passed" in out, out


def test_training_graph_stays_static_after_a_validation_of_another_batch_size(tmp_path, monkeypatch):
    """The default GPU run validates 15-sample batches (the bundled validation set holds 31 of
    1,024 tokens) before training on 16: Dynamo's automatic dynamic shapes then compiled the
    training graph with a symbolic batch size, which under --deterministic (Inductor's reduction
    configs fixed, the batch hint canonicalized) cost 16% of a step on 2 H200s
    (bench/results/h200x2_det_default_2026-11-30.log). Every graph the loop compiles must have
    static shapes; Dynamo's own graph capture is what decides it, so a recording backend stands
    in for Inductor here."""
    from raygpt.storage import open_run_dir
    import raygpt.train.loop
    from raygpt.train.session import LocalSession
    from tests.helpers import tiny_config

    graphs = []

    def recording_backend(gm, example_inputs):
        # a symbolic size enters the graph as an input of its own (a SymInt beside the tensors)
        graphs.append([tuple(t.shape) if isinstance(t, torch.Tensor) else t for t in example_inputs])
        return gm.forward

    real_compile = torch.compile

    def compile_recording(model, **kw):
        kw.pop("mode", None)  # an Inductor option: the recording backend takes none
        return real_compile(model, backend=recording_backend, **kw)

    monkeypatch.setattr(raygpt.train.loop.torch, "compile", compile_recording)
    torch._dynamo.reset()
    cfg = tiny_config(tmp_path / "run", compile=True, max_steps=3, val_every=2, val_batch_size=3,
                      checkpoint_every=0)
    try:
        raygpt.train.loop.train(cfg.resolve(0), LocalSession(open_run_dir(cfg.output_dir),
                                                       torch.device("cpu")))
    finally:
        torch._dynamo.reset()
    batch_sizes = {x[0] for g in graphs for x in g if isinstance(x, tuple) and len(x) == 2}
    assert len(graphs) >= 2 and {3, 4} <= batch_sizes, graphs  # validation's graph and training's
    symbolic = [[x for x in g if not isinstance(x, tuple)] for g in graphs]
    assert not any(symbolic), f"graphs compiled with symbolic sizes: {symbolic}"


def _json_line(out: str) -> dict:
    return json.loads(next(line for line in out.splitlines() if line.startswith("{")))


def check_new_node_starts_warm(tmp_path, device: str) -> str:
    """Compile once per run, not once per node: the compile-once check's process compiled the
    step cold on node A and stored its artifacts beside the run; a second process with an empty
    node cache (node B, a replacement node) resumes the run and finds every Inductor graph in
    the cache the artifacts filled: hits only, no miss."""
    run_dir, node_a, node_b = str(tmp_path / "run"), str(tmp_path / "node_a"), str(tmp_path / "node_b")
    out = _run_check("loop", device, run_dir, node_a)
    assert "compile check passed" in out, out
    cold = _json_line(out)
    new = _json_line(_run_check("artifacts", run_dir, node_b, device))
    assert new["resumed_from"] == 4 and new["artifacts"], new
    assert new["counters"].get("fxgraph_cache_miss", 0) == 0, new
    assert new["counters"].get("fxgraph_cache_hit", 0) >= 2, new
    # AOTAutograd's too (raygpt's autograd Functions made it bypass its cache: the whole joint
    # graph traced and partitioned again, most of a warm first step)
    assert new["counters"].get("autograd_cache_hit", 0) >= 1, new
    assert new["counters"].get("autograd_cache_bypass", 0) == 0, new
    bundled = None
    if device == "cuda":
        from raygpt.artifacts.compile_cache import COMPILE_ARTIFACTS

        # raygpt's own Triton kernels launched from Python (the optimizer's, the restore's
        # re-derive) came in the run's kernel bundle: the new node compiles none of them.
        # Inductor's copies of its triton_op kernels (the loss gradient, the attention) are
        # compiled there under other keys than node A's, so they are printed, not bundled.
        from raygpt.artifacts.signed_file import ArtifactKey, verified

        [bundle] = [a for a in new["artifacts"] if a.endswith(".kernels.zip")]
        name = f"{COMPILE_ARTIFACTS}/{bundle}"
        signed = Path(run_dir, name).read_bytes()
        with zipfile.ZipFile(io.BytesIO(verified(ArtifactKey(TEST_KEY_BYTES), name, signed))) as z:
            bundled = [(k["group"], k["key"]) for k in json.loads(z.read("index.json"))["kernels"]]
        ours = [k for k in new["triton_compiled"] if k[0].startswith("raygpt.")]
        assert not ours, f"the new node compiled raygpt's kernels {ours}; bundled: {bundled}"
    return (f"first step: cold {cold['first_step_dt']:.2f} s, new node "
            f"{new['first_step_dt']:.2f} s | new node's counters {new['counters']} | Triton "
            f"kernels it compiled: {new.get('triton_compiled')} | bundled: {bundled}")


def test_the_compilers_imports_choose_the_nodes_cache_first(tmp_path):
    """compile_cache.import_compiler, in a fresh process as a restarted worker is: the node's
    cache is chosen first, then Dynamo and Inductor are imported and Inductor's per-process
    system key computed, on the calling thread (the loop's, while the resume read hashes)."""
    out = _json_line(_run_check("imports", str(tmp_path / "node_cache"), timeout=300))
    assert out["before"] == {"torch._dynamo": False, "torch._inductor.compile_fx": False}
    assert out["after"] == {"torch._dynamo": True, "torch._inductor.compile_fx": True}
    assert out["importer"] == "MainThread"
    assert out["cache_dir_when_imported"] == str(tmp_path / "node_cache")
    assert out["system_key_cached"] is True


def _check_imports(cache_dir: str) -> None:
    import threading

    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    os.environ.pop("TRITON_CACHE_DIR", None)
    import raygpt.artifacts.compile_cache as cc

    names = ("torch._dynamo", "torch._inductor.compile_fx")
    before = {n: n in sys.modules for n in names}
    seen = {}

    class Spy:  # notes the thread importing torch._dynamo and the cache chosen by then
        def find_spec(self, name, path=None, target=None):
            if name == "torch._dynamo" and not seen:
                seen.update(thread=threading.current_thread().name,
                            cache=os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
            return None

    sys.meta_path.insert(0, Spy())
    real = cc.use_node_compile_cache
    cc.use_node_compile_cache = lambda: real(cache_dir)  # this test's node instead of /tmp's
    cc.import_compiler()
    from torch._inductor.codecache import CacheBase

    print(json.dumps({"before": before, "after": {n: n in sys.modules for n in names},
                      "importer": seen.get("thread"), "cache_dir_when_imported": seen.get("cache"),
                      "system_key_cached": CacheBase.get_system.cache_info().currsize == 1}))


def test_cached_graphs_are_keyed_by_the_code_torch_compile_traces(tmp_path, monkeypatch):
    """AOTAutograd may cache graphs holding raygpt's autograd Functions because the source they
    are traced from is in every key: a changed byte in the model or the ops is another key
    (an entry compiled from other code is never loaded), a change elsewhere in raygpt is not;
    the user's own tag is kept in front."""
    import shutil

    import raygpt
    import raygpt.artifacts.compile_cache as cc

    package = tmp_path / "raygpt"
    shutil.copytree(os.path.dirname(raygpt.__file__), package,
                    ignore=shutil.ignore_patterns("__pycache__", "data_files"))
    key = cc.compiled_code_key(str(package))
    assert key == cc.compiled_code_key()  # the copy is the installed code
    loop = package / "train" / "loop.py"
    loop.write_text(loop.read_text() + "\n# a comment\n")
    assert cc.compiled_code_key.__wrapped__(str(package)) == key
    for changed in ("model/gpt.py", "ops/reference.py"):
        source = (package / changed).read_text()
        (package / changed).write_text(source.replace("return", "return ", 1))
        assert cc.compiled_code_key.__wrapped__(str(package)) != key, changed
        (package / changed).write_text(source)

    import torch._functorch.config
    import torch.compiler.config
    monkeypatch.setattr(torch.compiler.config, "cache_key_tag", "")
    monkeypatch.setattr(torch._functorch.config, "autograd_cache_allow_custom_autograd_functions",
                        False)
    monkeypatch.setenv("TORCH_COMPILE_CACHE_KEY_TAG", "users-tag")
    cc.trust_raygpt_functions()
    assert torch.compiler.config.cache_key_tag == f"users-tag+raygpt-{key}"
    assert torch._functorch.config.autograd_cache_allow_custom_autograd_functions is True


def test_the_node_compile_cache_is_private_to_its_user(tmp_path, monkeypatch):
    """Compiled code is loaded from the node's cache: it is made 0700, and a directory that is
    not private (e.g. made first by another user of the node) is refused, naming it."""
    from raygpt.artifacts.compile_cache import use_node_compile_cache

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    fresh = tmp_path / "fresh"
    assert use_node_compile_cache(str(fresh)) == str(fresh)
    assert (fresh.stat().st_mode & 0o777) == 0o700
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(PermissionError, match=str(shared)):
        use_node_compile_cache(str(shared))


class _CreatesAFile:
    """Unpickled, opens (creates) `path`: what a planted pickle could do with any code."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _planted_artifacts(outside: Path) -> bytes:
    """An artifacts file as torch.compiler.save_cache_artifacts writes one, made by someone who
    can write the run directory: an autotune entry whose key is a path (torch writes its
    content there) and an Inductor graph whose pickle creates a file when torch unpickles it
    (at load with Triton bundling on, else at the first cache lookup). Loaded by torch, it
    creates outside/written and outside/pickled."""
    from torch.compiler._cache import (CacheArtifactFactory, CacheArtifactManager,
                                       _serialize_single_cache)
    from torch.utils._appending_byte_serializer import AppendingByteSerializer

    CacheArtifactManager._ensure_cache_artifacts_registered()
    serializer = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
    serializer.extend([
        ("autotune", [CacheArtifactFactory.create("autotune", str(outside / "written"), b"{}")]),
        ("inductor", [CacheArtifactFactory.create(
            "inductor", "fplanted", pickle.dumps(_CreatesAFile(str(outside / "pickled"))))])])
    return serializer.to_bytes()


def test_a_planted_artifacts_file_is_never_loaded_and_is_replaced_by_a_signed_one(
        tmp_path, monkeypatch):
    """Issue 43: a file someone else wrote at the run's artifacts name (unsigned, or signed
    with another key) is not unpickled: nothing it would create exists, one warning names it,
    the run compiles as with none, and rank 0's save after the first step replaces it with a
    file signed by the user's key, which the next new node loads."""
    import torch._inductor.config

    from raygpt.artifacts import compile_cache, signed_file
    from raygpt.artifacts.signed_file import ArtifactKey
    from raygpt.storage import open_run_dir
    from tests.helpers import log_lines

    key, other = ArtifactKey(TEST_KEY_BYTES), ArtifactKey(bytes(32))
    outside = tmp_path / "outside"
    outside.mkdir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "node"))
    monkeypatch.setattr(torch._inductor.config, "bundle_triton_into_fx_graph_cache", True)
    rd, name = open_run_dir(str(tmp_path / "run")), "compile_cache/abc.bin"
    node = str(tmp_path / "node")
    planted = _planted_artifacts(outside)
    for how, data in (("unsigned", planted), ("other key", signed_file.sign(other, name, planted))):
        rd.write_bytes_atomic(name, data)
        with log_lines(compile_cache.__name__) as warnings:
            loaded = compile_cache.load_compile_artifacts(rd, name, node, key)
        assert os.listdir(outside) == [], how  # nothing of it ran
        assert loaded is False, how  # as with no file: rank 0 stores its own
        [warning] = warnings
        assert warning.startswith(f"raygpt | WARNING: {rd.uri(name)}: not signed by this "
                                  f"user's key ("), (how, warning)
        assert warning.endswith("); compiling"), (how, warning)
        assert not os.path.exists(compile_cache._artifacts_marker(node, name)), how

    # the run compiled; its first step's save replaces the planted file, signed
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"compiled", None))
    compile_cache.CompileCache(name, node, key, had_artifacts=False).save_if_new(rd)
    assert signed_file.verified(key, name, rd.read_bytes(name)) == b"compiled"


def test_a_planted_artifacts_file_is_read_only_up_to_its_bound(tmp_path, monkeypatch):
    """Before its signature is checked a file is read at most MAX_ARTIFACT_BYTES: one past it is
    one warning and not loaded; one at it is read (and here refused as unsigned)."""
    from raygpt.artifacts import compile_cache
    from raygpt.artifacts.signed_file import ArtifactKey
    from raygpt.storage import open_run_dir
    from tests.helpers import log_lines

    monkeypatch.setattr(compile_cache, "MAX_ARTIFACT_BYTES", 1000)
    rd, name = open_run_dir(str(tmp_path / "run")), "compile_cache/abc.bin"
    for size, says in ((1001, "expected at most 1,000 bytes"), (1000, "no raygpt signature")):
        rd.write_bytes_atomic(name, b"x" * size)
        with log_lines(compile_cache.__name__) as warnings:
            assert compile_cache.load_compile_artifacts(rd, name, str(tmp_path / "node"),
                                                        ArtifactKey(bytes(32))) is False
        [warning] = warnings
        assert says in warning and warning.endswith("; compiling"), warning


def test_without_a_key_no_artifacts_are_loaded_or_stored(tmp_path, monkeypatch):
    """A session with no key (artifact_key None): the run's artifacts file is not read, and
    nothing is stored after the first step; the run just compiles."""
    from raygpt.artifacts import compile_cache
    from raygpt.storage import open_run_dir
    from raygpt.train.session import LocalSession
    from tests.helpers import tiny_config

    rd = open_run_dir(str(tmp_path / "run"))
    monkeypatch.setattr(compile_cache, "use_node_compile_cache", lambda: str(tmp_path / "node"))
    monkeypatch.setattr(rd, "read_bytes", lambda name: pytest.fail(f"read {name}"))
    cfg = tiny_config(tmp_path / "run", compile=True).resolve(0)
    name = compile_cache.compile_artifacts_name(cfg, "cpu")
    rd.write_bytes_atomic(name, b"whatever")
    cache = compile_cache.CompileCache.for_run(cfg, LocalSession(rd, torch.device("cpu")))
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"compiled", None))
    cache.save_if_new(rd)
    assert cache.key is None and (tmp_path / "run" / name).read_bytes() == b"whatever"


def test_a_symlink_planted_at_the_node_cache_path_is_refused(tmp_path, monkeypatch):
    """Issue 43: another user of the node plants /tmp/raygpt_compile_cache_<uid> as a symlink
    before this user's first run. Pointed, while it is checked, at a private directory of this
    user's (the check saw 0700 and this uid through the link), and afterwards at their own, it
    would have Inductor and Triton load their code: a symlink is refused as such, naming the
    path, and nothing is written through it."""
    from raygpt.artifacts.compile_cache import use_node_compile_cache
    from raygpt.storage.atomic_file import NotPrivateError

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    target = tmp_path / "looks_private"
    target.mkdir(mode=0o700)
    planted = tmp_path / "raygpt_compile_cache_1000"
    planted.symlink_to(target)
    with pytest.raises(NotPrivateError) as e:
        use_node_compile_cache(str(planted))
    assert str(e.value).startswith(f"{planted}: expected a private compile cache, found a "
                                   f"symlink")
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ and os.listdir(target) == []


# ---------------------------------------------------------------------- the checks (subprocess)

def _check_artifacts(run_dir: str, cache_dir: str, device: str = "cpu") -> None:
    """The compile-once check's run resumed for steps 4-5 on a node whose compile cache is
    `cache_dir`; prints the compile counters and the first step's time."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    from raygpt.artifacts.compile_cache import COMPILE_ARTIFACTS
    from raygpt.artifacts.kernel_bundle import raygpt_kernel_names
    from raygpt.artifacts.signed_file import ArtifactKey
    from raygpt.runlog.history import read_history
    from raygpt.storage import open_run_dir
    from raygpt.train.loop import train
    from raygpt.train.session import LocalSession
    from tests.helpers import tiny_config

    torch.set_num_threads(1)
    compiled = []  # every Triton kernel this process compiled: (its module, its name)
    if device == "cuda":
        import triton

        def listener(*, src, metadata, cache_hit, **_):
            if not cache_hit:
                compiled.append((getattr(getattr(src, "fn", None), "module", "?"),
                                 metadata.get("name"), metadata.get("hash")))

        triton.knobs.compilation.listener = listener
    cfg = tiny_config(run_dir, compile=True, max_steps=6, val_every=0, checkpoint_every=2, resume=1,
                      device="gpu" if device == "cuda" else "cpu"
                      ).resolve(1 if device == "cuda" else 0)
    train(cfg, LocalSession(open_run_dir(run_dir), torch.device(device),
                            ArtifactKey(TEST_KEY_BYTES)))
    recs = [r for r in read_history(open_run_dir(run_dir)) if r["kind"] == "train"]
    c = torch._dynamo.utils.counters
    print(json.dumps({"counters": {**c["inductor"], **c["aot_autograd"]},
                      "first_step_dt": recs[-2]["dt"],
                      "resumed_from": recs[-2]["step"],
                      "triton_compiled": compiled,
                      "raygpt_kernels": sorted(raygpt_kernel_names()) if compiled else [],
                      "artifacts": sorted(os.listdir(os.path.join(run_dir, COMPILE_ARTIFACTS)))}))



def _check_artifacts_unit(mode: str, run_dir: str, cache_dir: str) -> None:
    """One node of test_compiled_artifacts_fill_a_new_nodes_cache: `save` compiles and stores
    the artifacts, `load` fills its empty cache from them first; prints the cache counters."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    from raygpt.artifacts.compile_cache import (_artifacts_marker, load_compile_artifacts,
                                      save_compile_artifacts, use_node_compile_cache)
    from raygpt.artifacts.signed_file import ArtifactKey
    from raygpt.storage import open_run_dir

    torch.set_num_threads(1)
    rd, name, key = open_run_dir(run_dir), "compile_cache/unit.bin", ArtifactKey(TEST_KEY_BYTES)
    use_node_compile_cache()
    loaded = load_compile_artifacts(rd, name, cache_dir, key) if mode == "load" else False
    from raygpt.model.gpt import fused_classifier_loss

    def step(x, w, t):  # forward and backward through one of raygpt's autograd Functions
        loss_sum, _, _ = fused_classifier_loss(torch.relu(x), w, t, 12, chunk_rows=4)
        return loss_sum

    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, generator=g, requires_grad=True)
    torch.compile(step)(x, torch.randn(16, 4, generator=g), torch.arange(8)).backward()
    if mode == "save":
        save_compile_artifacts(rd, name, cache_dir, key)
    c, a = torch._dynamo.utils.counters["inductor"], torch._dynamo.utils.counters["aot_autograd"]
    print(json.dumps({"loaded": loaded, "hit": c["fxgraph_cache_hit"], "miss": c["fxgraph_cache_miss"],
                      "aot_hit": a["autograd_cache_hit"], "aot_bypass": a["autograd_cache_bypass"],
                      "marker": os.path.exists(_artifacts_marker(cache_dir, name))}))


def _check_loop(device: str, run_dir: str | None = None, cache_dir: str | None = None) -> None:
    if cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    from raygpt.artifacts.signed_file import ArtifactKey
    from raygpt.storage import open_run_dir
    from raygpt.train.loop import train
    from raygpt.train.session import LocalSession
    from tests.helpers import tiny_config

    class CountingSession(LocalSession):
        """Notes the compile counters at every training step (the loop polls once per step,
        after the backward, before the update); arms error_on_recompile after step 1."""

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.per_step: list[dict[str, int]] = []

        def poll_requests(self):
            self.per_step.append(compile_counts())
            torch._dynamo.config.error_on_recompile = True
            return super().poll_requests()

    torch.set_num_threads(1)
    run_dir = run_dir or tempfile.mkdtemp(prefix="raygpt_compile_check_")
    cfg = tiny_config(run_dir, compile=True, device="gpu" if device == "cuda" else "cpu",
                      max_steps=4, val_every=0,
                      checkpoint_every=2).resolve(1 if device == "cuda" else 0)
    session = CountingSession(open_run_dir(run_dir), torch.device(device),
                              ArtifactKey(TEST_KEY_BYTES))
    assert compile_counts()["dynamo_frames"] == 0
    train(cfg, session)
    counts = session.per_step + [compile_counts()]  # the last: after the final checkpoint
    from raygpt.runlog.history import read_history
    first = next(r for r in read_history(open_run_dir(run_dir)) if r["kind"] == "train")
    print(json.dumps({"device": device, "precision": cfg.precision, "per_step": counts,
                      "first_step_dt": first["dt"]}))
    if os.environ.get("RAYGPT_COMPILE_TIMES"):
        print(torch._dynamo.utils.compile_times(repr="str"))
    assert len(session.per_step) == cfg.max_steps, session.per_step
    assert counts[0]["dynamo_frames"] >= 1 and counts[0]["inductor_graphs"] >= 2, counts[0]  # compiled
    later = [i + 1 for i, c in enumerate(counts[1:], start=1) if c != counts[0]]
    assert not later, f"compiled again after step 1 (by step {later[0]}): {counts}"
    print("compile check passed")


def _check_kernel_lookup() -> None:
    from raygpt import ops

    def forward(x):
        return x * ops._triton().NORM_WARPS  # what cross_entropy_grad does for a CUDA tensor

    compiled = torch.compile(forward, backend="eager")
    x = torch.ones(3)
    compiled(x)
    frames = compile_counts()["dynamo_frames"]
    ops._triton()  # the eager optimizer's first call (global_norm_squared on CUDA)
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled(x)
    assert compile_counts()["dynamo_frames"] == frames
    print("compile check passed")


if __name__ == "__main__":
    if sys.argv[1] == "loop":
        _check_loop(*sys.argv[2:])
    elif sys.argv[1] == "artifacts":
        _check_artifacts(*sys.argv[2:])
    elif sys.argv[1] == "artifacts-unit":
        _check_artifacts_unit(*sys.argv[2:])
    elif sys.argv[1] == "imports":
        _check_imports(*sys.argv[2:])
    else:
        _check_kernel_lookup()
