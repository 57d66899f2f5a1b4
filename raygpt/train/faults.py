"""Fault injection for tests and drills: real faults at chosen steps, off unless asked for.

The spec is `--fault` (TrainConfig.fault) and, only with `--allow-fault-injection`, the
RAYGPT_FAULT environment variable (an inherited variable must not arm kills in a real run:
without the flag the run is refused). The driver folds both into `cfg.fault` before anything
starts (`armed_spec`), prints the armed faults and records them in `<run dir>/fault_injection.jsonl`
(`raygpt status` shows them); workers read only `cfg.fault`, never their environment. Faults
are separated by ';', each `kind:key=value,...`:

    kill:rank=1,step=7          SIGKILL this worker process before step 7's update
    raise:rank=0,step=5         raise InjectedFault in the worker at step 5 (a fault a restart
                                may cure: Ray retries it)
    bad_input:rank=0,step=5     raise InjectedBadInput, a ShardError as a shard that changed
                                under the loader raises (not retried: the run ends, exit 2)
    sigterm:rank=1,step=9       send SIGTERM to this worker process (checkpoint, clean exit)
    sigusr1:rank=0,step=9       send SIGUSR1 to this worker process (checkpoint, continue)
    preempt:rank=0,step=9       behave as if Ray announced a preemption of this node
    nan:rank=1,step=12          make this rank's loss (and so every gradient) NaN at step 12
    hog:rank=0,step=2           grow this worker's host memory, 64 MiB a touch, until something
                                kills it (Ray's memory monitor, the kernel's OOM killer)
    crash_before_done:step=20   checkpoint 20's files reach storage but DONE is never written
                                (the driver's finalizer leaves it, as if it had died there), and
                                this rank is SIGKILLed two steps later (Ray only)

`rank` defaults to 0. `after=N` waits, from its step on, for the first step at which checkpoint
N's DONE is in the run directory (a kill that must follow a complete checkpoint however long it
takes: `kill:rank=1,step=12,after=10`). `visit=N` fires at the Nth arrival at its step within
one attempt (a spike rewind revisits steps: `kill:rank=1,step=7,visit=2`). A fault fires once
per run directory, so the restarted attempt runs clean, unless it carries `every=1` (every
attempt: retry-budget tests).

Every fault that fires first leaves a record, one small JSON file `<run dir>/faults/<name>`
(`record_fired`; a file each, so ranks never share a file and nothing appends on an object
store). Faults from outside the run, which no spec arms (`EXTERNAL_KINDS`: Ctrl-C, a node
removed, a worker SIGKILLed, as bench/fault_campaign.py and bench/recovery.py inject them), are
recorded by their injector (`record_external`). `raygpt status` lists them all (`read_fired`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import time
from dataclasses import dataclass

from raygpt.checkpointing.protocol import done_path
from raygpt.config import ConfigError
from raygpt.llmc.shards import ShardError
from raygpt.runlog import segments
from raygpt.storage import parse_json

log = logging.getLogger(__name__)

KINDS = ("kill", "raise", "bad_input", "sigterm", "sigusr1", "preempt", "nan", "hog",
         "crash_before_done")
EXTERNAL_KINDS = ("ctrl_c", "remove_node", "kill_worker")

# what each kind does, as `raygpt status` says it
WHAT = {
    "kill": "SIGKILL to the worker process",
    "raise": "InjectedFault raised in the worker",
    "bad_input": "InjectedBadInput (a shard changed under the loader) raised in the worker",
    "sigterm": "SIGTERM to the worker process",
    "sigusr1": "SIGUSR1 to the worker process",
    "preempt": "a preemption notice",
    "nan": "a NaN loss",
    "hog": "the worker's host memory grown until it is killed",
    "crash_before_done": "checkpoint left without DONE/MANIFEST, the worker SIGKILLed 2 steps later",
    "ctrl_c": "SIGINT to the driver's process group (a terminal's Ctrl-C)",
    "remove_node": "a Ray node removed under the run (its processes killed)",
    "kill_worker": "SIGKILL to a worker process from outside the run",
}


class InjectedFault(RuntimeError):
    """The exception a `raise:` fault throws."""


class InjectedBadInput(ShardError):
    """The exception a `bad_input:` fault throws: a bad input met inside a worker."""


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int = 0
    every: bool = False
    visit: int = 1
    after: int | None = None

    @property
    def marker(self) -> str:
        return f"{FIRED}/{self.kind}_r{self.rank}_s{self.step}"

    @property
    def spec(self) -> str:
        return (f"{self.kind}:rank={self.rank},step={self.step}" + (",every=1" if self.every else "")
                + (f",visit={self.visit}" if self.visit != 1 else "")
                + (f",after={self.after}" if self.after is not None else ""))


def parse_spec(spec: str) -> list[Fault]:
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        kind, _, args = part.partition(":")
        if kind not in KINDS:
            raise ValueError(f"--fault {part!r}: expected a kind in {KINDS}, found {kind!r}")
        kv = {}
        for item in filter(None, args.split(",")):
            key, _, value = item.partition("=")
            if (key not in ("rank", "step", "every", "visit", "after")
                    or not value.lstrip("-").isdigit()):
                raise ValueError(f"--fault {part!r}: expected rank=N, step=N, every=1, visit=N or "
                                 f"after=N, found {item!r}")
            kv[key] = int(value)
        if "step" not in kv:
            raise ValueError(f"--fault {part!r}: expected step=N")
        if kv.get("visit", 1) < 1:
            raise ValueError(f"--fault {part!r}: visit: expected N >= 1, found {kv['visit']}")
        if kv.get("after", 0) < 0:
            raise ValueError(f"--fault {part!r}: after: expected a checkpoint step N >= 0, found "
                             f"{kv['after']}")
        if "after" in kv and kv.get("every"):
            raise ValueError(f"--fault {part!r}: expected after=N or every=1, not both (after=N "
                             f"fires once, at the first step with checkpoint N complete)")
        faults.append(Fault(kind, kv["step"], kv.get("rank", 0), bool(kv.get("every", 0)),
                            kv.get("visit", 1), kv.get("after")))
    return faults


class FaultPlan:
    """The faults that apply to this rank, and a way to fire them at the right step."""

    def __init__(self, faults: list[Fault], rank: int, run_dir=None):
        self.faults = [f for f in faults if f.rank == rank]
        self.run_dir = run_dir
        self.visits: dict[int, int] = {}  # arrivals at each step in this attempt

    def _due(self, f: Fault, kind: str, step: int) -> bool:
        if f.kind != kind or self.visits.get(step, 1) < f.visit:
            return False
        if f.after is None or self.run_dir is None:
            return f.step == step
        return step >= f.step and self.run_dir.exists(done_path(f.after))

    def _arm(self, kind: str, step: int) -> Fault | None:
        for f in self.faults:
            if self._due(f, kind, step):
                if self.run_dir is None:
                    return f
                if not f.every and self.run_dir.exists(f.marker):
                    return None
                # the record is the marker (written before the fault strikes: a SIGKILL follows)
                name = f.marker if not f.every else f"{f.marker}_{time.time_ns()}"
                record_fired(self.run_dir, name, {
                    "kind": f.kind, "fault": f.spec, "rank": f.rank, "step": f.step,
                    "at_step": step if kind != "crash_before_done" else step + 2,
                    "visit": self.visits.get(step, 1), "pid": os.getpid(), "by": "worker",
                    "time": time.time()})
                return f
        return None

    def before_update(self, step: int) -> None:
        """Fire process-level faults due at this step (called at the top of the step)."""
        self.visits[step] = self.visits.get(step, 0) + 1
        if self._arm("kill", step) or self._arm("crash_before_done", step - 2):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._arm("raise", step):
            raise InjectedFault(f"injected fault at step {step}")
        if self._arm("bad_input", step):
            raise InjectedBadInput(f"injected bad input at step {step}: a shard's token count "
                                   f"changed under the loader")
        if self._arm("hog", step):
            hog_memory()
        if self._arm("sigterm", step):
            os.kill(os.getpid(), signal.SIGTERM)
        if self._arm("sigusr1", step):
            os.kill(os.getpid(), signal.SIGUSR1)

    def preempt_now(self, step: int) -> bool:
        return self._arm("preempt", step) is not None

    def nan_now(self, step: int) -> bool:
        return self._arm("nan", step) is not None


HOG_CHUNK = 64 << 20
HOG_SPARE = 1 << 30


def hog_memory() -> None:
    """Allocate and touch host memory until this process is killed: a worker whose memory
    outgrows the machine, as Ray's memory monitor sees one (the pages are written, so resident).
    It stops growing, and waits, while the machine has less than HOG_SPARE available: the
    kernel's OOM killer would pick a process of its own choosing."""
    held = []
    while True:
        if _available_bytes() > HOG_SPARE:
            chunk = bytearray(HOG_CHUNK)
            chunk[::4096] = b"\1" * (HOG_CHUNK // 4096)  # one byte a page: every page resident
            held.append(chunk)
        time.sleep(0.05)  # ~1.3 GB/s: Ray's monitor, sampling every few tens of ms, sees it rise


def _available_bytes() -> int:
    """MemAvailable of /proc/meminfo (the memory new allocations can take), in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def plan_for(spec: str, rank: int, run_dir=None) -> FaultPlan:
    """This rank's plan for `spec` (cfg.fault, already holding any allowed RAYGPT_FAULT)."""
    return FaultPlan(parse_spec(spec), rank, run_dir)


ENV = "RAYGPT_FAULT"
RECORD = "fault_injection.jsonl"
# the record of armed faults: the single file locally, immutable parts on an object store (one per
# announce: a run arms faults once per attempt), read back in order like the other logs
RECORD_LOG = segments.LogLayout(RECORD, "fault_injection", "jsonl")


def armed_spec(cfg_fault: str, environ, allow: bool) -> tuple[str, list[str]]:
    """(the whole fault spec, where it came from): `cfg_fault` (--fault) plus RAYGPT_FAULT when
    `allow` (--allow-fault-injection). ConfigError when the environment arms a fault without
    the flag, or when the spec does not parse. Pure."""
    env = (environ.get(ENV) or "").strip()
    if env and not allow:
        raise ConfigError(f"{ENV}={env!r} is set in the environment: refusing to inject faults "
                          f"into this run without --allow-fault-injection (unset {ENV}, or pass "
                          f"the flag if this is a drill)")
    parts = [(s, src) for s, src in ((cfg_fault.strip(), "--fault"), (env, ENV)) if s]
    spec = ";".join(s for s, _ in parts)
    try:
        parse_spec(spec)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    return spec, [src for _, src in parts]


def announce(run_dir, spec: str, sources: list[str]) -> None:
    """Print the armed faults and append them to the run directory's record (nothing when none
    are armed)."""
    if not spec:
        return
    log.info(f"raygpt | FAULT INJECTION ARMED: {spec} (from {' and '.join(sources)})")
    segments.append_once(run_dir, RECORD_LOG, json.dumps(
        {"spec": spec, "sources": sources, "time": time.time()}) + "\n")


FIRED = "faults"


def record_fired(run_dir, name: str, record: dict) -> None:
    """Write the record of a fault that fires now, as `<run dir>/<name>` (under FIRED/)."""
    run_dir.write_bytes_atomic(name, json.dumps(record, sort_keys=True).encode())


def record_external(run_dir, kind: str, at_step: int, **detail) -> str:
    """Record a fault injected from outside the run (EXTERNAL_KINDS) at about `at_step` (the
    last step the run had logged); returns the record's name. Written by the injector before
    it strikes, like the workers' own."""
    if kind not in EXTERNAL_KINDS:
        raise ValueError(f"external fault: expected a kind in {EXTERNAL_KINDS}, found {kind!r}")
    name = f"{FIRED}/{kind}_s{at_step}_{time.time_ns()}"
    record_fired(run_dir, name, {"kind": kind, "fault": kind, "step": at_step,
                                 "at_step": at_step, "by": "external", "time": time.time(),
                                 **detail})
    return name


_MARKER = re.compile(r"^(?P<kind>[a-z_0-9]+?)_r(?P<rank>\d+)_s(?P<step>\d+)(?:_\d+)?$")


def read_fired(run_dir, *, keep: int = 50) -> tuple[int, list[dict]]:
    """(how many faults fired in this run directory, the records of the last `keep` of them in
    the order they fired). A record from before records had content (an empty marker) is
    described from its name; an unreadable one is listed as such, never dropped."""
    names = run_dir.listdir(FIRED, files_only=True) if run_dir.exists(FIRED) else []
    out = []
    for name in names:
        try:
            rel = f"{FIRED}/{name}"
            rec = parse_json(run_dir.read_bytes(rel, max_bytes=1 << 16) or b"{}", run_dir.uri(rel))
        except (OSError, ValueError):
            rec = None
        if not isinstance(rec, dict):
            rec = {"kind": name, "fault": f"unreadable record {FIRED}/{name}"}
        if not rec:  # an empty marker: what its name says
            m = _MARKER.match(name)
            rec = ({"kind": m["kind"], "rank": int(m["rank"]), "step": int(m["step"]),
                    "fault": f"{m['kind']}:rank={m['rank']},step={m['step']}"} if m
                   else {"kind": name, "fault": name})
        out.append({**rec, "name": name})
    out.sort(key=lambda r: (r.get("time") if isinstance(r.get("time"), (int, float)) else 0.0,
                            r["name"]))
    return len(out), out[-keep:]


def read_armed(run_dir, *, keep: int = 5) -> tuple[int, list[dict]]:
    """(how many times faults were armed in this run directory, the last `keep` records),
    streamed from the record (bounded memory whatever its size)."""
    count, last = 0, []
    for raw in segments.read_lines(run_dir, RECORD_LOG):
        try:
            rec = parse_json(raw, RECORD)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("spec"), str):
            count += 1
            last = (last + [rec])[-keep:]
    return count, last
