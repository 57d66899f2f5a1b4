"""llm.c's on-disk formats, byte for byte, one module each, reader and writer side by side:

    shards.py      token shards (llm.c's dev/data/data_common.py, llmc/dataloader.h)
"""
