"""GPT-2's shapes by depth, as llm.c's `-e dN`: the model's (raygpt.model.gpt.GPTConfig.from_depth)
and the config's check of `-e` (raygpt.config) read them here, without importing torch; and the
fused loss's chunk of logit rows by device, which the config, the model and raygpt.model.memory share."""

# depth -> (channels, heads). Depths of 6 and below are CPU-sized models with 64-wide heads
# (llm.c's own d6 is 384 channels, 6 heads).
MODEL_SHAPES = {12: (768, 12), 24: (1024, 16), 36: (1280, 20), 48: (1600, 25)}
for _depth in range(1, 7):
    MODEL_SHAPES[_depth] = (64 * _depth, _depth)
del _depth

# Rows of the (B*T, Vp) logits the fused loss holds at once, by device (--ce-chunk-rows' default).
# On a GPU 16384 rows of GPT-2's Vp = 50304 are 1.6 GB in bf16, and Inductor fuses the fp32 work
# into one kernel. On a CPU the loss runs eagerly: a chunk also holds about four fp32 (rows, Vp)
# temporaries, 103 MB each at 512 rows (16384 rows would be 3.3 GB each).
CE_CHUNK_ROWS = {"gpu": 16384, "cpu": 512}
