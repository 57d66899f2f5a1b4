"""`raygpt compact RUN_DIR`: merge each log's segments on an object store into one base object
(`segments.compact`), for a run that is not writing.

A part stored by a live writer while compaction runs could be hidden by the new base, and
compaction deletes what it merged, so the command holds the run directory's lease
(`ownership.Lease`: refused, naming the holder, while a job runs there) and touches only a run
directory of this user's (`ownership.check_own_run`).
"""

from __future__ import annotations

import argparse
import sys

from raygpt.config.flag_hints import HintingParser
from raygpt.runlog.history import LOSS_HISTORY_LOG, SAMPLES_LOG
from raygpt.runlog.mainlog import MAIN_LOG_LAYOUT
from raygpt.runlog.segments import compact
from raygpt.runlog.terminal import printable
from raygpt.storage import open_run_dir
from raygpt.storage.ownership import Lease, RunDirBusy, check_own_run
from raygpt.train.run_dir import run_evidence
from raygpt.train.errors import EXIT_BAD_INPUT, EXIT_FAILED

LAYOUTS = (LOSS_HISTORY_LOG, MAIN_LOG_LAYOUT, SAMPLES_LOG)


def build_parser() -> argparse.ArgumentParser:
    p = HintingParser(prog="raygpt compact", description=(
        "Merge the segments of a run's logs (loss_history/, main_log/, samples/ part objects on an "
        "object store) into one object each; the parts are deleted only after the merged object "
        "is stored and read back. Holds the run directory's lease: refused while a job runs "
        "there. A local run directory has one file per log already: nothing to do."))
    p.add_argument("run_dir", help="the run directory: a path or an s3:// / gs:// URI")
    return p


def compact_main(argv: list[str]) -> int:
    """`raygpt compact RUN_DIR`: 0 done; 2 bad input (a run directory not yours, or a file of it
    that is not raygpt's: too large, nested too deep, wrong types); 1 another error (a job
    holds the lease, storage failed). One line on stderr; nothing deleted that was not merged."""
    args = build_parser().parse_args(argv)
    try:
        run_dir = open_run_dir(args.run_dir)
        check_own_run(run_dir, "raygpt compact", run_evidence)
        with Lease(run_dir, what="raygpt compact") as lease:
            lease.start_heartbeat()  # a week's history may take longer than one lease
            for layout in LAYOUTS:
                if lease.lost:  # another job took the run over: it may be writing now
                    raise RunDirBusy(f"{run_dir.uri()}: stopped before {layout.legacy}, "
                                     f"{lease.lost}")
                done = compact(run_dir, layout)
                if done["base"] is None:
                    print(f"{printable(layout.legacy)}: nothing to compact")
                else:
                    print(f"{layout.legacy}: {done['parts']} segments merged into "
                          f"{printable(run_dir.uri(done['base']))} ({done['bytes']:,} bytes)")
    except RunDirBusy as e:  # a job runs there now: the same command may succeed later
        print(f"raygpt compact: error: {printable(e)}", file=sys.stderr)
        return EXIT_FAILED
    except ValueError as e:  # RunDirRefused, JSONError, FileTooLarge, RefusedPath: bad input
        print(f"raygpt compact: error: {printable(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:
        print(f"raygpt compact: error: {printable(e)}", file=sys.stderr)
        return EXIT_FAILED
    return 0
