"""Fault campaign: one small run on 2 CPU workers with retention (-nk) and the spike monitor on,
hit by a seeded random sequence of real faults, against an uninterrupted run that meets the
same spikes. The final loss of every step must equal the reference as floats, and `raygpt
status` on the run directory must list every fault and every resume's audit.

    python bench/fault_campaign.py [--faults 20] [--seed N] [--steps 60] [--dir DIR]
                                   [--kinds kill,ctrl_c,...]

Ray runs as a `ray.cluster_utils.Cluster`: a head with no CPU (the drivers and Ray Train's
controller live there) and two 1-CPU worker nodes, one worker each. The reference runs in this
process; every job of the campaign run is a real driver process, `python -m raygpt.cli train
... --fault SPEC`, in its own session (its own process group, as a terminal gives it), joined
to the cluster.

Faults, each a real one. Inside the run (armed with --fault; raygpt/train/faults.py fires them at
their exact step): a killed worker (SIGKILL), SIGTERM to a worker (the job stops with exit 3
and is relaunched with `-y 1`), SIGUSR1, a NaN that rewinds (also given to the reference: it is
the spike both runs meet), a crash before DONE (the driver leaves a checkpoint incomplete, a
worker dies two steps later), a worker killed right after a rewind (before a checkpoint carries
it). From outside, once the run has logged the planned step: Ctrl-C (SIGINT to the driver's
process group; the job must exit 3, and is relaunched with `-y 1`) and a removed node (a worker
node removed ungracefully, its worker with it, and a replacement added: Ray Train restarts the
worker group and the run resumes by itself). Each fault leaves a record in `RUN_DIR/faults/`
(external ones through faults.record_external), which `raygpt status` lists.

The seed is printed first and in the summary line, so a failure replays with --seed.
tests/test_fault_campaign.py runs a handful of faults in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KINDS = ("kill", "sigterm", "sigusr1", "ctrl_c", "nan", "crash_before_done", "kill_after_rewind",
         "remove_node")
EXTERNAL = ("ctrl_c", "remove_node")  # injected by this script, not by the workers
CHECKPOINT_EVERY = 2
SAFETY_STEPS = 3  # a rewind goes back at least this far: it deletes registered checkpoints
EXIT_FINISHED, EXIT_STOPPED = 0, 3  # raygpt.train.errors (not imported: this module loads without torch)
JOB_TIMEOUT_S = 1800.0
# node death noticed in about 2 s (Ray's default is much slower), as tests/ray_seam/test_node_loss.py
FAST_FAILURE_DETECTION = {"health_check_period_ms": 500, "health_check_failure_threshold": 4,
                          "health_check_initial_delay_ms": 0}


@dataclass
class Campaign:
    seed: int
    max_steps: int
    nan_steps: list[int]  # the spikes both runs meet
    faults: list[str]     # the fault specs only the campaign run meets (fired by the workers)
    external: list[tuple[str, int, int]] = field(default_factory=list)
    # (kind, step, which) injected from outside once the run has logged `step`; `which` picks
    # the worker node a remove_node takes

    @property
    def spec(self) -> str:
        return ";".join([f"nan:rank={1 - i % 2},step={s}" for i, s in enumerate(self.nan_steps)]
                        + self.faults)

    @property
    def reference_spec(self) -> str:
        return ";".join(f"nan:rank={1 - i % 2},step={s}" for i, s in enumerate(self.nan_steps))

    @property
    def n_faults(self) -> int:
        return len(self.nan_steps) + len(self.faults) + len(self.external)


def plan(seed: int, n_faults: int, max_steps: int, kinds=KINDS) -> Campaign:
    """A seeded sequence of faults at distinct steps: the kinds in shuffled rounds (each kind
    once per round); a NaN is always among them (so there is a rewind to survive), and every
    worker killed right after a rewind is placed between a NaN's rewind target and the NaN (one
    per NaN; any more become plain kills).
    An external fault lands a step or two after its step (it waits for the step's record), so
    it keeps the next two steps to itself and stays clear of the last steps (a Ctrl-C must meet
    a running job). A fault that finds no free step is left out (the summary counts the ones
    that fired)."""
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"kinds: expected some of {KINDS}, found {sorted(unknown)}")
    rng = random.Random(seed)
    chosen: list[str] = []
    while len(chosen) < n_faults:
        round_ = list(kinds)
        rng.shuffle(round_)
        chosen += round_
    chosen = chosen[:n_faults]
    if "nan" not in chosen:
        chosen[0] = "nan"
    kinds = chosen
    taken: set[int] = set()

    def free(lo: int, hi: int, pred=lambda s: True) -> int | None:
        options = [s for s in range(lo, hi) if s not in taken and pred(s)]
        if not options:
            return None
        s = rng.choice(options)
        taken.add(s)
        return s

    # NaNs first, one in each of equal segments of [8, max_steps - 2), at least 8 steps apart
    # so that each rewind's region is its own
    k = kinds.count("nan")
    seg = (max_steps - 10) // k
    if seg < 8:
        raise ValueError(f"{k} spikes need at least {8 * k + 10} steps, found {max_steps}")
    nans = []
    for i in range(k):
        s = 8 + i * seg + rng.randrange(seg - 7)
        taken.add(s)
        nans.append(s)
    faults, external = [], []
    unkilled = list(nans)  # NaNs without a worker killed right after their rewind yet
    for kind in kinds:
        if kind == "nan":
            continue
        rank = rng.randrange(2)
        if kind == "kill_after_rewind" and unkilled:
            # one per NaN: the resumed attempt skips that NaN's window for good (the rewind's
            # decision is durable), so no second rewind brings the loop back there
            nan = unkilled.pop(rng.randrange(len(unkilled)))
            target = (nan - SAFETY_STEPS) // CHECKPOINT_EVERY * CHECKPOINT_EVERY
            s = free(target + 1, nan)
            if s is not None:
                faults.append(f"kill:rank={rank},step={s},visit=2")
        elif kind == "kill_after_rewind":  # more of them than NaNs: a plain kill instead
            s = free(1, max_steps - 1)
            if s is not None:
                faults.append(f"kill:rank={rank},step={s}")
        elif kind == "crash_before_done":
            # a checkpoint step that no rewind needs as its target
            targets = {(n - SAFETY_STEPS) // CHECKPOINT_EVERY * CHECKPOINT_EVERY for n in nans}
            s = free(2, max_steps - 3, lambda s: s % CHECKPOINT_EVERY == 0 and s not in targets
                     and s + 2 not in taken)
            if s is not None:
                taken.add(s + 2)
                faults.append(f"crash_before_done:rank={rank},step={s}")
        elif kind in EXTERNAL:
            s = free(2, max_steps - 5, lambda s: s + 1 not in taken and s + 2 not in taken)
            if s is not None:
                taken.update((s + 1, s + 2))
                external.append((kind, s, rank))
        else:
            s = free(1, max_steps - 1)
            if s is not None:
                faults.append(f"{kind}:rank={rank},step={s}")
    return Campaign(seed, max_steps, sorted(nans), faults, sorted(external, key=lambda e: e[1]))


def config(run_dir, campaign: Campaign, spec: str):
    """The run's config (unresolved: the reference resolves it, the campaign's drivers get it
    through --config)."""
    from raygpt.config import SpikeConfig, TrainConfig

    spike = SpikeConfig(enabled=True, min_history=4, window=8, safety_steps=SAFETY_STEPS,
                        max_rewinds=len(campaign.nan_steps) + 1)
    return TrainConfig(
        model="d2", batch_size=4, seq_len=32, max_steps=campaign.max_steps, val_every=0,
        val_batches=2, sample_every=0, checkpoint_every=CHECKPOINT_EVERY, checkpoints_keep=3,
        major_checkpoint_every=8, output_dir=str(run_dir), device="cpu", num_workers=2,
        compile=False, warmup_steps=2, spike=spike, fault=spec,
        max_failures=campaign.n_faults + 2)


class CampaignError(RuntimeError):
    """A job of the campaign ended in a way no fault explains (its log tail is in the message)."""


# ---------------------------------------------------------------------- the cluster

class CampaignCluster:
    """A head without CPUs and two 1-CPU worker nodes, this process connected to it."""

    def __init__(self):
        import ray
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(initialize_head=True, connect=False, head_node_args={
            "num_cpus": 0, "include_dashboard": False, "_system_config": FAST_FAILURE_DETECTION})
        for _ in range(2):
            self.cluster.add_node(num_cpus=1)
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, log_to_driver=False)
        self.address = self.cluster.address

    def remove_node(self, which: int) -> str:
        """Remove a worker node ungracefully (its raylet and worker processes killed) and add a
        replacement (Cluster.add_node must run on the main thread); the removed node's id."""
        victim = sorted(self.cluster.worker_nodes, key=lambda n: n.node_id)[which % 2]
        self.cluster.remove_node(victim, allow_graceful=False)
        self.cluster.add_node(num_cpus=1)
        return victim.node_id

    def shutdown(self) -> None:
        import ray
        ray.shutdown()
        self.cluster.shutdown()


