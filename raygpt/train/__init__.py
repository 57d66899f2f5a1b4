"""Training: the per-worker loop and the policies it calls, none of them aware of Ray.

    loop.py         the loop, top to bottom like llm.c's main loop (no Ray inside)
    tasks.py        periodic work as tasks (due at a step, run in llm.c's order)
    session.py      what the loop needs from Ray (or from a plain process)
    run_dir.py      the run's directory claimed (marker, lease) before anything is written
    state.py        step, RNG and policy state that every checkpoint carries
    schedule.py     learning_rate(kind, step, ...): llm.c's schedulers.h, pure functions
    outlier.py      llm.c's z-score detector; the spike monitor and its rewind policy
    optim.py        flat buffers in llm.c's order, AdamW with fp32 master weights, ZeRO-1, the
                    gradient reduction in buckets during backward
    signals.py      SIGTERM / SIGUSR1 as flags the ranks agree on; --checkpoint-minutes
    faults.py       fault injection (--fault; RAYGPT_FAULT with --allow-fault-injection)
    determinism.py  a run's torch switches (deterministic mode, TF32), set and given back
    gc_freeze.py    the garbage collector kept off the step (gc.freeze after the first step)
    errors.py       which worker errors end a run at once (not retried); the exit codes
"""
