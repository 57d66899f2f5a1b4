"""Downstream evaluation of a model: HellaSwag scored as llm.c scores it (`hellaswag`)."""