# ---------------------------------------------------------------------- one job: a driver process

def launch(cfg, resume: int, address: str, log_path: Path) -> subprocess.Popen:
    """`python -m raygpt.cli train --config FILE -o DIR -y RESUME --fault SPEC` joined to the
    cluster, in a session of its own (its process group is what a terminal's Ctrl-C reaches)."""
    from raygpt.config import as_command  # no torch: config imports none
    fields, flags = as_command(cfg.with_overrides({"resume": resume}))
    cfg_file = log_path.with_suffix(".json")
    cfg_file.write_text(json.dumps(fields))
    env = {**os.environ, "RAY_ADDRESS": address, "RAY_DEDUP_LOGS": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with open(log_path, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "raygpt.cli", "train", "--config",
                                 str(cfg_file), *flags], stdout=out, stderr=subprocess.STDOUT,
                                env=env, cwd=REPO, start_new_session=True)


def history(run_dir: Path) -> list[dict]:
    """The loss history's complete records (a line being appended is left for the next read)."""
    path = run_dir / "loss_history.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def last_attempt(run_dir: Path) -> int:
    return max((r.get("attempt") or 0 for r in history(run_dir)), default=0)


def last_step(run_dir: Path, after_attempt: int = 0) -> int:
    """The step of the newest train record of an attempt after `after_attempt` (-1 before the
    first): a job's external faults wait for that job's own training, never strike while it
    starts up on the strength of an earlier job's records."""
    step = -1
    for r in history(run_dir):
        if r.get("kind") == "train" and (r.get("attempt") or 0) > after_attempt:
            step = r["step"]
    return step


