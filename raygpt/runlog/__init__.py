"""The run log: everything a run tells a person, and where it keeps it.

    reporter.py     the one object the loop calls once per event; it alone knows which rank
                    writes and fans each event out to the sinks below (and Ray's report)
    history.py      loss_history.jsonl and samples.jsonl: schema, writer, the one reader
    mainlog.py      main.log in llm.c's line format
    segments.py     the logs on object stores: immutable part objects, read back as one file,
                    merged into one base object by `compact`
    compact.py      `raygpt compact RUN_DIR`: that merge for each log, under the run's lease
    console.py      the step line, and the `raygpt` logger every module's messages go through
    eta.py          the step line's ETA: the steps left and the periodic tasks' runs to come
    tensorboard.py  TensorBoard event files, and their reader
    tracking.py     W&B and MLflow
    mfu.py          model FLOPs utilisation
"""
