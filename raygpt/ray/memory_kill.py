"""A worker killed by Ray's memory monitor, told as it was: raygpt over its own memory estimate
(the same shape would be killed again: exit 2, lower -b), or a node whose memory something else
holds (a fault that may pass: retried within FailureConfig).

Ray's OutOfMemoryError text is the only account of the node at the kill: the node's use and
limit, the workers of the killing raylet (pid, task, memory) and the node's top 10 processes by
memory (pid, GiB, command). `parse` reads it (pure, over text), `judge` compares it with the
estimate of raygpt.model.memory (a worker over it, or raygpt's largest worker the node's largest
process: raygpt's own), and the two `*_line` functions say the verdict in one line (a retried
kill's is said by the failure policy, raygpt.ray.driver). `is_kill_account` tells Ray's account
apart from the raylet's other messages (raygpt.ray.ray_logs sends it to the log file). The text itself is data from another process: bounded and escaped before it is printed.
Checked on Ray 2.60.0 (its default policy and the by-group one)."""

from __future__ import annotations

import dataclasses
import re

import ray

from raygpt.ray import compat
from raygpt.runlog.terminal import printable

# How Ray's memory monitor words the death of a worker it killed (its OutOfMemoryError, or
# an ActorDiedError carrying the same message).
MEMORY_MONITOR_WORDS = ("running low on memory", "memory monitor")
# Ray's "GB" in this text is 2**30 bytes (a limit of 25,324,953,600 B is "23.59GB")
RAY_GIB = 1 << 30
MAX_TEXT = 64 << 10  # Ray's text is ~6 KB at 10 top users; more is not read
MAX_COMMAND = 60  # characters of another process's command line in the one line

_NODE = re.compile(r"was ([\d.]+)GB used / ([\d.]+)GB limit")
_WORKER = re.compile(r"^(Selected to kill: )?\(Actor\([0-9a-f]+\): job ID=(\w+), .*?"
                     r"task name=(.*?), required resources=.*?, pid=(\d+), "
                     r"actual memory used=([\d.]+)GB", re.M)
# the rows of "Top 10 memory users:", the only tab-separated lines of the text
_TOP = re.compile(r"^(\d+)\t([\d.]+)\t(.*)$", re.M)


@dataclasses.dataclass(frozen=True)
class Process:
    """One process as Ray's text names it: pid, resident GiB, what it is (task or command)."""
    pid: int
    gib: float
    what: str


@dataclasses.dataclass(frozen=True)
class MemoryKill:
    """What Ray's text says of a kill: the node's use and limit (GiB; None when unsaid), the
    killing raylet's workers (the training workers among them: `train`) and the top processes."""
    used_gib: float | None
    limit_gib: float | None
    workers: tuple[Process, ...]
    top: tuple[Process, ...]

    @property
    def train(self) -> tuple[Process, ...]:
        return tuple(w for w in self.workers if w.what.startswith("RayTrainWorker"))


def parse(text: str) -> MemoryKill:
    """Ray's OutOfMemoryError text as a MemoryKill (what it lacks stays empty or None)."""
    text = text[:MAX_TEXT]
    node = _NODE.search(text)
    workers = tuple(Process(int(m[4]), float(m[5]), m[3]) for m in _WORKER.finditer(text))
    top = tuple(Process(int(m[1]), float(m[2]), m[3]) for m in _TOP.finditer(text))
    return MemoryKill(float(node[1]) if node else None, float(node[2]) if node else None,
                      workers, top)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """raygpt's share of the node at a kill, against its estimate, and the largest process
    outside this Ray. `passing`: something else holds the memory (retry); else raygpt's own."""
    raygpt_gib: float          # the training workers' memory (else the run's listed workers',
                               # else the estimate)
    largest_gib: float         # the largest of those processes (the estimate when none listed)
    estimate_gib: float | None  # one worker's estimate (raygpt.model.memory)
    over_estimate: bool
    outsider: Process | None
    outside_gib: float | None  # the node's use less this Ray's workers and the driver

    @property
    def passing(self) -> bool:
        return (not self.over_estimate and self.outsider is not None
                and self.outsider.gib > self.largest_gib)


