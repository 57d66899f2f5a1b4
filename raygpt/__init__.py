"""raygpt: fault-tolerant GPT-2 pretraining on Ray with llm.c's training infrastructure."""

__version__ = "0.1.0"
