"""The Ray seam: the only package that imports Ray (tests/ray_seam/test_seam.py enforces it).

    driver.py      one run under Ray Train: start or join Ray, the TorchTrainer, its failure
                   policy, the control actor
    driver_signals.py  SIGTERM / SIGUSR1 / Ctrl-C to the driver, forwarded to the workers
    worker.py      what each worker runs (train_func) and the Session the loop sees Ray through
    checkpoints.py the Ray side of a checkpoint's life: each rank's upload, the controller's
                   hook that finalizes it (raygpt.checkpointing.finalize), failure records
    checkpoint_list.py  Ray Train's own list of a run's checkpoints kept to the ones that exist
    compat.py      every use of Ray's private API, each hook with its why and the Ray version
                   it was checked on (the only module allowed one: test_seam.py)
    sweep.py       Ray Tune sweeps over raygpt runs and WSD branches; each trial is driver.run
    trials.py      a sweep's trial configs, their checks and its command line (`raygpt
                   sweep` checks the trials before Ray Tune is loaded or Ray started)
    pg_cleanup.py  the workers' placement group removed if Ray Train's controller dies
    capacity.py    what a Ray started on this machine holds: its GPUs, Ray's count of its CPUs
    prepare.py     `raygpt prepare`: a corpus to llm.c's token shards on Ray Data

Importing this package imports no Ray: each module does, when it is imported.
"""
