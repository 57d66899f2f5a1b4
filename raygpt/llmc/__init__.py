"""llm.c's on-disk formats, byte for byte, one module each, reader and writer side by side:

    shards.py      token shards (llm.c's dev/data/data_common.py, llmc/dataloader.h)
    model_file.py  the model file (train_gpt2.cu's gpt2_write_to_checkpoint and
                   gpt2_build_from_checkpoint)
    state_file.py  one rank's state file (train_gpt2.cu's save_state / load_state)
"""
