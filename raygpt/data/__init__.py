"""Training data: the loader that serves llm.c token shards to the ranks (`loader`), where the
shards live (`sources`: local files or an object store through a node-local cache), several
sources mixed by weight (`mixture`: -i NAME=WEIGHT:GLOB), and how a
corpus becomes shards (`corpus`: documents read from Parquet, JSON Lines and text, tokenized;
`staging`: a unit's tokens staged and a shard written from staged byte ranges, a worker's two
jobs; `shard_writer`: llm.c's cut planned from token counts, progress, manifest, publishing).
Ray tasks run the staging (`raygpt.ray.prepare`)."""