def tail(path: Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


def run_campaign(cfg, campaign: Campaign, cluster: CampaignCluster, workdir: Path,
                 log=print) -> list[int]:
    """The campaign run: one driver process after another until one finishes (exit 0); a job
    stopped by SIGTERM or Ctrl-C must exit 3 and is relaunched with -y 1. The external faults
    strike as the run reaches their steps. Returns every job's exit code."""
    from raygpt.storage import open_run_dir
    from raygpt.train.faults import record_external

    run_path = Path(cfg.output_dir)
    pending = list(campaign.external)
    codes: list[int] = []
    while not codes or codes[-1] != EXIT_FINISHED:
        job = len(codes) + 1
        log_path = workdir / f"campaign_job{job}.log"
        before = last_attempt(run_path)  # this job's attempts are numbered after it
        proc = launch(cfg, 1 if job > 1 else 0, cluster.address, log_path)
        deadline = time.monotonic() + JOB_TIMEOUT_S
        ctrl_c_sent = False
        try:
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    raise CampaignError(f"job {job} still running after {JOB_TIMEOUT_S:.0f} s:\n"
                                        + tail(log_path))
                at = last_step(run_path, before)
                if pending and not ctrl_c_sent and at >= pending[0][1]:
                    kind, step, which = pending.pop(0)
                    rd = open_run_dir(str(run_path))
                    if kind == "ctrl_c":
                        record_external(rd, kind, at, injector="bench/fault_campaign.py",
                                        detail=f"SIGINT to process group {proc.pid}")
                        log(f"campaign | job {job}: Ctrl-C after step {at} (planned {step})")
                        os.killpg(proc.pid, signal.SIGINT)
                        ctrl_c_sent = True
                    else:
                        record_external(rd, kind, at, injector="bench/fault_campaign.py",
                                        detail=f"worker node {which % 2} removed, a new one added")
                        node = cluster.remove_node(which)
                        log(f"campaign | job {job}: removed node {node[:12]} after step {at} "
                            f"(planned {step}); a replacement joined")
                time.sleep(0.1)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        codes.append(proc.returncode)
        if ctrl_c_sent and proc.returncode != EXIT_STOPPED:
            raise CampaignError(f"job {job}: Ctrl-C: expected exit {EXIT_STOPPED}, found "
                                f"{proc.returncode}:\n" + tail(log_path))
        if proc.returncode == EXIT_STOPPED:
            log(f"campaign | job {job} stopped at step {last_step(run_path)} "
                f"({'Ctrl-C' if ctrl_c_sent else 'SIGTERM'}), exit 3: relaunching with -y 1")
        elif proc.returncode != EXIT_FINISHED:
            raise CampaignError(f"job {job} exited {proc.returncode}:\n" + tail(log_path))
    if pending:
        log(f"campaign | {len(pending)} external fault(s) never struck (the run ended first): "
            f"{pending}")
    return codes


def final_losses(run_dir) -> dict[int, float]:
    """{step: loss} of the final curve (each step's latest attempt)."""
    from raygpt.runlog.history import read_history
    from raygpt.storage import open_run_dir

    out = {}
    for r in read_history(open_run_dir(str(run_dir))):
        if r.get("kind") == "train":
            out[r["step"]] = r["loss"]
    return out


def fired(run_dir) -> list[dict]:
    """The records of the faults that fired (raygpt/train/faults.py's, under <run dir>/faults/)."""
    from raygpt.storage import open_run_dir
    from raygpt.train.faults import read_fired

    return read_fired(open_run_dir(str(run_dir)), keep=10**6)[1]


def status_text(run_dir) -> str:
    """`raygpt status RUN_DIR --quick`, run as a user runs it."""
    out = subprocess.run([sys.executable, "-m", "raygpt.cli", "status", "--quick", str(run_dir)],
                         capture_output=True, text=True, cwd=REPO, timeout=300, env={
                             **os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
                                 str(REPO), os.environ.get("PYTHONPATH")]))})
    if out.returncode != 0:
        raise CampaignError(f"raygpt status exited {out.returncode}: {out.stderr[-2000:]}")
    return out.stdout


