"""Checkpoints, each concern with one owner, from save to restore:

    protocol.py    the protocol: names (step_XXXXXXXX, step_of_dir), DONE and MANIFEST, the one
                   completeness check (verify_checkpoint: quick, or full with hashes), resume
                   selection, abandoned trajectories, copy
    staging.py     the private local directories a rank writes its files in before they are
                   stored, and the sweep of what dead processes left
    store.py       the one owner of a run's checkpoints in storage: listing, the newest complete
                   and resumable ones, commit (DONE, MANIFEST), delete, a rewind's abandon, retain
    runtime.py     the worker side: async save, restore in llm.c's order, resharding across
                   world sizes and ZeRO, rewind
    reading.py     the files a rank loads, fetched and checked against MANIFEST (early, on a thread)
    snapshot.py    the copy of a checkpoint's tensors at the step boundary (on a GPU straight to
                   pinned host memory on a side stream; the next writes wait for it on the device)
    finalize.py    the committing side: the config's facts added to rank 0's report, the store's
                   commit then retention; the queue that does it off the caller's thread
    retention.py   which checkpoints a run keeps, as pure functions (-nk / -nm, their defaults,
                   the last before a WSD decay)
    local_copy.py  the node's hard-linked copies of its ranks' files, read on a restart
    fingerprints.py  what a checkpoint must agree with to be resumed (the config's and the
                   tokenizer's hashes, the files the config names by their bytes), computed one
                   way for preflight's check on the driver and the restore's in the workers

llm.c's file formats (model_*.bin, state_*.bin) are raygpt.llmc's, the training state a
checkpoint holds raygpt.train.state's (the loop's too), and the hash-while-writing file
raygpt.storage.hashing_writer's (the model file's writer uses it too). Ray's side (each rank's
upload, the controller's hook that calls finalize, Ray's own checkpoint list) is the adapter in
raygpt/ray/checkpoints.py and raygpt/ray/checkpoint_list.py.
"""
