"""The Ray seam: the only package that imports Ray (tests/ray_seam/test_seam.py enforces it).

    driver.py      one run under Ray Train: start or join Ray, the TorchTrainer, its failure
                   policy, the control actor, the driver's signals, the checkpoint finalizer
    worker.py      what each worker runs (train_func) and the Session the loop sees Ray through
    sweep.py       Ray Tune sweeps over raygpt runs and WSD branches; each trial is driver.run
    trials.py      a sweep's trial configs, their checks and its command line (`raygpt
                   sweep` checks the trials before Ray Tune is loaded or Ray started)
    checkpoint_list.py  Ray Train's checkpoint list kept to the checkpoints that exist
    pg_cleanup.py  the workers' placement group removed if Ray Train's controller dies
    capacity.py    what a Ray started on this machine holds: its GPUs, Ray's count of its CPUs

Importing this package imports no Ray: each module does, when it is imported.
"""