def status_problems(text: str, campaign: Campaign, run_dir) -> list[str]:
    """What `raygpt status` fails to show: a fault of the plan that fired but is not listed,
    a resume without its line (and its audit's verdict), an audit that found a difference."""
    from raygpt.runlog.history import read_history
    from raygpt.storage import open_run_dir

    problems = []
    lines = text.splitlines()
    fired_lines = _section(lines, "fired")
    for spec in campaign.spec.split(";"):
        if not any(l.strip().startswith(spec + ":") or l.strip().startswith(spec + " (")
                   for l in fired_lines):
            problems.append(f"status does not list the fault {spec!r}")
    for kind in EXTERNAL:
        planned = sum(1 for k, _, _ in campaign.external if k == kind)
        listed = sum(1 for l in fired_lines if l.strip().startswith(kind + " after step"))
        if listed != planned:
            problems.append(f"status lists {listed} {kind} fault(s), {planned} were injected")
    records = read_history(open_run_dir(str(run_dir)))
    resumes = [r for r in records if r.get("kind") == "resume"]
    audits = {r["attempt"]: r["message"] for r in records if r.get("kind") == "audit"}
    resume_lines = _section(lines, "resumes")
    for r in resumes:
        line = next((l for l in resume_lines
                     if f"attempt {r['attempt']} from step {r['resumed_from']}:" in l), None)
        if line is None:
            problems.append(f"status has no line for the resume of attempt {r['attempt']}")
        elif r["attempt"] in audits and audits[r["attempt"]] not in line:
            problems.append(f"status does not show attempt {r['attempt']}'s audit: {line!r}")
    for attempt, message in audits.items():
        if "verified bit-exact" not in message:
            problems.append(f"the resume audit of attempt {attempt} found a difference: {message}")
    return problems