def judge(kill: MemoryKill, estimate_bytes: int | None, own_pids=()) -> Verdict:
    """Whose memory it was: raygpt is over when a training worker held more than its estimate;
    the memory is someone else's when the largest process outside this Ray (its workers and
    `own_pids`, the driver) held more than raygpt's largest worker, process against process (a
    run of many workers within their estimate is not the node's largest holder for its number)."""
    est = None if estimate_bytes is None else estimate_bytes / RAY_GIB
    ours = {w.pid for w in kill.workers} | set(own_pids)
    train = kill.train
    # a kill of a helper actor lists no training worker: then raygpt's share is what it lists
    listed = train or kill.workers
    raygpt_gib = sum(w.gib for w in listed) if listed else (est or 0.0)
    largest = max(w.gib for w in listed) if listed else (est or 0.0)
    over = est is not None and any(w.gib > est for w in train)
    outsider = next((p for p in kill.top if p.pid not in ours), None)
    own = sum(w.gib for w in kill.workers) + sum(p.gib for p in kill.top
                                                  if p.pid in set(own_pids))
    outside = None if kill.used_gib is None else max(0.0, kill.used_gib - own)
    return Verdict(raygpt_gib, largest, est, over, outsider, outside)


def killed_for_memory(error) -> tuple[int | None, str] | None:
    """(rank, Ray's text) of a worker that Ray's memory monitor killed, found in a Ray Train
    error (WorkerGroupError's worker_failures, by rank), or (None, text) when the error itself
    is Ray's OutOfMemoryError (the monitor killed the controller); else None."""
    failures = getattr(error, "worker_failures", None) or {}
    for rank in sorted(failures):
        text = kill_text(failures[rank])
        if text is not None:
            return rank, text
    text = None if failures else kill_text(error)
    return None if text is None else (None, text)


# the raylet's own lines about its kills: its periodic count ("N Workers (tasks / actors) killed
# due to memory pressure (OOM)") and the advice that follows it. Checked on Ray 2.60.0.
RAYLET_KILL_WORDS = ("killed due to memory pressure", "address the out of memory issue")


def is_kill_account(text: str) -> bool:
    """Whether a message of the raylet's is its account of a kill by its memory monitor."""
    return any(w in text for w in (*MEMORY_MONITOR_WORDS, *RAYLET_KILL_WORDS))


def kill_text(failure: BaseException) -> str | None:
    """Ray's text when this failure (or what it wraps) is the memory monitor's kill, else None."""
    for cause in reversed(compat.worker_death_causes(failure)):  # innermost first
        if isinstance(cause, ray.exceptions.OutOfMemoryError) or any(
                w in str(cause) for w in MEMORY_MONITOR_WORDS):
            return str(cause)
    return None


def _gib(x: float | None) -> str:
    return "?" if x is None else f"{x:.1f}"


def passing_line(kill: MemoryKill, verdict: Verdict, rank: int | None,
                 step: int | None) -> str:
    """One line for a kill whose memory something else held."""
    who = "the run's controller" if rank is None else f"rank {rank}"
    at = "" if step is None else f" at step {step}"
    p = verdict.outsider
    what = printable(p.what[:MAX_COMMAND] + ("..." if len(p.what) > MAX_COMMAND else ""))
    est = ("" if verdict.estimate_gib is None
           else f", estimate {verdict.estimate_gib:.1f} GiB a worker")
    return (f"Ray's memory monitor killed {who}{at}: the node held {_gib(kill.used_gib)} of "
            f"{_gib(kill.limit_gib)} GiB, {_gib(verdict.outside_gib)} GiB of it outside this "
            f"run, the most by pid {p.pid} ({what}, {p.gib:.2f} GiB); raygpt's workers held "
            f"{verdict.raygpt_gib:.2f} GiB{est}")


def summary_line(text: str) -> str:
    """Ray's text in one line without judgement (a failure record's cause): the node's use and
    the largest process."""
    kill = parse(text)
    top = kill.top[0] if kill.top else None
    largest = "" if top is None else (f"; largest: pid {top.pid} "
                                      f"({printable(top.what[:MAX_COMMAND])}, {top.gib:.2f} GiB)")
    return (f"killed by Ray's memory monitor, the node at {_gib(kill.used_gib)} of "
            f"{_gib(kill.limit_gib)} GiB{largest}")
