"""`raygpt status RUN_DIR`: a run at a glance, as text (`format_status`, a pure function of the
view `run_view.load_run` reads); of a sweep directory, the sweep's own table. It needs nothing
beyond raygpt.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from raygpt.config.flag_hints import HintingParser
from raygpt.train.faults import WHAT as FAULT_WHAT
from raygpt.runlog.run_view import (STATUS_RECENT, Progress, RunView, _human_bytes, _open_checked,
                                    _stderr_progress, _storage_flags, _sweep_module, _verify_flags,
                                    load_run, max_steps_of, run_state, throughput,
                                    tokens_per_step)
from raygpt.storage import RunDir, open_run_dir
from raygpt.runlog.terminal import printable, printable_lines


def format_status(view: RunView, *, now: float | None = None) -> str:
    """The status report of a run (pure; `now` only sets the "ago" figures)."""
    now = time.time() if now is None else now
    lines = [f"run       {view.uri}"]
    n_attempts = view.counts.get("start", 0) + view.counts.get("resume", 0)
    restarts = max(n_attempts - 1, 0)
    lines.append(f"state     {run_state(view)} | last record {_human_seconds(now - view.last_time)}"
                 f" ago | {n_attempts} attempt(s), {restarts} restart(s)")
    armed, last_armed = view.faults
    if armed:
        a = last_armed[-1]
        lines.append(f"faults    FAULT INJECTION ARMED {armed} time(s) in this run directory; "
                     f"last: {a.get('spec')} (from {' and '.join(map(str, a.get('sources') or []))})")
    lines += fired_lines(*view.fired)

    if view.train:
        step = max(view.train)
        rec = view.train[step]
        total = max_steps_of(view)
        where = (f"{step + 1}/{total} steps ({100 * (step + 1) / total:.1f}%)" if total
                 else f"{step + 1} steps")
        recent = [view.train[s] for s in sorted(view.train)[-20:]]
        dts = sum(r.get("dt") or 0.0 for r in recent)
        avg_tps = sum(tokens_per_step(r) for r in recent) / dts if dts > 0 else float("nan")
        val_step = max(view.val) if view.val else None
        val = f"val {view.val[val_step]:.4f} (step {val_step})" if val_step is not None else "val n/a"
        hs = (f" | HellaSwag {view.evals[max(view.evals)]:.4f} (step {max(view.evals)})"
              if view.evals else "")
        lines.append(f"progress  {where} | loss {rec['loss']:.4f} | {val}{hs} | "
                     f"lr {rec['lr']:.2e} | norm {rec['norm']:.4f}")
        if view.eval_sets:  # --eval-set: each set's last loss
            lines.append("eval sets " + " | ".join(
                f"{name} {series[max(series)]:.4f} (step {max(series)})"
                for name, series in view.eval_sets.items()))
        eta = ""
        if total and dts > 0 and step + 1 < total:
            eta = f" | ETA {_human_seconds((total - step - 1) * dts / len(recent))} of training"
        lines.append(f"speed     {throughput(rec):,.0f} tok/s last step, {avg_tps:,.0f} tok/s over "
                     f"the last {len(recent)} | {rec['tokens']:,} tokens seen{eta}")
        lines += source_lines(rec, view.source_epochs)
    else:
        lines.append("progress  no step trained yet")

    n = view.counts
    events = [f"{n.get('skip', 0)} skip(s)"]
    if view.skips:
        s = view.skips[-1]
        events[-1] += f" (last at step {s.get('step')}: {s.get('reason') or 'no reason given'})"
    events.append(f"{n.get('rewind', 0)} rewind(s)" + (
        " (" + ", ".join(f"step {r.get('step')} -> {r.get('to_step')}" for r in view.rewinds[-3:]) + ")"
        if view.rewinds else ""))
    events.append(f"{n.get('failure', 0)} failure(s)" + (
        f" (last after step {view.failures[-1]['at_step']}: {_first_cause(view.failures[-1])})"
        if view.failures else ""))
    resumed = [r for r in view.attempts if r.get("kind") == "resume"]
    events.append(f"{n.get('resume', 0)} resume(s)" + (
        " (from step " + ", ".join(str(r.get("resumed_from")) for r in resumed[-5:]) + ")"
        if resumed else ""))
    if n.get("malformed"):
        events.append(f"{n['malformed']} malformed record(s) left out")
    lines.append("events    " + " | ".join(events))
    lines += resume_lines(view)

    good = [c for c in view.checkpoints if c.ok]
    bad = [c for c in view.checkpoints if not c.ok]
    # "verified" only when every byte was hashed: the quick check sees missing and short files
    # (DONE, MANIFEST, each listed size), not a flipped byte, and says so
    hashed = view.checkpoint_check == "full"
    ckpt = (f"{len(good)} {'verified' if hashed else 'complete'}"
            + (": step " + ", ".join(str(c.step) for c in good) if good else ""))
    if good:
        ckpt += f" | newest resumable: step {good[-1].step} ({_human_bytes(good[-1].size)})"
    if not hashed and view.checkpoints:
        ckpt += " | sizes checked, not hashed (--verify hashes)"
    lines.append(f"ckpts     {ckpt}")
    for c in bad:
        more = f" (+{len(c.problems) - 1} more)" if len(c.problems) > 1 else ""
        lines.append(f"          NOT usable: step {c.step}: {c.problems[0]}{more}")

    if view.goodput is not None:
        lines.append(f"goodput   {view.goodput['line']}")
        split = view.goodput.get("recovery_lines", [])
        if len(split) > RECOVERIES_SHOWN:
            lines.append(f"          (the last {RECOVERIES_SHOWN} of {len(split)} recoveries)")
        lines += [f"          {line}" for line in split[-RECOVERIES_SHOWN:]]
    return "\n".join(printable(line) for line in lines)


def source_lines(rec: dict, epochs: dict[str, int]) -> list[str]:
    """A mixed -i's tokens per source at the last step, each with its share and the epoch it
    is in (its last source_epoch record); nothing for one glob or a malformed record."""
    tokens = rec.get("source_tokens")
    if not (isinstance(tokens, dict) and tokens
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                    for n in tokens.values())):
        return []
    total = sum(tokens.values()) or 1
    return ["sources   " + " | ".join(
        f"{name} {n:,} tokens ({100 * n / total:.1f}%), epoch {epochs.get(str(name), 0)}"
        for name, n in tokens.items())]


# recoveries split into their parts on `raygpt status` (the newest; the goodput line has them all)
RECOVERIES_SHOWN = 5


def fired_lines(count: int, fired: list[dict]) -> list[str]:
    """One line per fault that fired (faults.read_fired: the last few, oldest first)."""
    if not count:
        return []
    out = [f"fired     {count} fault(s) injected" + (f", the last {len(fired)}:" if len(fired) < count
                                                     else ":")]
    for r in fired:
        kind = str(r.get("kind"))
        if r.get("by") == "external":
            name = f"{kind} after step {r.get('at_step')} (injected by {r.get('injector') or 'an outside tool'})"
        else:
            name = str(r.get("fault", kind))
            if isinstance(r.get("at_step"), int) and r["at_step"] != r.get("step"):
                name += f" (struck at step {r['at_step']})"
        what = FAULT_WHAT.get(kind)
        detail = f" [{r['detail']}]" if r.get("detail") else ""
        out.append(f"          {name}" + (f": {what}" if what else "") + detail)
    return out


def resume_lines(view: RunView) -> list[str]:
    """One line per resume (the last few): where it resumed from, how many steps it re-did and
    what the resume audit found when it had re-done them (history.ResumeAudit)."""
    resumes = [r for r in view.attempts if r.get("kind") == "resume"]
    if not resumes:
        return [f"audit     {a.get('message', '')}" for a in view.audits[-1:]]
    audits = {a["attempt"]: a for a in view.audits if isinstance(a.get("attempt"), int)}
    newest = max((r["attempt"] for r in view.attempts if isinstance(r.get("attempt"), int)),
                 default=0)
    out = []
    for i, r in enumerate(resumes):
        attempt, lost = r.get("attempt"), r.get("steps_lost")
        head = f"attempt {attempt} from step {r.get('resumed_from')}"
        n = f"{lost} step(s)" if isinstance(lost, int) else "steps"  # older records lack it
        if isinstance(attempt, int) and attempt in audits:
            verdict = f"{n} re-done: {audits[attempt].get('message', '')}"
        elif lost == 0:
            verdict = "no step to re-do (it resumed where the run stopped): nothing to audit"
        elif attempt == newest and view.last_record is not None \
                and view.last_record.get("attempt") == attempt \
                and view.last_record.get("kind") != "end":
            verdict = f"{n} to re-do: audit pending"
        else:
            verdict = f"{n} to re-do: no audit (the attempt ended before re-doing them)"
        out.append(f"{'resumes' if i == 0 else '':<10}{head}: {verdict}")
    total = view.counts.get("resume", 0)
    if total > len(resumes):
        out.append(f"          (the last {len(resumes)} of {total} resumes)")
    return out


def run_status(run_dir: RunDir | str, *, verify: str = "quick",
               progress: Progress | None = None) -> str:
    """`raygpt status`: what ran (config.json of every launch), the last step, loss, tok/s,
    checkpoints, restarts, the faults injected (RUN_DIR/faults/), each resume with its audit and
    goodput of a run (`run_dir`: a RunDir, or a place a library caller names: opened here,
    once). The history is streamed: memory does not grow with its records (only a number per
    step)."""
    run_dir = open_run_dir(run_dir)
    from raygpt.runlog.run_config import format_launches, read_launches
    text = format_status(load_run(run_dir, verify=verify, progress=progress,
                                  recent=STATUS_RECENT))
    skipped: list[str] = []
    launches = format_launches(read_launches(run_dir, skipped=skipped), skipped)
    return "\n".join([text, *launches]) if launches else text


def _first_cause(failure: dict) -> str:
    causes = failure.get("causes")
    if not causes or not isinstance(causes, dict):
        return "no cause recorded"
    rank, cause = next(iter(causes.items()))
    return f"rank {rank}: {str(cause)[:120]}"


def _human_seconds(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    if s < 172800:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days"


def status_parser() -> argparse.ArgumentParser:
    p = HintingParser(prog="raygpt status", description=(
        "Print where a run is: last step, loss, tok/s, checkpoints (complete? --verify: hashed), "
        "restarts, failures, skips, rewinds, injected faults, each resume's audit and goodput; "
        "of a sweep directory, every trial's row."))
    p.add_argument("run_dir", help="the run directory (or a sweep's): a path or an s3:// / gs:// URI")
    _verify_flags(p)
    _storage_flags(p)
    return p


def status_main(argv: list[str], *, sweeps=None) -> int:
    """`raygpt status`; `sweeps`: the sweep reader for a sweep directory (run_view._sweep_module)."""
    args = status_parser().parse_args(argv)
    try:
        uri, run_dir = _open_checked(args.run_dir, args.storage_endpoint)
        try:
            text = run_status(run_dir, verify="full" if args.verify else "quick",
                              progress=_stderr_progress)
        except FileNotFoundError as not_a_run:  # no run's history there: a sweep directory?
            text = _sweep_module(sweeps, run_dir, not_a_run).sweep_status(uri)
    except (FileNotFoundError, ValueError) as e:
        print(f"raygpt status: error: {printable(e)}", file=sys.stderr)
        return 2
    print(printable_lines(text))  # a guard: every part above made its values printable already
    return 0
