"""Fault campaign: one small run on 2 CPU workers with retention (-nk) and the spike monitor on,
hit by a seeded random sequence of real faults, against an uninterrupted run that meets the
same spikes. The final loss of every step must equal the reference as floats.

    python bench/fault_campaign.py [--faults 20] [--seed N] [--steps 60] [--dir DIR]

Faults (raygpt/faults.py, each a real one): a killed worker (SIGKILL), SIGTERM to a worker then
`-y 1`, SIGUSR1, a NaN that rewinds (also given to the reference: it is the spike both runs
meet), a crash before DONE (the driver leaves a checkpoint incomplete, a worker dies two steps
later), a worker killed right after a rewind (before a checkpoint carries it). Ctrl-C is left
out (its handling is being changed elsewhere). The seed is printed first, so a failure replays
with --seed. tests/test_fault_campaign.py runs a handful of faults in CI.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

KINDS = ("kill", "sigterm", "sigusr1", "nan", "crash_before_done", "kill_after_rewind")
CHECKPOINT_EVERY = 2
SAFETY_STEPS = 3  # a rewind goes back at least this far: it deletes registered checkpoints


@dataclass
class Campaign:
    seed: int
    max_steps: int
    nan_steps: list[int]  # the spikes both runs meet
    faults: list[str]     # the fault specs only the campaign run meets

    @property
    def spec(self) -> str:
        return ";".join([f"nan:rank={1 - i % 2},step={s}" for i, s in enumerate(self.nan_steps)]
                        + self.faults)

    @property
    def reference_spec(self) -> str:
        return ";".join(f"nan:rank={1 - i % 2},step={s}" for i, s in enumerate(self.nan_steps))


def plan(seed: int, n_faults: int, max_steps: int) -> Campaign:
    """A seeded sequence of faults at distinct steps: the kinds in shuffled rounds (each kind
    once per round); a NaN is always among them (so there is a rewind to survive), and every
    worker killed right after a rewind is placed between a NaN's rewind target and the NaN.
    A fault that finds no free step is left out (the summary counts the ones that fired)."""
    rng = random.Random(seed)
    kinds: list[str] = []
    while len(kinds) < n_faults:
        round_ = list(KINDS)
        rng.shuffle(round_)
        kinds += round_
    kinds = kinds[:n_faults]
    if "nan" not in kinds:
        kinds[0] = "nan"
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
    faults = []
    for kind in kinds:
        if kind == "nan":
            continue
        rank = rng.randrange(2)
        if kind == "kill_after_rewind":
            nan = rng.choice(nans)
            target = (nan - SAFETY_STEPS) // CHECKPOINT_EVERY * CHECKPOINT_EVERY
            s = free(target + 1, nan)
            if s is not None:
                faults.append(f"kill:rank={rank},step={s},visit=2")
        elif kind == "crash_before_done":
            # a checkpoint step that no rewind needs as its target
            targets = {(n - SAFETY_STEPS) // CHECKPOINT_EVERY * CHECKPOINT_EVERY for n in nans}
            s = free(2, max_steps - 3, lambda s: s % CHECKPOINT_EVERY == 0 and s not in targets
                     and s + 2 not in taken)
            if s is not None:
                taken.add(s + 2)
                faults.append(f"crash_before_done:rank={rank},step={s}")
        else:
            s = free(1, max_steps - 1)
            if s is not None:
                faults.append(f"{kind}:rank={rank},step={s}")
    return Campaign(seed, max_steps, sorted(nans), faults)


def config(run_dir, campaign: Campaign, spec: str):
    from raygpt.config import SpikeConfig, TrainConfig

    spike = SpikeConfig(enabled=True, min_history=4, window=8, safety_steps=SAFETY_STEPS,
                        max_rewinds=len(campaign.nan_steps) + 1)
    return TrainConfig(
        model="d2", batch_size=4, seq_len=32, max_steps=campaign.max_steps, val_every=0,
        val_batches=2, sample_every=0, checkpoint_every=CHECKPOINT_EVERY, checkpoints_keep=3,
        major_checkpoint_every=8, output_dir=str(run_dir), device="cpu", num_workers=2,
        compile=False, warmup_steps=2, spike=spike, fault=spec,
        max_failures=len(campaign.faults) + 2).resolve(0)


def run_to_the_end(cfg, log=print) -> int:
    """Run, and resume with -y 1 after every stop by signal; returns the number of jobs."""
    from raygpt.trainer import run

    jobs = 0
    while True:
        jobs += 1
        summary = run(cfg if jobs == 1 else cfg.with_overrides({"resume": 1}))
        if not summary.get("stopped_early"):
            return jobs
        log(f"campaign | stopped at step {summary['step']} by a signal: resuming with -y 1")


def final_losses(run_dir) -> dict[int, float]:
    """{step: loss} of the final curve (each step's latest attempt)."""
    from raygpt.history import read_history
    from raygpt.storage import open_run_dir

    out = {}
    for r in read_history(open_run_dir(str(run_dir))):
        if r.get("kind") == "train":
            out[r["step"]] = r["loss"]
    return out


def fired(run_dir) -> list[str]:
    """The faults that fired (faults.py leaves one marker each under <run dir>/faults/)."""
    d = Path(run_dir) / "faults"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def execute(campaign: Campaign, workdir, log=print) -> dict:
    """Run the reference and the campaign; return the comparison."""
    log(f"campaign | seed {campaign.seed} | {campaign.max_steps} steps | spikes at "
        f"{campaign.nan_steps} | faults: {campaign.spec}")
    workdir = Path(workdir)
    t0 = time.time()
    run_to_the_end(config(workdir / "reference", campaign, campaign.reference_spec), log)
    t1 = time.time()
    jobs = run_to_the_end(config(workdir / "campaign", campaign, campaign.spec), log)
    t2 = time.time()
    ref, got = final_losses(workdir / "reference"), final_losses(workdir / "campaign")
    lost = sorted(set(range(campaign.max_steps)) - set(got))
    extra = sorted(set(got) - set(range(campaign.max_steps)))
    differing = sorted(s for s in set(ref) & set(got) if ref[s] != got[s])
    survived = fired(workdir / "campaign")
    line = (f"{len(survived)} faults survived, {len(lost)} steps lost, {len(differing)} differing"
            f" (seed {campaign.seed}, {jobs} job(s); reference {t1 - t0:.0f} s, campaign "
            f"{t2 - t1:.0f} s)")
    log(f"campaign | {line}")
    return {"line": line, "survived": survived, "lost": lost, "extra": extra,
            "differing": differing, "jobs": jobs, "reference": ref, "losses": got}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", type=int, default=20)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="default: 3 steps per fault + 12")
    ap.add_argument("--dir", default=None, help="work directory (default: a fresh temp dir)")
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    steps = args.steps or 3 * args.faults + 12
    campaign = plan(seed, args.faults, steps)
    import ray
    for attempt in range(3):  # on a loaded machine the local node may miss Ray's 30 s start-up
        try:
            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
            break
        except Exception as e:  # noqa: BLE001 - retried, then raised
            if attempt == 2:
                raise
            print(f"campaign | Ray did not start ({e}); retrying", flush=True)
            ray.shutdown()
    result = execute(campaign, args.dir or tempfile.mkdtemp(prefix="raygpt-campaign-"))
    ok = not (result["lost"] or result["extra"] or result["differing"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