def _section(lines: list[str], head: str) -> list[str]:
    """The lines of one status section: its head line and the indented lines under it."""
    out, inside = [], False
    for line in lines:
        if line.startswith(head + " "):
            inside = True
        elif line[:1] != " ":
            inside = False
        if inside:
            out.append(line[len(head):] if line.startswith(head) else line)
    return out


def execute(campaign: Campaign, workdir, log=print) -> dict:
    """Start the cluster, run the reference (in this process) and the campaign (driver
    processes), and return the comparison, the faults that fired and what status shows."""
    log(f"campaign | seed {campaign.seed} | {campaign.max_steps} steps | spikes at "
        f"{campaign.nan_steps} | faults: {campaign.spec} | from outside: "
        + (", ".join(f"{k} after step {s}" for k, s, _ in campaign.external) or "none"))
    from raygpt.ray.driver import run

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    cluster = CampaignCluster()
    try:
        t1 = time.time()
        summary = run(config(workdir / "reference", campaign, campaign.reference_spec).resolve(0))
        if summary.get("stopped_early"):
            raise CampaignError("the reference run stopped early")
        t2 = time.time()
        codes = run_campaign(config(workdir / "campaign", campaign, campaign.spec), campaign,
                             cluster, workdir, log)
        t3 = time.time()
    finally:
        cluster.shutdown()
    ref, got = final_losses(workdir / "reference"), final_losses(workdir / "campaign")
    lost = sorted(set(range(campaign.max_steps)) - set(got))
    extra = sorted(set(got) - set(range(campaign.max_steps)))
    differing = sorted(s for s in set(ref) & set(got) if ref[s] != got[s])
    survived = fired(workdir / "campaign")
    status = status_text(workdir / "campaign")
    problems = status_problems(status, campaign, workdir / "campaign")
    line = (f"{len(survived)} faults survived, {len(lost)} steps lost, {len(differing)} differing"
            f" (seed {campaign.seed}; {len(codes)} job(s), exits {codes}; cluster {t1 - t0:.0f} s,"
            f" reference {t2 - t1:.0f} s, campaign {t3 - t2:.0f} s)")
    log("campaign | raygpt status of the campaign run:\n" + status)
    if problems:
        log("campaign | status problems: " + "; ".join(problems))
    log(f"campaign | {line}")
    return {"line": line, "survived": survived, "lost": lost, "extra": extra,
            "differing": differing, "jobs": len(codes), "codes": codes, "reference": ref,
            "losses": got, "status": status, "status_problems": problems}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", type=int, default=20)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="default: 3 steps per fault + 12")
    ap.add_argument("--kinds", default=",".join(KINDS), help="the fault menu (comma-separated)")
    ap.add_argument("--dir", default=None, help="work directory (default: a fresh temp dir)")
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    steps = args.steps or 3 * args.faults + 12
    campaign = plan(seed, args.faults, steps, tuple(k for k in args.kinds.split(",") if k))
    result = execute(campaign, args.dir or tempfile.mkdtemp(prefix="raygpt-campaign-"))
    ok = not (result["lost"] or result["extra"] or result["differing"]
              or result["status_problems"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
