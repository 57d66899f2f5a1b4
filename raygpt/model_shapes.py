"""GPT-2's shapes by depth, as llm.c's `-e dN`: the model's (raygpt.model.GPTConfig.from_depth)
and the config's check of `-e` (raygpt.config) read them here, without importing torch."""

# depth -> (channels, heads). Depths of 6 and below are CPU-sized models with 64-wide heads
# (llm.c's own d6 is 384 channels, 6 heads).
MODEL_SHAPES = {12: (768, 12), 24: (1024, 16), 36: (1280, 20), 48: (1600, 25)}
for _depth in range(1, 7):
    MODEL_SHAPES[_depth] = (64 * _depth, _depth)
del _depth
