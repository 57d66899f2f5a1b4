"""A trained model in and out of raygpt.

    hf.py       Hugging Face's GPT-2 folder: writer (raygpt export) and reader (-e DIR)
    trained.py  a checkpoint's model, and the commands that use it: export, sample, eval

llm.c's own formats are raygpt.llmc.
"""
