"""Checkpoints, each concern with one owner:

    protocol.py    the protocol: names (step_XXXXXXXX, step_of_dir), DONE and MANIFEST, the one
                   completeness check (verify_checkpoint: quick, or full with hashes), finalize,
                   retention, abandoned trajectories, copy; and llm.c's state file format
    runtime.py     the worker side: async save, restore in llm.c's order, resharding across
                   world sizes and ZeRO, rewind
    fingerprints.py  what a checkpoint must agree with to be resumed (the config's and the
                   tokenizer's hashes, the files the config names by their bytes), computed one
                   way for preflight's check on the driver and the restore's in the workers

The driver-side hook that calls finalize once Ray has every rank's files is Ray's, and lives
in raygpt/ray/driver.py (CheckpointFinalizer).
"""
