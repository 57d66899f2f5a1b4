"""The Ray seam: the only package that imports Ray (tests/ray_seam/test_seam.py enforces it).

    connect.py     start or join Ray: the drivers' one ray.init (no Ray Train, no torch)
    driver.py      one run under Ray Train: start or join Ray, the TorchTrainer, its failure
                   policy, the control actor
    driver_signals.py  SIGTERM / SIGUSR1 / Ctrl-C to the driver, forwarded to the workers
    worker.py      what each worker runs (train_func) and the Session the loop sees Ray through
    checkpoints.py the Ray side of a checkpoint's life: each rank's upload, the controller's
                   hook that finalizes it (raygpt.checkpointing.finalize), failure records
    checkpoint_list.py  Ray Train's own list of a run's checkpoints kept to the ones that exist
    compat.py      every use of Ray's private API, each hook with its why and the Ray version
                   it was checked on (the only module allowed one: test_seam.py)
    ray_logs.py    Ray's own driver-side lines to the session's log files, not the terminal
    controller_logs.py  Ray Train's controller's lines about a memory kill off the terminal
    memory_kill.py a kill by Ray's memory monitor: Ray's text read, judged, told in one line
    shared_dir.py  whether every node of the cluster sees a local directory (a probe)
    knobs.py       the Ray seam's knobs: device, workers, restarts (no Ray imported)
    sweep.py       Ray Tune sweeps over raygpt runs and WSD branches; each trial is driver.run
                   (the face of the modules below, which re-exports their names)
    sweep_plan.py  a sweep's plan (sweep.json), its ledger and the trials' rows; no Ray
    sweep_asha.py  ASHA's rungs: an early stop asks the trial's run to stop; rebuilt on resume
    sweep_wsd.py   WSD branches: the shared stable phase, trained once, and each branch's seed
    sweep_tune.py  the Tune runner: run_sweep, run_wsd_branches, resume_sweep, each trial
    sweep_results.py  results.txt, best_config.json, val_loss.png; a sweep's status and plot
    sweep_console.py  a sweep's console: one line per trial event, with its hyperparameters
    sweep_command.py  `raygpt sweep`'s command line: the known trials checked, then sweep_tune
    trials.py      a sweep's trial configs, their checks and its command line (`raygpt
                   sweep` checks the trials before Ray Tune is loaded or Ray started)
    pg_cleanup.py  the workers' placement group removed if Ray Train's controller dies
    capacity.py    what a Ray started on this machine holds: its GPUs, Ray's count of its CPUs
    prepare.py     `raygpt prepare`: a corpus to llm.c's token shards as Ray tasks

Importing this package imports no Ray: each module does, when it is imported.
"""
