"""Downstream evaluation of a model: HellaSwag scored as llm.c scores it (`hellaswag`), and
--eval-set's named validation sets as loop tasks (`sets`)."""
