"""torch.compile once per node, and once per run for a new node.

`CompileCache` is the loop's one handle: `for_run` points torch.compile's caches (Inductor's,
AOTAutograd's, Triton's) at NODE_COMPILE_CACHE, this user's private directory on the node's disk
shared by its workers, and fills them from the run's artifacts before the restore launches a
kernel; `save_if_new` (rank 0) stores the first step's graphs as COMPILE_ARTIFACTS/<key>.bin and
raygpt's own Triton kernels, which those do not carry, as <key>.kernels.zip (raygpt.artifacts.kernel_bundle).
A restarted worker finds its graphs in the node's cache, a new node in the run's files
(TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR set by the user win).

Both run-directory files are signed with the session's `artifact_key` (raygpt.artifacts.signed_file) and
checked before a byte is unpickled or installed (others may write the run's storage): one that
does not verify is not loaded, and rank 0 stores its own. Without a key nothing is stored.

`trust_raygpt_functions` lets AOTAutograd's cache keep graphs holding raygpt's custom
autograd.Functions (skipped by default, so a warm start would re-trace most of the step) and
puts a hash of the traced source (raygpt/model/gpt.py, raygpt/ops/) into every key instead.
`import_compiler` imports Dynamo and Inductor (seconds of Python per process) on the loop's
thread while the resume checkpoint is read on another.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import tempfile

import torch

from raygpt.artifacts import signed_file
from raygpt.artifacts.signed_file import ArtifactKey
from raygpt.config import TrainConfig
from raygpt.model import torch_compat
from raygpt.storage import FileTooLarge
from raygpt.storage.atomic_file import NotPrivateError, private_dir

log = logging.getLogger(__name__)

NODE_COMPILE_CACHE = os.path.join(tempfile.gettempdir(), f"raygpt_compile_cache_{os.getuid()}")
COMPILE_ARTIFACTS = "compile_cache"
# read at most this much before the signature is checked: a planted file cannot exhaust memory
MAX_ARTIFACT_BYTES = 4 << 30


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # raygpt/


@functools.cache
def compiled_code_key(package: str = _PACKAGE) -> str:
    """A hash of the source torch.compile traces into raygpt's graphs: the model and the ops
    (the autograd Functions' forward and backward among them) of the raygpt `package`."""
    ops = os.path.join(package, "ops")
    files = [os.path.join(package, "model", "gpt.py")] + sorted(
        os.path.join(ops, f) for f in os.listdir(ops) if f.endswith(".py"))
    h = hashlib.sha256()
    for path in files:
        with open(path, "rb") as f:
            h.update(os.path.relpath(path, package).encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()[:16]


def trust_raygpt_functions() -> None:
    """Let AOTAutograd cache graphs holding raygpt's autograd Functions (see the module's notes),
    with compiled_code_key() in every key through torch.compiler.config.cache_key_tag (after the
    user's own TORCH_COMPILE_CACHE_KEY_TAG). TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD,
    when the user sets it, wins: torch reads it over any value set here."""
    import torch.compiler.config

    own = f"raygpt-{compiled_code_key()}"
    user = os.environ.get("TORCH_COMPILE_CACHE_KEY_TAG", "")
    torch.compiler.config.cache_key_tag = f"{user}+{own}" if user else own
    torch_compat.allow_custom_autograd_in_aot_cache()


def use_node_compile_cache(root: str = NODE_COMPILE_CACHE) -> str:
    """Point Inductor's and Triton's on-disk caches at the node-local `root` (unless set), and
    let them keep raygpt's graphs whole (trust_raygpt_functions)."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        try:
            private_dir(root, "compile cache")
        except NotPrivateError as e:
            raise NotPrivateError(f"{e}; remove it or set TORCHINDUCTOR_CACHE_DIR") from None
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", root)
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"],
                                                           "triton_user"))
    trust_raygpt_functions()
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def import_compiler() -> None:
    """Import torch.compile's machinery now, on the calling thread (the node's caches chosen
    first: Inductor reads where they are when it starts), and compute Inductor's per-process
    system key. The loop calls it while the resume checkpoint is read and hashed on another
    thread (file reads and sha256 release the GIL; these imports are seconds of pure Python). A
    failure here only moves the imports: torch.compile imports what it needs itself, and says
    why it cannot."""
    use_node_compile_cache()
    try:
        torch_compat.import_compiler()
    except Exception as e:  # noqa: BLE001 - an optimisation: torch.compile will say it
        log.debug(f"raygpt | compiler imports: {type(e).__name__}: {e}")


def compile_artifacts_name(cfg: TrainConfig, device_name: str) -> str:
    """Where the run keeps its compiled artifacts: one file per (config, torch, device model),
    since a graph compiled for another GPU or torch version is of no use (and torch's own keys
    would only miss), nor one of other raygpt code (its keys differ: trust_raygpt_functions).
    The config is its identity plus what a resume may change that changes the graphs
    (--deterministic picks other kernels)."""
    mode = None if cfg.compile_mode == "default" else cfg.compile_mode
    key = hashlib.sha256(json.dumps([cfg.hash(), cfg.deterministic, mode, torch.__version__,
                                     device_name, compiled_code_key()]).encode())
    return f"{COMPILE_ARTIFACTS}/{key.hexdigest()[:20]}.bin"


def load_compile_artifacts(run_dir, name: str, cache_dir: str, key: ArtifactKey) -> bool:
    """Fill this node's caches from the run's artifacts `name`, once per node (a marker in the
    local cache says they are in); True when the run has artifacts this node can use, False
    when it has none signed by `key` (then rank 0 stores its own). A damaged file only costs a
    compilation: torch checks what it loads, and the loop compiles as if there were none."""
    if not run_dir.exists(name):
        return False
    marker = _artifacts_marker(cache_dir, name)
    if not os.path.exists(marker):
        artifacts = _signed_payload(run_dir, name, key, "compiling")
        if artifacts is None:
            return False
        try:
            torch.compiler.load_cache_artifacts(artifacts)
        except Exception as e:  # noqa: BLE001 - a cache: compiling is always a correct fallback
            log.warning(f"raygpt | WARNING: {run_dir.uri(name)}: compiled artifacts not loaded "
                        f"({e}); compiling")
            return True
        _touch(marker)
    return True


def kernels_name(name: str) -> str:
    """The run's bundle of raygpt's own Triton kernels, beside the artifacts file `name`."""
    return name.removesuffix(".bin") + ".kernels.zip"


def load_kernel_bundle(run_dir, name: str, cache_dir: str, key: ArtifactKey) -> bool:
    """Install the run's bundle `name` of raygpt's Triton kernels into this node's Triton
    cache, once per node (a marker, as for the artifacts); True when the run has one this node
    can use, False when it has none signed by `key`. A bundle that cannot be read or installed
    only costs Triton's compiling them: a warning says which file and why."""
    if not run_dir.exists(name):
        return False
    marker = _artifacts_marker(cache_dir, name)
    if not os.path.exists(marker):
        from raygpt.artifacts import kernel_bundle
        bundle = _signed_payload(run_dir, name, key, "Triton compiles raygpt's kernels")
        if bundle is None:
            return False
        try:  # the bundle's own checks too (CRCs, plain names): a damaged file installs nothing
            kernel_bundle.install(kernel_bundle.read_bundle(bundle, run_dir.uri(name)))
        except (kernel_bundle.BundleError, ImportError, OSError) as e:
            log.warning(f"raygpt | WARNING: {run_dir.uri(name)}: raygpt's kernels not installed "
                        f"({e}); Triton compiles them")
            return True
        _touch(marker)
    return True


def _signed_payload(run_dir, name: str, key: ArtifactKey, fallback: str) -> bytes | None:
    """The payload of the run's file `name` when `key` signed it for that name, else None with
    one warning naming the file (nothing of it is used: it may have been planted)."""
    try:
        return signed_file.verified(key, name, run_dir.read_bytes(name, max_bytes=MAX_ARTIFACT_BYTES))
    except (signed_file.NotSigned, FileTooLarge) as e:
        log.warning(f"raygpt | WARNING: {run_dir.uri(name)}: not signed by this user's key "
                    f"({e}); {fallback}")
    except OSError as e:
        log.warning(f"raygpt | WARNING: {run_dir.uri(name)}: cannot read it ({e}); {fallback}")
    return None


def save_kernel_bundle(run_dir, name: str, cache_dir: str, key: ArtifactKey) -> None:
    """Store the Triton kernels raygpt launched in this process (none on a CPU) beside the run,
    signed with `key` (replacing whatever file had the name)."""
    from raygpt.artifacts import kernel_bundle
    kernels = kernel_bundle.launched_kernels()
    if kernels:
        run_dir.write_bytes_atomic(name, signed_file.sign(key, name,
                                                          kernel_bundle.write_bundle(kernels)))
        _touch(_artifacts_marker(cache_dir, name))


def save_compile_artifacts(run_dir, name: str, cache_dir: str, key: ArtifactKey) -> None:
    """Store what this process compiled (the first step's graphs, validation's) beside the run,
    signed with `key` (replacing whatever file had the name); this node's cache has them."""
    artifacts = torch.compiler.save_cache_artifacts()
    if artifacts is not None:
        run_dir.write_bytes_atomic(name, signed_file.sign(key, name, artifacts[0]))
        _touch(_artifacts_marker(cache_dir, name))


def _artifacts_marker(cache_dir: str, name: str) -> str:
    return os.path.join(cache_dir, "raygpt_loaded_" + os.path.basename(name))


def _touch(path: str) -> None:
    """Create the marker `path` in the node's private cache (O_NOFOLLOW: never through a link)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                     0o600))


@dataclasses.dataclass
class CompileCache:
    """A compiling run's caches: the run's artifacts file (`name`), this node's cache directory,
    the key its run-directory files are signed with (None: neither loaded nor stored), and
    whether the run had usable artifacts and a kernel bundle when this process started (then
    there is nothing new to store)."""

    name: str
    cache_dir: str
    key: ArtifactKey | None
    had_artifacts: bool
    had_kernels: bool = False

    @classmethod
    def for_run(cls, cfg: TrainConfig, session) -> "CompileCache":
        name = compile_artifacts_name(cfg, session.device_name)
        cache_dir = use_node_compile_cache()
        key = session.artifact_key
        cuda = session.device.type == "cuda"
        if cuda:  # raygpt's Triton kernels, noted as they compile (a CPU run has none)
            from raygpt.artifacts import kernel_bundle
            kernel_bundle.record_compiled_kernels()
        if key is None:
            return cls(name, cache_dir, None, False)
        return cls(name, cache_dir, key,
                   load_compile_artifacts(session.run_dir, name, cache_dir, key),
                   cuda and load_kernel_bundle(session.run_dir, kernels_name(name), cache_dir, key))

    def save_if_new(self, run_dir) -> None:
        if self.key is None:
            return
        if not self.had_artifacts:
            save_compile_artifacts(run_dir, self.name, self.cache_dir, self.key)
        if not self.had_kernels:
            save_kernel_bundle(run_dir, kernels_name(self.name), self.cache_dir, self.key)
